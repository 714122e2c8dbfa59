"""Tensor-parallel loading (issue 15): ``lct.load(tp_plan="auto")`` under torch.distributed
(gloo, ranks spawned here as processes, bounded by a timeout) builds what
``from_pretrained(tp_plan="auto")`` builds from the source, logits included."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lct
from lct.conversion.converter import Policy

pytestmark = pytest.mark.slow   # each test spawns a world of ranks that import torch

WORKER = Path(__file__).with_name("tp_worker.py")
TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, art, src, out: Path, nf4: str = "keep", corrupt_rank: int = -1,
           stream: bool = False, env: dict | None = None) -> list:
    """Run ``world`` ranks of tests/tp_worker.py; their JSON results, by rank."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = []
    for rank in range(world):
        rank_env = dict(env or os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                        LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(art), str(src), str(out), nf4, str(corrupt_rank),
             "stream" if stream else "local"],
            env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + TIMEOUT
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{world} ranks did not finish in {TIMEOUT} s (a rank left waiting?)")
    results = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        f = out / f"rank{rank}.json"
        assert p.returncode == 0 and f.is_file(), f"rank {rank} exited {p.returncode}:\n{log}"
        results.append(json.loads(f.read_text()))
    return results


@pytest.fixture(scope="module")
def qwen_src(tmp_path_factory):
    """A tiny Qwen2 with grouped-query attention whose heads divide over 2 and 4 ranks."""
    from lct.demo import tiny
    return tiny.save_tiny(tmp_path_factory.mktemp("tp") / "qwen2", "qwen2",
                          num_attention_heads=8, num_key_value_heads=4)


def _lossless(src, out):
    lct.convert(str(src), out, policy=Policy(nf4=()))
    return out


def test_llama_two_ranks_equals_from_pretrained(llama_src, tmp_path):
    art = _lossless(llama_src, tmp_path / "llama.lct")
    results = launch(2, art, llama_src, tmp_path / "out")
    for r in results:
        assert "error" not in r, r
        assert r["max_diff"] == 0.0 and r["names_equal"], r
        assert r["placements"] == [] and r["local_shapes"] == [], r
        assert any("whole tensors" in n for n in r["notes"])


def test_qwen2_gqa_four_ranks_equals_from_pretrained(qwen_src, tmp_path):
    """Four ranks over an artifact stored in 2 pieces: each rank decodes whole tensors, keeps
    its slice, and the note says why (it claimed the artifact had no pieces)."""
    art = tmp_path / "qwen.lct"
    lct.convert(str(qwen_src), art, policy=Policy(nf4=(), tp_pieces=2))
    results = launch(4, art, qwen_src, tmp_path / "out")
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert "error" not in r, r
        assert r["max_diff"] == 0.0 and r["placements"] == [] and r["local_shapes"] == [], r
        assert any("its 2 tensor-parallel pieces do not divide over 4 ranks" in n
                   for n in r["notes"]), r["notes"]


@pytest.fixture(scope="module")
def qwen256_src(tmp_path_factory):
    """``qwen_src`` with rows of 256 values, whole Q6_K (and int8_b128) blocks."""
    from lct.demo import tiny
    return tiny.save_tiny(tmp_path_factory.mktemp("tp256") / "qwen2", "qwen2",
                          num_attention_heads=8, num_key_value_heads=4, hidden_size=256,
                          intermediate_size=256)


