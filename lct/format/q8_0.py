"""Q8_0 reference codec: llama.cpp's (ggml's) 8-bit block quantization, byte for byte.

A row of ``K`` values (``K`` a multiple of 32) is ``K / 32`` blocks of 34 bytes, each a float16
scale ``d`` (little-endian) and 32 signed bytes ``q``; a matrix is its rows' blocks in row order,
as a GGUF file holds a ``Q8_0`` tensor. 8.5 bits per value. The compiled loops
(``lct.format.native``) give the same bytes faster; this torch code is their tested fallback.

Rule per block of 32 values, in float32 (ggml's ``quantize_row_q8_0_ref``, and the ``gguf``
package's ``Q8_0.quantize_blocks``): ``d = max|x| / 127``; ``id = 1 / d`` (0 when ``d`` is 0);
``q = round_half_away_from_zero(x * id)``; ``d`` is then stored as float16 (round to nearest even).
Dequantized value: ``float32(d) * q``, then cast to the tensor's dtype. Tables are processed in
pieces so that memory does not grow with the table beyond one piece.
"""

from __future__ import annotations

import math

from lct.errors import OptionError, PolicyError
from lct.format import blocks as _blocks
from lct.format import constants as C

PIECE_ELEMENTS = 1 << 22


def blocks_nbytes(numel: int) -> int:
    """Bytes of ``numel`` values in Q8_0 (34 per block of 32)."""
    return _blocks.blocks_nbytes(numel, C.Q8_0_BLOCK, C.Q8_0_BLOCK_BYTES)


def row_bytes(cols: int) -> int:
    """Bytes of one row of ``cols`` values."""
    return blocks_nbytes(cols)


def check_shape(shape, name: str = "tensor") -> None:
    """Refuse a shape whose rows do not split into whole blocks (``PolicyError``)."""
    _blocks.check_rows(shape, name, "Q8_0", C.Q8_0_BLOCK)


def quantize_blocks(x):
    """The rule on float32 values ``x`` [..., 32]: ``(q, d)``, the codes as int8 and the scales
    as float16 [...]. ``x`` is not changed."""
    import torch
    d = x.abs().amax(dim=-1) / C.INT8_MAX
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    v = x * inv.unsqueeze(-1)
    # Half away from zero, as C's roundf: floor(|v|) + floor(2 * frac), signed (gguf's np_roundf).
    a = v.abs()
    fl = torch.floor(a)
    q = (fl + torch.floor(2 * (a - fl))).copysign_(v)
    return q.to(torch.int8), d.to(torch.float16)


