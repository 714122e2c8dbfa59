"""NF4 reference codec: byte-identical to bitsandbytes' CPU ``quantize_4bit(quant_type="nf4")``.

Layout and rounding rules are in docs/FORMAT.md (section 2.2) and follow bitsandbytes exactly:
blocks of ``blocksize`` consecutive elements, float32 ``absmax`` per block, scale by the float32
reciprocal, code = number of float32 midpoints strictly below the scaled value, all-zero blocks
get code 7, first element of a pair in the high nibble. Large tables are processed in pieces so
memory does not grow with the table beyond one piece.
"""

from __future__ import annotations

import functools
import json
import math

from lct.format import constants as C
from lct.errors import CorruptChunkError, OptionError, PolicyError

PIECE_ELEMENTS = 1 << 22


def _torch():
    import torch
    return torch


def code_table():
    """The 16 NF4 values as a float32 tensor (index = code)."""
    torch = _torch()
    return torch.tensor(C.NF4_CODE, dtype=torch.float32)


def _midpoints():
    table = code_table()
    return (table[:-1] + table[1:]) / 2


@functools.lru_cache(maxsize=1)
def _code_lut():
    """A 65,536-entry table indexed by the top 16 bits of a float32 scaled value.

    All float32 values sharing their top 16 bits lie in one narrow interval, which contains at
    most one midpoint. ``base[i]`` is the code of the interval's low end and ``split[i]`` that
    midpoint (+inf if none), so ``code = base[i] + (s > split[i])`` equals the number of midpoints
    strictly below ``s`` (the bucketize rule) for every float32 ``s``, 2.5x faster than a search.
    """
    import numpy as np
    torch = _torch()
    mids = _midpoints()
    bits = np.arange(65536, dtype=np.uint32) << 16
    lo = torch.from_numpy(bits.view(np.float32).copy())
    hi = torch.from_numpy((bits | 0xFFFF).view(np.float32).copy())
    a, b = torch.minimum(lo, hi), torch.maximum(lo, hi)
    ca, cb = torch.bucketize(a, mids), torch.bucketize(b, mids)
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not bool(((cb - ca)[finite] <= 1).all()):  # pragma: no cover - a property of the table
        raise AssertionError("NF4 midpoints closer than one float32 16-bit cell")
    base = ca.to(torch.uint8)
    base[~finite] = C.NF4_ZERO_CODE
    split = torch.full((65536,), float("inf"))
    cut = finite & (cb > ca)
    split[cut] = mids[ca[cut]]
    return base, split


def _codes(scaled):
    """NF4 codes of float32 ``scaled`` values (any shape), by the bucketize rule."""
    torch = _torch()
    base, split = _code_lut()
    flat = scaled.contiguous().view(-1)
    # The top 16 bits of a little-endian float32 are its odd int16; a negative index wraps to
    # the same table entry as the unsigned value would.
    idx = flat.view(torch.int16).view(-1, 2)[:, 1].long()
    codes = torch.take(base, idx)
    codes += torch.take(split, idx) < flat
    return codes.view(scaled.shape)


def packed_size(numel: int) -> int:
    """Bytes of ``numel`` NF4 codes: two to a byte, high nibble first (docs/FORMAT.md 2.2)."""
    return (numel + 1) // 2


