"""The object-store cases every store must pass, against its real server on loopback with a proxy
of our own in front for the faults (tests/s3_server.py's ``FaultProxy``): collected by
tests/test_gcs.py (gcp-storage-emulator) and tests/test_azure.py (Azurite), which name the
server class (``SERVER``) and what their store does differently (``upload_order``,
``CONDITION``, ``REPLACED``).

A push and a pull are byte for byte the local artifact, the manifest uploaded last; a load
streamed from the store equals the local load and reads data files only by range requests, each
asking for the object as listed; a flipped byte, on the store or in transit, is refused naming
the object; an object replaced in the middle of a load is an error, never a mix; transient
faults are retried to the right result; the CLI takes the address.
"""

import filecmp
import os
import re

import pytest
import torch
from cloud_servers import ServerNotFound
from s3_server import FaultProxy

import lct
from lct import cloud
from lct.errors import ChecksumError, ManifestError

BUCKET = "models"
IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])
DATA = r"model-\d+\.lct$"


def start(cls):
    """Start the server, or skip naming the install command; under CI (``CI`` set) a missing
    server fails: CI installs it (.ci/run)."""
    try:
        return cls().start()
    except ServerNotFound as e:
        if os.environ.get("CI"):
            pytest.fail(f"{e} (.ci/run installs it)")
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def server(request):
    srv = start(request.module.SERVER)
    srv.make_bucket(BUCKET)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def scheme(request):
    return request.module.SCHEME


@pytest.fixture(scope="module")
def proxy(server):
    p = FaultProxy(server.endpoint).start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from lct.demo.tiny import save_tiny, save_tokenizer
    d = tmp_path_factory.mktemp("cloud-src")
    src = save_tiny(d / "llama", "llama")
    save_tokenizer(src, vocab_size=256)
    art = d / "llama.lct"
    lct.convert(str(src), art)
    return art


def _env(monkeypatch, tmp_path, env: dict) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LCT_CLOUD_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def direct(server, monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path, server.env(server.endpoint))


@pytest.fixture
def faulty(server, proxy, monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path, server.env(proxy.endpoint))
    monkeypatch.setenv("LCT_CLOUD_TIMEOUT", "2")
    proxy.clear()
    proxy.reset()
    yield proxy
    proxy.clear()


@pytest.fixture(scope="module")
def pushed(server, scheme, tiny, tmp_path_factory):
    """The tiny artifact pushed once (straight to the server), its address."""
    mp = pytest.MonkeyPatch()
    _env(mp, tmp_path_factory.mktemp("cloud-push"), server.env(server.endpoint))
    uri = f"{scheme}://{BUCKET}/tiny/llama.lct"
    try:
        assert cloud.push(tiny, uri) > 0
    finally:
        mp.undo()
    return uri


def _fresh(scheme, tiny, name: str) -> str:
    uri = f"{scheme}://{BUCKET}/{name}/llama.lct"
    assert cloud.push(tiny, uri) > 0
    return uri


def _one_line(e) -> None:
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value), str(e.value)


def test_push_writes_the_manifest_last_and_pull_gives_the_same_bytes(request, scheme, tiny,
                                                                    server, faulty, tmp_path):
    uri = _fresh(scheme, tiny, "order")
    order = request.module.upload_order(server, faulty.log, "order/llama.lct")
    names = sorted(p.name for p in tiny.iterdir())
    assert sorted(order) == names and order[-1] == "lct.json", order  # a half-upload: no artifact
    got = cloud.pull(uri, tmp_path / "pulled")
    assert sorted(p.name for p in got.iterdir()) == names
    assert all(filecmp.cmp(got / n, tiny / n, shallow=False) for n in names)
    from lct.errors import WriteError
    with pytest.raises(WriteError, match="already exists"):
        cloud.pull(uri, got)
    with pytest.raises(WriteError, match="already holds"):
        cloud.push(tiny, uri)                   # nothing LCT did not write is overwritten


def test_a_streamed_load_equals_the_local_load_reading_listed_ranges(request, pushed, tiny,
                                                                      faulty):
    want = lct.load(tiny, cache=False)(IDS).logits
    assert torch.equal(lct.load(pushed, prefetch=2, cache=False)(IDS).logits, want)
    data = [e for e in faulty.log if re.search(DATA, e["path"]) and e["method"] == "GET"]
    assert data and all(e["range"] for e in data), data        # no data file fetched whole
    client, bucket, prefix = cloud.objects.client_for(pushed)
    listed = {n: v for n, (_, v) in client.list(bucket, prefix).items() if re.search(DATA, n)}
    asked = {request.module.CONDITION(e) for e in data}
    assert asked == {v.strip('"') for v in listed.values()}, (asked, listed)  # each as listed
    faulty.reset()
    with lct.open(pushed) as art:
        assert sum(1 for _ in art.stream(prefetch=1)) == len(art.groups)
        assert art.store.readahead.hits > 0     # fetched ahead of the decoders
    ranges = [(e["path"], e["range"]) for e in faulty.log if re.search(DATA, e["path"])]
    assert len(ranges) == len(set(ranges)), ranges


