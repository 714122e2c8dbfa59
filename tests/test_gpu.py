"""On a CUDA device: the loader (pinned host buffers, non-blocking copies) against the CPU load,
the NF4 head (bitsandbytes' 4-bit matmul) and the int8 head against their dequantized dense
matmuls, NF4/int8 lookups, and MaximusEmbedding residency (hot shards on the device, cold ones in
pinned host memory).

Every test here is marked ``cuda`` and skipped where CUDA is not available; run them with
``python -m pytest -q -m cuda tests/test_gpu.py`` (``benchmarks/gpu_check.sh`` does, with
timings). They use the tiny generated models of conftest.py and small random tables only.
"""

import pytest
import torch

import lct

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

IDS = torch.tensor([[1, 5, 9, 200, 17, 3, 44, 100]])
CUDA = "cuda"


@pytest.fixture(autouse=True)
def _full_float32_matmuls():
    """float32 matmuls in full precision (torch's default; TF32 would need looser bounds)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _bnb():
    """bitsandbytes (the NF4 kernels on CUDA), or skip."""
    return pytest.importorskip("bitsandbytes")


def _logits(model, ids=IDS):
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(ids.to(device)).logits


def _close(got, ref, rel):
    """``got`` within ``rel`` of the reference's largest magnitude, element by element."""
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    scale = max(1.0, float(ref.abs().max()))
    err = float((got - ref).abs().max())
    assert err <= rel * scale, f"max error {err:.3g} > {rel:.3g} x {scale:.3g}"


def _on_device(model, device_type="cuda"):
    """Names of parameters and buffers that are not on ``device_type`` (expected: none)."""
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t is not None and t.device.type != device_type]


@pytest.fixture(scope="module")
def int8_arts(gemma_src, llama_src, tmp_path_factory):
    """Both tiny models with the embedding and head in int8 (the default picks NF4 for them)."""
    from lct.conversion.converter import Policy
    out = {}
    for arch, src in (("gemma", gemma_src), ("llama", llama_src)):
        path = tmp_path_factory.mktemp("gpu-int8") / f"{arch}.lct"
        lct.convert(str(src), path, policy=Policy(int8=("embed", "head")))
        out[arch] = path
    return out


def _artifact(request, arch, kind):
    if kind == "int8":
        return request.getfixturevalue("int8_arts")[arch]
    _bnb()                                      # the default artifacts keep NF4 parts
    return request.getfixturevalue(f"{arch}_art")


# The loader -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gemma", "llama"])
@pytest.mark.parametrize("kind,nf4,head", [("nf4", "keep", "NF4Linear"),
                                           ("nf4", "dequantize", "FlatLinear"),
                                           ("int8", "keep", "Int8Linear")])
