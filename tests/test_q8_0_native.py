"""llama.cpp's Q8_0 in the two compiled modules: the format's codec (lct/format/_native.c's
``q8_0_quantize``, ``q8_0_dequant``) byte for byte against the ``gguf`` package (ggml's own
reference rule), and the kernels' fused ``q8_0_matmul`` (kernels/_native.c) against a float64
matmul of the dequantized weight, at every instruction set this CPU runs. Skipped where a module
was not built or ``LCT_NATIVE=0``."""

import numpy as np
import pytest
import torch

from lct.format import native as fnative
from lct.kernels import native as knative

gguf = pytest.importorskip("gguf")
Q8_0 = gguf.GGMLQuantizationType.Q8_0

codec = pytest.mark.skipif(not fnative.available(),
                           reason="lct.format._native not built, or LCT_NATIVE=0")
fused = pytest.mark.skipif(not knative.available(),
                           reason="lct.kernels._native not built, or LCT_NATIVE=0")


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (int16), torch's rounding."""
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16) \
        .view(torch.int16).numpy()


def _widen(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits -> their float32 values."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _quantize(x: np.ndarray, bf16: bool = False):
    out = np.full(x.size // 32 * 34, 0xAA, np.uint8)
    return fnative.q8_0_quantize(x.reshape(-1), bf16, out), out


def _reference(x32: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # a d above float16's range
        return gguf.quants.quantize(x32.reshape(-1, 32), Q8_0).reshape(-1)


def _special_blocks() -> np.ndarray:
    """Blocks of 32 float32 values at the rule's edges: zero blocks, exact .5 ties of x / d,
    scales whose float16 d overflows, is subnormal or sits on a float16 rounding tie, and random
    blocks over many magnitudes."""
    rng = np.random.default_rng(7)
    blocks = [np.zeros(32), -np.zeros(32)]
    ties = np.arange(-16, 15) + 0.5
    for d in (1.0, 0.5, 0.25, 2.0**-10, 8.0):  # d a power of two: x * id is exactly k + 0.5
        blocks.append(np.append(ties, 127.0) * d)
        blocks.append(np.append(-ties, -127.0) * d)
    for amax in (1e7, 127.0 * 65520, 127.0 * 65504, 127.0 * 65519, np.finfo(np.float32).max,
                 127.0 * 2.0**-20, 127.0 * 2.0**-25, 127.0 * 1.5 * 2.0**-25, 127.0 * 2.0**-24,
                 127.0 * 1.5 * 2.0**-24, 127.0 * 2.0**-14, 127.0 * (2.0**-14 - 2.0**-25), 1e-6,
                 3e-9, 127.0 * (1 + 2.0**-11), 127.0 * (1 + 3 * 2.0**-11),  # float16 ties: to even
                 127.0 * (1 + 2.0**-11 + 2.0**-20), 127.0 * 2.0**-7 * (1 + 5 * 2.0**-11)):
        b = rng.uniform(-1, 1, 32) * amax
        b[rng.integers(32)] = amax * rng.choice([-1.0, 1.0])
        blocks.append(b)
    for scale in 10.0 ** rng.uniform(-12, 12, 96):
        blocks.append(rng.standard_normal(32) * scale)
    blocks.append(np.where(np.arange(32) == 3, 1.0, 0.0))  # one nonzero
    out = np.array(blocks, np.float64).astype(np.float32)
    assert np.isfinite(out).all()
    return out.reshape(-1)


@codec
def test_quantize_is_gguf_byte_for_byte():
    x = _special_blocks()
    bad, got = _quantize(x)
    assert bad == -1
    assert np.array_equal(got, _reference(x))


@codec
def test_quantize_random_matrix():
    x = (np.random.default_rng(1).standard_normal((77, 256)) * 0.02).astype(np.float32)
    bad, got = _quantize(x)
    assert bad == -1
    assert np.array_equal(got, gguf.quants.quantize(x, Q8_0).reshape(-1))


@codec
def test_quantize_bf16_is_gguf_on_the_widened_values():
    bits = _bf16_bits(_special_blocks()).reshape(-1, 32)
    bits = bits[np.isfinite(_widen(bits)).all(axis=1)].reshape(-1)  # FLT_MAX rounds to Inf
    bad, got = _quantize(bits, bf16=True)
    assert bad == -1
    assert np.array_equal(got, _reference(_widen(bits)))


@codec
def test_quantize_float32_scale_whose_reciprocal_overflows():
    """d under 2^-128 (a float32 subnormal): 1/d is Inf and ggml's products are Inf or NaN;
    the codes are 0 and d rounds to float16 zero, as gguf's numpy rule gives on x86."""
    x = np.zeros(64, np.float32)
    x[:32] = np.linspace(-1, 1, 32, dtype=np.float32) * np.float32(1e-38)
    x[32:] = np.float32(2e-45)
    bad, got = _quantize(x)
    assert bad == -1
    assert not got.any()
    with np.errstate(all="ignore"):
        assert np.array_equal(got, _reference(x))


@pytest.mark.parametrize("bf16", [False, True])
@codec
def test_quantize_reports_the_first_nan_or_inf_block(bf16):
    x = np.random.default_rng(2).standard_normal(8 * 32).astype(np.float32)
    cases = [({3 * 32 + 5: np.nan, 5 * 32: np.inf}, 3), ({5 * 32 + 31: np.inf}, 5),
             ({0: -np.inf, 7 * 32: np.nan}, 0), ({7 * 32 + 31: np.nan}, 7)]
    for put, first in cases:
        y = x.copy()
        for i, v in put.items():
            y[i] = v
        bad, got = _quantize(_bf16_bits(y) if bf16 else y, bf16)
        assert bad == first, put
        good = _widen(_bf16_bits(y)) if bf16 else y
        if first:  # the blocks before it are written
            assert np.array_equal(got[:first * 34], _reference(good[:first * 32]))


def _random_blocks(n: int, seed: int, finite: bool = False) -> np.ndarray:
    """n blocks of random bytes: every float16 d (subnormals, Inf, NaN unless ``finite``)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, 34), dtype=np.uint8)
    d = rng.integers(0, 65536, n, dtype=np.uint16)
    if finite:
        d[(d & 0x7C00) == 0x7C00] &= 0xBFFF
    b[:, :2] = d.view(np.uint8).reshape(n, 2)
    return b.reshape(-1)


def _all_scales() -> np.ndarray:
    """65536 blocks, one per float16 bit pattern of d, codes spanning -128..127."""
    b = np.empty((65536, 34), np.uint8)
    b[:, :2] = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    b[:, 2:] = np.array([0, 1, -1, 127, -128, 2, -3, 64] * 4, np.int8).view(np.uint8)
    return b.reshape(-1)


def _gguf_dequant(blocks: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # 0 * Inf where d is Inf
        return gguf.quants.dequantize(blocks.reshape(-1, 34), Q8_0).reshape(-1)


def _dequant(blocks: np.ndarray, bf16: bool) -> np.ndarray:
    out = np.empty(blocks.size // 34 * 32, np.int16 if bf16 else np.float32)
    fnative.q8_0_dequant_into(blocks, out, bf16)
    return out


@codec
def test_dequant_is_gguf_bit_for_bit():
    for blocks in (_reference(_special_blocks()), _random_blocks(500, 3), _all_scales()):
        want = _gguf_dequant(blocks)
        got = _dequant(blocks, False)
        np.testing.assert_array_equal(got, want)  # NaN where NaN
        ok = ~np.isnan(want)
        assert np.array_equal(got.view(np.uint32)[ok], want.view(np.uint32)[ok])


@codec
def test_dequant_bf16_is_torchs_cast():
    for blocks in (_reference(_special_blocks()), _random_blocks(500, 4), _all_scales()):
        want = torch.from_numpy(_gguf_dequant(blocks)).to(torch.bfloat16)
        got = torch.from_numpy(_dequant(blocks, True)).view(torch.bfloat16)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@codec
def test_codec_rejects_bad_sizes():
    x = np.zeros(64, np.float32)
    with pytest.raises(ValueError):
        fnative.q8_0_quantize(x[:33], False, np.empty(34, np.uint8))  # not whole blocks
    with pytest.raises(ValueError):
        fnative.q8_0_quantize(x, False, np.empty(67, np.uint8))
    with pytest.raises(ValueError):
        fnative.q8_0_quantize(x, False, np.empty(102, np.uint8))
    with pytest.raises(ValueError):  # 64 float32 read as bfloat16 are 128 elements: 4 blocks
        fnative.q8_0_quantize(x, True, np.empty(68, np.uint8))
    with pytest.raises(ValueError):
        fnative._native.q8_0_quantize(x, 2, np.empty(68, np.uint8))
    blocks = np.zeros(68, np.uint8)
    with pytest.raises(ValueError):
        fnative.q8_0_dequant_into(blocks[:67], np.empty(64, np.float32), False)
    with pytest.raises(ValueError):
        fnative.q8_0_dequant_into(blocks, np.empty(63, np.float32), False)
    with pytest.raises(ValueError):
        fnative.q8_0_dequant_into(blocks, np.empty(64, np.float32), True)
    with pytest.raises(ValueError):
        fnative._native.q8_0_dequant(blocks, np.empty(64, np.float32), 2)
    assert fnative.q8_0_quantize(x[:0], False, np.empty(0, np.uint8)) == -1


def _isas():
    return [pytest.param(isa, marks=fused) for isa in knative.ISAS]


def _skip_isa(isa: str):
    if knative.ISAS.index(isa) > knative.ISAS.index(knative.matmul_isa()):
        pytest.skip(f"this CPU runs {knative.matmul_isa()}, not {isa}")


def _matmul(x, x_bf16, blocks, n, out_bf16, isa, threads=3):
    m, k = x.shape
    out = np.full((m, n), -1, np.int16 if out_bf16 else np.float32)
    knative.q8_0_matmul(x, x_bf16, blocks, out, out_bf16, (m, n, k), threads, isa)
    return _widen(out) if out_bf16 else out


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("m", [1, 3, 8, 24])
@pytest.mark.parametrize("x_bf16,out_bf16", [(False, False), (True, True), (True, False),
                                             (False, True)])
def test_matmul_against_float64_reference(isa, m, x_bf16, out_bf16):
    _skip_isa(isa)
    n, k = 77, 256
    rng = np.random.default_rng(m)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.001, 1, (n, 1))).astype(np.float32)
    blocks = gguf.quants.quantize(w, Q8_0)
    deq = gguf.quants.dequantize(blocks, Q8_0).astype(np.float64)
    x = rng.standard_normal((m, k)).astype(np.float32)
    if x_bf16:
        x = _bf16_bits(x)
    x64 = (_widen(x) if x_bf16 else x).astype(np.float64)
    got = _matmul(x, x_bf16, blocks.reshape(-1), n, out_bf16, isa).astype(np.float64)
    ref = x64 @ deq.T
    # float32 sums of K products: within (K + 1) float32 ulps of the sum of magnitudes.
    tol = 2e-5 * (np.abs(x64) @ np.abs(deq).T)
    if out_bf16:
        tol = 1.01 * tol + 2.0**-8 * np.abs(ref)  # and the float32 sum's rounding to bf16
    assert np.all(np.abs(got - ref) <= tol)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("k", [32, 96])
def test_matmul_reads_every_scale_exactly(isa, k):
    """x one-hot: each output is one dequantized weight, so the kernel's float16 -> float32
    table must give every finite d exactly (subnormals included), at odd block counts too."""
    _skip_isa(isa)
    n = 400
    blocks = _random_blocks(n * k // 32, 5 + k, finite=True)
    deq = gguf.quants.dequantize(blocks.reshape(n, -1), Q8_0)
    x = np.eye(k, dtype=np.float32)
    got = _matmul(x, False, blocks, n, False, isa, threads=2)
    assert np.array_equal(got, deq.T)


@fused
def test_matmul_agrees_with_int8_matmul_on_exact_weights():
    """Q8_0 blocks whose d is 1 are int8 codes with scale 1: both kernels give the same sums
    up to order."""
    n, k, m = 50, 128, 5
    rng = np.random.default_rng(9)
    q = rng.integers(-127, 128, (n, k), dtype=np.int8)
    blocks = np.empty((n, k // 32, 34), np.uint8)
    blocks[:, :, :2] = np.array([1.0], np.float16).view(np.uint8)
    blocks[:, :, 2:] = q.view(np.uint8).reshape(n, k // 32, 32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    a = np.empty((m, n), np.float32)
    b = np.empty((m, n), np.float32)
    knative.q8_0_matmul(x, False, blocks.reshape(-1), a, False, (m, n, k), 2)
    knative.int8_matmul(x, False, q.view(np.uint8), np.ones(n, np.float32), b, False, (m, n, k), 2)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


@fused
def test_matmul_rejects_bad_sizes():
    m, n, k = 2, 5, 64
    x = np.zeros((m, k), np.float32)
    blocks = np.zeros(n * k // 32 * 34, np.uint8)
    out = np.zeros((m, n), np.float32)
    run = knative.q8_0_matmul
    run(x, False, blocks, out, False, (m, n, k), 1)
    with pytest.raises(ValueError):
        run(x, False, blocks[:-1], out, False, (m, n, k), 1)
    with pytest.raises(ValueError):
        run(x, False, np.zeros(blocks.size + 34, np.uint8), out, False, (m, n, k), 1)
    with pytest.raises(ValueError):
        run(x[:1], False, blocks, out, False, (m, n, k), 1)
    with pytest.raises(ValueError):
        run(x, False, blocks, out[:1], False, (m, n, k), 1)
    with pytest.raises(ValueError):
        run(x, True, blocks, out, False, (m, n, k), 1)  # float32 x read as bf16: twice the size
    with pytest.raises(ValueError):
        run(x, False, blocks, out, True, (m, n, k), 1)
    with pytest.raises(ValueError):  # K not a multiple of 32
        run(np.zeros((m, 48), np.float32), False, np.zeros(n * 51, np.uint8), out, False,
            (m, n, 48), 1)
    with pytest.raises(ValueError):
        run(x[:0], False, blocks, out[:0], False, (0, n, k), 1)
    with pytest.raises(ValueError):
        knative._native.q8_0_matmul(x, 2, blocks, out, 0, m, n, k, 1, -1)
