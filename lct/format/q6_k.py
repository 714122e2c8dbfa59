"""Q6_K reference codec: llama.cpp's (ggml's) 6-bit k-quant, byte for byte.

A row of ``K`` values (``K`` a multiple of 256) is ``K / 256`` blocks of 210 bytes; a matrix is
its rows' blocks in row order, as a GGUF file holds a ``Q6_K`` tensor. A block is ``ql[128]``
(the low 4 bits of each 6-bit code), ``qh[64]`` (their high 2 bits), ``scales[16]`` (int8, one
per sub-block of 16 values) and ``d`` (float16, little-endian): 6.5625 bits per value. The value
of code ``q`` (0..63) in sub-block ``j`` is ``float32(d) * scales[j] * (q - 32)``.

The rule is ggml's ``quantize_row_q6_K_ref`` (docs/FORMAT.md section 2.2 states it), in float32
in the reference's order: every sum over a sub-block's 16 values runs in order, so the torch code
here vectorises across sub-blocks and loops over the 16 positions and the 19 trial scales. The
compiled loops (``lct.format.native``) give the same bytes faster; this torch code is their tested
fallback. Tables are processed in pieces so that memory does not grow with the table beyond one
piece.
"""

from __future__ import annotations

import math

import numpy as np

from lct.errors import OptionError, PolicyError
from lct.format import blocks as _blocks
from lct.format import constants as C

PIECE_ELEMENTS = 1 << 20

_SUBS = C.Q6_K_BLOCK // C.Q6_K_SUB_BLOCK        # 16 sub-blocks a block
_QL = C.Q6_K_BLOCK // 2                          # ql: bytes [0, 128)
_QH = _QL + C.Q6_K_BLOCK // 4                    # qh: bytes [128, 192)
_SC = _QH + _SUBS                                # scales: bytes [192, 208); d: [208, 210)
_NMAX = 32                                       # codes l in [-32, 31], stored as l + 32
_SCALE_MAX = 128                                 # the largest scale becomes -128
# The trial scales' numerators in float32: 32, then 32 + 0.1 * t for t = -9..-1, 1..9.
_TRIALS = [float(np.float32(_NMAX))] + [
    float(np.float32(_NMAX) + np.float32(0.1) * np.float32(t)) for t in range(-9, 10) if t]
_ROUND = 12582912.0                              # 1.5 * 2^23: see _nearest


def blocks_nbytes(numel: int) -> int:
    """Bytes of ``numel`` values in Q6_K (210 per block of 256)."""
    return _blocks.blocks_nbytes(numel, C.Q6_K_BLOCK, C.Q6_K_BLOCK_BYTES)


def row_bytes(cols: int) -> int:
    """Bytes of one row of ``cols`` values."""
    return blocks_nbytes(cols)


def check_shape(shape, name: str = "tensor") -> None:
    """Refuse a shape whose rows do not split into whole blocks (``PolicyError``)."""
    _blocks.check_rows(shape, name, "Q6_K", C.Q6_K_BLOCK)


def _nearest(f):
    """ggml's ``nearest_int`` on float32 ``f``: the low 23 bits of ``f + 1.5 * 2^23`` (a float32
    add, which rounds half to even) less 2^22, as int32; defined bit for bit for any ``f``."""
    import torch
    v = f + _ROUND
    return (v.view(torch.int32) & 0x7FFFFF) - 0x400000


def _codes(f):
    """``clamp(nearest(f), -32, 31)`` as int32."""
    return _nearest(f).clamp_(-_NMAX, _NMAX - 1)


def _sub_blocks(x):
    """ggml's ``make_qx_quants(16, 32, x, L, 1, NULL)`` on float32 sub-blocks ``x`` [S, 16], all
    at once: ``(scale, iscale, amax)`` [S], the sub-block scales (0 for one whose max |x| is
    under the epsilon), the trial scale whose codes were kept, and max |x|."""
    import torch
    ax = x.abs()
    at = ax.argmax(dim=1, keepdim=True)         # the first of largest magnitude, as the C loop
    amax = ax.gather(1, at).squeeze(1)
    mx = x.gather(1, at).squeeze(1)
    w = x * x
    wx = w * x
    scale = best = best_is = None
    for t, nm in enumerate(_TRIALS):
        iscale = torch.full_like(mx, -nm).div_(mx)      # -(nmax + 0.1 t) / max, one rounding
        lf = _codes(iscale.unsqueeze(1) * x).to(torch.float32)
        a = (wx * lf).t().contiguous()
        b = (w * lf).mul_(lf).t().contiguous()
        slx = torch.zeros_like(mx)
        sl2 = torch.zeros_like(mx)
        for i in range(C.Q6_K_SUB_BLOCK):                # float32 sums in the reference's order
            slx.add_(a[i])
            sl2.add_(b[i])
        s = slx / sl2
        if t == 0:
            scale = torch.where(sl2 != 0, s, torch.zeros_like(s))
            best = scale * slx
            best_is = iscale
            continue
        take = (sl2 > 0) & (slx * slx > best * sl2)
        scale = torch.where(take, s, scale)
        best = torch.where(take, s * slx, best)
        best_is = torch.where(take, iscale, best_is)
    zero = amax < torch.tensor(C.Q6_K_GROUP_MAX_EPS, dtype=torch.float32)
    return torch.where(zero, torch.zeros_like(scale), scale), best_is, amax


