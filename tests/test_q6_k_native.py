"""llama.cpp's Q6_K in the format's compiled module (lct/format/_native.c's ``q6_k_quantize``,
``q6_k_dequant``): at every instruction set this CPU runs and over several threads, byte for
byte the golden vectors of llama.cpp's ``quantize_row_q6_K_ref`` (tests/data/q6_k) and bit for
bit the ``gguf`` package's dequantize, on every float16 scale. Skipped where the module was not
built or ``LCT_NATIVE=0`` (tests/test_q6_k.py runs the torch fallback on the same vectors)."""

import numpy as np
import pytest
import torch
from test_q6_k import CASES, _case

from lct.format import constants as C
from lct.format import native as fnative

pytestmark = pytest.mark.skipif(not fnative.available(),
                                reason="lct.format._native not built, or LCT_NATIVE=0")


def _isas():
    if not fnative.available():
        return []
    best = fnative.CODEC_ISAS.index(fnative.codec_isa())
    return list(fnative.CODEC_ISAS[:best + 1])


def _source(name: str):
    """A golden case's values as the codec reads them: (array, bf16) and the expected bytes."""
    x, want = _case(name)
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().reshape(-1), True, want.reshape(-1)
    return x.float().numpy().reshape(-1), False, want.reshape(-1)


def _quantize(x: np.ndarray, bf16: bool, threads: int = 1, isa=None):
    out = np.full(x.size // C.Q6_K_BLOCK * C.Q6_K_BLOCK_BYTES, 0xAA, np.uint8)
    return fnative.q6_k_quantize(x, bf16, out, threads, isa), out


@pytest.mark.parametrize("isa", _isas())
def test_quantize_is_llama_cpp_byte_for_byte(isa):
    for name in sorted(CASES):
        x, bf16, want = _source(name)
        bad, got = _quantize(x, bf16, 1, isa)
        assert bad == -1 and np.array_equal(got, want), (name, isa)
    # All the float32-read cases in one call: 57 blocks, split over 3 threads.
    srcs = [_source(n) for n in sorted(CASES)]
    x = np.concatenate([s[0] for s in srcs if not s[1]])
    bad, got = _quantize(x, False, 3, isa)
    assert bad == -1 and np.array_equal(got, np.concatenate([s[2] for s in srcs if not s[1]]))


def test_isa_names():
    assert fnative.codec_isa() in fnative.CODEC_ISAS
    with pytest.raises(ValueError, match="isa"):
        fnative._native.q6_k_quantize(np.zeros(256, np.float32), 0,
                                      np.empty(210, np.uint8), 1, len(fnative.CODEC_ISAS))


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("threads", [1, 4])
def test_quantize_reports_the_first_nan_or_inf_block(bf16, threads):
    """64 blocks (4 threads: 16 each): the first bad block, whichever share holds it."""
    x = np.random.default_rng(2).standard_normal(64 * 256).astype(np.float32)
    cases = [({3 * 256 + 5: np.nan, 40 * 256: np.inf}, 3), ({37 * 256 + 255: np.inf}, 37),
             ({0: -np.inf, 63 * 256: np.nan}, 0), ({63 * 256 + 255: np.nan}, 63),
             ({20 * 256: np.nan, 17 * 256 + 3: -np.inf}, 17)]
    for put, first in cases:
        y = x.copy()
        for i, v in put.items():
            y[i] = v
        src = torch.from_numpy(y).to(torch.bfloat16).view(torch.int16).numpy() if bf16 else y
        bad, got = _quantize(src, bf16, threads)
        assert bad == first, put
        n = first * C.Q6_K_BLOCK     # every block before it is written (other shares' too)
        assert np.array_equal(got[:first * C.Q6_K_BLOCK_BYTES], _quantize(src[:n], bf16)[1])


def test_quantize_rejects_bad_sizes():
    x = np.zeros(512, np.float32)
    q = fnative.q6_k_quantize
    with pytest.raises(ValueError):
        q(x[:300], False, np.empty(210, np.uint8), 1)              # not whole blocks
    with pytest.raises(ValueError):
        q(x, False, np.empty(419, np.uint8), 1)
    with pytest.raises(ValueError):  # 512 float32 read as bfloat16 are 1024 elements: 4 blocks
        q(x, True, np.empty(420, np.uint8), 1)
    with pytest.raises(ValueError):
        fnative._native.q6_k_quantize(x, 2, np.empty(420, np.uint8), 1, -1)
    with pytest.raises(ValueError, match="aligned"):
        q(x.view(np.uint8)[1:1 + 1024].view(np.int16), True, np.empty(420, np.uint8), 1)
    assert q(x[:0], False, np.empty(0, np.uint8), 3) == -1


def _gguf_dequant(blocks: np.ndarray) -> np.ndarray:
    gguf = pytest.importorskip("gguf")
    with np.errstate(all="ignore"):     # 0 * Inf where d is Inf
        return gguf.quants.dequantize(blocks.reshape(-1, C.Q6_K_BLOCK_BYTES),
                                      gguf.GGMLQuantizationType.Q6_K).reshape(-1)


def _all_scales() -> np.ndarray:
    """65536 blocks, one per float16 bit pattern of d (subnormals, Inf, NaN), with random codes
    and sub-block scales spanning -128..127."""
    rng = np.random.default_rng(4)
    b = rng.integers(0, 256, (65536, C.Q6_K_BLOCK_BYTES), dtype=np.uint8)
    b[:, 192:208] = np.array([0, 1, -1, 127, -128, 2, -3, 64] * 2, np.int8).view(np.uint8)
    b[:, 208:] = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


def _dequant(blocks: np.ndarray, bf16: bool, threads: int) -> np.ndarray:
    out = np.empty(blocks.size // C.Q6_K_BLOCK_BYTES * C.Q6_K_BLOCK,
                   np.int16 if bf16 else np.float32)
    fnative.q6_k_dequant_into(blocks, out, bf16, threads)
    return out


@pytest.mark.parametrize("threads", [1, 3])
def test_dequant_is_gguf_bit_for_bit(threads):
    golden = np.concatenate([_case(n)[1].reshape(-1) for n in sorted(CASES)])
    for blocks in (golden, _all_scales()):
        want = _gguf_dequant(blocks)
        got = _dequant(blocks, False, threads)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
        bf = torch.from_numpy(_dequant(blocks, True, threads)).view(torch.bfloat16)
        ref = torch.from_numpy(want).to(torch.bfloat16)
        tnan = torch.from_numpy(nan)
        assert torch.equal(torch.isnan(bf), tnan)
        assert torch.equal(bf.view(torch.int16)[~tnan], ref.view(torch.int16)[~tnan])


def test_dequant_rejects_bad_sizes():
    blocks = np.zeros(420, np.uint8)
    d = fnative.q6_k_dequant_into
    with pytest.raises(ValueError):
        d(blocks[:419], np.empty(512, np.float32), False, 1)
    with pytest.raises(ValueError):
        d(blocks, np.empty(511, np.float32), False, 1)
    with pytest.raises(ValueError):
        d(blocks, np.empty(512, np.float32), True, 1)    # 1024 bfloat16 slots: 4 blocks
    with pytest.raises(ValueError):
        fnative._native.q6_k_dequant(blocks, np.empty(512, np.float32), 2, 1)
