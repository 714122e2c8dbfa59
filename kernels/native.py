"""The kernels' optional compiled loops (``kernels/_native.c``): the CPU matmuls of the NF4, int8,
Q8_0 and Q6_K LM heads. Two kinds: the fused kernels (``nf4_matmul`` ...), which read codes in
place one weight row against a few rows of x, and ``tiled_matmul``, which dequantizes tiles of
rows into cache and multiplies many rows of x with each; float32 sums throughout.

The extension is built by ``pip install`` where a C compiler is present. Without it, or with
``LCT_NATIVE=0`` (``lct.format.native.requested()``), ``available()`` is False and the heads
(``kernels/linear.py`` and the encodings' modules) take their torch path instead: dequantize a
chunk of rows, then ``F.linear``.
"""

from __future__ import annotations

import numpy as np

from lct.format.native import requested

try:
    from lct.kernels import _native
except ImportError:  # pragma: no cover - exercised where no compiler was available at install
    _native = None

_ENABLED = _native is not None and requested()

# The instruction sets, narrowest first; avx512bf16 (AVX512_BF16 beside AVX-512 F/BW/VL/DQ) adds
# the tiled matmul's bfloat16 dot products, the fused kernels run their avx512 code there.
ISAS = ("scalar", "avx2", "avx512", "avx512bf16")
# tiled_matmul's weight kinds, in the C module's numbering.
TILED_KINDS = ("nf4", "int8", "q8_0", "q6_k")


def available() -> bool:
    """Whether the compiled matmuls (fused and tiled) can run."""
    return _ENABLED


def matmul_isa() -> str:
    """The instruction set the matmuls use on this CPU, one of ``ISAS``
    (``LCT_NATIVE_ISA=scalar|avx2|avx512`` caps it). Only call when ``available()``."""
    return _native.nf4_matmul_isa()


def nf4_matmul(x: np.ndarray, x_bf16: bool, packed: np.ndarray, absmax: np.ndarray,
               code: np.ndarray, out: np.ndarray, out_bf16: bool, shape: tuple,
               blocksize: int, threads: int, isa: str | None = None) -> None:
    """``out[M, N] = x[M, K] @ W.T`` with ``W`` [N, K] in NF4 (``packed`` [N, K/2], float32
    ``absmax`` [N, K/blocksize], ``code`` the 16 float32 levels), accumulated in float32, over
    ``threads`` threads with the GIL released.

    Args:
        x, out: float32, or bfloat16 bits as int16 when ``x_bf16`` / ``out_bf16``.
        shape: (M, N, K); K a multiple of ``blocksize``, which is even.
        isa: force a narrower instruction set than the best (tests); one of ``ISAS``.

    Raises:
        ValueError: a buffer's size or alignment does not match ``shape``.

    Only call when ``available()``.

    Example:
        >>> nf4_matmul(x, False, packed, absmax, nf4.code_array(), out, False, (1, N, K), 64, 4)
    """
    m, n, k = shape
    _native.nf4_matmul(x, 1 if x_bf16 else 0, packed, absmax, code, out, 1 if out_bf16 else 0,
                       m, n, k, blocksize, threads, -1 if isa is None else ISAS.index(isa))


def int8_matmul(x: np.ndarray, x_bf16: bool, q: np.ndarray, scale: np.ndarray, out: np.ndarray,
                out_bf16: bool, shape: tuple, threads: int, isa: str | None = None,
                block: int | None = None) -> None:
    """``out[M, N] = x[M, K] @ (q * scale).T`` with ``q`` int8 [N, K] (as uint8 bytes or int8)
    and one float32 ``scale`` per row ([N]), or per ``block`` codes of a row ([N, K/block],
    row-major; ``block`` None: per row), accumulated in float32 over ``threads`` threads with
    the GIL released; ``x``, ``out``, ``shape`` (M, N, K) and ``isa`` as for ``nf4_matmul``.

    Raises:
        ValueError: a buffer's size or alignment does not match ``shape``.

    Only call when ``available()``.

    Example:
        >>> int8_matmul(x, False, q.view(torch.uint8).numpy(), scale, out, False, (1, N, K), 4)
    """
    m, n, k = shape
    _native.int8_matmul(x, 1 if x_bf16 else 0, q, scale, out, 1 if out_bf16 else 0, m, n, k,
                        block or k, threads, -1 if isa is None else ISAS.index(isa))


