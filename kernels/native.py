"""The kernels' optional compiled loops (``kernels/_native.c``): the fused CPU matmuls of the NF4,
int8 and Q8_0 LM heads, which read 4-bit or 8-bit codes in place and sum in float32.

The extension is built by ``pip install`` where a C compiler is present. Without it, or with
``LCT_NATIVE=0`` (``lct.format.native.requested()``), ``available()`` is False and the heads
(``kernels/linear.py``, ``kernels/int8.py``) take their torch path instead: dequantize a chunk of
rows, then ``F.linear`` (slower for a few rows, and rounded as the dequantized weight's matmul).
"""

from __future__ import annotations

import numpy as np

from lct.format.native import requested

try:
    from lct.kernels import _native
except ImportError:  # pragma: no cover - exercised where no compiler was available at install
    _native = None

_ENABLED = _native is not None and requested()

ISAS = ("scalar", "avx2", "avx512")


def available() -> bool:
    """Whether the fused matmuls (``nf4_matmul``, ``int8_matmul``, ``q8_0_matmul``) can run."""
    return _ENABLED


def matmul_isa() -> str:
    """The instruction set the fused matmuls use on this CPU: ``scalar``, ``avx2`` or ``avx512``
    (``LCT_NATIVE_ISA=scalar|avx2`` caps it). Only call when ``available()``."""
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
                out_bf16: bool, shape: tuple, threads: int, isa: str | None = None) -> None:
    """``out[M, N] = x[M, K] @ (q * scale[:, None]).T`` with ``q`` int8 [N, K] (as uint8 bytes
    or int8) and one float32 ``scale`` per row, accumulated in float32 over ``threads`` threads
    with the GIL released; ``x``, ``out``, ``shape`` (M, N, K) and ``isa`` as for
    ``nf4_matmul``.

    Raises:
        ValueError: a buffer's size or alignment does not match ``shape``.

    Only call when ``available()``.

    Example:
        >>> int8_matmul(x, False, q.view(torch.uint8).numpy(), scale, out, False, (1, N, K), 4)
    """
    m, n, k = shape
    _native.int8_matmul(x, 1 if x_bf16 else 0, q, scale, out, 1 if out_bf16 else 0, m, n, k,
                        threads, -1 if isa is None else ISAS.index(isa))


def q8_0_matmul(x: np.ndarray, x_bf16: bool, blocks: np.ndarray, out: np.ndarray,
                out_bf16: bool, shape: tuple, threads: int, isa: str | None = None) -> None:
    """``out[M, N] = x[M, K] @ W.T`` with ``W`` [N, K] in llama.cpp's Q8_0: ``blocks`` is uint8,
    N * K/32 blocks of 34 bytes, row-major (a row's K/32 blocks contiguous), each a
    little-endian float16 ``d`` then 32 int8 codes ``q``, ``W = q * d``. Each weight is formed
    exactly in float32 and summed in float32, over ``threads`` threads with the GIL released;
    ``x``, ``out``, ``shape`` (M, N, K; K a multiple of 32) and ``isa`` as for ``nf4_matmul``.

    Raises:
        ValueError: a buffer's size or alignment does not match ``shape``.

    Only call when ``available()``.

    Example:
        >>> q8_0_matmul(x, False, blocks.numpy(), out, False, (1, N, K), 4)
    """
    m, n, k = shape
    _native.q8_0_matmul(x, 1 if x_bf16 else 0, blocks, out, 1 if out_bf16 else 0, m, n, k,
                        threads, -1 if isa is None else ISAS.index(isa))
