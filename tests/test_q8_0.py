"""The Q8_0 block encoding: its reference codec (lct/format/q8_0.py) byte for byte the ``gguf``
package's own ``Q8_0`` quantize (llama.cpp's layout and rounding), its dequantize exactly, the
rounding ties, the float16 scale's range, bfloat16 sources, the errors and the spec's worked
examples; the head's paths and the row gather; Q8_0 artifacts end to end (load kept and
dequantized, verify, export, manifest checks, Maximus pieces, plan, policy)."""


import numpy as np
import pytest
import torch
from lct.kernels import Q8_0Embedding, Q8_0Linear
from torch.nn import functional as F

from lct.errors import PolicyError
from lct.format import constants as C
from lct.format import q8_0

gguf = pytest.importorskip("gguf")
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def blocks_to_check() -> np.ndarray:
    """Rows of 4 blocks: random, all zero, exact .5 ties, tiny and huge scales."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 128)).astype(np.float32)
    x[1, :32] = 0                                   # d = 0: codes 0, scale 0
    # max 127 gives d = 1 and id = 1: x * id lands on k + 0.5, rounded away from zero
    # (round-half-even would give 0, 2, -2, 4).
    x[2, :32] = [127, 0.5, 1.5, -2.5, 3.5] + [0.25] * 27
    x[3] *= 1e-9                                    # d below float16's subnormals
    x[4] *= 1e-5                                    # d a float16 subnormal
    x[5] *= 1e5                                     # d past float16's range: inf
    x[6, 32:64] = -x[6, 32:64].max()                # ties of sign: a block of -max values
    return x


def test_quantize_is_gguf_byte_for_byte(native_mode):
    x = blocks_to_check()
    got = q8_0.quantize(torch.from_numpy(x))
    assert got.dtype == torch.uint8 and tuple(got.shape) == (8, 128 // 32 * 34)
    assert np.array_equal(got.numpy(), gguf.quants.quantize(x, Q8_0))
    codes = got.numpy().reshape(8, 4, 34)[2, 0, 2:7].view(np.int8)
    assert codes.tolist() == [127, 1, 2, -3, 4]     # half away from zero


def test_bfloat16_sources_quantize_their_values(native_mode):
    for dtype in (torch.bfloat16, torch.float16, torch.float64):     # read in place or widened
        x = torch.from_numpy(blocks_to_check()[:5]).to(dtype)
        ref = gguf.quants.quantize(x.float().numpy(), Q8_0)
        assert np.array_equal(q8_0.quantize(x).numpy(), ref), dtype


def test_dequantize_is_gguf_exactly_and_casts_once(native_mode):
    x = blocks_to_check()
    blocks = q8_0.quantize(torch.from_numpy(x))
    want = gguf.quants.dequantize(blocks.numpy(), Q8_0).reshape(8, 128)
    got = q8_0.dequantize(blocks, (8, 128))
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)
    bf = q8_0.dequantize(blocks, (2, 4, 128), torch.bfloat16)
    assert tuple(bf.shape) == (2, 4, 128)
    assert torch.equal(bf.reshape(8, 128), torch.from_numpy(want).to(torch.bfloat16))
    out = torch.empty(8 * 128, dtype=torch.bfloat16)
    assert q8_0.dequantize(blocks, (8, 128), torch.bfloat16, out=out).data_ptr() == \
        out.data_ptr()
    # A gathered row is the table's row: rows_of is the one rule.
    row = q8_0.rows_of(blocks[3].view(4, 34), torch.float32).reshape(-1)
    assert torch.equal(row, got[3])


def test_pieces_do_not_change_the_bytes(monkeypatch, native_mode):
    x = torch.randn(40, 96)
    whole = q8_0.quantize(x)
    monkeypatch.setattr(q8_0, "PIECE_ELEMENTS", 96 * 3)
    assert torch.equal(q8_0.quantize(x), whole)
    assert torch.equal(q8_0.dequantize(whole, (40, 96)),
                       torch.from_numpy(gguf.quants.dequantize(whole.numpy(), Q8_0)))


@pytest.mark.parametrize("bad,match", [
    (torch.arange(64, dtype=torch.int32).reshape(2, 32), "floating-point"),
    (torch.zeros(2, 48), "multiple of 32"),
    (torch.tensor(1.0), "multiple of 32"),
])
def test_what_q8_0_cannot_encode_is_refused(bad, match):
    with pytest.raises(PolicyError, match=match):
        q8_0.quantize(bad, "t.weight")


def test_nan_and_inf_name_the_row(native_mode):
    x = torch.zeros(5, 64)
    x[3, 40] = float("nan")
    with pytest.raises(PolicyError, match=r"t\.weight: .*NaN or Inf.*row 3"):
        q8_0.quantize(x, "t.weight")
    x[3, 40] = 0
    x[1, 0] = float("-inf")
    with pytest.raises(PolicyError, match="row 1"):
        q8_0.quantize(x, "t.weight")


def test_sizes():
    assert q8_0.blocks_nbytes(2048) == 2048 // 32 * 34 == q8_0.row_bytes(2048)
    assert C.Q8_0_BLOCK_BYTES * 8 / C.Q8_0_BLOCK == 8.5        # bits per value


def test_spec_examples_byte_for_byte(native_mode):
    """docs/FORMAT.md section 2.2's two worked examples."""
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[0, :5] = torch.tensor([127, 0.5, 1.5, -2.5, 3.25])
    x[1, :4] = torch.tensor([-2.0, 1.0, 0.25, 0.0078125])
    b = q8_0.quantize(x).numpy()
    assert b[0].tobytes() == bytes.fromhex("003c 7f 01 02 fd 03") + bytes(27)
    assert b[1].tobytes() == bytes.fromhex("0824 81 40 10 00") + bytes(28)
    assert float(q8_0.dequantize(torch.from_numpy(b[1]), (32,))[1]) == 64 * 0.0157470703125


