"""``s3://`` artifacts (lct/cloud/s3.py) against a real S3 server on loopback (SeaweedFS, started by
these tests: tests/s3_server.py), and a proxy of our own in front of it for the faults a real
server does not make on demand: a push and a pull are byte for byte the local artifact, a load
streamed from the store equals the local load, and every fault either gives the right result
(retried) or one clean LCT error, never different data."""

import filecmp
import os

import pytest
import torch

import lct
from lct import cloud
from lct.errors import (
    ArtifactNotFoundError,
    ChecksumError,
    ManifestError,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreNotFoundError,
    ObjectStoreOfflineError,
    ObjectStoreURIError,
    WriteError,
)

s3_server = pytest.importorskip("s3_server")
pytest.importorskip("boto3")
from cloud_cases import tiny  # noqa: E402,F401 - the tiny artifact every store's tests push

BUCKET = "models"
IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])


@pytest.fixture(scope="module")
def server():
    try:
        srv = s3_server.S3Server().start()
    except s3_server.WeedNotFound as e:
        pytest.skip(str(e))
    srv.make_bucket(BUCKET)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def proxy(server):
    p = s3_server.FaultProxy(server).start()
    yield p
    p.stop()



def _env(monkeypatch, tmp_path, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LCT_CLOUD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")         # botocore's own retries: keep faults quick
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture(scope="module")
def pushed(server, tiny, tmp_path_factory):
    """The tiny artifact pushed once (straight to the server), its address."""
    mp = pytest.MonkeyPatch()
    _env(mp, tmp_path_factory.mktemp("s3-push"), server.env())
    uri = f"s3://{BUCKET}/tiny/llama.lct"
    try:
        assert cloud.push(tiny, uri) > 0
    finally:
        mp.undo()
    return uri


@pytest.fixture
def direct(server, monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path, server.env())


@pytest.fixture
def faulty(proxy, monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path, proxy.env())
    monkeypatch.setenv("LCT_CLOUD_TIMEOUT", "2")
    proxy.clear()
    proxy.reset()
    yield proxy
    proxy.clear()


def test_push_writes_the_manifest_last_and_pull_gives_the_same_bytes(tiny, faulty, tmp_path):
    uri = f"s3://{BUCKET}/order/llama.lct"
    assert cloud.push(tiny, uri) > 0
    puts = [e["path"] for e in faulty.log if e["method"] == "PUT"]
    assert puts and puts[-1].endswith("/lct.json"), puts        # a half-upload is no artifact
    got = cloud.pull(uri, tmp_path / "pulled")
    names = sorted(p.name for p in tiny.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    assert all(filecmp.cmp(got / n, tiny / n, shallow=False) for n in names)
    with pytest.raises(WriteError, match="already exists"):
        cloud.pull(uri, got)
    with pytest.raises(WriteError, match="already holds"):
        cloud.push(tiny, uri)                   # nothing LCT did not write is overwritten


def test_a_streamed_load_equals_the_local_load_reading_only_ranges(pushed, tiny, faulty):
    want = lct.load(tiny)(IDS).logits
    assert torch.equal(lct.load(pushed, prefetch=2)(IDS).logits, want)
    data = [e for e in faulty.log if e["path"].endswith(".lct") and e["method"] == "GET"]
    assert data and all(e["range"] for e in data), data        # no data file fetched whole
    faulty.reset()
    with lct.open(pushed) as art:
        n = sum(1 for _ in art.stream(prefetch=1))
        # the stream's hints fetched chunks ahead of the decoders, each range once
        assert n == len(art.groups) and art.store.readahead.hits > 0
    ranges = [(e["path"], e["range"]) for e in faulty.log if e["path"].endswith(".lct")]
    assert len(ranges) == len(set(ranges)), ranges


def test_the_cli_load_lists_once_and_the_tokenizer_comes_with_the_model(pushed, faulty):
    from click.testing import CliRunner
    from lct.cli.main import cli
    from transformers import AutoTokenizer
    r = CliRunner().invoke(cli, ["load", pushed, "--prompt", "a b", "--max-new-tokens", "2",
                                 "-q"])
    assert r.exit_code == 0 and r.output.strip(), r.output
    lists = [e for e in faulty.log if e["method"] == "GET" and e["path"] == f"/{BUCKET}"]
    manifests = [e for e in faulty.log if e["path"].endswith("/lct.json")]
    assert len(lists) == 1 and len(manifests) == 1, (lists, manifests)   # resolve, then open
    model = lct.load(pushed)        # config and tokenizer in the cache folder it names
    assert AutoTokenizer.from_pretrained(model.name_or_path)("a b").input_ids


@pytest.mark.parametrize("kind,kw", [
    ("slowdown", {"count": 2}),             # 503 SlowDown, twice: retried
    ("error500", {"count": 2}),
    ("drop", {"count": 1}),                 # the connection dropped mid-body: resumed
    ("stall", {"count": 1, "seconds": 6, "after": 100}),     # stalled past the timeout: retried
])
def test_transient_faults_are_retried_to_the_right_result(pushed, tiny, faulty, kind, kw):
    want = lct.load(tiny)(IDS).logits
    fault = faulty.set_fault(kind, match=r"model-\d+\.lct$", range=True, **kw)
    assert torch.equal(lct.load(pushed)(IDS).logits, want)
    assert fault.injected == kw["count"]


@pytest.mark.parametrize("kind,error,match", [
    ("flip", (ChecksumError, ManifestError), "checksum|header"),    # different bytes: refused
    ("etag", ObjectStoreError, "changed while it was read"),
    ("ignore_range", ObjectStoreError, "does not serve byte ranges"),
])
def test_faults_that_would_give_different_data_are_one_line_errors(pushed, faulty, kind, error,
                                                                    match):
    faulty.set_fault(kind, match=r"model-\d+\.lct$", range=True)
    with pytest.raises(error, match=match) as e:
        lct.load(pushed)
    assert "\n" not in str(e.value) and "s3://" in str(e.value)


def test_a_server_that_keeps_failing_is_one_line_after_the_retries(pushed, faulty):
    faulty.set_fault("slowdown", match=r"model-\d+\.lct$", range=True)
    with pytest.raises(ObjectStoreOfflineError, match="giving up after") as e:
        with lct.open(pushed) as art:
            store = art.store
            store.backoff = 0.01
            art.read_group(art.groups[0])
    assert "\n" not in str(e.value)


def test_addresses_buckets_and_permissions_are_one_line_errors(server, pushed, tiny, monkeypatch,
                                                               tmp_path):
    _env(monkeypatch, tmp_path, server.env())
    with pytest.raises(ObjectStoreNotFoundError, match="no such bucket"):
        lct.open("s3://no-such-bucket/x.lct")
    with pytest.raises(ArtifactNotFoundError, match="not an LCT artifact"):
        lct.open(f"s3://{BUCKET}/nothing/here")
    for bad in ("s3://Bad_Bucket/x", f"s3://{BUCKET}", f"s3://{BUCKET}/a/../b"):
        with pytest.raises(ObjectStoreURIError):
            lct.open(bad)
    _env(monkeypatch, tmp_path, server.env(readonly=True))
    with lct.open(pushed) as art:                   # reading is allowed
        assert art.groups
    with pytest.raises(ObjectStoreAuthError, match="access denied"):
        cloud.push(tiny, f"s3://{BUCKET}/readonly/llama.lct")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ObjectStoreAuthError):
        lct.open(pushed)


def test_info_verify_and_export_take_s3_addresses(pushed, direct, tmp_path):
    from click.testing import CliRunner
    from lct.cli.main import cli
    r = CliRunner().invoke(cli, ["info", pushed, "-q"])
    # named by the address given, not by the local cache of its small files (a new user's find)
    assert r.exit_code == 0 and r.output.startswith(f"{pushed}: LCT 1."), r.output
    r = CliRunner().invoke(cli, ["verify", pushed])
    assert r.exit_code == 0 and "OK" in r.output, r.output
    assert lct.verify(pushed).ok
    out = tmp_path / "exported"
    r = CliRunner().invoke(cli, ["export", pushed, str(out)])
    assert r.exit_code == 0 and (out / "config.json").is_file(), r.output


def test_the_cli_converts_pushes_and_pulls_s3_addresses(tiny, direct, tmp_path):
    from click.testing import CliRunner
    from lct.cli.main import cli
    src = tiny.parent / "llama"
    uri = f"s3://{BUCKET}/cli/converted.lct"
    r = CliRunner().invoke(cli, ["convert", str(src), "-o", uri, "-q"])
    assert r.exit_code == 0 and r.output.strip().endswith(uri), r.output
    assert torch.equal(lct.load(uri)(IDS).logits, lct.load(tiny)(IDS).logits)
    r = CliRunner().invoke(cli, ["convert", str(src), "-o", uri, "-q"])
    assert r.exit_code != 0 and "already holds" in r.output, r.output     # refused up front
    r = CliRunner().invoke(cli, ["push", str(tiny), f"s3://{BUCKET}/cli/pushed.lct", "-q"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["push", str(tiny), f"s3://{BUCKET}/cli/x.lct", "--private"])
    assert r.exit_code != 0 and "--private is for the Hub" in r.output, r.output
    out = tmp_path / "pulled"
    r = CliRunner().invoke(cli, ["pull", f"s3://{BUCKET}/cli/pushed.lct", "--local-dir",
                                 str(out), "-q"])
    assert r.exit_code == 0 and r.output.strip() == str(out), r.output
    assert all(filecmp.cmp(out / p.name, p, shallow=False) for p in tiny.iterdir())
    r = CliRunner().invoke(cli, ["pull", f"s3://{BUCKET}/cli/pushed.lct"])
    assert r.exit_code != 0 and "--local-dir" in r.output, r.output


@pytest.mark.slow
def test_tensor_parallel_ranks_each_read_only_their_share_from_s3(server, faulty, tmp_path):
    """``lct.load("s3://...", tp_plan="auto")`` in a gloo world of 2: each rank range-reads the
    chunks of its own tensor-parallel pieces, not the artifact (tests/cloud_cases.py)."""
    from cloud_cases import check_ranks_read_their_share
    check_ranks_read_their_share(f"s3://{BUCKET}/tp/pieces.lct", faulty, tmp_path)


def test_credentials_from_a_profile_in_the_shared_files(server, pushed, monkeypatch, tmp_path):
    """As the AWS CLI finds them: AWS_PROFILE's keys in a shared credentials file, the
    endpoint in the shared config file, nothing in the environment."""
    env = server.env()
    _env(monkeypatch, tmp_path, {})
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
              "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "credentials").write_text(
        f"[lct-test]\naws_access_key_id = {env['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {env['AWS_SECRET_ACCESS_KEY']}\n")
    (tmp_path / "config").write_text(f"[profile lct-test]\nregion = us-east-1\n"
                                     f"endpoint_url = {env['AWS_ENDPOINT_URL']}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "lct-test")
    with lct.open(pushed) as art:
        assert art.read_group(art.groups[0])


def test_the_cli_says_what_went_wrong_in_one_line(server, pushed, faulty):
    from click.testing import CliRunner
    from lct.cli.main import cli
    for args, words in [(["info", "s3://no-such-bucket/x.lct"], "no such bucket"),
                        (["info", f"s3://{BUCKET}/nothing/here"], "not an LCT artifact"),
                        (["info", "s3://Bad_Bucket/x"], "not a valid bucket name")]:
        r = CliRunner().invoke(cli, args)
        assert r.exit_code != 0 and words in r.output, (args, r.output)
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
    faulty.set_fault("flip", match=r"model-\d+\.lct$", range=True)
    r = CliRunner().invoke(cli, ["verify", pushed])
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output


def test_only_the_artifacts_files_go_up_and_an_oversized_small_file_is_refused(
        server, tiny, direct, tmp_path, monkeypatch):
    import shutil

    import boto3

    from lct.format import constants as C
    art = tmp_path / "with-stray.lct"
    shutil.copytree(tiny, art)
    (art / "notes.txt").write_text("not part of the artifact")
    uri = f"s3://{BUCKET}/stray/llama.lct"
    cloud.push(art, uri)
    s3 = boto3.client("s3")
    keys = {o["Key"].rsplit("/", 1)[1] for o in
            s3.list_objects_v2(Bucket=BUCKET, Prefix="stray/llama.lct/")["Contents"]}
    assert "notes.txt" not in keys and {"lct.json", "config.json"} <= keys, keys
    s3.put_object(Bucket=BUCKET, Key="stray/llama.lct/huge.json",
                  Body=b"0" * (C.MAX_SIDE_FILE_BYTES + 1))
    with lct.open(uri) as opened:           # not the manifest's: never fetched
        assert not (opened.path / "huge.json").exists()
    s3.put_object(Bucket=BUCKET, Key="stray/llama.lct/tokenizer.json",
                  Body=b"0" * (C.MAX_SIDE_FILE_BYTES + 1))
    monkeypatch.setenv("LCT_CLOUD_CACHE", str(tmp_path / "fresh-cache"))     # no checked copy
    with pytest.raises(ObjectStoreError, match="tokenizer.json: .* more than"):
        lct.open(uri)                       # a named one that grew past the cap: refused unread


def _push_fresh(tiny, name: str) -> str:
    uri = f"s3://{BUCKET}/{name}/llama.lct"
    cloud.push(tiny, uri)
    return uri


def test_only_the_files_the_manifest_names_are_fetched_by_open_load_and_pull(tiny, faulty,
                                                                            tmp_path):
    """Objects under the prefix that the manifest does not name (40 junk objects of 1 MB, a
    data file it does not list) are never downloaded: not into LCT_CLOUD_CACHE by an open or a
    load, not into the folder a pull makes."""
    import boto3
    uri = _push_fresh(tiny, "junk")
    s3 = boto3.client("s3")
    junk = [f"junk/llama.lct/notes-{i:02d}.txt" for i in range(40)]
    for key in junk:
        s3.put_object(Bucket=BUCKET, Key=key, Body=os.urandom(1 << 20))
    s3.put_object(Bucket=BUCKET, Key="junk/llama.lct/model-00007.lct", Body=b"unlisted")
    junk.append("junk/llama.lct/model-00007.lct")
    faulty.reset()
    assert torch.equal(lct.load(uri)(IDS).logits, lct.load(tiny)(IDS).logits)
    with lct.open(uri) as art:
        assert art.read_group(art.groups[0])
    pulled = cloud.pull(uri, tmp_path / "pulled")
    want = sorted(p.name for p in tiny.iterdir())
    assert sorted(p.name for p in pulled.iterdir()) == want
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert cached == sorted(n for n in want if not n.endswith(".lct")), cached
    fetched = [e["path"] for e in faulty.log if e["method"] == "GET"
               and any(e["path"].endswith(k) for k in junk)]
    assert fetched == [], fetched


def test_a_side_file_changed_in_the_local_cache_is_fetched_again(tiny, faulty):
    """The cached copies are checked against the manifest's sha256 and size each time they are
    used: one changed (or removed) in LCT_CLOUD_CACHE is downloaded again, never used."""
    uri = _push_fresh(tiny, "recache")
    with lct.open(uri) as art:
        folder = art.path
    for name in ("tokenizer.json", "config.json"):
        data = bytearray((folder / name).read_bytes())
        data[len(data) // 2] ^= 1                       # the same size, one bit off
        (folder / name).write_bytes(bytes(data))
    (folder / "tokenizer_config.json").unlink()
    (folder / "special_tokens_map.json").write_text("{}")    # named by no manifest: removed
    faulty.reset()
    model = lct.load(uri)
    assert model.name_or_path == str(folder)
    for name in ("tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (tiny / name).read_bytes(), name
    assert not (folder / "special_tokens_map.json").exists()
    got = sorted(e["path"].rsplit("/", 1)[1] for e in faulty.log if e["method"] == "GET"
                 and not e["path"].endswith((".lct", "/lct.json", f"/{BUCKET}")))
    assert got == ["config.json", "tokenizer.json", "tokenizer_config.json"], got


def test_a_side_file_changed_on_the_store_is_refused_or_harmless(tiny, direct, tmp_path,
                                                                 monkeypatch):
    """A side file replaced on the store under an unchanged manifest: a copy already checked in
    the cache is the one the manifest names and keeps being used; with no such copy, the
    download does not match the manifest and the open is refused, naming the file."""
    import boto3
    uri = _push_fresh(tiny, "changed")
    with lct.open(uri) as art:
        folder = art.path
    tok = (tiny / "tokenizer.json").read_bytes()
    boto3.client("s3").put_object(Bucket=BUCKET, Key="changed/llama.lct/tokenizer.json",
                                  Body=tok.replace(b"<", b">", 1))
    with lct.open(uri) as art:                  # the checked copy: still the manifest's bytes
        assert art.path == folder and (folder / "tokenizer.json").read_bytes() == tok
    monkeypatch.setenv("LCT_CLOUD_CACHE", str(tmp_path / "fresh-cache"))
    with pytest.raises(ChecksumError, match="tokenizer.json.*manifest") as e:
        lct.open(uri)
    assert "\n" not in str(e.value) and "s3://" in str(e.value)
    with pytest.raises(ChecksumError, match="tokenizer.json"):
        cloud.pull(uri, tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()


def test_read_ahead_is_bounded_and_hands_over_errors():
    import threading

    from lct.io.store import ReadAhead
    calls, gate = [], threading.Event()

    def fetch(name, offset, size, out):
        gate.wait(5)
        calls.append((name, offset, size))
        if name == "bad":
            raise ObjectStoreOfflineError("bad: giving up")
        out[:] = bytes(range(offset, offset + size))

    sizes = {"a": 60, "b": 60, "bad": 10, "c": 30, "d": 500, "short": 40}
    ra = ReadAhead(fetch, sizes.__getitem__, max_bytes=100, threads=2, piece=25)
    ra.want("a", 0, 60)
    ra.want("a", 0, 60)                 # once
    ra.want("b", 0, 60)                 # past the budget: queued until "a" is taken
    ra.want("bad", 0, 10)               # behind "b", in order
    ra.want("c", 0, 30)
    gate.set()
    assert bytes(ra.take("a", 0, 60)) == bytes(range(60))     # frees its budget: "b" starts
    assert bytes(ra.take("b", 0, 60)) == bytes(range(60))
    with pytest.raises(ObjectStoreOfflineError):
        ra.take("bad", 0, 10)
    assert bytes(ra.take("c", 0, 30)) == bytes(range(30))
    # Each range in pieces of at most 25 bytes, straight into its buffer, in order.
    assert sorted(calls) == [("a", 0, 25), ("a", 25, 25), ("a", 50, 10), ("b", 0, 25),
                             ("b", 25, 25), ("b", 50, 10), ("bad", 0, 10), ("c", 0, 25),
                             ("c", 25, 5)]
    ra.want("d", 0, 200)                # larger than the budget: fetched ahead alone
    assert bytes(ra.take("d", 0, 200)) == bytes(range(200))
    ra.want("short", 30, 20)            # clipped to the file, as a read is
    assert bytes(ra.take("short", 30, 20)) == bytes(range(30, 40))
    ra.want("missing", 0, 5)            # the file's size fails: the take raises it
    with pytest.raises(KeyError):
        ra.take("missing", 0, 5)
    ra.close()
    ra.want("c", 0, 1)                  # closed: nothing starts
    assert ra.take("c", 0, 1) is None
    calls.clear()                       # one thread: the earliest range's pieces go first
    one = ReadAhead(fetch, sizes.__getitem__, max_bytes=1000, threads=1, piece=25)
    one.want("a", 0, 60)
    one.want("c", 0, 30)
    one.take("c", 0, 30)
    assert calls == [("a", 0, 25), ("a", 25, 25), ("a", 50, 10), ("c", 0, 25), ("c", 25, 5)]
    one.close()


def test_lct_pull_of_an_s3_artifact_keeps_its_decoded_copy(tiny, direct, tmp_path, monkeypatch):
    """Issue 36: as from the Hub, `lct pull s3://...` decodes the artifact it checked into the
    decoded cache, so that the first load of the pulled folder maps it."""
    from click.testing import CliRunner

    from lct.cli.main import cli
    from lct.io import cache
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "decoded"))
    monkeypatch.delenv(cache.ENV_SWITCH)                # on by default
    uri = f"s3://{BUCKET}/cached/pushed.lct"
    assert cloud.push(tiny, uri) > 0
    out = tmp_path / "pulled"
    r = CliRunner().invoke(cli, ["pull", uri, "--local-dir", str(out), "-q"])
    assert r.exit_code == 0 and r.output.strip() == str(out), r.output
    fills = cache.wait_fills()
    assert fills[-1].done and fills[-1].folder.parent == tmp_path / "decoded", fills[-1].reason
    stats = lct.LoadStats()
    model = lct.load(out, stats=stats)
    assert stats.cache.startswith("hit: mapped") and stats.bytes_read == 0, stats.cache
    assert torch.equal(model(IDS).logits, lct.load(tiny, cache=False)(IDS).logits)


@pytest.mark.parametrize("env,words", [
    ({"LCT_CLOUD_TIMEOUT": "abc"}, "LCT_CLOUD_TIMEOUT must be a number of seconds above 0, "
                                   "got 'abc'"),
    ({"LCT_CLOUD_TIMEOUT": "0"}, "LCT_CLOUD_TIMEOUT must be a number of seconds above 0"),
    ({"LCT_CLOUD_TIMEOUT": "-5"}, "LCT_CLOUD_TIMEOUT must be a number of seconds above 0"),
    ({"AWS_PROFILE": "nope"}, "The config profile (nope) could not be found"),
    ({"AWS_ENDPOINT_URL": "127.0.0.1:9000"}, "AWS_ENDPOINT_URL '127.0.0.1:9000' needs http:// "
                                             "or https://"),
])
def test_client_settings_that_cannot_work_are_one_line(monkeypatch, tmp_path, env, words):
    """Found by a new user: each of these was a Python traceback (botocore's ProfileNotFound,
    its "Invalid endpoint", a float() of the timeout). No server is needed: the client is
    refused as it is made."""
    from click.testing import CliRunner
    from lct.cli.main import cli
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))     # no profiles at all
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    for k, v in {"AWS_ACCESS_KEY_ID": "K", "AWS_SECRET_ACCESS_KEY": "S",
                 "AWS_DEFAULT_REGION": "us-east-1", **env}.items():
        monkeypatch.setenv(k, v)
    r = CliRunner().invoke(cli, ["info", "s3://models/x.lct"])
    assert r.exit_code == 1 and words in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_server_that_never_answers_is_retried_aloud_then_given_up(monkeypatch, tmp_path):
    """Found by a new user: an endpoint that takes connections and never answers held `lct info`
    silent for 361 s (LCT's retries on top of botocore's, each a whole timeout). Listings and
    reads are retried by LCT alone, each retry said on stderr, and the command gives up after
    its 5 retries: about 6 timeouts and 8 s of backoff."""
    import socket
    import threading
    import time

    from click.testing import CliRunner
    from lct.cli.main import cli
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held = []
    stop = threading.Event()

    def accept():               # takes every connection, says nothing
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                pass
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    _env(monkeypatch, tmp_path, {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{sock.getsockname()[1]}",
                                 "AWS_ACCESS_KEY_ID": "K", "AWS_SECRET_ACCESS_KEY": "S",
                                 "AWS_DEFAULT_REGION": "us-east-1", "LCT_CLOUD_TIMEOUT": "1"})
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    try:
        t0 = time.monotonic()
        r = CliRunner().invoke(cli, ["info", "s3://models/x.lct"])
        took = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        sock.close()
    assert r.exit_code == 1 and "cannot reach the object store" in r.output, r.output
    assert r.output.count("; retry ") == 5 and "retry 5 of 5" in r.output, r.output
    assert took < 60, took
