"""The streaming loader: exact logits, the prefetch window, errors and clean shutdown, layer-wise."""

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import manifest_text

import lct
from lct.conversion.converter import Policy
from lct.errors import ChecksumError, LCTError, ManifestError
from lct.io import stream as lstream
from lct.loader import GroupStream, LayerwiseModel, LoadStats

IDS = torch.tensor([[1, 5, 9, 200, 17, 3, 44, 100]])


def _threads():
    return [t for t in threading.enumerate()
            if t.name.startswith(("lct-prefetch", "lct-decode", "lct-skeleton", "lct-hold"))]


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", ["gemma", "llama"])
def test_load_equals_from_pretrained_lossless(arch, request, tmp_path):
    from transformers import AutoModelForCausalLM
    src = request.getfixturevalue(f"{arch}_src")
    lct.convert(str(src), tmp_path / "a.lct", policy=Policy(nf4=()))
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    for prefetch in (0, 2):
        model = lct.load(tmp_path / "a.lct", prefetch=prefetch)
        assert not model.training
        assert torch.equal(_logits(model), _logits(ref))


@pytest.mark.parametrize("arch", ["gemma", "llama"])
def test_nf4_keep_equals_dequantize_and_bnb_reference(arch, request):
    from transformers import AutoModelForCausalLM

    from lct.kernels import dequantize_rows
    Fb = pytest.importorskip("bitsandbytes.functional")
    art = request.getfixturevalue(f"{arch}_art")
    src = request.getfixturevalue(f"{arch}_src")
    stats = LoadStats()
    keep = lct.load(art, nf4="keep", stats=stats)
    deq = lct.load(art, nf4="dequantize")
    assert type(keep.get_input_embeddings()).__name__ == "NF4Embedding"
    assert type(keep.get_output_embeddings()).__name__ == "NF4Linear"
    assert isinstance(deq.get_input_embeddings(), torch.nn.Embedding)
    assert stats.nf4_modules and stats.groups == len(lct.open(art).groups)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        mods = {id(m): m for m in (ref.get_input_embeddings(), ref.get_output_embeddings())}
        for m in mods.values():
            q, st = Fb.quantize_4bit(m.weight.data, quant_type="nf4", blocksize=64,
                                     compress_statistics=False)
            m.weight.data = Fb.dequantize_4bit(q, st)
    # The dequantized model is bitsandbytes' bit for bit; the kept head (fused kernel, float32
    # sums) is at least as close to a float64 reference from the same weights and hidden states.
    assert torch.equal(_logits(deq), _logits(ref))
    with torch.no_grad():
        out = deq(IDS, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        head = keep.get_output_embeddings()
        w = dequantize_rows(head.packed, head.absmax, head.blocksize, torch.float32).double()
        exact = hidden.double() @ w.T
        softcap = getattr(deq.config, "final_logit_softcapping", None)
        if softcap:
            exact = torch.tanh(exact / softcap) * softcap
    err_keep = (_logits(keep).double() - exact).abs().max().item()
    err_deq = (out.logits.double() - exact).abs().max().item()
    assert err_keep <= err_deq * 1.01 + 1e-6, (err_keep, err_deq)
    a = keep.generate(IDS, max_new_tokens=8, do_sample=False)
    b = deq.generate(IDS, max_new_tokens=8, do_sample=False)
    assert a.shape == (1, IDS.shape[1] + 8) and torch.equal(a, b)


def test_nf4_keep_saves_memory(llama_art):
    keep = lct.load(llama_art, nf4="keep")
    deq = lct.load(llama_art, nf4="dequantize")
    def size(m):
        mod = m.get_input_embeddings()
        return sum(t.numel() * t.element_size() for t in list(mod.parameters()) + list(mod.buffers()))
    assert size(deq) / size(keep) > 3.0


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_prefetch_window_never_exceeded(llama_art, prefetch, monkeypatch):
    lock = threading.Lock()
    state = {"started": 0, "consumed": 0, "max_ahead": 0, "threads": set()}
    real = lstream.GroupStream._load

    def load(self, name):
        with lock:
            state["started"] += 1
            state["max_ahead"] = max(state["max_ahead"], state["started"] - state["consumed"])
            state["threads"].add(threading.current_thread().name)
        time.sleep(0.02)
        return real(self, name)

    monkeypatch.setattr(lstream.GroupStream, "_load", load)
    with lct.open(llama_art) as art, art.stream(prefetch=prefetch) as stream:
        names = []
        for group in stream:
            names.append(group.name)
            time.sleep(0.03)  # a slow consumer lets the workers run ahead as far as allowed
            with lock:
                state["consumed"] += 1  # the consumer is done with this group
        assert names == art.groups
    # started - consumed = the group the consumer holds + the groups decoding ahead of it:
    # never more than 1 + prefetch, and a slow consumer reaches exactly that.
    assert state["max_ahead"] == prefetch + 1
    if prefetch == 0:
        assert state["threads"] == {threading.current_thread().name}
    else:
        assert stream.stats.max_in_flight == prefetch
        assert all(t.startswith("lct-prefetch") for t in state["threads"])
    assert not _threads()


def _corrupt(art_path, tmp_path, group):
    dst = tmp_path / "bad.lct"
    shutil.copytree(art_path, dst)
    with lct.open(dst) as art:
        chunk = art.manifest.group_chunks(group)[0]
        path = dst / art.manifest.files[chunk.file]["name"]
    data = bytearray(path.read_bytes())
    data[chunk.offset + chunk.stored_size // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return dst, chunk


def test_a_damaged_chunk_is_the_checksum_error_whatever_its_decode_says(llama_art, tmp_path,
                                                                       monkeypatch):
    """The checksum is computed beside the decode (Artifact.decode_verified): where the codec
    fails on the damaged bytes first, the error is still the ChecksumError naming the chunk,
    and a decode that returns is never handed on before the checksum matched."""
    from lct.io.reader import Artifact
    bad, chunk = _corrupt(llama_art, tmp_path, "layers.1")
    real = Artifact.decode

    def decode(self, c, stored, out=None):
        if c.id == chunk.id:
            raise ValueError("the codec's own complaint about these bytes")
        return real(self, c, stored, out)
    monkeypatch.setattr(Artifact, "decode", decode)
    with pytest.raises(ChecksumError, match=rf"chunk {chunk.id} \(group 'layers.1'"):
        lct.load(bad)
    monkeypatch.setattr(Artifact, "decode", real)
    with lct.open(bad) as art, pytest.raises(ChecksumError):
        art.read_chunk(chunk.id)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_corrupt_chunk_mid_stream_raises_and_leaves_no_thread(llama_art, tmp_path, prefetch):
    bad, chunk = _corrupt(llama_art, tmp_path, "layers.1")
    seen = []
    with pytest.raises(ChecksumError, match=rf"chunk {chunk.id} \(group 'layers.1'"):
        with lct.open(bad) as art:
            for group in art.stream(prefetch=prefetch):
                seen.append(group.name)
    assert seen == ["embed", "layers.0"]
    assert not _threads()
    with pytest.raises(ChecksumError, match="layers.1"):
        lct.load(bad, prefetch=prefetch)
    assert not _threads()
    # Checksums off (the caller's choice): the load goes through, and the flipped bit reaches
    # the corrupted chunk's tensors, and only those; every other parameter is the intact one.
    model = lct.load(bad, verify=False, nf4="dequantize")
    intact = dict(lct.load(llama_art, nf4="dequantize").named_parameters())
    with lct.open(llama_art) as art:
        in_chunk = {t.name for t in art.manifest.group_tensors("layers.1")
                    if t.chunk == chunk.id}
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, intact[n])}
    assert changed and changed <= in_chunk, (changed, in_chunk)
    assert set(dict(model.named_parameters())) == set(intact)