# --- kernels -------------------------------------------------------------------------------

def _blocks(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return q8_0.quantize(torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g))


@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_paths_agree(m, dtype, monkeypatch):
    blocks = _blocks(300, 128, 5)
    w = q8_0.dequantize(blocks, (300, 128)).double()
    lin = Q8_0Linear(blocks, torch.bfloat16, chunk_rows=64)
    assert (lin.in_features, lin.out_features) == (128, 300)
    x = torch.randn(1, m, 128).to(dtype)
    ref = x.double() @ w.T
    tol = 2e-2 if dtype == torch.bfloat16 or lin(x).dtype == torch.bfloat16 else 1e-4
    got = lin(x)
    assert got.shape == (1, m, 300)
    assert (got.double() - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())
    monkeypatch.setenv("LCT_HEAD_PATH", "chunked")               # the chunked (and GPU) path
    chunked = lin(x)
    assert (chunked.double() - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())
    big = torch.randn(1, m + 2, 128).to(dtype)     # strided input: what contiguous input gives
    assert torch.equal(lin(big[:, 1:-1, :]), lin(big[:, 1:-1, :].contiguous()))
    bias = torch.randn(300).to(torch.bfloat16)
    with_bias = Q8_0Linear(blocks, torch.bfloat16, bias=bias, chunk_rows=64)(x)
    assert (with_bias.double() - ref - bias.double()).abs().max() <= \
        tol * max(1.0, ref.abs().max().item())


def test_embedding_gathers_dequantized_rows_and_pads():
    blocks = _blocks(50, 64, 7)
    table = q8_0.dequantize(blocks, (50, 64), torch.bfloat16)
    emb = Q8_0Embedding(blocks, torch.bfloat16, pad_ids=(3,))
    ids = torch.tensor([[1, 3, 49, 0, 3]])
    out = emb(ids)
    assert torch.equal(out[0, [0, 2, 3]], table[[1, 49, 0]])
    assert out[0, 1].abs().sum() == 0 and out[0, 4].abs().sum() == 0
    with pytest.raises(IndexError):
        emb(torch.tensor([50]))
    assert torch.equal(Q8_0Embedding(blocks, torch.bfloat16)(ids), F.embedding(ids, table))
    assert torch.equal(emb.weight, table)
