"""The Q6_K kernels: the fused ``q6_k_matmul`` (kernels/_native.c) decodes llama.cpp's blocks as
the ``gguf`` package's dequantize does, exactly, at every instruction set this CPU runs, and sums
within float32 rounding of a float64 matmul; ``Q6_KLinear`` by each path and ``Q6_KEmbedding``,
which dequantizes only the rows it gathers. The weights are random valid blocks: no quantizer is
needed to decode."""

import numpy as np
import pytest
import torch
from lct.kernels import Q6_KEmbedding, Q6_KLinear, native, paths
from lct.kernels import blocks as kblocks
from torch.nn import functional as F

from tests.head_weights import q6_k_blocks

gguf = pytest.importorskip("gguf")
Q6_K = gguf.GGMLQuantizationType.Q6_K
compiled = pytest.mark.skipif(not native.available(),
                              reason="lct.kernels._native not built, or LCT_NATIVE=0")


@pytest.fixture(autouse=True)
def _fresh():
    paths.reset()
    yield
    paths.force(None)
    paths.reset()


def _gguf(blocks: torch.Tensor, n: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(blocks.numpy().reshape(-1), Q6_K).reshape(n, k)


def _isas():
    return [pytest.param(isa, marks=compiled) for isa in native.ISAS]


def _skip_isa(isa: str):
    if native.ISAS.index(isa) > native.ISAS.index(native.matmul_isa()):
        pytest.skip(f"this CPU runs {native.matmul_isa()}, not {isa}")


def _matmul(x: np.ndarray, x_bf16: bool, blocks, n: int, out_bf16: bool, isa, threads=3):
    m, k = x.shape
    out = np.full((m, n), -1, np.int16 if out_bf16 else np.float32)
    native.q6_k_matmul(x, x_bf16, blocks.numpy().reshape(-1), out, out_bf16, (m, n, k),
                       threads, isa)
    if out_bf16:
        return (out.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return out


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("k", [256, 768])
def test_fused_decodes_as_gguf(isa, k):
    """x one-hot: each output is one weight, which must be gguf's float32 value exactly (codes,
    high bits, sub-block scales, d, and the (d * scale) * q order)."""
    _skip_isa(isa)
    n = 70
    blocks = q6_k_blocks(n * k // 256, k).reshape(n, -1)
    got = _matmul(np.eye(k, dtype=np.float32), False, blocks, n, False, isa)
    assert np.array_equal(got, _gguf(blocks, n, k).T)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("m", [1, 3, 8, 9])
@pytest.mark.parametrize("x_bf16,out_bf16", [(False, False), (True, True), (True, False)])
def test_fused_against_float64(isa, m, x_bf16, out_bf16):
    _skip_isa(isa)
    n, k = 41, 512
    blocks = q6_k_blocks(n * k // 256, m).reshape(n, -1)
    w = _gguf(blocks, n, k).astype(np.float64)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    if x_bf16:
        x = x.to(torch.bfloat16)
    xa = x.view(torch.int16).numpy() if x_bf16 else x.numpy()
    got = _matmul(xa, x_bf16, blocks, n, out_bf16, isa).astype(np.float64)
    x64 = x.double().numpy()
    ref = x64 @ w.T
    tol = 2e-5 * (np.abs(x64) @ np.abs(w).T)   # float32 sums of K products
    if out_bf16:
        tol = 1.01 * tol + 2.0 ** -8 * np.abs(ref)
    assert np.all(np.abs(got - ref) <= tol)


@compiled
def test_fused_rejects_bad_sizes():
    m, n, k = 2, 5, 256
    x = np.zeros((m, k), np.float32)
    blocks = np.zeros(n * 210, np.uint8)
    out = np.zeros((m, n), np.float32)
    run = native.q6_k_matmul
    run(x, False, blocks, out, False, (m, n, k), 1)
    with pytest.raises(ValueError, match="buffer sizes"):
        run(x, False, blocks[:-1], out, False, (m, n, k), 1)
    with pytest.raises(ValueError, match="buffer sizes"):
        run(x, True, blocks, out, False, (m, n, k), 1)
    with pytest.raises(ValueError, match="bad shape"):  # K not a multiple of 256
        run(np.zeros((m, 128), np.float32), False, blocks[:n * 105], out, False, (m, n, 128), 1)
    with pytest.raises(ValueError, match="bad shape"):
        run(x[:0], False, blocks, out[:0], False, (0, n, k), 1)


@pytest.mark.parametrize("path", paths.PATHS)
def test_linear_by_each_path(path, native_mode):
    """Every path within bfloat16 rounding of the float64 product; the chunked path (and every
    path without the compiled module) is F.linear over the bfloat16 dequantized weight exactly;
    sliced input gives what contiguous input gives; a bias is added."""
    n, k = 70, 512
    blocks = q6_k_blocks(n * k // 256, 1).reshape(n, -1)
    w32 = torch.from_numpy(_gguf(blocks, n, k))
    head = Q6_KLinear(blocks, torch.bfloat16, chunk_rows=32)
    assert (head.in_features, head.out_features) == (k, n)
    assert torch.equal(head.weight, w32.to(torch.bfloat16))
    paths.force(path)
    x = torch.randn(1, 5, k).to(torch.bfloat16)
    got = head(x)
    ref = x.double() @ w32.double().T
    assert got.shape == (1, 5, n) and got.dtype == torch.bfloat16
    assert (got.double() - ref).abs().max() <= 2e-2 * max(1.0, ref.abs().max().item())
    if path == "chunked" or native_mode == "numpy":
        assert torch.equal(got, F.linear(x, w32.to(torch.bfloat16)))
    big = torch.randn(1, 7, k).to(torch.bfloat16)
    assert torch.equal(head(big[:, 1:-1, :]), head(big[:, 1:-1, :].contiguous()))
    bias = torch.randn(n).to(torch.bfloat16)
    with_bias = Q6_KLinear(blocks, torch.bfloat16, bias=bias, chunk_rows=32)(x)
    assert (with_bias.double() - ref - bias.double()).abs().max() <= \
        2e-2 * max(1.0, ref.abs().max().item())


def test_embedding_gathers_only_its_rows(monkeypatch):
    n, k = 50, 256
    blocks = q6_k_blocks(n, 2).reshape(n, -1)
    table = torch.from_numpy(_gguf(blocks, n, k)).to(torch.bfloat16)
    emb = Q6_KEmbedding(blocks, torch.bfloat16, pad_ids=(3,))
    assert (emb.num_embeddings, emb.embedding_dim) == (n, k)
    rows = []
    real = kblocks.BlocksEmbedding.dequantize_rows
    monkeypatch.setattr(kblocks.BlocksEmbedding, "dequantize_rows",
                        lambda self, b, dtype, out=None: rows.append(b.shape[0])
                        or real(self, b, dtype, out))
    ids = torch.tensor([[1, 3, 49, 0, 3]])
    out = emb(ids)
    assert rows == [3]                              # three kept ids, the pads never gathered
    assert torch.equal(out[0, [0, 2, 3]], table[[1, 49, 0]])
    assert out[0, 1].abs().sum() == 0 and out[0, 4].abs().sum() == 0
    with pytest.raises(IndexError):
        emb(torch.tensor([n]))
    assert torch.equal(Q6_KEmbedding(blocks, torch.bfloat16)(ids), F.embedding(ids, table))
    scaled = Q6_KEmbedding(blocks, torch.bfloat16, scale_by=torch.tensor(16.0))(ids)
    assert torch.equal(scaled, F.embedding(ids, table) * 16)
