"""Runtime kernels: NF4 dequantize, NF4Embedding, NF4Linear and dense padded lookups are exact."""

import pytest
import torch
from torch.nn import functional as F

from lct.format import nf4
from lct.kernels import NF4Embedding, NF4Linear, PaddedEmbedding, dequantize, padded_lookup
from lct.kernels import embedding as kemb
from lct.kernels import linear as klin
from lct.kernels import paths

V, H, BS = 300, 128, 64


@pytest.fixture(scope="module")
def table():
    w = (torch.randn(V, H, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    packed, absmax = nf4.quantize(w, BS)
    return w, packed, absmax, nf4.dequantize(packed, absmax, (V, H), BS, torch.bfloat16)


def test_dequantize_equals_bitsandbytes(table):
    Fb = pytest.importorskip("bitsandbytes.functional")
    w = table[0]
    q, st = Fb.quantize_4bit(w, quant_type="nf4", blocksize=BS, compress_statistics=False)
    assert torch.equal(dequantize(table[1], table[2], (V, H), BS, torch.bfloat16),
                       Fb.dequantize_4bit(q, st))


def test_nf4_embedding_equals_full_dequantize_and_index(table):
    _, packed, absmax, full = table
    emb = NF4Embedding(packed, absmax, V, H, BS, torch.bfloat16)
    ids = torch.tensor([[0, 5, 5, 299, 17], [3, 2, 1, 0, 298]])
    out = emb(ids)
    assert out.shape == (2, 5, H) and out.dtype == torch.bfloat16
    assert torch.equal(out, full[ids])
    assert emb.gathered_rows == ids.numel()


def test_nf4_embedding_pad_ids_zero_and_not_gathered(table, monkeypatch):
    _, packed, absmax, full = table
    absmax = absmax.clone()
    absmax.view(V, H // BS)[7] = float("nan")  # poison row 7: gathering it would give NaN
    emb = NF4Embedding(packed, absmax, V, H, BS, torch.bfloat16, pad_ids=(7, 9))
    seen = []
    real = kemb.dequantize_rows
    monkeypatch.setattr(kemb, "dequantize_rows",
                        lambda p, a, bs, dt: seen.append(p.shape[0]) or real(p, a, bs, dt))
    ids = torch.tensor([[7, 1, 9, 2, 7]])
    out = emb(ids)
    assert seen == [2]
    assert torch.equal(out[0, [0, 2, 4]], torch.zeros(3, H, dtype=torch.bfloat16))
    assert torch.equal(out[0, [1, 3]], full[[1, 2]])
    assert not torch.isnan(out).any()


def test_nf4_embedding_scale_like_gemma(table):
    _, packed, absmax, full = table
    scale = torch.tensor(H ** 0.5)
    emb = NF4Embedding(packed, absmax, V, H, BS, torch.bfloat16, scale=scale)
    ids = torch.tensor([[4, 8]])
    assert torch.equal(emb(ids), full[ids] * scale.to(torch.bfloat16))


@pytest.mark.parametrize("chunk_rows", [V, 64, 7])
def test_nf4_linear_equals_dequantized_matmul(table, chunk_rows, monkeypatch):
    _, packed, absmax, full = table
    head = NF4Linear(packed, absmax, V, H, BS, torch.bfloat16, chunk_rows=chunk_rows)
    monkeypatch.setenv(paths.ENV, "chunked")
    rows = []
    real = klin.dequantize_rows_into
    monkeypatch.setattr(klin, "dequantize_rows_into",
                        lambda p, a, bs, dt, out: rows.append(p.shape[0]) or real(p, a, bs, dt, out))
    x = torch.randn(2, 6, H).to(torch.bfloat16)
    assert torch.equal(head(x), F.linear(x, full))
    assert max(rows) <= chunk_rows  # memory bounded by one chunk of the vocabulary
    assert sum(rows) == V


def test_nf4_linear_default_chunk_is_bounded_by_bytes():
    w = (torch.randn(40, 4096) * 0.02).to(torch.bfloat16)
    packed, absmax = nf4.quantize(w, BS)
    head = NF4Linear(packed, absmax, 40, 4096, BS, torch.bfloat16)
    assert head.chunk_rows == klin.DEFAULT_CHUNK_BYTES // (4096 * 2)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_row_dequantize_is_exact(table, threads, monkeypatch):
    from lct.kernels import nf4 as knf4
    _, packed, absmax, full = table
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(knf4, "_POOL", None)
    big_p, big_a = packed.view(V, -1).repeat(4, 1), absmax.view(V, -1).repeat(4, 1)
    out = torch.empty(4 * V * H, dtype=torch.bfloat16)
    got = knf4.dequantize_rows_into(big_p, big_a, BS, torch.bfloat16, out)
    assert torch.equal(got, full.repeat(4, 1))
    if knf4._POOL is not None:
        knf4._POOL.shutdown(wait=True)


@pytest.mark.parametrize("path", ["fused", "tiled", "chunked"])
def test_nf4_linear_bias(table, path, monkeypatch):
    _, packed, absmax, full = table
    from lct.kernels import native
    if path != "chunked" and not native.available():
        pytest.skip("the compiled extension is not built")
    monkeypatch.setenv(paths.ENV, path)
    bias = torch.randn(V).to(torch.bfloat16)
    x = torch.randn(3, H).to(torch.bfloat16)
    head = NF4Linear(packed, absmax, V, H, BS, torch.bfloat16, bias=bias, chunk_rows=100)
    if path != "chunked":  # float32 sums in another order: within bf16 rounding
        assert torch.allclose(head(x).float(), F.linear(x, full, bias).float(), rtol=2e-2,
                              atol=2e-3)
        assert not torch.equal(head(x) - bias, head(x))
    else:
        assert torch.equal(head(x), F.linear(x, full, bias))


def test_dense_padded_lookup_and_gradient():
    w = torch.randn(10, 4)
    ids = torch.tensor([[0, 3, 3, 9]])
    out = padded_lookup(w, ids, torch.tensor([3]))
    assert torch.equal(out[0, 1], torch.zeros(4)) and torch.equal(out[0, 2], torch.zeros(4))
    assert torch.equal(out[0, [0, 3]], w[[0, 9]])
    assert torch.equal(padded_lookup(w, ids), w[ids])
    emb = PaddedEmbedding(10, 4, pad_ids=(3,))
    emb(ids).sum().backward()
    assert torch.equal(emb.weight.grad[3], torch.zeros(4))
    assert torch.equal(emb.weight.grad[0], torch.ones(4))


def test_blocksize_must_divide(table):
    with pytest.raises(ValueError):
        NF4Embedding(table[1], table[2], V, H, 96, torch.bfloat16)