@pytest.mark.parametrize("encoding", ["nf4", "int8", "int8_b128", "q8_0", "q6_k"])
@pytest.mark.parametrize("pieces", [None, 2])
def test_lossy_tables_are_kept_split_by_rows_or_dequantized(request, tmp_path, encoding,
                                                            pieces):
    """NF4/int8/int8_b128/Q8_0/Q6_K embedding and head under tensor parallelism: kept in their encoding,
    each rank holding its rows (a ShardedEmbedding and a GatheredHead), with the logits of a
    single process that keeps them too; or dequantized to plain DTensors on request. Both equal
    the source up to the encoding's error."""
    import torch
    qwen_src = request.getfixturevalue("qwen256_src" if encoding in ("q6_k", "int8_b128")
                                       else "qwen_src")
    art = tmp_path / f"{encoding}.lct"
    lct.convert(str(qwen_src), art, policy=Policy(**{encoding: ("embed", "head")},
                                                  tp_pieces=pieces))
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4]])
    with torch.no_grad():
        single = lct.load(art, dtype=torch.float32)(ids).logits[0, :3, :5]
    for nf4 in ("keep", "dequantize"):
        results = launch(2, art, qwen_src, tmp_path / nf4, nf4=nf4)
        for r in results:
            assert "error" not in r, r
            assert 0 < r["max_diff"] < 0.5, r
            kept = (r["embed"], r["head"]) == ("ShardedEmbedding", "GatheredHead")
            assert kept == (nf4 == "keep"), r
            note = " ".join(r["notes"])
            assert ("stay in their encoding" in note) == (nf4 == "keep"), note
            if nf4 == "keep":      # the same kernels as one process, on this rank's rows
                assert torch.allclose(torch.tensor(r["logits"]), single, atol=1e-5), r