def absmax_count(numel: int, blocksize: int) -> int:
    """float32 absmax scales of ``numel`` elements: one per block, the last block partial."""
    return -(-numel // blocksize)


def encoded_size(numel: int, blocksize: int = C.DEFAULT_BLOCKSIZE) -> int:
    """Bytes of an NF4 tensor: its packed codes and 4-byte absmax scales."""
    return packed_size(numel) + 4 * absmax_count(numel, blocksize)


def check_blocksize(shape, blocksize: int, name: str = "tensor") -> None:
    """Raise ``PolicyError`` unless ``blocksize`` is even, in ``NF4_MIN_BLOCKSIZE`` ..
    ``NF4_MAX_BLOCKSIZE`` and divides the last dimension (what a reader accepts, FORMAT.md 2.2)."""
    if not C.NF4_MIN_BLOCKSIZE <= blocksize <= C.NF4_MAX_BLOCKSIZE or blocksize % 2:
        raise PolicyError(f"{name}: NF4 blocksize must be an even number in "
                          f"{C.NF4_MIN_BLOCKSIZE}..{C.NF4_MAX_BLOCKSIZE}, got {blocksize}",
                          option="blocksize")
    if not shape or shape[-1] % blocksize:
        raise PolicyError(
            f"{name}: NF4 blocksize {blocksize} must divide the row length "
            f"{shape[-1] if shape else '(scalar)'} so that no block spans two rows",
            option="blocksize")


def quantize(tensor, blocksize: int = C.DEFAULT_BLOCKSIZE, name: str = "tensor"):
    """Quantize ``tensor`` to NF4.

    Args:
        tensor: a floating-point torch tensor; every value must be finite.
        blocksize: elements per absmax block; must divide the last dimension.
        name: used in error messages.

    Returns:
        ``(packed, absmax)``: uint8 ``[ceil(n/2)]`` and float32 ``[ceil(n/blocksize)]``, equal
        byte for byte to bitsandbytes ``quantize_4bit(..., compress_statistics=False)`` on CPU.

    Raises:
        PolicyError: bad blocksize, or a NaN/Inf value.

    Example:
        >>> packed, absmax = quantize(torch.randn(4, 128), 64)
    """
    torch = _torch()
    check_blocksize(tuple(tensor.shape), blocksize, name)
    if not tensor.is_floating_point():
        raise PolicyError(f"{name}: NF4 needs a floating-point tensor, got {tensor.dtype}")
    flat = tensor.reshape(-1)
    n = flat.numel()
    nblocks = absmax_count(n, blocksize)
    packed = torch.empty(packed_size(n), dtype=torch.uint8)
    absmax = torch.empty(nblocks, dtype=torch.float32)
    if _quantize_native(flat, packed, absmax, blocksize, name):
        return packed, absmax
    per_piece = max(1, PIECE_ELEMENTS // blocksize)
    for b0 in range(0, nblocks, per_piece):
        b1 = min(nblocks, b0 + per_piece)
        e0, e1 = b0 * blocksize, min(n, b1 * blocksize)
        x = flat[e0:e1].to(torch.float32)
        pad = (b1 - b0) * blocksize - (e1 - e0)
        if pad:
            x = torch.cat([x, x.new_zeros(pad)])
        blocks = x.view(-1, blocksize)
        am = blocks.abs().amax(dim=1)
        if not torch.isfinite(am).all():  # amax propagates NaN and Inf: one check per block
            raise PolicyError(f"{name}: NF4 cannot encode NaN or Inf values "
                              f"(found one in elements {e0}..{e1})")
        absmax[b0:b1] = am
        scaled = blocks * (1.0 / am).unsqueeze(1)
        codes = _codes(scaled)
        codes[am == 0] = C.NF4_ZERO_CODE
        codes = codes.view(-1)[: e1 - e0]
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_full((1,), C.NF4_ZERO_CODE)])
        pairs = codes.view(-1, 2)
        packed[e0 // 2: e0 // 2 + pairs.shape[0]] = (pairs[:, 0] << 4) | pairs[:, 1]
    return packed, absmax


def dequantize(packed, absmax, shape, blocksize: int, dtype=None, out=None):
    """Dequantize NF4 ``packed``/``absmax`` to a tensor of ``shape`` (float32, then cast to ``dtype``).

    Bit-identical to bitsandbytes' ``dequantize_4bit``: ``code_table[nibble] * absmax[block]``
    in float32. Works in pieces so the float32 intermediate never exceeds one piece (one
    compiled pass, lct.format.native, for float32 and bfloat16 output on the CPU). ``out``, if given,
    is a contiguous tensor of ``shape``'s size and ``dtype`` to write into.
    """
    torch = _torch()
    n = math.prod(shape)
    if out is None:
        out = _empty(n, dtype or torch.float32)
    elif out.numel() != n or out.dtype != (dtype or torch.float32) or not out.is_contiguous():
        raise OptionError(f"out must be a contiguous {dtype or torch.float32} tensor of {n} "
                          f"elements, got {out.dtype} {tuple(out.shape)}", option="out")
    out = out.view(-1)
    if _dequantize_native(packed, absmax, out, blocksize):
        return out.view(*shape)
    pairs = _pair_table()
    flat = packed.reshape(-1)
    per_piece = max(1, PIECE_ELEMENTS // blocksize) * blocksize
    for e0 in range(0, n, per_piece):
        e1 = min(n, e0 + per_piece)
        # One lookup per byte gives both nibbles' values (high nibble first).
        vals = torch.embedding(pairs, flat[e0 // 2: (e1 + 1) // 2].long()).view(-1)[: e1 - e0]
        scale = absmax[e0 // blocksize: -(-e1 // blocksize)]
        if (e1 - e0) % blocksize == 0:
            vals = vals.view(-1, blocksize).mul_(scale.unsqueeze(1)).view(-1)
        else:
            vals = vals * scale.repeat_interleave(blocksize)[: e1 - e0]
        out[e0:e1] = vals
    return out.view(*shape)


def _quantize_native(flat, packed, absmax, blocksize: int, name: str) -> bool:
    """The compiled quantizer (lct.format.native) on the CPU; False if it does not apply. Same rule and
    bytes as the torch code below (tests/test_nf4.py checks both against bitsandbytes)."""
    torch = _torch()
    from lct.format import native
    if not native.available() or flat.device.type != "cpu":
        return False
    n = flat.numel()
    per_piece = max(1, PIECE_ELEMENTS // blocksize) * blocksize
    mids = _midpoints().numpy()
    # bf16 and float32 are read in place; other float types a piece at a time as float32.
    pieces = [(0, n)] if flat.dtype in (torch.bfloat16, torch.float32) else \
        [(e0, min(n, e0 + per_piece)) for e0 in range(0, n, per_piece)]
    for e0, e1 in pieces:
        x = flat[e0:e1]
        if x.dtype not in (torch.bfloat16, torch.float32):
            x = x.to(torch.float32)
        x = x.contiguous()
        bf16 = x.dtype == torch.bfloat16
        b0, b1 = e0 // blocksize, -(-e1 // blocksize)
        bad = native.nf4_quantize(x.view(torch.int16).numpy() if bf16 else x.numpy(), bf16,
                                  mids, packed[e0 // 2: (e1 + 1) // 2].numpy(),
                                  absmax[b0:b1].numpy(), blocksize)
        if bad >= 0:
            s0 = e0 + bad * blocksize
            raise PolicyError(f"{name}: NF4 cannot encode NaN or Inf values "
                              f"(found one in elements {s0}..{min(e1, s0 + blocksize)})")
    return True


def _empty(n: int, dtype):
    """An uninitialised CPU tensor; large ones come from numpy, whose allocator asks the kernel
    for transparent huge pages (torch's does not): faulting in a dequantized 256k x 2048 table
    took 2 s in 4 KiB pages against 0.1-0.5 s in huge pages on our VMs."""
    torch = _torch()
    import numpy as np
    size = dtype.itemsize
    if n * size < (4 << 20) or size not in (2, 4):
        return torch.empty(n, dtype=dtype)
    return torch.from_numpy(np.empty(n, dtype=np.uint16 if size == 2 else np.uint32)).view(dtype)


def _dequantize_native(packed, absmax, out, blocksize: int) -> bool:
    """The compiled loop (lct.format.native) for float32/bfloat16 CPU output; False if it does not apply."""
    torch = _torch()
    from lct.format import native
    if not native.available() or out.dtype not in (torch.float32, torch.bfloat16) \
            or packed.device.type != "cpu" or absmax.dtype != torch.float32:
        return False
    n = out.numel()
    flat = packed.reshape(-1)[: packed_size(n)].contiguous()
    am = absmax.reshape(-1)[: absmax_count(n, blocksize)].contiguous()
    if flat.numel() != packed_size(n) or am.numel() != absmax_count(n, blocksize):
        raise CorruptChunkError(f"NF4 data too short for {n} elements: {flat.numel()} packed "
                                f"bytes, {am.numel()} absmax values (blocksize {blocksize})")
    bf16 = out.dtype == torch.bfloat16
    native.nf4_dequant_into(flat.numpy(), am.numpy(), code_array(),
                            out.view(torch.int16).numpy() if bf16 else out.numpy(), blocksize, bf16)
    return True


@functools.lru_cache(maxsize=1)
def code_array():
    """The 16 NF4 values as a float32 numpy array (the compiled kernels' table)."""
    import numpy as np
    return np.asarray(C.NF4_CODE, dtype=np.float32)


@functools.lru_cache(maxsize=1)
def _pair_table():
    """[256, 2] float32: the NF4 values of a packed byte's high and low nibble."""
    torch = _torch()
    table = code_table()
    return torch.stack([table.repeat_interleave(16), table.repeat(16)], dim=1)


def quant_state_json(shape, blocksize: int, dtype: str) -> bytes:
    """The UTF-8 JSON that bitsandbytes stores under ``*.weight.quant_state.bitsandbytes__nf4``."""
    return json.dumps({"quant_type": "nf4", "blocksize": blocksize, "dtype": dtype,
                       "shape": list(shape)}).encode()


def bnb_state_dict(prefix: str, packed, absmax, shape, blocksize: int, dtype: str) -> dict:
    """The bitsandbytes state-dict entries for a parameter at module path ``prefix``.

    ``QuantState.from_dict`` and ``Params4bit.from_prequantized`` rebuild the quantization state
    from these keys unchanged.
    """
    torch = _torch()
    blob = quant_state_json(shape, blocksize, dtype)
    return {
        f"{prefix}.weight": packed.reshape(-1, 1),
        f"{prefix}.weight.absmax": absmax,
        f"{prefix}.weight.quant_map": code_table(),
        f"{prefix}.weight.quant_state.bitsandbytes__nf4":
            torch.frombuffer(bytearray(blob), dtype=torch.uint8),
    }