def quantize_blocks(x):
    """The rule on float32 values ``x`` [n, 256] (finite): their blocks as uint8 [n, 210].
    ``x`` is not changed."""
    import torch
    n = x.shape[0]
    xs = x.reshape(n * _SUBS, C.Q6_K_SUB_BLOCK)
    scale, best_is, amax = (v.view(n, _SUBS) for v in _sub_blocks(xs))
    eps = torch.tensor(C.Q6_K_GROUP_MAX_EPS, dtype=torch.float32)
    a = scale.abs()
    a = torch.where(a.isnan(), torch.zeros_like(a), a)  # a NaN scale (x^2 overflowed) never wins
    at = a.argmax(dim=1, keepdim=True)
    max_abs = a.gather(1, at)
    max_scale = scale.gather(1, at)
    iscale = torch.full_like(max_scale, -_SCALE_MAX).div_(max_scale)
    d16 = torch.ones_like(iscale).div_(iscale).to(torch.float16)          # [n, 1]
    sc = (_nearest(iscale * scale).clamp_(max=_SCALE_MAX - 1) & 0xFF).to(torch.uint8)
    d = d16.to(torch.float32) * sc.view(torch.int8).to(torch.float32)     # [n, 16]
    x3 = x.view(n, _SUBS, C.Q6_K_SUB_BLOCK)
    again = _codes(x3 / d.unsqueeze(2))                  # where d * scale is not 0
    kept = _codes(best_is.unsqueeze(2) * x3)             # the sub-block's own codes
    kept = torch.where((amax < eps).unsqueeze(2), torch.full_like(kept, -_NMAX), kept)
    L = (torch.where((d != 0).unsqueeze(2), again, kept) + _NMAX).to(torch.uint8)
    L4 = L.view(n, 2, 4, 32)                             # half, quarter, position
    ql = (L4[:, :, :2] & 0xF) | ((L4[:, :, 2:] & 0xF) << 4)
    hi = L4 >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out = torch.cat([ql.reshape(n, -1), qh.reshape(n, -1), sc, d16.view(torch.uint8)], dim=1)
    out[(max_abs < eps).squeeze(1)] = 0                  # an all-zero block: 210 zero bytes
    return out