def test_a_corrupt_chunk_on_one_rank_ends_every_rank_with_the_typed_error(llama_src, tmp_path):
    art = _lossless(llama_src, tmp_path / "llama.lct")
    bad = Path(str(art) + ".bad")
    shutil.copytree(art, bad)
    with lct.open(art) as a:
        chunk = a.manifest.chunks[len(a.manifest.chunks) // 2]
        data = bad / a.manifest.files[chunk.file]["name"]
    raw = bytearray(data.read_bytes())
    raw[chunk.offset + chunk.stored_size // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    results = launch(2, art, llama_src, tmp_path / "out", corrupt_rank=1)
    for r in results:
        assert r["error"].startswith("ChecksumError"), r
        assert f"chunk {chunk.id}" in r["error"], r
    assert "rank 1: " in results[0]["error"]
    # rank 0 only heard of it (and says whose it is), rank 1 raised its own
    assert results[0]["failed_rank"] == 1 and results[1]["failed_rank"] is None


def _one_kv_head(tmp_path):
    """A tiny Gemma with one key/value head (whose heads no tensor-parallel plan splits over
    2 ranks), converted."""
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "gemma1", "gemma")
    art = tmp_path / "gemma1.lct"
    lct.convert(str(src), art)
    return src, art


def test_every_rank_that_fails_raises_its_own_error(tmp_path):
    """Issue 37.8: two ranks that fail alike each raise their own error; rank 1 raised rank 0's
    ('rank 0: ...'), as if it had not failed itself."""
    src, art = _one_kv_head(tmp_path)
    results = launch(2, art, src, tmp_path / "out")
    for r in results:
        assert r["error"] == f"LCTError: {art}: num_key_value_heads = 1 does not divide over 2 " \
                             f"ranks; tensor-parallel attention needs whole heads on every rank", r
        assert r["failed_rank"] is None, r


def _lct_load_tp(art, cwd, *args):
    """``torchrun --nproc_per_node 2 -m lct load ART --tp ARGS``, run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(_free_port()), "-m", "lct", "load", str(art), "--tp", *args],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd,
        env=dict(os.environ, OMP_NUM_THREADS="1"))


def _lct_load_tp_n(art, cwd, *args, env=None):
    """``lct load ART --tp 2 ARGS``: LCT starts the two ranks itself."""
    return subprocess.run(
        [sys.executable, "-m", "lct", "load", str(art), "--tp", "2", *args],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd,
        env=dict(env or os.environ, OMP_NUM_THREADS="1"))


def test_cli_tp_n_says_each_ranks_error_in_one_line(tmp_path):
    """Issue 37.8: a model whose key/value heads do not divide over the ranks. Under torchrun
    the line came under ~40 lines of torchrun's traceback, and rank 1 printed rank 0's error;
    ``lct load ART --tp 2`` starts the ranks itself and prints one line per failed rank, its
    number and its error, and nothing else: no traceback, no torch warning."""
    src, art = _one_kv_head(tmp_path)
    out = _lct_load_tp_n(art, tmp_path, "--ids", "1,5,9")
    assert out.returncode == 1, out.stderr[-3000:]
    why = f"{art}: num_key_value_heads = 1 does not divide over 2 ranks; tensor-parallel " \
          f"attention needs whole heads on every rank"
    assert sorted(out.stderr.splitlines()) == [f"error: rank {r}: {why}" for r in (0, 1)], \
        out.stderr[-3000:]
    assert out.stdout == ""
    assert "Traceback" not in out.stderr and "UserWarning" not in out.stderr


def test_cli_tp_n_loads_and_generates_without_torch_warnings(tmp_path):
    """``lct load ART --tp 2 --ids ...``: both ranks' lines and rank 0's text, and no
    UserWarning of torch's DTensor (they leaked into the normal output; only --quiet hid
    them, with every other warning)."""
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "gemma", "gemma", num_attention_heads=4,
                         num_key_value_heads=2)
    art = tmp_path / "gemma.lct"
    lct.convert(str(src), art)
    out = _lct_load_tp_n(art, tmp_path, "--ids", "1,5,9", "--max-new-tokens", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines if ln.startswith("rank ")] == \
        ["rank 0/2", "rank 1/2"], out.stdout
    assert len([ln for ln in lines if ln.startswith("output: ")]) == 1, out.stdout
    assert "Warning" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    # under torchrun too, without --quiet
    out = _lct_load_tp(art, tmp_path, "--ids", "1,5,9", "--max-new-tokens", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]


def test_cli_tp_n_shows_a_bugs_traceback_and_its_line(tmp_path):
    """An error that is not LCT's (a bug, here a RuntimeError put into the load) keeps its
    traceback, followed by the rank's line saying it is a bug; a bad argument is refused
    before any rank starts."""
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "gemma", "gemma", num_attention_heads=4,
                         num_key_value_heads=2)
    art = tmp_path / "gemma.lct"
    lct.convert(str(src), art, policy=Policy(nf4=()))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import lct.loader.tensor_parallel as tp\n"
        "def _bug(*args):\n"
        "    raise RuntimeError('injected')\n"
        "tp._rank_chunks = _bug\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = _lct_load_tp_n(art, tmp_path, "--ids", "1,5,9", env=env)
    assert out.returncode == 1, out.stderr[-3000:]
    for r in (0, 1):
        assert f"error: rank {r}: RuntimeError: injected (a bug in LCT: the traceback " \
               f"above)" in out.stderr.splitlines(), out.stderr[-3000:]
    assert out.stderr.count("Traceback (most recent call last)") == 2, out.stderr[-3000:]
    bad = subprocess.run([sys.executable, "-m", "lct", "load", "--tp", str(art)],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert bad.returncode == 2 and "is not a number of ranks" in bad.stderr, bad.stderr


def test_without_a_process_group_the_error_says_what_to_do(llama_src, tmp_path):
    from lct.errors import LCTError
    art = _lossless(llama_src, tmp_path / "llama.lct")
    with pytest.raises(LCTError, match="torch.distributed process group"):
        lct.load(art, tp_plan="auto")


def test_cli_under_torchrun_prints_each_rank_and_the_text_once(llama_src, tmp_path):
    """``torchrun --nproc_per_node 2 -m lct load ART --tp --ids ...``: one JSON line per rank
    (bytes read and decoded, time to ready), the same greedy tokens on both."""
    art = _lossless(llama_src, tmp_path / "llama.lct")
    out = _lct_load_tp(art, tmp_path, "--ids", "1,5,9", "--max-new-tokens", "3", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert sorted(r["rank"] for r in lines) == [0, 1]
    single = lct.load(art)
    import torch
    want = single.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=3, do_sample=False)
    for r in lines:
        assert r["world_size"] == 2 and r["bytes_read"] > 0 and r["new_tokens"] == 3
        assert r["bytes_decoded"] == sum(c.decoded_size for c in lct.open(art).manifest.chunks)
    assert lines[0]["text"] == lines[1]["text"] == " ".join(map(str, want[0, 3:].tolist()))


def test_cli_under_torchrun_quiet_prints_only_the_text(tmp_path):
    """``lct load --tp -q``: rank 0's generated text and nothing else, stderr free of the
    UserWarnings torch's DTensor raises for a Gemma on a CPU mesh (they leaked before)."""
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "gemma", "gemma", num_attention_heads=4,
                         num_key_value_heads=2)
    art = tmp_path / "gemma.lct"
    lct.convert(str(src), art)
    out = _lct_load_tp(art, tmp_path, "--ids", "1,5,9", "--max-new-tokens", "2", "-q")
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.stdout.splitlines()) == 1 and len(out.stdout.split()) == 2, out.stdout
    assert "Warning" not in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("world", [2, 4])