def test_load_on_cuda_equals_the_cpu_load_in_float32(arch, kind, nf4, head, request):
    """In float32 (no TF32: torch's default for matmuls) the CUDA load gives the CPU load's
    logits up to summation order, and the same greedy tokens (the tiny models' top-2 margins
    are at least 0.007 there, far above float32 differences)."""
    art = _artifact(request, arch, kind)
    cpu = lct.load(art, nf4=nf4, dtype=torch.float32)
    gpu = lct.load(art, device=CUDA, nf4=nf4, dtype=torch.float32)
    assert type(gpu.get_output_embeddings()).__name__ == head
    assert _on_device(gpu) == []
    assert not gpu.training
    ref = _logits(cpu)
    got = _logits(gpu)
    assert got.is_cuda and got.shape == ref.shape
    _close(got, ref, 1e-3)
    a = cpu.generate(IDS, max_new_tokens=4, do_sample=False)
    b = gpu.generate(IDS.to(CUDA), max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("arch", ["gemma", "llama"])
def test_load_on_cuda_in_the_stored_dtype_is_close_to_float32(arch, request):
    """The default load (bf16 weights, NF4 parts kept) on CUDA against the float32 CPU load:
    as close as the bf16 CPU load is (about 1 % of the largest logit on these models)."""
    art = _artifact(request, arch, "nf4")
    ref = _logits(lct.load(art, dtype=torch.float32))
    gpu = lct.load(art, device=CUDA)
    got = _logits(gpu)
    assert got.dtype == torch.bfloat16 and got.is_cuda
    _close(got, ref, 0.05)
    cos = torch.nn.functional.cosine_similarity(got.double().cpu().flatten(),
                                                ref.double().flatten(), dim=0)
    assert float(cos) > 0.999


def test_load_on_cuda_decodes_into_pinned_buffers_and_copies_without_staging(llama_art,
                                                                              monkeypatch):
    """lct.load(device='cuda') opens the artifact with pin_memory: every decoded chunk buffer is
    page-locked, so the installer copies the zero-copy views to the GPU non-blocking without a
    staging copy (Tensor.pin_memory is never needed with NF4 parts kept in the stored dtype).
    On the CPU the buffers are ordinary memory."""
    _bnb()
    from lct.io.reader import Artifact
    pinned = []
    real_decode = Artifact.decode

    def decode(self, chunk, stored, out=None):
        out = real_decode(self, chunk, stored, out)
        pinned.append((chunk.group, bool(torch.from_numpy(out).is_pinned())))
        return out

    staged = []
    real_pin = torch.Tensor.pin_memory

    def pin_memory(self, *a, **kw):
        staged.append(tuple(self.shape))
        return real_pin(self, *a, **kw)

    monkeypatch.setattr(Artifact, "decode", decode)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    model = lct.load(llama_art, device=CUDA, prefetch=2)
    with lct.open(llama_art) as art:
        groups = art.groups
        n_chunks = len(art.manifest.chunks)
    assert len(pinned) == n_chunks and {g for g, _ in pinned} == set(groups)
    assert all(p for _, p in pinned), pinned
    assert staged == [], f"staging copies of {staged}"
    assert _on_device(model) == []
    pinned.clear()
    lct.load(llama_art, device="cpu", prefetch=2)
    assert len(pinned) == n_chunks and not any(p for _, p in pinned)


def test_load_on_cuda_maps_the_decoded_copy_and_equals_the_decoding_load(llama_art):
    """With a decoded copy kept (the default path of every later start), the CUDA load maps it
    (``stats.cache`` "hit": nothing is decoded), every weight lands on the GPU, and the logits
    equal those of the CUDA load that decodes the artifact."""
    _bnb()
    from lct.io import cache
    from lct.loader import LoadStats
    with lct.open(llama_art) as art:
        assert cache.fill(art).done
    ref = _logits(lct.load(llama_art, device=CUDA, cache=False))
    st = LoadStats()
    gpu = lct.load(llama_art, device=CUDA, cache=True, stats=st)
    assert st.cache.startswith("hit") and st.bytes_read == 0, (st.cache, st.bytes_read)
    assert _on_device(gpu) == []
    assert torch.equal(_logits(gpu), ref)


def test_reader_pin_memory_gives_pinned_zero_copy_tensors(llama_art):
    from lct.io.reader import open_artifact
    with open_artifact(llama_art, pin_memory=True) as art:
        assert art.pin_memory
        name = next(g for g in art.groups if g.startswith("layers."))
        buf = art.read_chunk(art.manifest.group_chunks(name)[0].id)
        assert torch.from_numpy(buf).is_pinned()
        tensors = art.read_group(name)
        assert tensors and all(t.is_pinned() for t in tensors.values())
        t = next(iter(tensors.values()))
        moved = t.to(CUDA, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(moved.cpu(), t)
    with open_artifact(llama_art) as art:
        assert not art.pin_memory
        assert not torch.from_numpy(art.read_chunk(0)).is_pinned()


def test_cli_load_on_cuda(run, llama_art):
    import json
    _bnb()
    res = run("load", llama_art, "--device", CUDA, "--ids", "1,5,9", "--max-new-tokens", "2",
              "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert 1 <= out["new_tokens"] <= 2 and len(out["text"].split()) == out["new_tokens"]
    with lct.open(llama_art) as art:
        assert out["breakdown"]["groups"] == len(art.groups)


# The NF4 head and lookups ------------------------------------------------------------------

def _nf4_table(n, k, bs=64, seed=0):
    from lct.format import nf4
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    packed, absmax = nf4.quantize(w, bs)
    return packed, absmax, nf4.dequantize(packed, absmax, (n, k), bs, torch.float32)


# (input shape, dtype, relative tolerance): one row takes bitsandbytes' gemv_4bit kernel,
# more rows its dequantize + matmul path.
NF4_CASES = [((1, 512), torch.bfloat16, 2e-2), ((1, 1, 512), torch.float16, 5e-3),
             ((1, 512), torch.float32, 1e-4), ((2, 5, 512), torch.bfloat16, 2e-2),
             ((7, 512), torch.float16, 5e-3), ((3, 512), torch.float32, 1e-4)]


@pytest.mark.parametrize("shape,dtype,rel", NF4_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_nf4_linear_on_cuda_equals_the_dequantized_dense_matmul(shape, dtype, rel, bias):
    from lct.format import nf4
    from lct.kernels import NF4Linear
    _bnb()
    n, k = 1000, shape[-1]
    packed, absmax, dense = _nf4_table(n, k)
    g = torch.Generator().manual_seed(1)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    lin = NF4Linear(packed.to(CUDA), absmax.to(CUDA), n, k, 64, dtype,
                    bias=None if b is None else b.to(CUDA))
    # bitsandbytes' CUDA dequantize equals the reference codec bit for bit
    assert torch.equal(lin.weight.cpu(), nf4.dequantize(packed, absmax, (n, k), 64, dtype))
    x = torch.randn(*shape, generator=g).to(dtype)
    with torch.no_grad():
        y = lin(x.to(CUDA))
    assert y.is_cuda and y.dtype == dtype and tuple(y.shape) == (*shape[:-1], n)
    ref = x.double() @ dense.double().T
    if b is not None:
        ref = ref + b.double()
    _close(y, ref, rel)
    with torch.no_grad():   # and the CPU module (fused kernel or chunked path) agrees
        cpu = NF4Linear(packed, absmax, n, k, 64, dtype, bias=b)(x)
    _close(y, cpu, 2 * rel)


def test_nf4_embedding_on_cuda_equals_the_cpu_lookup():
    from lct.kernels import NF4Embedding
    _bnb()
    v, h = 1000, 128
    packed, absmax, _ = _nf4_table(v, h)
    ids = torch.tensor([[0, 3, 999, 17, 3], [5, 5, 42, 3, 600]])
    for dtype in (torch.bfloat16, torch.float32):
        cpu = NF4Embedding(packed, absmax, v, h, 64, dtype, pad_ids=(3,))
        gpu = NF4Embedding(packed.to(CUDA), absmax.to(CUDA), v, h, 64, dtype, pad_ids=(3,))
        out = gpu(ids.to(CUDA))
        assert out.is_cuda and out.dtype == dtype
        assert torch.equal(out.cpu(), cpu(ids))
        assert torch.equal(out[0, 1].cpu(), torch.zeros(h, dtype=dtype))   # a pad id
        assert gpu.gathered_rows == ids.numel() - 3


# The int8 head and lookups -----------------------------------------------------------------

INT8_CASES = [((1, 512), torch.bfloat16, 2e-2), ((2, 5, 512), torch.bfloat16, 2e-2),
              ((1, 512), torch.float16, 5e-3), ((4, 512), torch.float32, 1e-4)]


@pytest.mark.parametrize("shape,dtype,rel", INT8_CASES)
def test_int8_linear_on_cuda_equals_the_dequantized_dense_matmul(shape, dtype, rel):
    """The int8 head on CUDA (chunked dequantize-and-matmul with torch kernels; chunk_rows
    300 gives four chunks, the last shorter) against the float64 matmul of the dequantized
    weight, and against the CPU module."""
    from lct.format import int8
    from lct.kernels import Int8Linear
    n, k = 1000, shape[-1]
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
    q, scale = int8.quantize(w)
    dense = int8.dequantize(q, scale, (n, k), torch.float32)
    lin = Int8Linear(q.to(CUDA), scale.to(CUDA), dtype, chunk_rows=300)
    assert torch.equal(lin.weight.cpu(), int8.dequantize(q, scale, (n, k), dtype))
    x = torch.randn(*shape, generator=g).to(dtype)
    with torch.no_grad():
        y = lin(x.to(CUDA))
    assert y.is_cuda and y.dtype == dtype and tuple(y.shape) == (*shape[:-1], n)
    _close(y, x.double() @ dense.double().T, rel)
    with torch.no_grad():
        cpu = Int8Linear(q, scale, dtype)(x)
    _close(y, cpu, 2 * rel)


def test_int8_embedding_on_cuda_equals_the_cpu_lookup():
    from lct.format import int8
    from lct.kernels import Int8Embedding
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(500, 96, generator=g) * 0.05).to(torch.bfloat16)
    q, scale = int8.quantize(w)
    ids = torch.tensor([[0, 7, 499, 7, 31]])
    cpu = Int8Embedding(q, scale, torch.bfloat16, pad_ids=(7,))
    gpu = Int8Embedding(q.to(CUDA), scale.to(CUDA), torch.bfloat16, pad_ids=(7,))
    out = gpu(ids.to(CUDA))
    assert out.is_cuda and torch.equal(out.cpu(), cpu(ids))
    assert torch.equal(out[0, 1].cpu(), torch.zeros(96, dtype=torch.bfloat16))


# MaximusEmbedding ----------------------------------------------------------------------------

V, H = 1000, 64


def _counts():
    """Token counts falling with the id, so frequency order is id order: shard s holds ids
    125 s .. 125 s + 124 (8 shards)."""
    return torch.arange(V, 0, -1, dtype=torch.int64) * 10


def _fresh(m):
    """Residency as lct.load plans it from real frequencies: the hottest shards, up to the
    budget, resident from the start (load_state_tensors of a state with no steps yet)."""
    m.load_state_tensors(m.state_tensors())
    return m


def _batch(shards, per_shard, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [s * 125 + torch.randint(0, 125, (per_shard,), generator=g) for s in shards]
    return torch.cat(ids).view(1, -1)


def test_maximus_hot_shards_on_cuda_cold_in_pinned_host_memory():
    from lct.kernels import MaximusEmbedding
    from lct.kernels.maximus import MaximusPolicy
    g = torch.Generator().manual_seed(4)
    ref = torch.nn.Embedding(V, H)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(V, H, generator=g))
    m = _fresh(MaximusEmbedding(V, H, policy=MaximusPolicy(num_shards=8, budget_shards=2),
                                weight=ref.weight.detach(), counts=_counts(), device=CUDA))
    m.weight.requires_grad_(False)
    assert m.budget_shards == 2 and sorted(m.resident) == [0, 1]      # the two hottest
    assert all(c.is_cuda for c in m.resident.values())
    assert m.weight.device.type == "cpu" and m.weight.is_pinned()     # the whole table, host
    assert m.resident_bytes == 2 * 125 * H * m.weight.element_size()
    torch.cuda.synchronize()
    for s, copy in m.resident.items():
        assert torch.equal(copy.cpu(), m.weight.detach()[s * 125: (s + 1) * 125])

    # Hot ids (shards 0, 1) are hits read from the device copies; one id in each of three
    # cold shards is a miss read from host memory (too rare to be loaded).
    ids = torch.cat([_batch([0, 1], 6), _batch([3, 5, 7], 1, seed=1)], 1)
    before = m.stats.bytes_moved
    with torch.no_grad():
        out = m(ids.to(CUDA))
    assert out.is_cuda and out.shape == (1, ids.shape[1], H)
    assert torch.equal(out.cpu(), ref(ids))
    assert (m.stats.hits, m.stats.misses) == (12, 3)
    assert sorted(m.resident) == [0, 1] and m.stats.bytes_moved == before

    # A cold shard that turns hot is copied to the device, evicting the colder resident one;
    # the budget holds and the lookups stay exact.
    for step in range(3):
        ids = _batch([5], 20, seed=10 + step)
        with torch.no_grad():
            out = m(ids.to(CUDA))
        assert torch.equal(out.cpu(), ref(ids))
        assert len(m.resident) <= 2
    assert 5 in m.resident and m.resident[5].is_cuda
    assert m.stats.bytes_moved > before and m.stats.shard_evictions >= 1


def test_maximus_nf4_shards_on_cuda_equal_gather_then_dequantize():
    from lct.format import nf4
    from lct.kernels import MaximusEmbedding
    from lct.kernels.maximus import MaximusPolicy
    _bnb()
    packed, absmax, _ = _nf4_table(V, H, bs=64, seed=5)
    full = nf4.dequantize(packed, absmax, (V, H), 64, torch.bfloat16)
    m = _fresh(MaximusEmbedding(V, H, policy=MaximusPolicy(num_shards=8, budget_shards=3),
                                nf4=(packed, absmax, 64),
                                counts=_counts(), dtype=torch.bfloat16, pad_ids=(2,),
                                device=CUDA))
    assert sorted(m.resident) == [0, 1, 2]
    assert all(t.is_cuda for copy in m.resident.values() for t in copy)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in m.nf4[:2])
    ids = torch.cat([_batch([0, 2], 5), _batch([4, 6], 1, seed=1)], 1)
    ids[0, 0] = 2                                                    # a pad id
    expected = full[ids]
    expected[ids == 2] = 0
    with torch.no_grad():
        out = m(ids.to(CUDA))
    assert out.is_cuda and out.dtype == torch.bfloat16
    assert torch.equal(out.cpu(), expected)
    assert m.stats.misses == 2 and m.stats.hits == ids.numel() - 1 - 2


def test_load_with_maximus_on_cuda_keeps_the_table_on_the_host(llama_src, tmp_path):
    import numpy as np

    from lct.conversion.converter import Policy
    from lct.kernels import MaximusEmbedding
    _bnb()
    counts = np.bincount(np.random.default_rng(0).zipf(1.2, 5000) % 384, minlength=384)
    np.save(tmp_path / "counts.npy", counts)
    art = tmp_path / "mx.lct"
    lct.convert(str(llama_src), art, policy=Policy(maximus_shards=4),
                token_freq=str(tmp_path / "counts.npy"))
    plain = lct.load(art, device=CUDA, dtype=torch.float32)
    model = lct.load(art, device=CUDA, maximus=True, dtype=torch.float32)
    emb = model.get_input_embeddings()
    assert isinstance(emb, MaximusEmbedding)
    assert sorted(emb.resident) == [0]
    host = emb.nf4[:2] if emb.nf4 is not None else (emb.weight,)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in host)
    _close(_logits(model), _logits(plain), 1e-5)