def _flipped(server, key: str, at: int) -> bytes:
    data = bytearray(server.get(BUCKET, key))
    data[at] ^= 0xFF
    return bytes(data)


def test_a_flipped_byte_in_a_data_object_is_refused_naming_it(scheme, tiny, server, direct,
                                                              monkeypatch, tmp_path):
    uri = _fresh(scheme, tiny, "flipped")
    with lct.open(tiny) as art:
        chunk = art.manifest.chunks[-1]
        name = art.manifest.files[chunk.file]["name"]
    key = f"flipped/llama.lct/{name}"
    server.put(BUCKET, key, _flipped(server, key, chunk.offset + chunk.stored_size // 2))
    with pytest.raises(ChecksumError, match=f"{scheme}://{BUCKET}/{key}: chunk {chunk.id}") as e:
        lct.load(uri, cache=False)
    _one_line(e)
    with pytest.raises(ChecksumError, match=re.escape(name)):
        cloud.pull(uri, tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()


def test_an_object_replaced_mid_load_is_an_error_never_a_mix(request, scheme, tiny, server,
                                                             direct):
    """The artifact is opened (listed) and its first group read; then another writer replaces
    a data object (one byte of its last chunk changed); reading on is an error naming the
    object, never tensors from two versions."""
    uri = _fresh(scheme, tiny, "replaced")
    with lct.open(uri) as art:
        first = art.read_group(art.groups[0])
        assert first
        chunk = art.manifest.chunks[-1]
        name = art.manifest.files[chunk.file]["name"]
        key = f"replaced/llama.lct/{name}"
        server.put(BUCKET, key, _flipped(server, key, chunk.offset + chunk.stored_size // 2))
        error, words = request.module.REPLACED
        with pytest.raises(error, match=words) as e:
            for group in art.groups[1:]:
                art.read_group(group)
    assert f"{scheme}://{BUCKET}/{key}" in str(e.value)
    _one_line(e)


@pytest.mark.parametrize("kind,kw", [
    ("slowdown", {"count": 2}),             # 503, twice: retried
    ("error500", {"count": 2}),
    ("drop", {"count": 1}),                 # the connection dropped mid-body: resumed
    ("stall", {"count": 1, "seconds": 6, "after": 100}),     # stalled past the timeout: retried
])
def test_transient_faults_are_retried_to_the_right_result(pushed, tiny, faulty, kind, kw):
    want = lct.load(tiny, cache=False)(IDS).logits
    fault = faulty.set_fault(kind, match=DATA, range=True, **kw)
    assert torch.equal(lct.load(pushed, cache=False)(IDS).logits, want)
    assert fault.injected == kw["count"]


def test_bytes_flipped_in_transit_are_refused_and_a_server_that_keeps_failing_gives_up(
        scheme, pushed, faulty):
    faulty.set_fault("flip", match=DATA, range=True)
    with pytest.raises((ChecksumError, ManifestError), match="checksum|header") as e:
        lct.load(pushed, cache=False)
    _one_line(e)
    assert f"{scheme}://" in str(e.value)
    from lct.errors import ObjectStoreOfflineError
    faulty.set_fault("slowdown", match=DATA, range=True)
    with pytest.raises(ObjectStoreOfflineError, match="giving up after") as e:
        with lct.open(pushed) as art:
            art.store.backoff = 0.01
            art.read_group(art.groups[0])
    _one_line(e)


def test_addresses_and_missing_objects_are_one_line_errors(scheme, server, direct):
    from lct.errors import ArtifactNotFoundError, ObjectStoreNotFoundError, ObjectStoreURIError
    with pytest.raises(ObjectStoreNotFoundError, match="no such") as e:
        lct.open(f"{scheme}://no-such-bucket/x.lct")
    _one_line(e)
    with pytest.raises(ArtifactNotFoundError, match="not an LCT artifact"):
        lct.open(f"{scheme}://{BUCKET}/nothing/here")
    for bad in (f"{scheme}://Bad_Bucket/x", f"{scheme}://{BUCKET}", f"{scheme}://{BUCKET}/a/../b"):
        with pytest.raises(ObjectStoreURIError):
            lct.open(bad)


def test_the_cli_converts_pushes_pulls_and_verifies(scheme, tiny, direct, tmp_path, monkeypatch):
    """`lct convert -o`, `push`, `pull --local-dir` (which keeps the decoded copy, issue 36),
    `info` and `verify` take the address."""
    from click.testing import CliRunner

    from lct.cli.main import cli
    from lct.io import cache
    src = tiny.parent / "llama"
    uri = f"{scheme}://{BUCKET}/cli/converted.lct"
    r = CliRunner().invoke(cli, ["convert", str(src), "-o", uri, "-q"])
    assert r.exit_code == 0 and r.output.strip().endswith(uri), r.output
    r = CliRunner().invoke(cli, ["convert", str(src), "-o", uri, "-q"])
    assert r.exit_code != 0 and "already holds" in r.output, r.output     # refused up front
    pushed = f"{scheme}://{BUCKET}/cli/pushed.lct"
    r = CliRunner().invoke(cli, ["push", str(tiny), pushed, "-q"])
    assert r.exit_code == 0 and r.output.strip() == pushed, r.output
    r = CliRunner().invoke(cli, ["info", pushed, "-q"])
    assert r.exit_code == 0 and "pushed.lct" in r.output, r.output
    r = CliRunner().invoke(cli, ["verify", pushed])
    assert r.exit_code == 0 and "OK" in r.output, r.output
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "decoded"))
    monkeypatch.delenv(cache.ENV_SWITCH, raising=False)               # on by default
    out = tmp_path / "pulled"
    r = CliRunner().invoke(cli, ["pull", pushed, "--local-dir", str(out), "-q"])
    assert r.exit_code == 0 and r.output.strip() == str(out), r.output
    assert all(filecmp.cmp(out / p.name, p, shallow=False) for p in tiny.iterdir())
    fills = cache.wait_fills()
    assert fills[-1].done and fills[-1].folder.parent == tmp_path / "decoded", fills[-1].reason
    stats = lct.LoadStats()
    lct.load(out, stats=stats)
    assert stats.cache.startswith("hit: mapped"), stats.cache
    r = CliRunner().invoke(cli, ["pull", pushed])
    assert r.exit_code != 0 and "--local-dir" in r.output, r.output


def test_vllm_resolves_the_address_to_its_small_files_and_streams_the_chunks(pushed, direct):
    """loader/source.py, the path vLLM's `--load-format lct` takes: the config and tokenizer in
    a local folder, the chunks read from the store."""
    from pathlib import Path

    from lct.loader.source import open_source, resolve
    r = resolve(pushed)
    assert r.stream and r.source == pushed and (Path(r.folder) / "config.json").is_file()
    with open_source(r.source) as art:
        assert not art.store.local and art.read_group(art.groups[0])


@pytest.mark.slow
def test_tensor_parallel_ranks_each_read_only_their_share(scheme, server, faulty, tmp_path):
    check_ranks_read_their_share(f"{scheme}://{BUCKET}/tp/pieces.lct", faulty, tmp_path)


def check_ranks_read_their_share(uri: str, proxy, tmp_path) -> None:
    """``lct.load(uri, tp_plan="auto")`` in a gloo world of 2 (the artifact pushed to ``uri``
    first): each rank range-reads the chunks of its own tensor-parallel pieces (and the small
    whole tensors), not the artifact; ``proxy`` counts the bytes (tests/test_s3.py too)."""
    from test_tensor_parallel import launch

    from lct.conversion.converter import Policy
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "qwen2", "qwen2", num_attention_heads=8,
                         num_key_value_heads=4)
    art = tmp_path / "pieces.lct"
    lct.convert(str(src), art, policy=Policy(nf4=(), tp_pieces=2))
    cloud.push(art, uri)
    proxy.reset()
    results = launch(2, uri, src, tmp_path / "out", stream=True, env=dict(os.environ))
    for r in results:
        assert "error" not in r, r
        assert r["max_diff"] == 0.0 and r["placements"] == [], r
    sizes = [int(b) - int(a) + 1 for e in proxy.log
             if e["method"] == "GET" and re.search(DATA, e["path"]) and e["range"]
             for a, b in [re.fullmatch(r"bytes=(\d+)-(\d+)", e["range"]).groups()]]
    stored = sum(c.stored_size for c in lct.open(art).manifest.chunks)
    assert stored * 0.9 < sum(sizes) < stored * 1.3, (sum(sizes), stored)