def test_tp_pieces_each_rank_reads_only_its_share(qwen_src, tmp_path, world):
    """An artifact converted with tp_pieces=4: a rank of degree 2 or 4 reads and decodes only
    the pieces of its slice (plus the few whole tensors, the norms), and the model still equals
    from_pretrained(tp_plan="auto")."""
    art = tmp_path / "pieces.lct"
    lct.convert(str(qwen_src), art, policy=Policy(nf4=(), tp_pieces=4))
    m = lct.open(art).manifest
    stored = sum(c.stored_size for c in m.chunks)
    decoded = sum(c.decoded_size for c in m.chunks)
    whole = sum(c.decoded_size for c in m.chunks
                if not any(t.pieces for t in m.group_tensors(c.group)
                           for p in t.placements() if p.chunk == c.id))
    results = launch(world, art, qwen_src, tmp_path / "out")
    for r in results:
        assert "error" not in r, r
        assert r["max_diff"] == 0.0 and r["placements"] == [] and r["local_shapes"] == [], r
        assert any("only the tensor-parallel pieces" in n for n in r["notes"]), r["notes"]
        # its 1/world of every pieced tensor, plus what is stored whole
        assert r["bytes_decoded"] <= (decoded - whole) / world + whole + 1, (r, decoded, whole)
        assert r["bytes_read"] < 0.6 * stored if world == 2 else r["bytes_read"] < 0.35 * stored
    assert sum(r["bytes_decoded"] for r in results) < decoded + world * whole


def test_a_world_of_one_rank_holds_whole_tensors_and_says_so(qwen_src, tmp_path):
    """torchrun with one process: the plan shards nothing, the pieces are joined, the model
    equals from_pretrained(tp_plan="auto") and the note does not claim the artifact lacks
    pieces."""
    art = tmp_path / "pieces.lct"
    lct.convert(str(qwen_src), art, policy=Policy(nf4=(), tp_pieces=2))
    [r] = launch(1, art, qwen_src, tmp_path / "out")
    assert "error" not in r, r
    assert r["max_diff"] == 0.0 and r["names_equal"] and r["local_shapes"] == [], r
    assert any("shards nothing" in n for n in r["notes"]), r["notes"]
    assert not any("no tensor-parallel pieces" in n for n in r["notes"]), r["notes"]


