"""NF4: lct's reference codec on its own (a hand-computed example, the code table, round-trip
error bounds, the compiled loops against the numpy fallback) and, where bitsandbytes is
installed, equal to bitsandbytes on CPU byte for byte, dequantizing equally.

Only the comparisons with bitsandbytes need it (``_bnb()`` skips those tests without it); the
rest of the module runs on a machine without bitsandbytes."""

import numpy as np
import pytest
import torch

from lct.errors import PolicyError
from lct.format import constants as C
from lct.format import nf4


def _bnb():
    """``bitsandbytes.functional``, or skip the calling test where bitsandbytes is missing."""
    return pytest.importorskip("bitsandbytes.functional")


# The NF4 data type of QLoRA (Dettmers et al. 2023, appendix E) as bitsandbytes writes it
# (bitsandbytes/functional.py, get_4bit_type("nf4")): index = 4-bit code, code 7 is exactly 0.
NF4_PAPER = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
             -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
             0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
             0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]

SHAPES = [((37, 192), 64), ((100, 256), 64), ((8, 128), 128), ((3, 64), 64), ((5, 2048), 64),
          ((1, 96), 32), ((260, 64), 64)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("shape,bs", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_bitsandbytes(shape, bs, dtype, native_mode):
    F = _bnb()
    gen = torch.Generator().manual_seed(hash((shape, bs)) % 1000)
    x = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    x[0, : bs] = 0  # an all-zero block
    q, state = F.quantize_4bit(x, quant_type="nf4", blocksize=bs, compress_statistics=False)
    packed, absmax = nf4.quantize(x, bs)
    assert torch.equal(q.view(-1), packed)
    assert torch.equal(state.absmax, absmax)
    ref = F.dequantize_4bit(q, state)
    got = nf4.dequantize(packed, absmax, shape, bs, dtype)
    assert got.dtype == dtype
    assert torch.equal(ref.view(-1), got.view(-1))


def test_dequantize_odd_length_and_out_buffer(native_mode):
    """An odd element count with a partial last block, written into a caller's buffer: the
    same values as without one (bitsandbytes' are compared in the next test)."""
    n = 3 * 64 + 5
    full = torch.randn(4 * 64, generator=torch.Generator().manual_seed(5)) * 0.1
    packed, absmax = nf4.quantize(full, 64)     # (the codec quantizes whole rows of blocks)
    packed, absmax = packed[: (n + 1) // 2].clone(), absmax[:4].clone()
    whole = nf4.dequantize(*nf4.quantize(full, 64), (4 * 64,), 64)
    for dtype in (torch.float32, torch.bfloat16):
        want = _hand_dequantize(packed, absmax, n, 64).to(dtype)
        assert torch.equal(want, whole[:n].to(dtype))
        assert torch.equal(nf4.dequantize(packed, absmax, (n,), 64, dtype), want)
        out = torch.full((n,), 7.0, dtype=dtype)
        got = nf4.dequantize(packed, absmax, (n,), 64, dtype, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="contiguous"):
        nf4.dequantize(packed, absmax, (n,), 64, torch.bfloat16,
                       out=torch.empty(n, dtype=torch.float32))


def test_dequantize_odd_length_and_out_buffer_match_bitsandbytes(native_mode):
    F = _bnb()
    x = torch.randn(3 * 64 + 5) * 0.1              # odd element count, a partial last block
    q, state = F.quantize_4bit(x, quant_type="nf4", blocksize=64, compress_statistics=False)
    packed, absmax = q.view(-1), state.absmax
    for dtype in (torch.float32, torch.bfloat16):
        ref = F.dequantize_4bit(q, state).to(dtype) if dtype == torch.float32 else \
            F.dequantize_4bit(q, F.QuantState(absmax=state.absmax, shape=state.shape,
                                              code=state.code, blocksize=64, quant_type="nf4",
                                              dtype=dtype))
        out = torch.full((x.numel(),), 7.0, dtype=dtype)
        got = nf4.dequantize(packed, absmax, (x.numel(),), 64, dtype, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got, ref.view(-1))


def test_native_dequant_refuses_short_buffers():
    from lct.format import native
    if native._native is None:
        pytest.fail("lct.format._native was not built")
    import numpy as np
    code = np.asarray(nf4.code_table().numpy(), np.float32)
    with pytest.raises(ValueError, match="packed bytes"):
        native._native.nf4_dequant(np.zeros(31, np.uint8), np.ones(1, np.float32), code,
                                   np.zeros(64, np.float32), 64, 0)
    with pytest.raises(ValueError, match="even"):
        native._native.nf4_dequant(np.zeros(32, np.uint8), np.ones(1, np.float32), code,
                                   np.zeros(64, np.float32), 63, 0)


def test_quantize_in_pieces_equals_whole(monkeypatch):
    x = torch.randn(64, 256).to(torch.bfloat16)
    whole = nf4.quantize(x, 64)
    monkeypatch.setattr(nf4, "PIECE_ELEMENTS", 128)
    pieces = nf4.quantize(x, 64)
    assert torch.equal(whole[0], pieces[0]) and torch.equal(whole[1], pieces[1])
    assert torch.equal(nf4.dequantize(*whole, (64, 256), 64), nf4.dequantize(*pieces, (64, 256), 64))


def test_bnb_state_dict_round_trips_through_quant_state():
    F = _bnb()
    QuantState = F.QuantState
    x = torch.randn(16, 128).to(torch.bfloat16)
    packed, absmax = nf4.quantize(x, 64)
    sd = nf4.bnb_state_dict("model.embed_tokens", packed, absmax, (16, 128), 64, "bfloat16")
    assert sd["model.embed_tokens.weight"].shape == (16 * 128 // 2, 1)
    qs_dict = {k[len("model.embed_tokens.weight."):]: v for k, v in sd.items()
               if k.startswith("model.embed_tokens.weight.")}
    state = QuantState.from_dict(qs_dict, device=torch.device("cpu"))
    assert state.blocksize == 64 and state.quant_type == "nf4"
    assert state.dtype == torch.bfloat16 and tuple(state.shape) == (16, 128)
    ref = F.dequantize_4bit(sd["model.embed_tokens.weight"], state)
    assert torch.equal(ref, nf4.dequantize(packed, absmax, (16, 128), 64, torch.bfloat16))


@pytest.mark.parametrize("shape,bs", [((4, 100), 64), ((4, 64), 63), ((4, 64), 0)])
def test_blocksize_must_divide_rows(shape, bs):
    with pytest.raises(PolicyError, match="blocksize"):
        nf4.quantize(torch.randn(shape), bs)


def test_nan_is_refused_with_the_name():
    x = torch.randn(4, 64)
    x[2, 3] = float("nan")
    with pytest.raises(PolicyError, match="emb.weight.*NaN"):
        nf4.quantize(x, 64, name="emb.weight")


def test_code_lut_equals_bucketize_everywhere():
    """The lookup-table coder equals the midpoint rule on exact midpoints, their float32
    neighbours, signed zeros, the ends of the range and a dense random sweep."""
    mids = nf4._midpoints()
    up, down = torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0))
    edge = torch.cat([mids, up, down, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-38, -1e-38])])
    sweep = torch.rand(2_000_000, generator=torch.Generator().manual_seed(3)) * 2.2 - 1.1
    for s in (edge, sweep):
        assert torch.equal(nf4._codes(s), torch.bucketize(s, mids).to(torch.uint8))