def quantize(tensor, name: str = "tensor"):
    """Quantize ``tensor`` to Q8_0 along its last dimension.

    Args:
        tensor: a floating-point torch tensor whose rows have a multiple of 32 values, all finite.
        name: used in error messages.

    Returns:
        The blocks as uint8 ``[rows, cols / 32 * 34]`` (a GGUF ``Q8_0`` tensor's bytes).

    Raises:
        PolicyError: a non-float tensor, rows not a multiple of 32, or a NaN/Inf value.

    Example:
        >>> blocks = quantize(torch.randn(4, 128))
    """
    import torch
    if not tensor.is_floating_point():
        raise PolicyError(f"{name}: Q8_0 needs a floating-point tensor, got {tensor.dtype}")
    check_shape(tuple(tensor.shape), name)
    rows, cols = math.prod(tensor.shape[:-1]), tensor.shape[-1]
    nb = cols // C.Q8_0_BLOCK
    x2 = tensor.reshape(rows, cols)
    out = torch.empty(rows, nb, C.Q8_0_BLOCK_BYTES, dtype=torch.uint8)
    if _quantize_native(x2, out, cols, name):
        return out.view(rows, nb * C.Q8_0_BLOCK_BYTES)
    step = max(1, PIECE_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        xf = x2[r0:r1].to(torch.float32).reshape(r1 - r0, nb, C.Q8_0_BLOCK)
        if not torch.isfinite(xf).all():
            bad = r0 + int((~torch.isfinite(xf)).flatten(1).any(1).nonzero()[0])
            raise PolicyError(f"{name}: Q8_0 cannot encode NaN or Inf values (row {bad})")
        q, d = quantize_blocks(xf)
        out[r0:r1, :, :2] = d.unsqueeze(-1).view(torch.uint8)
        out[r0:r1, :, 2:] = q.view(torch.uint8)
    return out.view(rows, nb * C.Q8_0_BLOCK_BYTES)


def dequantize(blocks, shape, dtype=None, out=None):
    """Dequantize Q8_0 ``blocks`` (uint8, the rows' blocks in order) to ``shape``:
    ``float32(d) * q``, then cast to ``dtype`` (default float32). ``out``, if given, is a
    contiguous tensor of ``shape``'s size and ``dtype`` to write into."""
    import torch
    dtype = dtype or torch.float32
    n = math.prod(shape)
    nb = n // C.Q8_0_BLOCK
    b = blocks.reshape(nb, C.Q8_0_BLOCK_BYTES)
    if out is None:
        out = torch.empty(n, dtype=dtype, device=blocks.device)
    elif out.numel() != n or out.dtype != dtype or not out.is_contiguous():
        raise OptionError(f"out must be a contiguous {dtype} tensor of {n} elements, got "
                          f"{out.dtype} {tuple(out.shape)}", option="out")
    if _dequantize_native(b, out):
        return out.view(*shape)
    o2 = out.view(nb, C.Q8_0_BLOCK)
    step = max(1, PIECE_ELEMENTS // C.Q8_0_BLOCK)
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        rows_of(b[b0:b1], dtype, out=o2[b0:b1])
    return out.view(*shape)


def rows_of(blocks, dtype, out=None):
    """Blocks ``blocks`` [k, 34] (uint8) dequantized to [k, 32] of ``dtype`` (into ``out`` if
    given): the one rule every path uses, so that a gathered row equals the table's row."""
    import torch
    d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    q = blocks[:, 2:].view(torch.int8).to(torch.float32)
    f = q.mul_(d)
    if out is None:
        return f.to(dtype)
    out.copy_(f)
    return out


def _quantize_native(x2, out, cols: int, name: str) -> bool:
    """The compiled quantizer (``lct.format.native.q8_0_quantize``) on the CPU, a piece of rows
    at a time (bfloat16 and float32 read in place, other floats widened); False if it does not
    apply. The same bytes as the torch rule above (tests/test_q8_0.py checks both against
    the gguf package)."""
    import torch

    from lct.format import native
    if not native.available() or x2.device.type != "cpu":
        return False
    rows = x2.shape[0]
    flat = out.view(rows, -1)
    step = max(1, PIECE_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = x2[r0:r1]
        if x.dtype not in (torch.bfloat16, torch.float32):
            x = x.to(torch.float32)
        x = x.contiguous()
        bf16 = x.dtype == torch.bfloat16
        bad = native.q8_0_quantize(x.view(torch.int16).numpy() if bf16 else x.numpy(), bf16,
                                   flat[r0:r1].numpy())
        if bad >= 0:
            raise PolicyError(f"{name}: Q8_0 cannot encode NaN or Inf values "
                              f"(row {r0 + bad * C.Q8_0_BLOCK // cols})")
    return True


def _dequantize_native(blocks, out) -> bool:
    """The compiled loop (``lct.format.native.q8_0_dequant_into``) for float32/bfloat16 CPU
    output; False if it does not apply."""
    import torch

    from lct.format import native
    if not native.available() or out.dtype not in (torch.float32, torch.bfloat16) or \
            blocks.device.type != "cpu":
        return False
    bf16 = out.dtype == torch.bfloat16
    native.q8_0_dequant_into(blocks.contiguous().numpy(),
                             out.view(torch.int16).numpy() if bf16 else out.numpy(), bf16)
    return True