def test_tp_pieces_are_whole_tensors_to_a_single_process_and_to_verify(qwen_src, tmp_path):
    """Pieces change nothing for a single process: the same logits as an artifact without
    them, verify bit-identical against the source, and export gives the source tensors back."""
    import torch
    from safetensors.torch import load_file
    a, b = tmp_path / "a.lct", tmp_path / "b.lct"
    lct.convert(str(qwen_src), a, policy=Policy(nf4=(), tp_pieces=2))
    lct.convert(str(qwen_src), b, policy=Policy(nf4=()))
    m = lct.open(a).manifest
    axes = {t.piece_axis for t in m.tensors.values() if t.pieces}
    assert axes == {0, 1} and m.format_version >= (1, 2)   # column pieces need 1.2
    assert m.tensors["model.layers.0.self_attn.o_proj.weight"].piece_axis == 1
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(lct.load(a)(ids).logits, lct.load(b)(ids).logits)
    assert lct.verify(a, against=str(qwen_src)).ok
    lct.export(a, tmp_path / "hf")
    src = load_file(str(qwen_src / "model.safetensors"))
    out = load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
    assert all(torch.equal(src[k], out[k]) for k in src)


def _entry(manifest: dict, name: str) -> dict:
    return next(t for t in manifest["tensors"] if t["name"] == name)


@pytest.mark.parametrize("edit, match", [
    (lambda p: p[0].update(rows=p[0].pop("cols")), "all pieces of a tensor split one axis"),
    (lambda p: p[1].update(cols=[p[1]["cols"][0] + 1, p[1]["cols"][1]]), "must continue at"),
    (lambda p: p.pop(), "pieces cover cols"),
])
def test_column_pieces_are_checked_as_the_spec_says(qwen_src, tmp_path, edit, match):
    """FORMAT.md 2.3 (1.2): column pieces continue one another over the whole width, on one
    axis; anything else is refused at open, naming the tensor."""
    import json

    from conftest import manifest_text

    from lct.errors import ManifestError
    art = tmp_path / "a.lct"
    lct.convert(str(qwen_src), art, policy=Policy(nf4=(), tp_pieces=2))
    m = json.loads((art / "lct.json").read_text())
    pieces = _entry(m, "model.layers.0.self_attn.o_proj.weight")["pieces"]
    assert [list(p) for p in pieces][0][0] == "cols"
    edit(pieces)
    (art / "lct.json").write_text(manifest_text(m, rebind=True))
    with pytest.raises(ManifestError, match=match):
        lct.open(art)


def test_column_pieces_on_a_lossy_tensor_are_refused(qwen_src, tmp_path):
    import json

    from conftest import manifest_text

    from lct.errors import ManifestError
    art = tmp_path / "a.lct"
    lct.convert(str(qwen_src), art, policy=Policy(nf4=(), tp_pieces=2))
    m = json.loads((art / "lct.json").read_text())
    t = _entry(m, "model.layers.0.self_attn.o_proj.weight")
    t["row_order"] = "maximus"
    (art / "lct.json").write_text(manifest_text(m, rebind=True))
    with pytest.raises(ManifestError, match="column pieces are for plain tensors in id order"):
        lct.open(art)


def test_tp_pieces_that_cannot_load_are_refused_at_convert(qwen_src, tmp_path):
    """A piece count that splits heads or leaves a layer weight whole was accepted silently
    (only the vocabulary tables were split, or no degree could ever load the artifact); now
    the conversion stops, naming the count, what it must divide and the source, and writes
    nothing."""
    import json

    from lct.demo import tiny
    from lct.errors import PolicyError
    cfg = json.loads((qwen_src / "config.json").read_text())
    with pytest.raises(PolicyError, match=rf"tp_pieces 3: num_attention_heads = "
                                          rf"{cfg['num_attention_heads']} does not divide") as e:
        lct.convert(str(qwen_src), tmp_path / "a.lct", policy=Policy(tp_pieces=3))
    assert e.value.option == "tp_pieces" and not (tmp_path / "a.lct").exists()
    gemma = tiny.save_tiny(tmp_path / "gemma", "gemma")         # one key/value head
    with pytest.raises(PolicyError, match="num_key_value_heads = 1 does not divide into 2"):
        lct.convert(str(gemma), tmp_path / "g.lct", policy=Policy(tp_pieces=2))
    odd = tiny.save_tiny(tmp_path / "odd", "llama", num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=90)
    with pytest.raises(PolicyError, match=r"tp_pieces 4: model\.layers\.0\.mlp\.\w+_proj\."
                                          r"weight has 90 (rows|columns) along the split"):
        lct.convert(str(odd), tmp_path / "o.lct", policy=Policy(tp_pieces=4))