def test_load_takes_every_group_while_the_skeleton_is_built(llama_art, monkeypatch):
    """The skeleton (the transformers import) is built beside the stream, on the caller's
    thread (whose allocator arena from_pretrained's import uses too): every group is decoded
    and taken off the stream, by a helper thread, before it exists, and the window still
    holds."""
    from lct.loader import build
    real = build.build_skeleton
    all_taken = threading.Event()
    seen = {}

    def slow_skeleton(art, dtype=None):
        seen["thread"] = threading.current_thread().name
        seen["waited"] = all_taken.wait(timeout=30)  # a loader that waits for us would hang here
        return real(art, dtype)

    real_next = lstream.GroupStream.__next__

    def counting_next(self):
        seen.setdefault("taker", threading.current_thread().name)
        try:
            return real_next(self)
        except StopIteration:
            all_taken.set()
            raise

    monkeypatch.setattr(build, "build_skeleton", slow_skeleton)
    monkeypatch.setattr(lstream.GroupStream, "__next__", counting_next)
    stats = LoadStats()
    model = lct.load(llama_art, prefetch=1, stats=stats)
    assert seen["waited"] is True
    assert seen["thread"] == threading.main_thread().name and seen["taker"].startswith("lct-hold")
    assert stats.max_in_flight == 1 and stats.groups == len(lct.open(llama_art).groups)
    assert not _threads()
    assert torch.equal(_logits(model), _logits(lct.load(llama_art, prefetch=0)))


