"""NF4 dequantization for the runtime: bitsandbytes' CUDA kernels on a GPU, the bit-exact torch
reference (``lct.format.nf4``) on the CPU."""

from __future__ import annotations

import torch

from lct.format import nf4 as ref


def quant_state(absmax, shape, blocksize: int, dtype: torch.dtype):
    """A bitsandbytes ``QuantState`` for NF4 data with plain (non-double-quantized) ``absmax``."""
    from bitsandbytes.functional import QuantState
    return QuantState(absmax=absmax, shape=torch.Size(shape), code=ref.code_table().to(absmax.device),
                      blocksize=blocksize, quant_type="nf4", dtype=dtype)


def dequantize(packed, absmax, shape, blocksize: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize NF4 ``packed``/``absmax`` to ``shape`` in ``dtype``.

    On CUDA this calls ``bitsandbytes.functional.dequantize_4bit``; on CPU the torch reference,
    which equals bitsandbytes bit for bit (tests/test_nf4.py).
    """
    if packed.is_cuda:
        import bitsandbytes.functional as F
        n = packed.numel() * 2
        flat = F.dequantize_4bit(packed.reshape(-1, 1), quant_state(absmax, (n,), blocksize, dtype))
        return flat[: torch.Size(shape).numel()].view(shape)
    return ref.dequantize(packed, absmax, tuple(shape), blocksize, dtype, out=out)


def dequantize_rows(packed_rows, absmax_rows, blocksize: int, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize whole rows: ``packed_rows`` [k, H/2] and ``absmax_rows`` [k, H/blocksize] -> [k, H].

    Because the blocksize divides H, this is bit-identical to dequantizing the whole table and
    indexing those rows. On CPU, ``out`` (k*H elements of ``dtype``) is written into if given.
    """
    k, half = packed_rows.shape
    if k == 0:
        return torch.empty(0, half * 2, dtype=dtype, device=packed_rows.device)
    return dequantize(packed_rows.reshape(-1), absmax_rows.reshape(-1), (k, half * 2), blocksize,
                      dtype, out=None if packed_rows.is_cuda else out)


_POOL = None


def _pool():
    """Helper threads for CPU dequantization (the compiled loop releases the GIL)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor
        _POOL = ThreadPoolExecutor(max(1, torch.get_num_threads() - 1),
                                   thread_name_prefix="lct-nf4")
    return _POOL


def dequantize_rows_into(packed_rows, absmax_rows, blocksize: int, dtype: torch.dtype,
                         out: torch.Tensor) -> torch.Tensor:
    """``dequantize_rows`` into ``out`` on the CPU, the rows split over torch's intra-op thread
    count when the compiled loop is in use (bit-identical: rows are independent)."""
    from lct.format import native
    k, half = packed_rows.shape
    parts = min(torch.get_num_threads(), max(1, k // 256)) if native.available() else 1
    if parts <= 1:
        return dequantize_rows(packed_rows, absmax_rows, blocksize, dtype, out=out)
    h = half * 2
    bounds = [k * i // parts for i in range(parts + 1)]

    def one(i):
        a, b = bounds[i], bounds[i + 1]
        dequantize_rows(packed_rows[a:b], absmax_rows[a:b], blocksize, dtype,
                        out=out[a * h: b * h])

    futures = [_pool().submit(one, i) for i in range(1, parts)]
    one(0)
    for f in futures:
        f.result()
    return out.view(k, h)