def blocks_matmul(kind: str, x: np.ndarray, x_bf16: bool, blocks: np.ndarray, out: np.ndarray,
                  out_bf16: bool, shape: tuple, threads: int, isa: str | None = None) -> None:
    """``out[M, N] = x[M, K] @ W.T`` with ``W`` [N, K] kept as rows of llama.cpp's blocks of
    the encoding ``kind`` (``"q8_0"`` or ``"q6_k"``, the block encodings of ``TILED_KINDS``):
    ``blocks`` is uint8, a row's K/block blocks contiguous, each block's bytes as the codec
    lays them out (``lct.format.q8_0``: a little-endian float16 ``d`` then 32 int8 codes,
    ``W = q * d``; ``lct.format.q6_k``: ``ql[128]``, ``qh[64]``, 16 int8 ``scales`` and a
    float16 ``d`` per 256 values, ``W = d * scale * (q - 32)``). Each weight is formed in
    float32 as the codec's ``dequantize`` forms it and summed in float32, over ``threads``
    threads with the GIL released; ``x``, ``out``, ``shape`` (M, N, K; K a multiple of the
    block) and ``isa`` as for ``nf4_matmul``.

    Raises:
        ValueError: a buffer's size or alignment does not match ``shape``.

    Only call when ``available()``.

    Example:
        >>> blocks_matmul("q8_0", x, False, blocks.numpy(), out, False, (1, N, K), 4)
    """
    m, n, k = shape
    getattr(_native, f"{kind}_matmul")(x, 1 if x_bf16 else 0, blocks, out, 1 if out_bf16 else 0,
                                       m, n, k, threads, -1 if isa is None else ISAS.index(isa))


def q8_0_matmul(*args, **kwargs) -> None:
    """``blocks_matmul("q8_0", ...)``: the head over Q8_0 blocks."""
    blocks_matmul("q8_0", *args, **kwargs)


def q6_k_matmul(*args, **kwargs) -> None:
    """``blocks_matmul("q6_k", ...)``: the head over Q6_K blocks."""
    blocks_matmul("q6_k", *args, **kwargs)


def tiled_matmul(kind: str, x: np.ndarray, x_bf16: bool, codes: np.ndarray,
                 scales: np.ndarray | None, table: np.ndarray | None, out: np.ndarray,
                 out_bf16: bool, shape: tuple, blocksize: int, w_bf16: bool, threads: int,
                 isa: str | None = None) -> None:
    """``out[M, N] = x[M, K] @ W.T`` for many rows of ``x``: each thread dequantizes a tile of
    W's rows into cache once and multiplies every row of ``x`` with it (kernels/_tiled.h).

    Args:
        kind: one of ``TILED_KINDS``. ``codes``, ``scales``, ``table`` as the fused kernel of
            that kind takes them: NF4 ``packed`` [N, K/2], float32 ``absmax`` [N, K/blocksize]
            and the 16 levels; int8 ``q`` [N, K] and float32 ``scale`` [N] (per block of
            ``blocksize`` codes: [N, K/blocksize]); Q8_0 / Q6_K the rows' blocks, with
            ``scales`` and ``table`` None.
        x, out, x_bf16, out_bf16: as for ``nf4_matmul``.
        shape: (M, N, K). blocksize: NF4's; int8's block (0 or K: one scale per row, else a
            multiple of 32); ignored otherwise.
        w_bf16: the weights may be rounded to bfloat16 once, as the torch path's dequantize to
            a bfloat16 model dtype does; with a bfloat16 ``x`` on an avx512bf16 CPU the tiles
            are then bfloat16 and multiplied by VDPBF16PS (exact products, float32 sums).
            Otherwise weights and ``x`` are float32.
        isa: force a narrower instruction set than the best (tests); one of ``ISAS``.

    Raises:
        ValueError: a buffer's size or alignment does not match ``shape``.

    Only call when ``available()``.

    Example:
        >>> tiled_matmul("q8_0", x, True, blocks.numpy(), None, None, out, True, (64, N, K),
        ...              0, True, 4)
    """
    m, n, k = shape
    empty = b""
    if kind == "int8" and not blocksize:
        blocksize = k
    _native.tiled_matmul(TILED_KINDS.index(kind), x, 1 if x_bf16 else 0, codes,
                         empty if scales is None else scales, empty if table is None else table,
                         out, 1 if out_bf16 else 0, m, n, k, blocksize, bool(w_bf16), threads,
                         -1 if isa is None else ISAS.index(isa))