def test_skeleton_error_while_the_helper_waits_for_a_group(llama_art, monkeypatch):
    """The skeleton fails while the helper thread waits on a group still being decoded: the
    caller sees the skeleton's error, not the closed stream's, and no thread is left."""
    from lct.loader import build
    slow = threading.Event()
    real_load = lstream.GroupStream._load

    def slow_load(self, name):
        slow.wait(timeout=2)
        return real_load(self, name)

    def failing_skeleton(art, dtype=None):
        raise LCTError("the skeleton failed")

    monkeypatch.setattr(lstream.GroupStream, "_load", slow_load)
    monkeypatch.setattr(build, "build_skeleton", failing_skeleton)
    with pytest.raises(LCTError, match="the skeleton failed"):
        lct.load(llama_art, prefetch=2)
    slow.set()
    assert not _threads()


def test_skeleton_error_reaches_the_caller_and_leaves_no_thread(llama_art, tmp_path):
    bad = tmp_path / "noconfig.lct"
    shutil.copytree(llama_art, bad)
    (bad / "config.json").unlink()
    with pytest.raises(LCTError, match="config.json: missing"):  # caught when it opens
        lct.load(bad, prefetch=2)
    with pytest.raises(LCTError, match="no config.json"):  # unchecked: the skeleton's error
        lct.load(bad, prefetch=2, verify=False)
    assert not _threads()


def test_decode_threads_of_load_run_at_lower_priority(llama_art, monkeypatch):
    import os

    from lct.loader import build
    nice = {}
    real = lstream.GroupStream._load

    def load(self, name):
        tid = threading.get_native_id()
        nice[threading.current_thread().name] = os.getpriority(os.PRIO_PROCESS, tid)
        return real(self, name)

    monkeypatch.setattr(lstream.GroupStream, "_load", load)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    lct.load(llama_art, prefetch=2)
    assert nice and all(v == min(19, base + build.DECODE_NICE) for v in nice.values())
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # caller untouched


@pytest.mark.parametrize("enabled", [True, False])
def test_load_holds_off_full_collections_and_restores_them(llama_art, monkeypatch, enabled,
                                                          tmp_path):
    import gc

    from lct.loader import build
    real = build.build_skeleton
    during = []
    monkeypatch.setattr(build, "build_skeleton", lambda art, dtype=None: during.append(
        (gc.isenabled(), gc.get_threshold())) or real(art, dtype))
    was, thresholds = gc.isenabled(), gc.get_threshold()
    try:
        gc.enable() if enabled else gc.disable()
        gc.set_threshold(500, 7, 9)
        lct.load(llama_art, prefetch=2)
        assert (gc.isenabled(), gc.get_threshold()) == (enabled, (500, 7, 9))
        # young collections as the caller set them, no full one; a disabled collector untouched
        assert during == [(enabled, (500, 7, build._NO_FULL_COLLECTION) if enabled
                           else (500, 7, 9))]
        bad = tmp_path / "noconfig.lct"
        shutil.copytree(llama_art, bad)
        (bad / "config.json").unlink()
        with pytest.raises(LCTError):
            lct.load(bad)
        assert (gc.isenabled(), gc.get_threshold()) == (enabled, (500, 7, 9))  # on errors too
    finally:
        gc.enable() if was else gc.disable()
        gc.set_threshold(*thresholds)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_stream_asks_for_each_group_once_one_ahead(llama_art, monkeypatch, prefetch):
    from lct.io.reader import Artifact
    advised, taken = [], []
    real = Artifact.will_need

    def will_need(self, chunks):
        chunks = list(chunks)
        advised.append(chunks[0].group)
        # Never more than one group beyond the decode window of the consumer's position.
        assert len(advised) <= len(taken) + prefetch + (2 if prefetch else 1)
        return real(self, chunks)

    monkeypatch.setattr(Artifact, "will_need", will_need)
    with lct.open(llama_art) as art, art.stream(prefetch=prefetch) as stream:
        for group in stream:
            taken.append(group.name)
        assert advised == art.groups == taken


