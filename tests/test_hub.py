"""Hub push, pull and streaming against a Hub-compatible server on 127.0.0.1 (tests/hub_server.py),
talked to by the real huggingface_hub client. Nothing leaves the machine."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hub_server import HubServer  # noqa: E402  (tests/ is on sys.path under pytest)

import lct
from lct import hub as lhub
from lct.cli.main import cli
from lct.errors import ArtifactNotFoundError, ChecksumError, LCTError
from lct.format import constants as C
from lct.hub.client import HUB_TIMEOUT
from lct.hub import HubAuthError, HubError, HubNotFoundError, HubOfflineError, HubURIError

pytestmark = pytest.mark.filterwarnings(  # huggingface_hub's own LFS PUT, not ours
    "ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

IDS = torch.tensor([[1, 5, 9, 200, 17, 3, 44, 100]])
ALICE, BOB = "tok-alice", "tok-bob"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fresh Hub server, with huggingface_hub pointed at it, online, Xet off (LFS path), an
    empty cache of its own and HF_TOKEN set to alice's token."""
    import huggingface_hub.constants as hc
    server = HubServer(tokens={ALICE: "alice", BOB: "bob"}).start()
    monkeypatch.setattr(hc, "ENDPOINT", server.url)
    monkeypatch.setattr(hc, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hc, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    if hasattr(hc, "AGENT_HARNESSES_PATH"):
        monkeypatch.setattr(hc, "AGENT_HARNESSES_PATH", str(tmp_path / "hf-home" / "agents.json"))
    monkeypatch.setenv("HF_TOKEN", ALICE)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    try:
        yield server
    finally:
        server.stop()


def _files(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in Path(d).iterdir()
            if p.is_file() and not p.name.startswith(".")}


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _front_matter(text: str) -> dict:
    import yaml
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


# Addresses -------------------------------------------------------------------------------------
def test_parse_hf_uri():
    assert lhub.parse_hf_uri("hf://org/name") == ("org/name", None)
    assert lhub.parse_hf_uri("hf://org/name@main") == ("org/name", "main")
    assert lhub.parse_hf_uri("hf://org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    assert lhub.parse_hf_uri("hf://org/name@refs%2Fpr%2F1") == ("org/name", "refs/pr/1")
    assert lhub.parse_hf_uri("hf://models/org/name") == ("org/name", None)
    assert lhub.parse_hf_uri("org/name@abc") == ("org/name", "abc")
    for bad in ("hf://", "hf://a/b/c", "hf://org/na me", "hf://org/name@", "hf://../x",
                "hf://datasets/org/name"):
        with pytest.raises(HubURIError):
            lhub.parse_hf_uri(bad)


# Push and pull ---------------------------------------------------------------------------------
def test_push_pull_byte_identical(gemma_art, hub, tmp_path):
    before = sorted(p.name for p in gemma_art.iterdir())
    seen = []
    res = lhub.push(gemma_art, "alice/gemma-lct", progress=lambda f, d, t: seen.append((f, d, t)))
    assert sorted(p.name for p in gemma_art.iterdir()) == before  # the artifact is untouched
    assert res.pr_url is None and res.commit_oid == hub.head("alice/gemma-lct").oid
    assert seen and seen[-1][1] == seen[-1][2] == res.bytes
    # One commit on top of the repo's initial one, with every file of the artifact.
    head = hub.head("alice/gemma-lct")
    assert hub.repos["alice/gemma-lct"].commits[head.parent].parent is None
    assert set(head.tree) >= set(before) | {"README.md"}
    assert all(head.tree[n].lfs_sha256 for n in before if n.endswith(".lct"))  # through LFS
    card = hub.blob("alice/gemma-lct", "README.md").decode()
    meta = _front_matter(card)
    assert meta["library_name"] == "lct" and "lct" in meta["tags"] and "gemma" in meta["tags"]
    assert 'lct.load("hf://alice/gemma-lct", prefetch=2)' in card
    assert "lossy parts" in card and "embed" in card and "Maximus shards" in card

    path = lhub.pull("alice/gemma-lct")
    got, want = _files(path), _files(gemma_art)
    assert set(got) == set(want) | {"README.md"}
    assert all(got[n] == want[n] for n in want)
    # A local folder works too, and hf:// addresses with a revision.
    local = lhub.pull("hf://alice/gemma-lct@main", local_dir=tmp_path / "copy")
    assert local == (tmp_path / "copy").resolve()
    assert all(_files(local)[n] == want[n] for n in want)


def test_push_refuses_invalid_artifacts(gemma_art, hub, tmp_path):
    bad = tmp_path / "bad.lct"
    shutil.copytree(gemma_art, bad)
    m = json.loads((bad / C.MANIFEST_NAME).read_text())
    c = m["chunks"][1]
    data = bad / m["files"][c["file"]]["name"]
    raw = bytearray(data.read_bytes())
    raw[c["offset"] + 7] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="refusing to push"):
        lhub.push(bad, "alice/bad")
    with pytest.raises(ArtifactNotFoundError, match="refusing to push"):
        lhub.push(tmp_path, "alice/bad")
    assert not hub.repos and not [r for r in hub.log if r["method"] != "GET"]


def test_push_refuses_a_symlink_inside_the_artifact(gemma_art, hub, tmp_path):
    """A LICENSE that links to a private file outside the folder must not be published."""
    art = tmp_path / "a.lct"
    shutil.copytree(gemma_art, art)
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    (art / "LICENSE").symlink_to(secret)
    with pytest.raises(LCTError, match="symbolic link that leaves the artifact folder"):
        lhub.push(art, "alice/leak")
    assert not hub.repos and not [r for r in hub.log if r["method"] != "GET"]


def test_cli_push_branch_and_pr_then_pull(llama_art, hub, run, tmp_path):
    res = run("push", llama_art, "alice/llama-lct", "--revision", "dev",
              "--commit-message", "first upload", "--license", "apache-2.0")
    assert res.exit_code == 0, res.output
    assert "pushed" in res.output and "hf://alice/llama-lct" in res.output
    repo = hub.repos["alice/llama-lct"]
    assert set(repo.branches) == {"main", "dev"}
    dev = hub.head("alice/llama-lct", "dev")
    assert dev.title == "first upload" and "lct.json" not in hub.head("alice/llama-lct").tree
    assert _front_matter(hub.blob("alice/llama-lct", "README.md", "dev").decode())["license"] \
        == "apache-2.0"
    res = run("push", llama_art, "alice/llama-lct", "--create-pr")
    assert res.exit_code == 0, res.output
    assert "pull request: " in res.output and len(repo.prs) == 1
    assert "lct.json" not in hub.head("alice/llama-lct").tree   # main unchanged by a PR

    res = run("pull", "alice/llama-lct", "--revision", "dev", "--local-dir", tmp_path / "d")
    assert res.exit_code == 0, res.output
    assert "chunk checksums OK" in res.output
    assert res.output.strip().splitlines()[-1] == str((tmp_path / "d").resolve())
    want = _files(llama_art)
    got = _files(tmp_path / "d")
    assert all(got[n] == want[n] for n in want)
    res = run("pull", "hf://alice/llama-lct@refs/pr/1")
    assert res.exit_code == 0, res.output


def test_pull_refuses_a_repo_without_manifest(gemma_src, hub):
    import huggingface_hub as hh
    hh.HfApi().create_repo("alice/plain")
    hh.HfApi().upload_folder(repo_id="alice/plain", folder_path=gemma_src)
    hub.clear_log()
    with pytest.raises(ArtifactNotFoundError, match="not an LCT artifact.*lct convert"):
        lhub.pull("alice/plain")
    assert not [r for r in hub.log if r["file"]]    # nothing was downloaded


def test_maximus_artifact_round_trip(llama_src, hub, tmp_path):
    from lct.conversion.converter import Policy
    from lct.hub.remote import open_remote
    art = tmp_path / "mx.lct"
    lct.convert(str(llama_src), art, policy=Policy(maximus_shards=3))
    lhub.push(art, "alice/mx")
    card = hub.blob("alice/mx", "README.md").decode()
    assert "maximus" in _front_matter(card)["tags"] and "3 shards of" in card
    path = lhub.pull("alice/mx")
    assert (path / C.MAXIMUS_FILE).read_bytes() == (art / C.MAXIMUS_FILE).read_bytes()
    name = "model.embed_tokens.weight"
    with open_remote("alice/mx") as remote, lct.open(art) as ref:
        assert torch.equal(remote.read_tensor(name), ref.read_tensor(name))
        assert torch.equal(remote.maximus_state()["maximus.row_to_id"],
                           ref.maximus_state()["maximus.row_to_id"])


def test_cli_pull_in_a_fresh_process_with_hf_endpoint(gemma_art, hub, tmp_path):
    """The plain user setup: HF_ENDPOINT and HF_TOKEN in the environment of a new process."""
    import os
    import subprocess
    import sys
    lhub.push(gemma_art, "alice/g")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN=ALICE, HF_HOME=str(tmp_path / "home"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    out = subprocess.run([sys.executable, "-m", "lct.cli.main", "pull", "alice/g"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.is_relative_to(tmp_path / "home")
    assert all(_files(path)[n] == b for n, b in _files(gemma_art).items())
    env["HF_TOKEN"] = "nope"
    out = subprocess.run([sys.executable, "-m", "lct.cli.main", "pull", "alice/g"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("error: alice/g: the Hub rejected")


def test_pull_offline_uses_cache(gemma_art, hub, monkeypatch):
    import huggingface_hub.constants as hc
    lhub.push(gemma_art, "alice/g")
    online = lhub.pull("alice/g")
    hub.clear_log()
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert lhub.pull("alice/g") == online
    assert not hub.log


# Streaming -------------------------------------------------------------------------------------
def _allowed_spans(manifest, groups=None):
    """{file: [(start, end)]}: the data file headers and the chunks of ``groups``."""
    spans = {f["name"]: [(0, C.DATA_HEADER_SIZE)] for f in manifest.files}
    for c in manifest.chunks:
        if groups is None or c.group in groups:
            spans[manifest.files[c.file]["name"]].append((c.offset, c.offset + c.stored_size))
    return spans


def _ranges(log_entries):
    out = []
    for r in log_entries:
        assert r["range"] and r["range"].startswith("bytes="), r   # never a whole file
        a, b = r["range"][len("bytes="):].split("-")
        out.append((int(a), int(b) + 1, r))
    return out


def _assert_only_spans(hub, manifest, groups=None):
    spans = _allowed_spans(manifest, groups)
    fetched = {}
    for name in spans:
        entries = [r for r in hub.requests_for(name) if r["method"] == "GET"]
        for a, b, r in _ranges(entries):
            assert (a, b) in spans[name], f"{name}: range {a}-{b} is not a chunk or header"
            if r["status"] == 206:
                assert r["sent"] == b - a
                fetched.setdefault(name, []).append((a, b))
            else:
                assert r["status"] == 302 and r["sent"] == 0   # the redirect to storage
    return fetched


def test_streamed_load_equals_local_and_fetches_only_chunks(gemma_art, hub):
    lhub.push(gemma_art, "alice/gemma-lct")
    hub.clear_log()
    streamed = lct.load("hf://alice/gemma-lct@main", prefetch=2, stream=True)
    local = lct.load(gemma_art, prefetch=2)
    assert torch.equal(_logits(streamed), _logits(local))
    manifest = lct.open(gemma_art).manifest
    fetched = _assert_only_spans(hub, manifest)
    # Each chunk and each header exactly once: no data file was downloaded whole.
    for name, spans in _allowed_spans(manifest).items():
        assert sorted(fetched[name]) == sorted(spans)
        size = next(f["size"] for f in manifest.files if f["name"] == name)
        assert sum(b - a for a, b in fetched[name]) < size
    cache = Path(lhub._hub().constants.HF_HUB_CACHE) / "models--alice--gemma-lct"
    assert not list(cache.rglob("*.lct"))          # only the small files were downloaded


def test_stream_one_group_fetches_only_its_chunks(llama_art, hub):
    from lct.hub.remote import HttpRangeStore, open_remote
    lhub.push(llama_art, "alice/llama-lct")
    hub.clear_log()
    with open_remote("alice/llama-lct") as art:
        assert isinstance(art.store, HttpRangeStore)
        assert art.store.revision == hub.head("alice/llama-lct").oid   # pinned to the commit
        got = art.read_group("layers.1")
    with lct.open(llama_art) as ref:
        want = ref.read_group("layers.1")
        manifest = ref.manifest
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    fetched = _assert_only_spans(hub, manifest, groups={"layers.1"})
    chunks = {(c.offset, c.offset + c.stored_size) for c in manifest.group_chunks("layers.1")}
    assert set().union(*map(set, fetched.values())) == chunks | {(0, C.DATA_HEADER_SIZE)}


def test_cli_load_stream(gemma_art, hub, run):
    lhub.push(gemma_art, "alice/gemma-lct")
    res = run("load", "hf://alice/gemma-lct", "--stream", "--ids", "1,5,9", "--max-new-tokens", 2)
    assert res.exit_code == 0, res.output
    assert "load to ready" in res.output and "output:" in res.output
    assert all(r["range"] for r in hub.log if (r["file"] or "").endswith(".lct")
               and r["method"] == "GET")
    res = run("load", "hf://alice/gemma-lct", "--ids", "1,5,9", "--max-new-tokens", 2)
    assert res.exit_code == 0, res.output


def test_layerwise_streams_from_the_hub(gemma_art, hub, run):
    from lct.loader import LayerwiseModel
    lhub.push(gemma_art, "alice/gemma-lct")
    hub.clear_log()
    local = lct.load(gemma_art)
    with LayerwiseModel("hf://alice/gemma-lct", prefetch=1, stream=True) as lw:
        assert torch.equal(_logits(lw), _logits(local))
    _assert_only_spans(hub, lct.open(gemma_art).manifest)
    res = run("load", "hf://alice/gemma-lct", "--stream", "--layerwise", "--ids", "1,5")
    assert res.exit_code == 0, res.output
    assert "max resident layers" in res.output


def test_open_hf_address(llama_art, hub):
    lhub.push(llama_art, "alice/llama-lct")
    with lct.open("hf://alice/llama-lct", stream=True) as art, lct.open(llama_art) as ref:
        assert torch.equal(art.read_tensor("model.norm.weight"), ref.read_tensor("model.norm.weight"))
    with lct.open("hf://alice/llama-lct@main") as art:
        assert art.groups == lct.open(llama_art).groups


def test_range_store_resumes_and_refuses_whole_files(gemma_art, hub):
    from lct.hub.remote import HttpRangeStore
    lhub.push(gemma_art, "alice/g")
    sha = hub.head("alice/g").oid
    store = HttpRangeStore("alice/g", sha, backoff=0.01)
    name = "model-00000.lct"
    size = store.size(name)
    want = hub.blob("alice/g", name)[4096:4096 + 20000]
    hub.clear_log()
    hub.drop_once(name, after=5000)
    assert bytes(store.read_range(name, 4096, 20000, size)) == want
    ranges = [r["range"] for r in hub.requests_for(name, "GET") if r["status"] == 206]
    assert ranges == [f"bytes=4096-{4096 + 20000 - 1}", f"bytes={4096 + 5000}-{4096 + 20000 - 1}"]
    hub.ignore_ranges = True
    with pytest.raises(HubError, match="206"):
        store.read_range(name, 4096, 100, size)


# Failures --------------------------------------------------------------------------------------
def test_interrupted_download_resumes(gemma_art, hub, monkeypatch):
    import huggingface_hub.constants as hc
    # huggingface_hub keeps what it received in blocks of DOWNLOAD_CHUNK_SIZE (10 MiB); the tiny
    # test files need small blocks for a resume to have something to resume from.
    monkeypatch.setattr(hc, "DOWNLOAD_CHUNK_SIZE", 4096)
    lhub.push(gemma_art, "alice/g")
    name = "model-00000.lct"
    size = (gemma_art / name).stat().st_size
    hub.drop_once(name, after=size // 3)
    path = lhub.pull("alice/g")
    assert (path / name).read_bytes() == (gemma_art / name).read_bytes()
    gets = [r for r in hub.requests_for(name, "GET") if r["status"] in (200, 206)]
    assert len(gets) == 2
    assert gets[0]["range"] is None and gets[0]["sent"] == size // 3      # dropped here
    kept = size // 3 // 4096 * 4096
    assert gets[1]["range"] == f"bytes={kept}-" and gets[1]["status"] == 206
    assert gets[1]["sent"] == size - kept                                   # only the rest


def test_corrupted_blob_is_detected_and_not_used(gemma_art, hub):
    lhub.push(gemma_art, "alice/g")
    m = lct.open(gemma_art).manifest
    c = m.chunks[2]
    name = m.files[c.file]["name"]
    hub.corrupt("alice/g", name, offset=c.offset + 11)
    with pytest.raises(ChecksumError, match=f"chunk {c.id}") as ei:
        lhub.pull("alice/g")
    assert "removed" in str(ei.value) and name in str(ei.value)
    cache = Path(lhub._hub().constants.HF_HUB_CACHE) / "models--alice--g"
    assert not list(cache.glob(f"snapshots/*/{name}"))        # the corrupt file is gone
    # Streaming reads the same corrupt chunk and refuses it, naming the Hub file.
    with pytest.raises(ChecksumError, match=f"hf://alice/g@.*{name}: chunk {c.id}"):
        lct.load("hf://alice/g", stream=True)
    hub.corrupt("alice/g", name, offset=c.offset + 11)        # flip back: the Hub is repaired
    path = lhub.pull("alice/g")
    assert (path / name).read_bytes() == (gemma_art / name).read_bytes()


def test_a_transient_corruption_is_fetched_again_once(gemma_art, hub):
    """Issue 12 item 13: one corrupt download (the Hub's copy is fine) is removed and fetched
    again by the same pull, instead of failing until `lct pull` runs twice."""
    lhub.push(gemma_art, "alice/g")
    m = lct.open(gemma_art).manifest
    c = m.chunks[2]
    name = m.files[c.file]["name"]
    hub.clear_log()
    hub.corrupt_once(name, c.offset + 11)
    path = lhub.pull("alice/g")
    assert (path / name).read_bytes() == (gemma_art / name).read_bytes()
    assert len([r for r in hub.requests_for(name, "GET") if r["status"] in (200, 206)]) == 2
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():  # and a load after it uses the good copy
        assert torch.equal(lct.load("hf://alice/g")(ids).logits, lct.load(gemma_art)(ids).logits)


def test_a_single_server_error_is_retried(gemma_art, hub):
    """Issue 12 item 13: one 500 on a data file no longer fails the pull."""
    lhub.push(gemma_art, "alice/g")
    name = lct.open(gemma_art).manifest.files[0]["name"]
    hub.clear_log()
    hub.fail_once(name, 500)
    path = lhub.pull("alice/g")
    assert (path / name).read_bytes() == (gemma_art / name).read_bytes()
    assert [r["status"] for r in hub.requests_for(name, "GET")][:1] == [500]


def test_corrupted_small_file_is_detected(gemma_art, hub, run):
    lhub.push(gemma_art, "alice/g")
    hub.corrupt("alice/g", "config.json", offset=3, nbytes=1)
    res = run("pull", "alice/g")
    assert res.exit_code == 1
    assert res.output.startswith("error: alice/g: download is corrupt")
    assert "config.json" in res.output and len(res.output.strip().splitlines()) == 1


def test_auth_hints(gemma_art, hub, monkeypatch, run):
    monkeypatch.setenv("HF_TOKEN", "wrong-token")
    with pytest.raises(HubAuthError, match="rejected the token"):
        lhub.push(gemma_art, "alice/g")
    res = run("pull", "alice/g")
    assert res.exit_code == 1 and "rejected the token" in res.output
    assert len(res.output.strip().splitlines()) == 1
    with pytest.raises(HubAuthError, match="rejected the token"):
        lct.load("hf://alice/g", stream=True)
    # A private repo: invisible without a token, and to another user.
    monkeypatch.setenv("HF_TOKEN", ALICE)
    lhub.push(gemma_art, "alice/private", private=True)
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubNotFoundError, match="private and you are not logged in"):
        lhub.pull("alice/private")
    monkeypatch.setenv("HF_TOKEN", BOB)
    with pytest.raises(HubNotFoundError, match="no such repo"):
        lhub.pull("alice/private")
    with pytest.raises(HubAuthError, match="no access"):
        lhub.push(gemma_art, "alice/private")
    assert lhub.pull("alice/private", token=ALICE).is_dir()


def test_not_found_hints(gemma_art, hub):
    with pytest.raises(HubNotFoundError, match="no such repo"):
        lhub.pull("alice/nothing")
    lhub.push(gemma_art, "alice/g")
    with pytest.raises(HubNotFoundError, match="no revision 'nope'"):
        lhub.pull("alice/g", revision="nope")
    with pytest.raises(HubNotFoundError, match="no revision 'nope'"):
        lct.load("hf://alice/g@nope", stream=True)


def test_offline_without_cache(hub, monkeypatch, run):
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubOfflineError, match="HF_HUB_OFFLINE"):
        lhub.pull("alice/g")
    with pytest.raises(HubOfflineError, match="HF_HUB_OFFLINE"):
        lct.load("hf://alice/g", stream=True)
    res = run("pull", "alice/g")
    assert res.exit_code == 1 and "offline" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not hub.log


def test_an_offline_push_says_so_before_it_verifies(gemma_art, hub, monkeypatch):
    """A new user's trial: an offline push verified the whole artifact first, then said offline
    mode blocks it. It says so at once."""
    import huggingface_hub.constants as hc

    import lct.io.check
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)

    def verified(*a, **k):
        raise AssertionError("verified before saying it is offline")
    monkeypatch.setattr(lct.io.check, "check_artifact", verified)
    with pytest.raises(HubOfflineError, match="HF_HUB_OFFLINE is set, and a push needs the Hub"):
        lhub.push(gemma_art, "alice/g")
    assert not hub.log


def test_unreachable_hub_hint(hub, monkeypatch):
    import huggingface_hub.constants as hc
    url = hub.url
    hub.stop()
    monkeypatch.setattr(hc, "ENDPOINT", url)
    with pytest.raises(HubOfflineError, match="cannot reach|could not be reached"):
        lhub.pull("alice/g")


# Conversion from the Hub and the model card ----------------------------------------------------
def test_convert_from_hf_uri_and_card_license(gemma_src, gemma_art, hub, tmp_path):
    import huggingface_hub as hh
    api = hh.HfApi()
    api.create_repo("alice/gemma-src")
    (tmp_path / "card").mkdir()
    (tmp_path / "card" / "README.md").write_text("---\nlicense: gemma\n---\n# tiny gemma\n")
    api.upload_folder(repo_id="alice/gemma-src", folder_path=gemma_src, commit_message="src")
    api.upload_file(repo_id="alice/gemma-src", path_or_fileobj=tmp_path / "card" / "README.md",
                    path_in_repo="README.md")
    out = tmp_path / "from-hub.lct"
    res = CliRunner().invoke(cli, ["convert", "hf://alice/gemma-src@main", "-o", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    art = lct.open(out)
    assert art.manifest.source["id"] == "alice/gemma-src"
    assert art.manifest.source["kind"] == "hub" and art.manifest.source["revision"] == "main"
    assert lct.verify(out, against=str(gemma_src)).ok
    want = lct.open(gemma_art)
    assert [c.checksum for c in art.manifest.chunks] == [c.checksum for c in want.manifest.chunks]
    lhub.push(out, "alice/gemma-lct")
    meta = _front_matter(hub.blob("alice/gemma-lct", "README.md").decode())
    assert meta["base_model"] == "alice/gemma-src" and meta["license"] == "gemma"


def test_model_card_mentions_policy_and_sizes(gemma_art):
    m = lct.open(gemma_art).manifest
    card = lhub.model_card(m, "org/name", license="mit")
    meta = _front_matter(card)
    assert meta == {"library_name": "lct", "tags": meta["tags"], "license": "mit"}
    assert "base_model" not in meta   # a local source has no Hub id to point at
    for needle in ("lossless codec", "`planes`", "zstd level", "lossy parts", "blocksize",
                   "Maximus shards", "source safetensors", "stored chunks", "x, the artifact",
                   "import lct", 'lct.load("hf://org/name", prefetch=2)'):
        assert needle in card, needle


def test_range_store_gives_up_on_a_trickle_and_on_endless_drops(gemma_art, hub):
    """Issue 12 item 13: a server trickling 200 bytes a second, or one that sends a few bytes
    and hangs up on every request, ends in a HubOfflineError after bounded retries (before,
    the first stalled for ever and the second reset the retry count on every byte)."""
    import time

    from lct.hub.remote import HttpRangeStore
    lhub.push(gemma_art, "alice/g")
    sha = hub.head("alice/g").oid
    name = "model-00000.lct"
    store = HttpRangeStore("alice/g", sha, backoff=0.01, retries=2, timeout=0.5,
                           min_rate=100_000)
    size = store.size(name)
    hub.trickle(name, 200)
    t = time.perf_counter()
    with pytest.raises(HubOfflineError, match="giving up after 2 retries .too slow"):
        store.read_range(name, 4096, 20000, size)
    assert time.perf_counter() - t < 15
    hub.trickle(name, 0)
    hub.drop_always(name, 100)
    hub.clear_log()
    with pytest.raises(HubOfflineError, match="giving up after 2 retries"):
        store.read_range(name, 4096, 20000, size)
    dropped = [r for r in hub.requests_for(name, "GET") if r["sent"] == 100]
    assert len(dropped) == 3      # the first try and two retries


def test_push_checks_what_the_hub_holds_after_the_commit(gemma_art, hub, run):
    """Issue 12 item 13: a Hub that keeps a truncated LFS upload without complaint; before,
    push exited 0."""
    hub.truncate_lfs_uploads = True
    res = run("push", str(gemma_art), "alice/g")
    assert res.exit_code == 1
    assert "after the push" in res.output and "model-00000.lct" in res.output
    assert "the upload was cut or changed" in res.output
    hub.truncate_lfs_uploads = False
    res = run("push", str(gemma_art), "alice/g2")
    assert res.exit_code == 0, res.output


def test_push_refuses_a_hub_that_shows_no_hashes(gemma_art, hub, run):
    """A push is checked against the hashes the Hub reports; a listing without them (no LFS
    sha256, no git blob id) cannot show the upload arrived whole, so the push fails."""
    hub.hide_hashes = True
    try:
        res = run("push", str(gemma_art), "alice/g")
    finally:
        hub.hide_hashes = False
    assert res.exit_code == 1
    assert "after the push" in res.output and "without a hash" in res.output


def test_a_stalled_hub_ends_in_the_timeout_hint(gemma_art, hub, run):
    """Issue 12 item 13: huggingface_hub's client waits for ever by default; a Hub that stops
    answering API calls now ends a pull (and a push) in one line naming the timeout."""
    import time

    lhub.push(gemma_art, "alice/g")
    lhub.use_timeout(1.0)
    try:
        hub.stall_api = 3.0
        t = time.perf_counter()
        res = run("pull", "alice/g")
        assert res.exit_code == 1
        assert "stopped answering for 1 s" in res.output and "LCT_HUB_TIMEOUT" in res.output
        res = run("push", str(gemma_art), "alice/g")
        assert res.exit_code == 1 and "stopped answering" in res.output
        assert time.perf_counter() - t < 60
    finally:
        hub.stall_api = 0.0
        lhub.use_timeout(HUB_TIMEOUT)


def test_a_wrong_repo_commit_header_is_named(gemma_art, hub, run):
    """Issue 12 item 13: file answers that name another commit (X-Repo-Commit) read as "no
    lct.json in the repo"; now the mismatch is said."""
    lhub.push(gemma_art, "alice/g")
    hub.wrong_commit = True
    res = run("pull", "alice/g")
    assert res.exit_code == 1
    assert "X-Repo-Commit" in res.output and "not an LCT artifact" not in res.output


FAULTS = {
    "500 once on the data file": lambda hub, data: hub.fail_once(data, 500),
    "503 once on the data file": lambda hub, data: hub.fail_once(data, 503),
    "429 once on the data file": lambda hub, data: hub.fail_once(data, 429),
    "502 once on lct.json": lambda hub, data: hub.fail_once("lct.json", 502),
    "a flipped byte in the data file, once": lambda hub, data: hub.corrupt_once(data, 9000),
    "a flipped byte in lct.json, once": lambda hub, data: hub.corrupt_once("lct.json", 40),
    "a flipped byte in config.json, once": lambda hub, data: hub.corrupt_once("config.json", 5),
    "the data file dropped after 5000 bytes, once": lambda hub, data: hub.drop_once(data, 5000),
    "the data file corrupt on the Hub": lambda hub, data: hub.corrupt("alice/g", data, offset=9000, nbytes=1),
    "config.json corrupt on the Hub": lambda hub, data: hub.corrupt("alice/g", "config.json", offset=3, nbytes=1),
    "wrong X-Repo-Commit": lambda hub, data: setattr(hub, "wrong_commit", True),
    "no range support": lambda hub, data: setattr(hub, "ignore_ranges", True),
    "API calls stall": lambda hub, data: setattr(hub, "stall_api", 3.0),
}


# What each fault must end in, under a pull and under streaming: None, the artifact comes out
# identical (a one-off fault is retried; a pull also fetches a small file that arrived corrupt
# again), or (error class, message). Not retried, by design: a chunk whose bytes do not match its
# checksum, wherever they came from (the reader checks it and does not fetch it again; the pull
# lct.open makes leaves the data files' chunks to the reader), and every lasting fault.
_CHUNK = r"/{data}: chunk 0 \(group 'embed', offset 4096\) checksum mismatch"
_CHUNK_STREAMED = r"hf://alice/g@[0-9a-f]{{12}}/{data}: chunk 0 \(group 'embed', offset 4096\) " \
    r"checksum mismatch"
FAULT_ENDS = {
    "a flipped byte in the data file, once": {"pull": (ChecksumError, _CHUNK),
                                              "stream": (ChecksumError, _CHUNK_STREAMED)},
    "the data file corrupt on the Hub": {"pull": (ChecksumError, _CHUNK),
                                         "stream": (ChecksumError, _CHUNK_STREAMED)},
    "config.json corrupt on the Hub": (ChecksumError, r"alice/g: download is corrupt, 1 "
                                       r"problem\(s\): .*/config\.json: content does not match "
                                       r"the Hub's hash"),
    "wrong X-Repo-Commit": (HubError, r"alice/g: the Hub's answers for the files named commit "
                            r"ffffffffffff \(X-Repo-Commit\)"),
    "no range support": {"pull": None,
                         "stream": (HubError, rf"/{{data}}: asked for bytes 0-4095, got HTTP 200 "
                                              rf"instead of 206 Partial Content")},
    "API calls stall": (HubOfflineError, r"alice/g: http://127\.0\.0\.1:\d+ stopped answering "
                                         r"for 1 s"),
}


@pytest.mark.parametrize("op", ["pull", "stream"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_hub_fault_sweep(gemma_art, hub, monkeypatch, fault, op):
    """Issue 12 reliability suite, Hub faults: every fault kind the loopback Hub can play, under
    a pull (then every tensor read) and under streaming, ends as FAULT_ENDS says within the time
    limit: a one-off fault is met and recovered from (the artifact comes out identical), any
    other ends in the error that names it; never other data. (Issue 37 item 9: it passed on any
    LCTError, so it passed with the retries broken.)"""
    import time

    lhub.push(gemma_art, "alice/g")
    data = lct.open(gemma_art).manifest.files[0]["name"]
    with lct.open(gemma_art) as ref:
        want = {g: ref.read_group(g) for g in ref.groups}
    end = FAULT_ENDS.get(fault)
    end = end.get(op) if isinstance(end, dict) else end
    monkeypatch.setenv("LCT_HUB_TIMEOUT", "1")
    lhub.use_timeout(1.0)
    FAULTS[fault](hub, data)
    t = time.perf_counter()
    try:
        if end is None:
            with lct.open("hf://alice/g", stream=(op == "stream")) as art:
                got = {g: art.read_group(g) for g in art.groups}
            assert set(got) == set(want)
            for g in want:
                for k, v in want[g].items():
                    assert torch.equal(got[g][k], v), f"{fault}/{op}: {k} differs"
        else:
            error, match = end
            with pytest.raises(error, match=match.format(data=re.escape(data))):
                with lct.open("hf://alice/g", stream=(op == "stream")) as art:
                    for g in art.groups:
                        art.read_group(g)
    finally:
        lhub.use_timeout(HUB_TIMEOUT)
    assert time.perf_counter() - t < 60
    assert hub.pending_faults() == {}       # the one-off fault was met, not left unused


def test_info_verify_and_export_take_hub_addresses(gemma_art, hub, run, tmp_path):
    """Issue 14: lct info, verify and export accept hf://org/name[@rev] as load does."""
    lhub.push(gemma_art, "alice/g")
    res = run("info", "hf://alice/g")
    assert res.exit_code == 0 and "policy:" in res.output, res.output
    res = run("verify", "hf://alice/g@main")
    assert res.exit_code == 0 and "OK" in res.output, res.output
    res = run("export", "hf://alice/g", tmp_path / "hf")
    assert res.exit_code == 0, res.output
    ref = tmp_path / "ref"
    lct.export(gemma_art, ref)
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == \
        (ref / "model.safetensors").read_bytes()


def test_model_card_of_an_int8_artifact_parses_with_huggingface_hub(llama_src, tmp_path):
    """Issue 14: the card's metadata reads back through huggingface_hub's ModelCard, with the
    tags of what is stored and the policy's measured cost in the body."""
    from huggingface_hub import ModelCard

    from lct.conversion.converter import Policy
    art = tmp_path / "a.lct"
    lct.convert(str(llama_src), art, policy=Policy(int8=("embed", "head")))
    card = ModelCard(lhub.model_card(lct.open(art).manifest, "org/name", license="apache-2.0"))
    data = card.data.to_dict()
    assert data["library_name"] == "lct" and data["license"] == "apache-2.0"
    assert {"lct", "int8", "llama"} <= set(data["tags"]) and "nf4" not in data["tags"]
    assert "embed, head in int8 with one scale per row" in card.text
    assert "estimated mean KL" in card.text


def test_offline_hints_say_what_is_true(gemma_art, hub, run, monkeypatch):
    """Issue 14: the offline hint names HF_HUB_OFFLINE only when it is set, and push offline
    does not advise pulling."""
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    res = run("push", str(gemma_art), "alice/g")
    assert res.exit_code == 1 and "HF_HUB_OFFLINE is set" in res.output
    assert "pull" not in res.output
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    hub.stop()       # nothing answers at the endpoint now
    res = run("convert", "alice/other", "-o", "unused.lct")
    assert res.exit_code == 1 and "HF_HUB_OFFLINE is set" not in res.output
    assert "could not be reached" in res.output or "cannot reach" in res.output


def test_cli_push_and_pull_quiet_print_only_the_url_and_the_path(llama_art, hub, run, tmp_path):
    """Issue 14: -q prints what `hf upload --quiet` / `hf download --quiet` print: the commit's
    URL, the local path; nothing else on stdout or stderr."""
    res = run("push", llama_art, "alice/quiet", "-q")
    assert res.exit_code == 0, res.output
    assert res.stdout == f"{hub.url}/alice/quiet/commit/{hub.head('alice/quiet').oid}\n"
    assert res.stderr == ""
    res = run("pull", "alice/quiet", "--local-dir", tmp_path / "d", "--quiet")
    assert res.exit_code == 0, res.output
    assert res.stdout == f"{(tmp_path / 'd').resolve()}\n" and res.stderr == ""


def test_plan_on_a_hub_id_uses_the_cache_and_fails_at_once_without_a_network(gemma_art, hub,
                                                                             run, caplog):
    """Issue 14: `lct plan ORG/NAME` reads config.json from the Hub, then from the cache when the
    Hub cannot be reached; an uncached id fails at once with the offline hint (it used to retry
    with backoff for 23 s)."""
    import logging
    lhub.push(gemma_art, "alice/g")
    res = run("plan", "alice/g", "-q")
    assert res.exit_code == 0 and res.stdout.startswith("peak "), res.output
    hub.stop()       # nothing answers at the endpoint now
    caplog.set_level(logging.DEBUG, logger="huggingface_hub")
    again = run("plan", "alice/g", "-q")
    assert again.exit_code == 0 and again.stdout == res.stdout, again.output
    res = run("plan", "alice/other")
    assert res.exit_code == 1 and "cannot reach" in res.output, res.output
    assert "HF_HUB_OFFLINE is set" not in res.output
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


def test_pipeline_downloads_get_the_hub_timeout_and_its_message(hub, monkeypatch):
    """hub_fetch (sources, configs) installs LCT's HTTP timeout like every other Hub call, and
    the stall message never formats an unset timeout (it raised TypeError before)."""
    import httpx2

    from lct.errors import HubOfflineError, SourceError
    from lct.hub import client
    monkeypatch.setattr(client, "_TIMEOUT", [None])

    def stall():
        raise httpx2.ReadTimeout("no byte")
    with pytest.raises(SourceError, match="stopped answering for 60 s"):
        client.hub_fetch(stall, "alice/x", None, not_found=SourceError, error=SourceError,
                         offline=SourceError)
    assert client._TIMEOUT[0] == 60.0
    monkeypatch.setattr(client, "_TIMEOUT", [0.0])    # a client of the program's own
    e = client.hub_error(httpx2.ReadTimeout("no byte"), "alice/x")
    assert isinstance(e, HubOfflineError) and "stopped answering (ReadTimeout)" in str(e)


def test_pull_refuses_a_data_file_changed_between_its_chunks(gemma_art, hub, tmp_path):
    """Issue 22.4: 16 bytes flipped in the middle of a data file, where no chunk lies (the
    zeros between chunks), passed the pull (data files are checked by their chunks' checksums,
    not by the Hub's sha256). The gaps are checked now: the pull is refused naming the byte,
    the file leaves the cache, and a local verify of such a file says the same."""
    import json
    lct.hub.push(gemma_art, "alice/gap")
    m = json.loads((gemma_art / "lct.json").read_text())
    chunks = sorted((c["offset"], c["offset"] + c["stored_size"]) for c in m["chunks"]
                    if c["file"] == 0)
    gap = next((a_end, b_start) for (_, a_end), (b_start, _) in zip(chunks, chunks[1:])
               if b_start - a_end >= 16)
    hub.corrupt("alice/gap", "model-00000.lct", offset=gap[0])
    with pytest.raises(ChecksumError, match=rf"model-00000\.lct: byte {gap[0]} is not zero"):
        lct.hub.pull("alice/gap")
    local = tmp_path / "g.lct"
    shutil.copytree(gemma_art, local)
    with open(local / "model-00000.lct", "r+b") as f:
        f.seek(gap[0])
        f.write(b"\xff" * 16)
    report = lct.verify(local)
    assert not report.ok and any(f"byte {gap[0]} is not zero" in x for x in report.failures)
    assert lct.verify(gemma_art).ok


def test_push_says_what_in_the_folder_it_does_not_push(gemma_art, hub, tmp_path, run):
    """Issue 22.6: a README.md in the artifact folder (a link, say) was replaced by the
    generated card, and a LICENSE that is a folder skipped, without a word; the Maximus state
    was written 0600 where every other file is 0644."""
    art = tmp_path / "g.lct"
    shutil.copytree(gemma_art, art)
    (tmp_path / "notes.md").write_text("mine")
    (art / "README.md").symlink_to(tmp_path / "notes.md")
    (art / "LICENSE").mkdir()
    res = lct.hub.push(art, "alice/notes")
    assert dict(res.skipped) == {"README.md": "the model card is generated from the manifest "
                                              "instead",
                                 "LICENSE": "a folder or a link to nothing, not a file"}
    r = run("push", art, "alice/notes2")
    assert "note: README.md in the artifact folder was not pushed" in r.output


def test_the_maximus_state_is_written_as_the_other_files(llama_src, tmp_path):
    import stat
    out = tmp_path / "mx.lct"
    lct.convert(str(llama_src), out, policy=lct.Policy(maximus_shards=4))
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["maximus.safetensors"] == modes["lct.json"], modes


def test_cli_pull_keeps_the_decoded_copy_for_the_first_load(llama_art, hub, run, tmp_path,
                                                            monkeypatch):
    """Issue 36: `lct pull` decodes the artifact it verified into the decoded cache (the
    command waits for it at exit), so that the first load maps it; --no-cache and LCT_CACHE=0
    keep nothing."""
    from lct.io import cache
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "decoded"))
    lhub.push(llama_art, "alice/l")
    for switch, flags in (("0", []), (None, ["--no-cache", "--local-dir", tmp_path / "d"])):
        if switch is None:
            monkeypatch.delenv(cache.ENV_SWITCH)    # on by default, off for this command
        else:
            monkeypatch.setenv(cache.ENV_SWITCH, switch)
        res = run("pull", "alice/l", *flags)
        assert res.exit_code == 0, res.output
        cache.wait_fills()
        assert cache.entries() == []
    res = run("pull", "alice/l", "-q")
    assert res.exit_code == 0, res.output
    path = Path(res.output.strip().splitlines()[-1])
    fills = cache.wait_fills()
    assert fills[-1].done and fills[-1].folder.parent == tmp_path / "decoded", fills[-1].reason
    (entry,) = cache.entries()
    with lct.open(path) as a:
        assert entry.digest == a.digest and entry.artifact == str(path)
    stats = lct.LoadStats()
    model = lct.load("hf://alice/l", stats=stats)
    assert stats.cache.startswith("hit: mapped") and stats.bytes_read == 0, stats.cache
    assert torch.equal(_logits(model), _logits(lct.load(llama_art, cache=False)))
    before = cache.wait_fills()
    assert run("pull", "alice/l").exit_code == 0      # an entry exists: no second fill
    assert [f for f in cache.wait_fills() if not any(f is b for b in before)] == []


def test_a_streamed_artifact_maps_its_entry_even_on_the_disk(llama_art, hub, tmp_path,
                                                              monkeypatch):
    """Issue 36: an entry mostly on the disk is left there and the artifact decoded instead
    only where the artifact is local; a streamed one's bytes come over the network, so its
    entry is mapped wherever its pages are."""
    from lct.io import cache
    from tests.decoded_cache import entry_on_disk
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "decoded"))
    monkeypatch.setenv(cache.ENV_SWITCH, "1")
    monkeypatch.setenv(cache.ENV_MAP, "auto")
    lhub.push(llama_art, "alice/l")
    with lct.open(llama_art) as a:
        assert cache.fill(a).done
    (entry,) = cache.entries()
    entry_on_disk(llama_art, entry)
    stats = lct.LoadStats()
    model = lct.load("hf://alice/l", stream=True, stats=stats)
    assert stats.cache == "hit: mapped (the artifact is remote)" and stats.bytes_read == 0
    assert torch.equal(_logits(model), _logits(lct.load(llama_art, cache=False)))
