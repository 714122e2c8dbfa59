"""NF4: lct's reference codec equals bitsandbytes on CPU byte for byte, and dequantizes equally."""

import pytest
import torch

from lct.format import nf4
from lct.errors import PolicyError

F = pytest.importorskip("bitsandbytes.functional")

SHAPES = [((37, 192), 64), ((100, 256), 64), ((8, 128), 128), ((3, 64), 64), ((5, 2048), 64),
          ((1, 96), 32), ((260, 64), 64)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("shape,bs", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_bitsandbytes(shape, bs, dtype, native_mode):
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
    with pytest.raises(ValueError, match="contiguous"):
        nf4.dequantize(packed, absmax, (x.numel(),), 64, torch.bfloat16,
                       out=torch.empty(x.numel(), dtype=torch.float32))


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
    from bitsandbytes.functional import QuantState
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