def test_local_store_will_need_asks_the_kernel_to_read_ahead(llama_art, tmp_path, monkeypatch):
    """will_need hands the whole range to posix_fadvise(WILLNEED) window by window (Linux reads
    at most one readahead window per call); a missing file is left for the read to report."""
    import os

    from lct.io import store as lstore
    from lct.io.store import LocalStore
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise on this platform")
    calls = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        calls.append((os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd")
                      else None, offset, length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    step = lstore.WILLNEED_STEP
    with lct.open(llama_art) as art:
        calls.clear()                   # the header's read at open: its page, no read-ahead
        f = art.manifest.files[0]
        art.store.will_need(f["name"], 0, f["size"], f["size"])
        assert calls and all(a == os.POSIX_FADV_WILLNEED for *_, a in calls)
        assert [(o, n) for _, o, n, _ in calls] == \
            [(o, min(step, f["size"] - o)) for o in range(0, f["size"], step)]
        if calls[0][0] is not None:
            assert {Path(c[0]).resolve() for c in calls} == {(llama_art / f["name"]).resolve()}
        # Artifact.will_need hints exactly the chunks it is given, by their stored ranges.
        calls.clear()
        chunks = art.manifest.group_chunks(art.groups[1])
        art.will_need(chunks)
        covered = sorted((o, o + n) for _, o, n, _ in calls)
        want = sorted((c.offset, c.offset + c.stored_size) for c in chunks)
        assert covered[0][0] == want[0][0] and covered[-1][1] == want[-1][1]
        assert sum(b - a for a, b in covered) == sum(b - a for a, b in want)
        calls.clear()
        art.store.will_need(f["name"], 0, 0, f["size"])       # nothing to read: no call
        assert calls == []
    LocalStore(tmp_path).will_need("missing.lct", 0, 4096, 8192)  # the read reports it
    assert calls == []


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_prefetch_reads_ahead_while_the_consumer_holds_a_group(llama_art, monkeypatch, prefetch):
    """While the consumer holds group i (and has not asked for the next), groups i+1..i+prefetch
    are read and decoded in the background, and group i+prefetch+1 is not started; prefetch=0
    reads nothing ahead. Checked with events (no timing): the consumer waits, up to a generous
    timeout, for the decodes it expects, then compares what was started."""
    from lct.io.reader import Artifact
    with lct.open(llama_art) as art:
        names = art.groups
    assert len(names) >= 4
    lock = threading.Lock()
    started, threads, decoded_chunks = [], set(), []
    decoded = {name: threading.Event() for name in names}   # every chunk of the group decoded
    real_read, real_decode, real_load = Artifact.read_stored, Artifact.decode, \
        lstream.GroupStream._load

    def read_stored(self, chunk, **kw):
        with lock:
            if chunk.group not in started:
                started.append(chunk.group)
            threads.add(threading.current_thread().name)
        return real_read(self, chunk, **kw)

    def decode(self, chunk, stored, out=None):
        out = real_decode(self, chunk, stored, out)
        with lock:
            decoded_chunks.append(chunk.id)
        return out

    def load(self, name):
        group = real_load(self, name)
        with lock:
            assert set(group.buffers) <= set(decoded_chunks)
        decoded[name].set()
        return group

    monkeypatch.setattr(Artifact, "read_stored", read_stored)
    monkeypatch.setattr(Artifact, "decode", decode)
    monkeypatch.setattr(lstream.GroupStream, "_load", load)
    with lct.open(llama_art) as art, art.stream(prefetch=prefetch) as stream:
        for i in range(len(names)):
            group = next(stream)                       # the consumer now holds group i
            assert group.name == names[i] and decoded[names[i]].is_set()
            ahead = names[i + 1: i + 1 + prefetch]
            for name in ahead:
                assert decoded[name].wait(timeout=30), \
                    f"group {name} was not decoded while {names[i]} was held"
            with lock:
                assert started == names[: i + 1 + len(ahead)], (i, started)
                # nothing beyond the window has even been read
                assert not any(decoded[n].is_set() for n in names[i + 1 + len(ahead):])
        with pytest.raises(StopIteration):
            next(stream)
    assert started == names
    if prefetch:
        assert threads and all(t.startswith("lct-prefetch") for t in threads)
    else:
        assert threads == {threading.current_thread().name}
    assert not _threads()


def test_stream_decodes_without_torch(llama_art):
    """Workers only read and decode (numpy, zstd): a stream flows in a process where torch
    cannot even be imported, so lct.load can import torch beside it. Tensors are built on
    first access, by the consumer."""
    import subprocess
    import sys
    code = f"""
import sys
sys.modules["torch"] = None          # any 'import torch' now raises ImportError
import lct
with lct.open({str(llama_art)!r}) as art, art.stream(prefetch=2) as stream:
    groups = list(stream)
print(len(groups), sum(b.nbytes for g in groups for b in g.buffers.values()))
try:
    groups[0].tensors
except ImportError:
    print("tensors need torch")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n, nbytes, last = out.stdout.split("\n")[0].split() + [out.stdout.split("\n")[1]]
    with lct.open(llama_art) as art:
        assert int(n) == len(art.groups)
        assert int(nbytes) == sum(c.decoded_size for c in art.manifest.chunks)
    assert last == "tensors need torch"


def test_breaking_out_releases_threads(llama_art):
    with lct.open(llama_art) as art:
        stream = art.stream(prefetch=3)
        for group in stream:
            break
        stream.close()
        assert not [t for t in _threads() if t.name.startswith("lct-prefetch")]
    assert not _threads()


def test_stream_yields_zero_copy_views(llama_art):
    with lct.open(llama_art) as art:
        for group in GroupStream(art, ["layers.0"], prefetch=1):
            t = group.tensors["model.layers.0.mlp.up_proj.weight"]
            info = art.tensor_info("model.layers.0.mlp.up_proj.weight")
            buf = group.buffers[info.chunk]
            assert t.data_ptr() == buf.ctypes.data + info.offset


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_recycling_stream_decodes_into_handed_back_buffers_never_into_viewed_ones(llama_art,
                                                                                  prefetch):
    """``recycle``: the buffers of a group the consumer hands back (``Group.recycle``) are
    decoded into again by a later group of the same size, whose tensors are still right; a
    group whose tensor is still alive is not handed back, and that tensor keeps its values."""
    with lct.open(llama_art) as art:
        names = [g for g in art.groups if g.startswith("layers.")][:2] * 2
        want = {g: {n: t.clone() for n, t in art.read_group(g).items()} for g in names[:2]}
        with art.stream(names, prefetch=prefetch, recycle=True) as stream:
            for i, group in enumerate(stream):
                got = group.tensors
                for name, t in got.items():
                    assert torch.equal(t, want[group.name][name]), (i, name)
                if i == 0:
                    kept_name, kept = next(iter(got.items()))
                    del got, t
                    assert group.recycle() == 0          # ``kept`` still views its buffer
                else:
                    del got, t
                    assert group.recycle() > 0
                assert group.buffers == {}
            assert stream.pool.reused > 0
        assert torch.equal(kept, want[names[0]][kept_name])


@pytest.mark.parametrize("arch", ["gemma", "llama"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_layerwise_equals_full_model(arch, prefetch, request):
    art = request.getfixturevalue(f"{arch}_art")
    full = lct.load(art)
    with LayerwiseModel(art, prefetch=prefetch) as lw:
        assert torch.equal(_logits(lw), _logits(full))
        assert lw.max_resident_layers <= prefetch + 1
        a = full.generate(IDS, max_new_tokens=3, do_sample=False)
        b = lw.generate(IDS, max_new_tokens=3, do_sample=False)
        assert torch.equal(a, b)
        n_layers = len([g for g in lct.open(art).groups if g.startswith("layers.")])
        assert lw.layers_streamed == 4 * n_layers  # prompt + 3 steps, every layer each time
        layer0 = lw.model.model.layers[0].mlp.up_proj.weight
        assert layer0.numel() == 0  # nothing resident between forwards
    assert not _threads()


def test_cli_load(llama_art):
    from lct.cli.main import cli
    res = CliRunner().invoke(cli, ["load", str(llama_art), "--ids", "1,5,9", "--max-new-tokens",
                                   "3", "--prefetch", "1"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    for line in ("imports", "manifest", "decode", "install", "load to ready", "first token",
                 "tok/s", "peak RSS"):
        assert line in res.output
    res = CliRunner().invoke(cli, ["load", str(llama_art), "--layerwise", "--ids", "1,2"])
    assert res.exit_code == 0 and "max resident layers" in res.output
    res = CliRunner().invoke(cli, ["load", str(llama_art), "--prompt", "hi"])
    assert res.exit_code == 1 and "no tokenizer" in res.output


@pytest.mark.parametrize("zero_row", [False, True])
def test_pad_id_is_skipped_only_when_it_is_padding_and_nothing_else(tmp_path, zero_row):
    """A chat model that pads with its end-of-turn token: the NF4 lookup must return that
    token's trained row, as transformers does; a pad id whose row is zero is still skipped."""
    from safetensors.torch import load_file, save_file

    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "src", "llama", pad_token_id=5)
    weights = load_file(src / "model.safetensors")
    if zero_row:
        weights["model.embed_tokens.weight"][5] = 0
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    lct.convert(str(src), tmp_path / "a.lct", policy=Policy(nf4=("embed",)))
    keep = lct.load(tmp_path / "a.lct", nf4="keep")
    deq = lct.load(tmp_path / "a.lct", nf4="dequantize")  # transformers' nn.Embedding lookup
    ids = torch.tensor([[1, 5, 9, 5, 17]])
    emb = keep.get_input_embeddings()
    assert emb.pad_ids.tolist() == ([5] if zero_row else [])
    with torch.no_grad():
        assert torch.equal(emb(ids), deq.get_input_embeddings()(ids))
        assert torch.equal(keep(ids).logits, deq(ids).logits)
        if zero_row:
            before = emb.gathered_rows
            emb(ids)
            assert emb.gathered_rows - before == 3  # the two pad positions were not gathered
            assert torch.equal(emb(ids)[0, 1], torch.zeros(emb.embedding_dim, dtype=emb.dtype))


def test_close_while_threads_read_ends_in_a_typed_error(llama_art):
    """Issue 12 item 14: closing an artifact that other threads read from gives them
    ArtifactClosedError (never a raw CancelledError/RuntimeError), and so does any later read."""
    from lct.errors import ArtifactClosedError
    art = lct.open(llama_art)
    errors, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                for g in art.groups:
                    art.read_group(g)
            except Exception as e:  # noqa: BLE001 - the type is what is tested
                errors.append(e)
                return

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    art.close()
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert all(isinstance(e, ArtifactClosedError) for e in errors), errors
    with pytest.raises(ArtifactClosedError):
        art.read_group(art.groups[0])


def test_interrupt_during_decode_is_not_masked_by_a_buffer_error(llama_art, monkeypatch):
    """Issue 12 item 14: Ctrl-C while decode threads still hold the chunk's stored bytes (the C
    decoder keeps a buffer export during its GIL-free run) used to surface as 'BufferError:
    memoryview has 2 exported buffers' instead of the interrupt."""
    from lct.io.reader import Artifact

    class Exported:  # a stored view whose release fails as one with live exports does
        def release(self):
            raise BufferError("memoryview has 2 exported buffers")

    def interrupted_decode(self, chunk, stored, out=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(Artifact, "read_stored", lambda self, chunk, **kw: Exported())
    monkeypatch.setattr(Artifact, "decode", interrupted_decode)
    with lct.open(llama_art) as art:
        with pytest.raises(KeyboardInterrupt):
            art.read_chunk(0)


def test_stored_shape_that_is_not_the_configs_is_a_typed_error(llama_art, tmp_path):
    """Issue 12 item 11: a manifest whose tensor shape disagrees with config.json (here one
    transposed, same bytes) fails the load naming the tensor and both shapes, instead of
    building a different model or failing deep in a kernel."""
    import json
    art = tmp_path / "a.lct"
    shutil.copytree(llama_art, art)
    m = json.loads((art / "lct.json").read_text())
    t = next(t for t in m["tensors"] if t["name"].endswith("mlp.up_proj.weight"))
    t["shape"] = t["shape"][::-1]
    (art / "lct.json").write_text(manifest_text(m))
    with pytest.raises(ManifestError, match="binding"):   # the chunk's binding catches it first
        lct.load(art)
    (art / "lct.json").write_text(manifest_text(m, rebind=True))   # and behind it, the loader
    with pytest.raises(LCTError, match=r"up_proj.weight' is stored as \[\d+, \d+\], but the "
                                       r"model built from config.json expects"):
        lct.load(art)


def test_held_groups_stay_within_the_budget_until_the_skeleton_exists(llama_art, monkeypatch):
    """Issue 12 item 14: while the skeleton is being built, load holds decoded groups only up
    to a budget from config.json, then waits for the skeleton (whose shape checks come before
    anything more is decoded), whatever sizes the manifest claims."""
    import time as _time

    from lct.loader import build
    real = build.build_skeleton

    def slow(art, dtype=None):
        _time.sleep(1.0)
        return real(art, dtype)
    monkeypatch.setattr(build, "build_skeleton", slow)
    with lct.open(llama_art) as a:
        sizes = [sum(c.decoded_size for c in a.manifest.group_chunks(g)) for g in a.groups]
        assert build.held_budget(a) > sum(sizes)          # a real model fits its budget
    free = build.LoadStats()
    ref = build.load(llama_art, stats=free)
    assert free.max_held_bytes == sum(sizes)               # all held while the skeleton built
    monkeypatch.setattr(build, "held_budget", lambda art: 0)
    capped = build.LoadStats()
    model = build.load(llama_art, stats=capped)
    assert capped.max_held_bytes == sizes[0]               # waited after the first group
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(_logits(model, ids), _logits(ref, ids))     # the same weights either way


def test_misused_arguments_are_lct_errors_naming_them(llama_art, monkeypatch):
    """Plausible misuse ended in AttributeError/TypeError from deep inside, a stream of one
    group's letters, verify of a closed artifact reporting 32 'corrupt' chunks, and a second
    error printed by GroupStream.__del__ after a refused stream."""
    import gc

    from lct.errors import ArtifactClosedError, LCTError
    for kw, option in ((dict(prefetch="2"), "prefetch"), (dict(stats={}), "stats"),
                       (dict(dtype="fp8"), "dtype"), (dict(maximus=0), "maximus")):
        with pytest.raises(LCTError) as e:
            lct.load(llama_art, **kw)
        assert e.value.option == option, kw
    model = lct.load(llama_art, dtype="float32", stats=lct.LoadStats())
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.float32}
    with lct.open(llama_art) as art:
        with art.stream(groups="layers.0") as s:
            assert [g.name for g in s] == ["layers.0"]
        import sys
        unraisable = []             # what a finalizer raised (printed, never propagated)
        monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
        with pytest.raises(ValueError, match="integer >= 0"):
            art.stream(prefetch=-1)
        gc.collect()
        assert unraisable == [], [u.exc_value for u in unraisable]
    art = lct.open(llama_art)
    art.close()
    with pytest.raises(ArtifactClosedError, match="closed"):
        lct.verify(art)


def test_a_stream_left_unclosed_ends_quietly(llama_art):
    """Breaking out of ``for group in art.stream()`` without closing it: the stream was
    collected on its own prefetch thread, whose finalizer tried to join itself ('Exception
    ignored in GroupStream.__del__ ... cannot join current thread')."""
    import subprocess
    import sys
    code = ("import lct\n"
            f"with lct.open({str(llama_art)!r}) as art:\n"
            "    for g in art.stream(prefetch=2):\n"
            "        break\n"
            "print('done')\n")
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-2000:]
        assert "Exception ignored" not in out.stderr, out.stderr[-2000:]