def test_hf_stream_every_rank_fetches_only_its_byte_ranges(qwen_src, tmp_path):
    """``lct.load("hf://...", stream=True, tp_plan="auto")``: each rank fetches by HTTP range
    requests only the chunks of its pieces (and the whole tensors), from a loopback Hub."""
    import sys as _sys
    sys_path = str(Path(__file__).parent)
    if sys_path not in _sys.path:
        _sys.path.insert(0, sys_path)
    from hub_server import HubServer

    from lct.hub.push import push
    art = tmp_path / "pieces.lct"
    lct.convert(str(qwen_src), art, policy=Policy(nf4=(), tp_pieces=2))
    m = lct.open(art).manifest
    with HubServer(tokens={"hf_alice": "alice"}) as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(HF_ENDPOINT=hub.url, HF_TOKEN="hf_alice", HF_HOME=str(tmp_path / "home"),
                   HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        import huggingface_hub.constants as hc
        saved = (hc.ENDPOINT, hc.HF_HUB_OFFLINE, hc.HF_HUB_DISABLE_XET)
        hc.ENDPOINT, hc.HF_HUB_OFFLINE, hc.HF_HUB_DISABLE_XET = hub.url, False, True
        try:
            push(art, "alice/q", token="hf_alice")
        finally:
            hc.ENDPOINT, hc.HF_HUB_OFFLINE, hc.HF_HUB_DISABLE_XET = saved
        hub.clear_log()
        results = launch(2, "hf://alice/q", qwen_src, tmp_path / "out", stream=True, env=env)
        data = [r for r in hub.log if r["file"] and r["file"].startswith("model-")
                and r["method"] == "GET" and r["range"]]
    for r in results:
        assert "error" not in r, r
        assert r["max_diff"] == 0.0 and r["placements"] == [], r
    stored = sum(c.stored_size for c in m.chunks)
    sent = sum(r["sent"] for r in data)
    # each rank fetched its own pieces (about half) and the small whole tensors: well under
    # the two full copies that two plain streams would fetch
    assert stored * 0.9 < sent < stored * 1.3, (sent, stored)


def test_a_tied_model_with_pieces_ties_as_from_pretrained(tmp_path):
    """Tied embedding and head (Qwen2 with tie_word_embeddings): the head is left to
    transformers' tie after the embedding's pieces are in, as from_pretrained does."""
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "qwen2-tied", "qwen2", num_attention_heads=8,
                         num_key_value_heads=4, tie_word_embeddings=True)
    art = tmp_path / "tied.lct"
    lct.convert(str(src), art, policy=Policy(nf4=(), tp_pieces=2))
    assert lct.open(art).manifest.ties
    for r in launch(2, art, src, tmp_path / "out"):
        assert "error" not in r, r
        assert r["max_diff"] == 0.0 and r["names_equal"] and r["placements"] == [], r


def test_a_rank_that_cannot_open_the_artifact_ends_every_rank(llama_src, tmp_path):
    """A damaged manifest on rank 1 only: every rank ends with its error before anyone builds
    the model (whose device mesh is a collective rank 1 would never join)."""
    art = _lossless(llama_src, tmp_path / "llama.lct")
    bad = Path(str(art) + ".bad")
    shutil.copytree(art, bad)
    (bad / "lct.json").write_text((art / "lct.json").read_text()[:-40])
    results = launch(2, art, llama_src, tmp_path / "out", corrupt_rank=1)
    for r in results:
        assert "Manifest" in r["error"].split(":")[0], r
    assert results[0]["error"].split(":", 1)[1].strip().startswith("rank 1: ")


