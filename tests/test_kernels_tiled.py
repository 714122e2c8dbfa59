"""The tiled matmul (kernels/_tiled.h, ``native.tiled_matmul``) for every encoding and instruction
set this CPU runs, against a float64 matmul of the encoding's exact weights: never further from it
than the chunked path (bfloat16 weights, float32 sums); its tiles hold exactly the dequantized
weights; odd M, N not a multiple of the tile or the microkernel's rows, K not a multiple of a
vector, every thread count give the same rows. Skipped where the module was not built or
``LCT_NATIVE=0``."""

import numpy as np
import pytest
import torch

from lct.kernels import native
from tests.head_weights import ENCODINGS, chunked_error, reference, weight

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="lct.kernels._native not built, or LCT_NATIVE=0")

# (n, k, NF4 blocksize): n off the 64-row tile and the 4-row microkernel; k off the 32-wide
# vector for int8; NF4 blocksizes the vector dequantizers step by and ones they fall back on.
SHAPES = {"nf4": [(133, 256, 64), (70, 96, 32), (37, 40, 8)],
          "int8": [(133, 256, 0), (70, 100, 0)],
          "int8_b128": [(133, 256, 128), (70, 384, 128)],
          "q8_0": [(133, 256, 0), (70, 96, 0)],
          "q6_k": [(133, 512, 0), (5, 256, 0)]}
CASES = [(kind, *shape) for kind in ENCODINGS for shape in SHAPES[kind]]


def _isas():
    return native.ISAS[: native.ISAS.index(native.matmul_isa()) + 1] if native.available() else ()


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def tiled(w, x: torch.Tensor, out_dtype=torch.float32, w_bf16=False, isa=None, threads=3):
    n, k = w.shape
    codes, scales, table, bs = w.tiled_args()
    out = torch.full((x.shape[0], n), float("nan"), dtype=out_dtype)
    native.tiled_matmul(w.tiled_kind, _bits(x), x.dtype == torch.bfloat16, codes, scales, table,
                        _bits(out), out_dtype == torch.bfloat16, (x.shape[0], n, k), bs, w_bf16,
                        threads, isa)
    return out


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("kind,n,k,bs", CASES)
def test_every_dequantizer_is_exact(isa, kind, n, k, bs):
    """x one-hot: each output is one weight. float32 tiles give the encoding's float32 value at
    every instruction set; bfloat16 tiles give the chunked path's bfloat16 weight, except int8,
    whose codes stay exact and whose scale multiplies the float32 sum (its float32 value)."""
    if isa not in _isas():
        pytest.skip(f"this CPU runs {native.matmul_isa()}, not {isa}")
    w = weight(kind, n, k, seed=n + k, blocksize=bs or 64)
    eye = torch.eye(k)
    assert torch.equal(tiled(w, eye, isa=isa), w.w32.T)
    got = tiled(w, eye.to(torch.bfloat16), w_bf16=True, isa=isa)
    bf16_tiles = isa == "avx512bf16" and kind != "int8"
    assert torch.equal(got, (w.w16.float() if bf16_tiles else w.w32).T)


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("m", [1, 7, 13])
@pytest.mark.parametrize("kind,n,k,bs", CASES)
def test_within_the_chunked_paths_error(isa, m, kind, n, k, bs):
    """bfloat16 x, weights allowed in bfloat16: no further from the float64 product than the
    chunked path, with bfloat16 output and with float32 output. float32 x and weights: float32
    summation error only."""
    if isa not in _isas():
        pytest.skip(f"this CPU runs {native.matmul_isa()}, not {isa}")
    w = weight(kind, n, k, seed=n + k + m, blocksize=bs or 64)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g)
    ref = reference(x, w)
    mag = (x.double().abs() @ w.w32.double().abs().T).max().item()
    xb = x.to(torch.bfloat16)
    ref16 = reference(xb, w)
    for out_dtype in (torch.bfloat16, torch.float32):
        got = tiled(w, xb, out_dtype, w_bf16=True, isa=isa)
        err = (got.double() - ref16).abs().max().item()
        assert err <= chunked_error(xb, w, out_dtype == torch.bfloat16) * 1.01 + 1e-5 * mag
    got = tiled(w, x, torch.float32, isa=isa)
    assert (got.double() - ref).abs().max().item() <= 2e-6 * k ** 0.5 * mag


@pytest.mark.parametrize("kind", ENCODINGS)
def test_threads_and_rows_of_x_change_nothing(kind):
    """Output rows are split over threads and x over microkernel blocks, never reordered within
    a sum: every thread count gives the same bits, and each row of x alone the same as within
    the whole."""
    n, k, bs = SHAPES[kind][0]
    w = weight(kind, n, k, blocksize=bs or 64)
    x = torch.randn(9, k).to(torch.bfloat16)
    runs = [tiled(w, x, torch.bfloat16, w_bf16=True, threads=t) for t in (1, 2, 5, 64)]
    assert all(torch.equal(r, runs[0]) for r in runs)
    alone = torch.cat([tiled(w, x[i:i + 1], torch.bfloat16, w_bf16=True) for i in range(9)])
    assert torch.equal(alone, runs[0])


def test_weights_stay_float32_unless_allowed():
    """w_bf16 False (a float32 model, or float32 input) keeps float32 weights even with a
    bfloat16 x: the result is the float32 tiles' one."""
    w = weight("q8_0", 64, 256)
    x = torch.randn(3, 256).to(torch.bfloat16)
    got = tiled(w, x, torch.float32, w_bf16=False)
    assert torch.equal(got, tiled(w, x.float(), torch.float32, w_bf16=False))


def test_rejects_bad_buffers():
    m, n, k = 2, 8, 64
    w = weight("nf4", n, k)
    codes, scales, table, bs = w.tiled_args()
    x, out = np.zeros((m, k), np.float32), np.zeros((m, n), np.float32)
    run = native.tiled_matmul
    run("nf4", x, False, codes, scales, table, out, False, (m, n, k), bs, False, 1)
    with pytest.raises(ValueError, match="buffer sizes"):
        run("nf4", x, False, codes[:4], scales, table, out, False, (m, n, k), bs, False, 1)
    with pytest.raises(ValueError, match="buffer sizes"):
        run("nf4", x, False, codes, scales, None, out, False, (m, n, k), bs, False, 1)
    with pytest.raises(ValueError, match="buffer sizes"):
        run("nf4", x, True, codes, scales, table, out, False, (m, n, k), bs, False, 1)
    with pytest.raises(ValueError, match="bad shape"):
        run("nf4", x, False, codes, scales, table, out, False, (m, n, k), 48, False, 1)
    with pytest.raises(ValueError, match="bad shape"):
        run("nf4", x[:0], False, codes, scales, table, out[:0], False, (0, n, k), bs, False, 1)
    q = weight("q6_k", n, 256).codes.numpy()
    with pytest.raises(ValueError, match="bad shape"):   # K not a multiple of 256
        run("q6_k", np.zeros((m, 128), np.float32), False, q.reshape(-1)[:n * 105], None, None,
            out, False, (m, n, 128), 0, False, 1)
    with pytest.raises(ValueError, match="buffer sizes"):  # int8 needs its scales
        run("int8", x, False, np.zeros((n, k), np.uint8), None, None, out, False, (m, n, k), 0,
            False, 1)
    with pytest.raises(ValueError, match="unknown weight kind"):
        native._native.tiled_matmul(7, x, 0, codes, b"", b"", out, 0, m, n, k, 0, False, 1, -1)