def test_a_plain_load_imports_no_encoding_kernels(llama_src, tmp_path):
    """A model of plain weights needs only the dense head's kernel: the encodings' kernels (and
    the layer-wise executor) are not imported, they are memory every process would keep
    (docs/BENCHMARKS.md: the last of LCT's peak RSS over from_pretrained's). A quantized table
    imports them where it is met."""
    import subprocess
    import sys

    from lct.conversion.converter import Policy
    plain, nf4 = tmp_path / "plain.lct", tmp_path / "nf4.lct"
    lct.convert(str(llama_src), plain, policy=Policy(nf4=()))
    lct.convert(str(llama_src), nf4, policy=Policy(nf4=("embed",)))
    code = """
import sys, lct
lct.load(sys.argv[1], cache=False)
print(" ".join(sorted(m for m in sys.modules if m.startswith(("lct.kernels", "lct.loader.")))))
"""
    seen = {}
    for art in (plain, nf4):
        out = subprocess.run([sys.executable, "-c", code, str(art)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        seen[art] = set(out.stdout.split())
    assert "lct.kernels.dense" in seen[plain]
    assert not seen[plain] & {"lct.kernels.registry", "lct.kernels.linear", "lct.kernels.nf4",
                              "lct.kernels.maximus", "lct.loader.layerwise"}
    assert {"lct.kernels.registry", "lct.kernels.linear"} <= seen[nf4]