# A hand-computed example (blocksize 8, float32). Row 0 has absmax 2, so the scaled values are
# x / 2 exactly: 1 -> code 15, -1 -> 0, 0 -> 7, 0.05 -> 8 (above the 7/8 midpoint 0.0398),
# -0.05 -> 6 (below the 6/7 midpoint -0.0455), 0.25 -> 10 (between 0.2035 and 0.2920),
# 0.6 -> 13 (between 0.5017 and 0.6428), -0.35 -> 3 (between -0.4600 and -0.3397).
# Row 1 is all zeros: absmax 0 and every code 7. Row 2 has absmax 1 (scaled = x): the 7/8
# midpoint itself -> 7 (the code is the number of midpoints strictly below), the next float32
# above it -> 8, 0.999 -> 15, 0.4 -> 12, -0.6 -> 2 (above the 1/2 midpoint -0.6106),
# 0.33 -> 11, 0.16 -> 9. Two codes per byte, the first in the high nibble.
_MID_7_8 = float(np.float32(NF4_PAPER[8]) / np.float32(2))
_HAND_X = [[2.0, -2.0, 0.0, 0.1, -0.1, 0.5, 1.2, -0.7],
           [0.0] * 8,
           [-1.0, _MID_7_8, float(np.nextafter(np.float32(_MID_7_8), np.float32(1))), 0.999,
            0.4, -0.6, 0.33, 0.16]]
_HAND_CODES = [[15, 0, 7, 8, 6, 10, 13, 3], [7] * 8, [0, 7, 8, 15, 12, 2, 11, 9]]
_HAND_PACKED = "f0786ad3" "77777777" "078fc2b9"
_HAND_ABSMAX = [2.0, 0.0, 1.0]


