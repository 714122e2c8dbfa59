"""The format's optional compiled inner loops (``lct/format/_native.c``): the planes join, runs
of zstd/planes frames, the NF4 and int8 codecs and llama.cpp's Q8_0 and Q6_K codecs; with a pure
numpy (or, for the codecs, torch) fallback.

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


# The instruction sets the threaded codecs (Q6_K, int8) can be told to use, narrowest first (all
# give the same bytes).
CODEC_ISAS = ("plain", "avx2")


def codec_isa() -> str:
    """The widest of ``CODEC_ISAS`` this CPU runs (what the threaded codecs use by default). Only
    call when ``available()``."""
    return CODEC_ISAS[_native.codec_isa()]


def _isa(isa: str | None) -> int:
    return -1 if isa is None else CODEC_ISAS.index(isa)


# The names tests/test_q6_k_native.py knows them by.


def q6_k_quantize(x: np.ndarray, bf16: bool, out: np.ndarray, threads: int,
                  isa: str | None = None) -> int:
    """Quantize ``x`` (float32, or bfloat16 bits as int16 when ``bf16``; a multiple of 256
    elements) into ``out`` (uint8, 210 bytes per 256 elements) as llama.cpp's Q6_K blocks,
    byte-identical to ggml's ``quantize_row_q6_K_ref`` (bfloat16 taken as its float32 value;
    the rule is lct/format/q6_k.py's). The blocks are split over ``threads`` threads (fewer when
    there are few blocks) with the GIL released. Returns the first block holding a NaN/Inf, or
    -1; every block before it is written (others may be). Only call when ``available()``.

    Args:
        isa: force a narrower instruction set than the best (tests); one of ``CODEC_ISAS``.

    Raises:
        ValueError: ``x`` is not whole blocks, ``out`` is not their size, or this CPU does not
            run ``isa``.

    Example:
        >>> q6_k_quantize(x, False, np.empty(x.size // 256 * 210, np.uint8), 4)
    """
    return _native.q6_k_quantize(x, 1 if bf16 else 0, out, threads, _isa(isa))


def q6_k_dequant_into(blocks: np.ndarray, out: np.ndarray, bf16: bool, threads: int) -> None:
    """Dequantize Q6_K ``blocks`` (uint8, 210 bytes per 256 elements) into ``out`` (float32, or
    bfloat16 bits as int16 when ``bf16``): ``float32(d) * scale * (q - 32)``, bit-identical to
    ``gguf.quants.dequantize`` and, for bfloat16, to torch's float32->bfloat16 cast of it, over
    ``threads`` threads (fewer when there are few blocks) with the GIL released. Only call when
    ``available()``.

    Raises:
        ValueError: ``out`` does not hold 256 elements per 210 bytes of ``blocks``.
    """
    _native.q6_k_dequant(blocks, out, 1 if bf16 else 0, threads)


# The element types int8_quantize reads and int8_dequant_into writes, in the compiled module's
# numbering (it writes the first three).
INT8_READS = ("float32", "bfloat16", "float16", "float64")
INT8_WRITES = INT8_READS[:3]


def int8_quantize(x: np.ndarray, kind: str, q: np.ndarray, scale: np.ndarray, threads: int,
                  isa: str | None = None) -> int:
    """Quantize the rows of ``x`` (``kind``, one of ``INT8_READS``; bfloat16 as its bits in
    int16) to int8 per row into ``q`` (int8, ``x``'s shape) and ``scale`` (float32, one per
    row): lct/format/int8.py's rule, bit for bit its torch code (``scale = max|x| / 127``,
    ``q = clamp(round_half_even(x / scale), -127, 127)``, 0 where the scale is 0; float64 taken
    as its float32 value). Rows are split over ``threads`` threads (fewer when there are few)
    with the GIL released. Returns the first row holding a NaN/Inf, or -1; every row before it
    is written (others may be). Only call when ``available()``.

    Args:
        x: a C-contiguous ``[rows, cols]`` array (``q`` the same shape, ``scale`` ``[rows]``).
        isa: force a narrower instruction set than the best (tests); one of ``CODEC_ISAS``.

    Raises:
        ValueError: the sizes do not agree, or this CPU does not run ``isa``.

    Example:
        >>> int8_quantize(x, "float32", np.empty(x.shape, np.int8), np.empty(len(x), np.float32), 4)
    """
    return _native.int8_quantize(x, INT8_READS.index(kind), q, scale, x.shape[-1], threads,
                                 _isa(isa))


def int8_dequant_into(q: np.ndarray, scale: np.ndarray, out: np.ndarray, kind: str, threads: int,
                      isa: str | None = None) -> None:
    """Dequantize int8 rows ``q`` ``[rows, cols]`` with float32 ``scale`` ``[rows]`` into ``out``
    (``kind``, one of ``INT8_WRITES``; bfloat16 as its bits in int16; ``q``'s shape): ``q * scale``
    in float32, then cast to ``kind`` to nearest even, bit for bit torch's (a NaN's bits aside).
    Rows are split over ``threads`` threads with the GIL released. Only call when
    ``available()``.

    Raises:
        ValueError: the sizes do not agree, or this CPU does not run ``isa``.
    """
    _native.int8_dequant(q, scale, out, INT8_WRITES.index(kind), q.shape[-1], threads, _isa(isa))