def _damage_a_chunk(art):
    """Flip a byte in the middle of the artifact's second chunk; returns that chunk."""
    with lct.open(art) as a:
        chunk = a.manifest.chunks[1]
        data = art / a.manifest.files[chunk.file]["name"]
    raw = bytearray(data.read_bytes())
    raw[chunk.offset + chunk.stored_size // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return chunk


def test_cli_under_torchrun_fails_with_one_line_on_every_rank(llama_src, tmp_path):
    """A corrupt chunk under ``lct load --tp``: each rank prints the one-line error and exits 1
    (its process group shut down, not an abort at exit)."""
    art = _lossless(llama_src, tmp_path / "llama.lct")
    chunk = _damage_a_chunk(art)
    out = _lct_load_tp(art, tmp_path, "--ids", "1,5,9")
    assert out.returncode == 1
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 2 and all(f"chunk {chunk.id}" in e for e in errors), out.stderr[-2000:]
    assert sorted(e.split(":")[1] for e in errors) == [" rank 0", " rank 1"], errors
    assert "terminate called" not in out.stderr and "exitcode  : -6" not in out.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="checks the refusal on a machine without CUDA")
def test_cli_under_torchrun_refuses_cuda_without_it_in_one_line(llama_src, tmp_path):
    """``--tp --device cuda`` where torch has no CUDA: each rank prints the device error and
    exits 1 before asking for NCCL (it raised 'Distributed package doesn't have NCCL built in'
    as a traceback); a prompt for an artifact without a tokenizer is refused before the
    load (a damaged chunk would be met first otherwise)."""
    art = _lossless(llama_src, tmp_path / "llama.lct")
    _damage_a_chunk(art)
    for extra, want in ((["--device", "cuda", "--ids", "1,5,9"], "CUDA is not available"),
                        (["--prompt", "Hello"], "no tokenizer to encode a prompt")):
        out = _lct_load_tp(art, tmp_path, *extra)
        assert out.returncode == 1, out.stderr[-2000:]
        errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
        # every rank that gets to print says it in one line; torchrun may stop the second
        # rank (SIGTERM) once the first has exited, before it prints
        assert 1 <= len(errors) <= 2 and all(want in e for e in errors), out.stderr[-2000:]
        assert "NCCL" not in out.stderr and "[rank0]: Traceback" not in out.stderr, \
            out.stderr[-2000:]


def test_ranks_keep_a_decoded_cache_entry_then_map_their_share_of_it(qwen_src, tmp_path):
    """Without an entry (the cache on, its default), the local rank 0 keeps one for the next
    start by a background fill, which its process waits for at exit; with it, each rank maps
    its pieces from it: nothing of the artifact is read, the model is the same."""
    from lct.io import cache
    art = tmp_path / "pieces.lct"
    lct.convert(str(qwen_src), art, policy=Policy(nf4=(), tp_pieces=2))
    root = tmp_path / "cache"
    env = dict(os.environ, **{cache.ENV_DIR: str(root)})
    env.pop(cache.ENV_SWITCH, None)
    first = launch(2, art, qwen_src, tmp_path / "first", env=env)
    assert sorted(r["cache"] for r in first) == [
        "miss", "miss: being kept for the next start (a background fill)"], first
    with lct.open(art) as a:
        (entry,) = cache.entries(root)
        assert entry.digest == a.digest
    results = launch(2, art, qwen_src, tmp_path / "out", env=env)
    for r in results:
        assert "error" not in r, r
        assert r["max_diff"] == 0.0 and r["placements"] == [] and r["local_shapes"] == [], r
        assert r["bytes_read"] == 0 and r["bytes_decoded"] > 0, r
