"""int8 reference codec (docs/FORMAT.md section 2.2): one signed byte per element and one float32
scale per row (encoding ``int8``) or per block of ``block`` values of a row (``int8_b128``: 128).

Rule, in float32 throughout: ``scale = absmax(row) / 127``; ``q = clamp(round_half_even(x /
scale), -127, 127)`` (``q = 0`` for a row whose scale is 0); dequantized value ``q * scale``, then
cast to the tensor's dtype. Per block, each block of a row is such a row of its own: the codes lie
as they would per row, the scales ``[rows, cols / block]`` row-major. Rows are processed in pieces
so memory does not grow with the table. The compiled loops (``lct.format.native``) give the same
codes and scales, bit for bit, faster; this torch code is their tested fallback
(``LCT_NATIVE=0``).
"""

from __future__ import annotations

import math

from lct.errors import OptionError, PolicyError
from lct.format import constants as C

PIECE_ELEMENTS = 1 << 22


def row_shape(shape) -> tuple:
    """``(rows, cols)`` of a tensor of ``shape`` for int8 per-row storage (rows = all but the
    last dimension)."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def quantize_rows(x):
    """The rule on float32 rows ``x`` [rows, cols]: ``(q, scale)`` with ``q`` the codes as
    integer-valued float32 and ``scale`` float32 [rows]. ``x`` is not changed."""
    import torch
    am = x.abs().amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    scale = am / C.INT8_MAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(x / safe.unsqueeze(1)).clamp_(-C.INT8_MAX, C.INT8_MAX)
    q[scale == 0] = 0
    return q, scale


def quantize(tensor, name: str = "tensor", block: int | None = None):
    """Quantize ``tensor`` to int8 with one float32 scale per row (its last dimension), or per
    ``block`` values of a row.

    Args:
        tensor: a floating-point torch tensor whose values are all finite.
        name: used in error messages.
        block: values per scale, dividing the row length (None: the whole row).

    Returns:
        ``(q, scale)``: int8 ``[rows, cols]`` and float32 ``[rows]`` (per block ``[rows, cols /
        block]``).

    Raises:
        PolicyError: a non-float tensor, a row that is not whole blocks, or a NaN/Inf value.

    Example:
        >>> q, scale = quantize(torch.randn(4, 256), block=128)
    """
    import torch
    if not tensor.is_floating_point():
        raise PolicyError(f"{name}: int8 needs a floating-point tensor, got {tensor.dtype}")
    if block is not None:
        from lct.format.blocks import check_rows
        check_rows(tuple(tensor.shape), name, f"int8 per {block} values", block)
        rows, cols = row_shape(tuple(tensor.shape))
        q, scale = quantize(tensor.reshape(-1, block), name)
        return q.view(rows, cols), scale.view(rows, cols // block)
    rows, cols = row_shape(tuple(tensor.shape))
    x2 = tensor.reshape(rows, cols)
    q = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, dtype=torch.float32)
    if _quantize_native(x2, q, scale, name):
        return q, scale
    step = max(1, PIECE_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        v, s = quantize_rows(x2[r0:r1].to(torch.float32))
        if not torch.isfinite(s).all():  # amax propagates NaN and Inf
            bad = r0 + int((~torch.isfinite(s)).nonzero()[0])
            raise PolicyError(f"{name}: int8 cannot encode NaN or Inf values (row {bad})")
        scale[r0:r1] = s
        q[r0:r1] = v.to(torch.int8)
    return q, scale


def dequantize(q, scale, shape, dtype=None, out=None):
    """Dequantize int8 ``q`` [rows, cols] with float32 ``scale`` [rows] (or ``[rows, cols /
    block]``: per block) to ``shape``: ``q * scale`` in float32, then cast to ``dtype`` (default
    float32). ``out``, if given, is a contiguous tensor of ``shape``'s size and ``dtype`` to
    write into."""
    import torch
    dtype = dtype or torch.float32
    rows, cols = row_shape(tuple(shape))
    per_row = scale.numel() // max(rows, 1)
    if per_row > 1:     # per block: each block dequantized as a row of its own
        block = cols // per_row
        got = dequantize(q.reshape(-1, block), scale.reshape(-1), (rows * per_row, block),
                         dtype, None if out is None else out.view(-1))
        return got.view(*shape)
    q2 = q.reshape(rows, cols)
    s = scale.reshape(rows).to(torch.float32)
    if out is None:
        out = torch.empty(rows, cols, dtype=dtype, device=q.device)
    elif out.numel() != rows * cols or out.dtype != dtype or not out.is_contiguous():
        raise OptionError(f"out must be a contiguous {dtype} tensor of {rows * cols} elements, "
                          f"got {out.dtype} {tuple(out.shape)}", option="out")
    out2 = out.view(rows, cols)
    if _dequantize_native(q2, s, out2):
        return out.view(*shape)
    step = max(1, PIECE_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out2[r0:r1] = q2[r0:r1].to(torch.float32) * s[r0:r1].unsqueeze(1)
    return out.view(*shape)


def _numpy(t):
    """A contiguous CPU tensor's elements as numpy (bfloat16 as its bits in int16)."""
    import torch
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _quantize_native(x2, q, scale, name: str) -> bool:
    """The compiled quantizer (``lct.format.native.int8_quantize``) on CPU rows ``x2``, over
    torch's intra-op threads: in one call when ``x2`` is contiguous and of a dtype it reads in
    place, else a piece of rows at a time (each made contiguous, float8 widened to float32);
    False if it does not apply."""
    import torch

    from lct.format import native
    if not native.available() or x2.device.type != "cpu":
        return False
    x2 = x2.detach()
    rows, cols = x2.shape
    whole = x2.is_contiguous() and str(x2.dtype).removeprefix("torch.") in native.INT8_READS
    step = max(1, rows if whole else PIECE_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = x2[r0:r1]
        kind = str(x.dtype).removeprefix("torch.")
        if kind not in native.INT8_READS:   # float8: widened exactly
            x, kind = x.to(torch.float32), "float32"
        bad = native.int8_quantize(_numpy(x.contiguous()), kind, q[r0:r1].numpy(),
                                   scale[r0:r1].numpy(), torch.get_num_threads())
        if bad >= 0:
            raise PolicyError(f"{name}: int8 cannot encode NaN or Inf values (row {r0 + bad})")
    return True


def _dequantize_native(q2, s, out2) -> bool:
    """The compiled loop (``lct.format.native.int8_dequant_into``) for int8 codes on the CPU and
    float32/bfloat16/float16 output, over torch's intra-op threads; False if it does not
    apply."""
    import torch

    from lct.format import native
    kind = str(out2.dtype).removeprefix("torch.")
    if not native.available() or kind not in native.INT8_WRITES or q2.dtype != torch.int8 or \
            q2.device.type != "cpu" or s.device.type != "cpu" or out2.device.type != "cpu":
        return False
    native.int8_dequant_into(q2.contiguous().numpy(), s.contiguous().numpy(), _numpy(out2), kind,
                             torch.get_num_threads())
    return True