def _hand_dequantize(packed, absmax, n, blocksize):
    """code_table[nibble] * absmax[block] in float32, one element at a time."""
    table = np.asarray(NF4_PAPER, np.float32)
    raw = packed.numpy()
    am = absmax.numpy()
    vals = []
    for i in range(n):
        nib = raw[i // 2] >> 4 if i % 2 == 0 else raw[i // 2] & 0x0F
        vals.append(np.float32(table[nib] * am[i // blocksize]))
    return torch.tensor(np.array(vals, np.float32))


def test_code_table_is_the_nf4_data_type():
    table = nf4.code_table()
    assert table.dtype == torch.float32 and table.shape == (16,)
    assert torch.equal(table, torch.tensor(NF4_PAPER, dtype=torch.float32))
    assert table[C.NF4_ZERO_CODE] == 0 and bool((table[1:] > table[:-1]).all())
    assert np.array_equal(nf4.code_array(), np.asarray(NF4_PAPER, np.float32))


def test_quantize_hand_computed_example(native_mode):
    x = torch.tensor(_HAND_X, dtype=torch.float32)
    packed, absmax = nf4.quantize(x, 8)
    assert packed.dtype == torch.uint8 and absmax.dtype == torch.float32
    assert bytes(packed.numpy()).hex() == _HAND_PACKED
    assert absmax.tolist() == _HAND_ABSMAX
    codes = [[b >> 4, b & 0x0F][k] for b in packed.tolist() for k in (0, 1)]
    assert codes == [c for row in _HAND_CODES for c in row]
    want = torch.tensor([[NF4_PAPER[c] for c in row] for row in _HAND_CODES], dtype=torch.float32)
    want = (want * torch.tensor(_HAND_ABSMAX).unsqueeze(1)).to(torch.float32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = nf4.dequantize(packed, absmax, (3, 8), 8, dtype)
        assert got.dtype == dtype and got.shape == (3, 8)
        assert torch.equal(got, want.to(dtype))
    # Values that are codes times the absmax come back exactly.
    assert torch.equal(nf4.dequantize(*nf4.quantize(want, 8), (3, 8), 8), want)


def test_quantize_bf16_and_f16_inputs_quantize_their_float32_values(native_mode):
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(6, 128, generator=g) * 0.03).to(dtype)
        a = nf4.quantize(x, 64)
        b = nf4.quantize(x.float(), 64)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("bs", [32, 64, 128])
def test_round_trip_error_is_within_half_a_code_step(bs, native_mode):
    """Every element decodes to the nearest code times its block's absmax: the error is at
    most half the gap between the two codes around it (times absmax), and each block's
    largest magnitude is exact (it scales to +-1)."""
    g = torch.Generator().manual_seed(bs)
    x = torch.randn(40, 256, generator=g) * torch.rand(40, 1, generator=g) * 0.1
    x[3] = 0                                             # all-zero blocks: exact zeros
    packed, absmax = nf4.quantize(x, bs)
    got = nf4.dequantize(packed, absmax, x.shape, bs)
    blocks, deq = x.view(-1, bs), got.view(-1, bs)
    am = blocks.abs().amax(1)
    assert torch.equal(absmax, am)
    table = torch.tensor(NF4_PAPER)
    scaled = blocks / am.clamp_min(1e-30).unsqueeze(1)
    # the nearest code's distance, and the bound it gives in original units
    nearest = (scaled.unsqueeze(-1) - table).abs().min(-1).values
    err = (deq - blocks).abs()
    assert bool((err <= nearest * am.unsqueeze(1) * (1 + 1e-5) + 1e-7).all())
    half_gap = float((table[1:] - table[:-1]).max() / 2)
    assert bool((err <= half_gap * am.unsqueeze(1) * (1 + 1e-5)).all())
    peak = blocks.abs().argmax(1, keepdim=True)
    assert torch.equal(deq.gather(1, peak), blocks.gather(1, peak))
    assert torch.equal(got[3], torch.zeros(256))


def test_compiled_loops_equal_the_numpy_fallback(monkeypatch):
    """The compiled quantizer/dequantizer (lct.format.native) and the torch/numpy fallback give
    the same bytes and values, for every input dtype, odd lengths and all-zero blocks."""
    from lct.format import native
    if native._native is None:
        pytest.fail("lct.format._native was not built (pip install needs a C compiler)")
    g = torch.Generator().manual_seed(4)
    cases = [(torch.randn(37, 192, generator=g) * 0.05, 64),
             (torch.randn(1, 320, generator=g), 64),
             (torch.randn(9, 96, generator=g) * 3, 32)]
    cases[0][0][2, :64] = 0
    for x, bs in cases:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xd = x.to(dtype)
            odd = x.numel() - 3                   # a partial last block, an odd count
            results = {}
            for enabled in (True, False):
                monkeypatch.setattr(native, "_ENABLED", enabled)
                packed, absmax = nf4.quantize(xd, bs)
                deq = {d: nf4.dequantize(packed, absmax, tuple(x.shape), bs, d)
                       for d in (torch.float32, torch.bfloat16, torch.float16)}
                deq["odd"] = nf4.dequantize(packed, absmax, (odd,), bs, torch.bfloat16)
                results[enabled] = (packed, absmax, deq)
            (p1, a1, d1), (p0, a0, d0) = results[True], results[False]
            assert torch.equal(p1, p0) and torch.equal(a1, a0), (tuple(x.shape), dtype)
            for d in d1:
                assert torch.equal(d1[d], d0[d]), (tuple(x.shape), dtype, d)