def quantize(tensor, name: str = "tensor"):
    """Quantize ``tensor`` to Q6_K along its last dimension. Other float dtypes are quantized as
    their float32 values (float64 rounded to nearest even), as llama.cpp's converter does; a
    tensor on another device is quantized a piece at a time on the CPU.

    Args:
        tensor: a floating-point torch tensor whose rows have a multiple of 256 values, all
            finite.
        name: used in error messages.

    Returns:
        The blocks as uint8 ``[rows, cols / 256 * 210]`` on the CPU (a GGUF ``Q6_K`` tensor's
        bytes).

    Raises:
        PolicyError: a non-float tensor, rows not a multiple of 256, or a NaN/Inf value.

    Example:
        >>> blocks = quantize(torch.randn(4, 512))
    """
    import torch

    from lct.format import native
    if not tensor.is_floating_point():
        raise PolicyError(f"{name}: Q6_K needs a floating-point tensor, got {tensor.dtype}")
    check_shape(tuple(tensor.shape), name)
    rows, cols = math.prod(tensor.shape[:-1]), tensor.shape[-1]
    x2 = tensor.detach().reshape(rows, cols)
    out = torch.empty(rows, row_bytes(cols), dtype=torch.uint8)
    step = max(1, PIECE_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = x2[r0:r1].cpu()
        if native.available():
            _quantize_native(x, out[r0:r1], r0, cols, name)
            continue
        xf = x.to(torch.float32)
        finite = torch.isfinite(xf).all(dim=1)
        if not finite.all():
            raise PolicyError(f"{name}: Q6_K cannot encode NaN or Inf values "
                              f"(row {r0 + int((~finite).nonzero()[0])})")
        out[r0:r1] = quantize_blocks(xf.reshape(-1, C.Q6_K_BLOCK)).view(r1 - r0, -1)
    return out


def dequantize(blocks, shape, dtype=None, out=None):
    """Dequantize Q6_K ``blocks`` (uint8, the rows' blocks in order, on any device) to
    ``shape``: ``float32(d) * scale * (q - 32)``, then cast to ``dtype`` (default float32).

    Args:
        blocks: ``blocks_nbytes(prod(shape))`` bytes as a uint8 tensor.
        shape: the table's shape; its last dimension a multiple of 256.
        dtype: the float dtype to return.
        out: if given, a contiguous tensor of ``shape``'s size and ``dtype`` on ``blocks``'
            device to write into.

    Returns:
        A tensor of ``shape`` and ``dtype`` on ``blocks``' device (``out`` viewed so, if given).

    Raises:
        PolicyError: ``shape``'s rows are not whole blocks.
        OptionError: ``blocks`` or ``out`` does not fit ``shape``.

    Example:
        >>> w = dequantize(quantize(torch.randn(4, 512)), (4, 512), torch.bfloat16)
    """
    import torch
    dtype = dtype or torch.float32
    check_shape(tuple(shape))
    n = math.prod(shape)
    nb = n // C.Q6_K_BLOCK
    if blocks.numel() != blocks_nbytes(n):
        raise OptionError(f"blocks must be {blocks_nbytes(n)} bytes for shape {tuple(shape)}, "
                          f"got {blocks.numel()}", option="blocks")
    b = blocks.reshape(nb, C.Q6_K_BLOCK_BYTES)
    if out is None:
        out = torch.empty(n, dtype=dtype, device=blocks.device)
    elif out.numel() != n or out.dtype != dtype or not out.is_contiguous() or \
            out.device != blocks.device:
        raise OptionError(f"out must be a contiguous {dtype} tensor of {n} elements on "
                          f"{blocks.device}, got {out.dtype} {tuple(out.shape)} on {out.device}",
                          option="out")
    if _dequantize_native(b, out):
        return out.view(*shape)
    o2 = out.view(nb, C.Q6_K_BLOCK)
    step = max(1, PIECE_ELEMENTS // C.Q6_K_BLOCK)
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        rows_of(b[b0:b1], dtype, out=o2[b0:b1])
    return out.view(*shape)


def rows_of(blocks, dtype, out=None):
    """Blocks ``blocks`` [k, 210] (uint8) dequantized to [k, 256] of ``dtype`` (into ``out`` if
    given): the one rule every torch path uses, so that a gathered row equals the table's row."""
    import torch
    k = blocks.shape[0]
    # Element h * 128 + nib * 64 + pair * 32 + l of a block: the nibble `nib` of ql byte
    # h * 64 + pair * 32 + l, and bits 2 * (2 * nib + pair) of qh byte h * 32 + l.
    ql = blocks[:, :_QL].to(torch.int32).view(k, 2, 1, 2, 32)
    qh = blocks[:, _QL:_QH].to(torch.int32).view(k, 2, 1, 1, 32)
    sc = blocks[:, _QH:_SC].contiguous().view(torch.int8).to(torch.float32)
    d = blocks[:, _SC:].contiguous().view(torch.float16).to(torch.float32)
    nib = torch.tensor([0, 4], dtype=torch.int32, device=blocks.device).view(1, 1, 2, 1, 1)
    pair = torch.tensor([0, 2], dtype=torch.int32, device=blocks.device).view(1, 1, 1, 2, 1)
    low = (ql >> nib) & 0xF
    high = (qh >> (nib + pair)) & 3
    q = (low | (high << 4)).sub_(_NMAX).to(torch.float32).view(k, _SUBS, C.Q6_K_SUB_BLOCK)
    f = (d * sc).unsqueeze(2).mul(q).view(k, C.Q6_K_BLOCK)           # (d * scale) * (q - 32)
    if out is None:
        return f.to(dtype)
    out.copy_(f)
    return out


def _quantize_native(x, out, r0: int, cols: int, name: str) -> None:
    """The compiled quantizer (``lct.format.native.q6_k_quantize``) on one CPU piece of rows
    ``x`` into ``out`` (bfloat16 and float32 read in place, other floats widened), over torch's
    intra-op threads. The same bytes as the torch rule above (tests/test_q6_k.py checks both
    against llama.cpp's)."""
    import torch

    from lct.format import native
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.to(torch.float32)
    x = x.contiguous()
    bf16 = x.dtype == torch.bfloat16
    bad = native.q6_k_quantize(x.view(torch.int16).numpy() if bf16 else x.numpy(), bf16,
                               out.numpy(), torch.get_num_threads())
    if bad >= 0:
        raise PolicyError(f"{name}: Q6_K cannot encode NaN or Inf values "
                          f"(row {r0 + bad * C.Q6_K_BLOCK // cols})")


def _dequantize_native(blocks, out) -> bool:
    """The compiled loop (``lct.format.native.q6_k_dequant_into``) for float32/bfloat16 CPU
    output, over torch's intra-op threads; False if it does not apply."""
    import torch

    from lct.format import native
    if not native.available() or out.dtype not in (torch.float32, torch.bfloat16) or \
            blocks.device.type != "cpu":
        return False
    bf16 = out.dtype == torch.bfloat16
    native.q6_k_dequant_into(blocks.contiguous().numpy(),
                             out.view(torch.int16).numpy() if bf16 else out.numpy(), bf16,
                             torch.get_num_threads())
    return True
