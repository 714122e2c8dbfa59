"""The format's optional compiled inner loops (``lct/format/_native.c``): the planes join, runs
of zstd/planes frames, the NF4 codec and llama.cpp's Q8_0 codec; with a pure numpy fallback.

The extension is built by ``pip install`` where a C compiler is present; without one the package
still installs and every function here gives the same bytes through numpy, only slower. Set
``LCT_NATIVE=0`` to force the fallback (benchmarks use it for A/B runs); it also turns off the
kernels' fused matmuls (``lct.kernels.native``).
"""

from __future__ import annotations

import os
import threading

import numpy as np

try:
    from lct.format import _native
except ImportError:  # pragma: no cover - exercised where no compiler was available at install
    _native = None


def requested() -> bool:
    """Whether the environment lets LCT use its compiled loops: ``LCT_NATIVE=0`` says no, for
    the format's loops here and the kernels' (``lct.kernels.native``)."""
    return os.environ.get("LCT_NATIVE", "1") != "0"


_ENABLED = _native is not None and requested()
_local = threading.local()  # per-thread scratch of the numpy fallback


def available() -> bool:
    """Whether the compiled loops are in use."""
    return _ENABLED


def frames_available() -> bool:
    """Whether whole runs of frames can be decoded in C (the extension and libzstd loaded)."""
    return _ENABLED and _native.zstd_available()


def decode_frames(stored, out: np.ndarray, rows: np.ndarray, width: int):
    """Decode a run of frames with the GIL released throughout (see ``lct/format/_native.c``).

    ``rows`` is an int64 array [k, 6] of (start, n, at, hi_len, lo_len, mode); ``width`` is 0
    for plain zstd frames, 2 or 4 for planes. Returns None, or ``(row, message)`` for the
    first frame that failed (every row is bounds-checked before anything is decoded).
    """
    return _native.decode_frames(stored, out, rows, width)


def join_planes16(hi: np.ndarray, lo: np.ndarray, out: np.ndarray) -> None:
    """``out = rotate_right(hi << 8 | lo, 1)`` for 16-bit elements (the planes decode)."""
    if _ENABLED:
        _native.join_planes(hi, lo, out, 2)
        return
    tmp = getattr(_local, "tmp16", None)
    if tmp is None or tmp.size < out.size:
        tmp = _local.tmp16 = np.empty(out.size, np.uint16)
    tmp = tmp[: out.size]
    # Five contiguous passes (no strided byte scatter): (hi << 7) | (lo >> 1) | (lo << 15).
    np.left_shift(hi, 7, out=out, dtype=np.uint16)
    np.right_shift(lo, 1, out=tmp, dtype=np.uint16)
    np.bitwise_or(out, tmp, out=out)
    np.left_shift(lo, 15, out=tmp, dtype=np.uint16)
    np.bitwise_or(out, tmp, out=out)


def join_planes32(hi: np.ndarray, lo: np.ndarray, out: np.ndarray) -> None:
    """``out = rotate_right(hi << 24 | lo, 1)`` for 32-bit elements; ``lo`` holds 3 bytes each."""
    if _ENABLED:
        _native.join_planes(hi, lo, out, 4)
        return
    n = out.size
    grid = out.view(np.uint8).reshape(n, 4)
    grid[:, 3] = hi
    grid[:, :3] = lo.reshape(n, 3)
    low = out >> 1
    np.left_shift(out, 31, out=out)
    np.bitwise_or(out, low, out=out)


def nf4_quantize(x: np.ndarray, bf16: bool, mids: np.ndarray, packed: np.ndarray,
                 absmax: np.ndarray, blocksize: int) -> int:
    """NF4-quantize ``x`` (float32, or bfloat16 bits as int16 when ``bf16``) into ``packed`` and
    ``absmax`` (lct/format/nf4.py's rule). Returns the first block holding a NaN/Inf, or -1. Only call
    when ``available()``."""
    return _native.nf4_quantize(x, 1 if bf16 else 0, mids, packed, absmax, blocksize)


def nf4_dequant_into(packed: np.ndarray, absmax: np.ndarray, code: np.ndarray, out: np.ndarray,
                     blocksize: int, bf16: bool) -> None:
    """Dequantize NF4 into ``out`` (float32, or bfloat16 bits as int16 when ``bf16``). Only call
    when ``available()``."""
    _native.nf4_dequant(packed, absmax, code, out, blocksize, 1 if bf16 else 0)


def q8_0_quantize(x: np.ndarray, bf16: bool, out: np.ndarray) -> int:
    """Quantize ``x`` (float32, or bfloat16 bits as int16 when ``bf16``; a multiple of 32
    elements) into ``out`` (uint8, 34 bytes per 32 elements) as llama.cpp's Q8_0 blocks: a
    little-endian float16 ``d = max|x| / 127``, then 32 int8 ``round(x / d)``, byte-identical to
    ``gguf.quants.quantize(x, GGMLQuantizationType.Q8_0)`` (bfloat16 taken as its float32 value).
    Returns the first block holding a NaN/Inf, or -1 (blocks before it are written). The GIL is
    released. Only call when ``available()``.

    Raises:
        ValueError: ``x`` is not whole blocks, or ``out`` is not their size.
    """
    return _native.q8_0_quantize(x, 1 if bf16 else 0, out)


def q8_0_dequant_into(blocks: np.ndarray, out: np.ndarray, bf16: bool) -> None:
    """Dequantize Q8_0 ``blocks`` (uint8, 34 bytes per 32 elements) into ``out`` (float32, or
    bfloat16 bits as int16 when ``bf16``): ``q * d``, bit-identical to ``gguf.quants.dequantize``
    and, for bfloat16, to torch's float32->bfloat16 cast of it. The GIL is released. Only call
    when ``available()``.

    Raises:
        ValueError: ``out`` does not hold 32 elements per 34 bytes of ``blocks``.
    """
    _native.q8_0_dequant(blocks, out, 1 if bf16 else 0)
