"""The LM head over an NF4 weight: on CPU a chunked dequantize-and-matmul whose memory does not
grow with the vocabulary beyond one chunk; on CUDA bitsandbytes' 4-bit matmul."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lct.errors import OptionError
from lct.format import constants as C
from lct.kernels.nf4 import dequantize_rows, dequantize_rows_into, quant_state

_FUSED_DTYPES = (torch.bfloat16, torch.float32)


def use_fused(rows: int) -> bool:
    """Whether a CPU NF4 matmul over ``rows`` input rows takes the fused kernel: it is built,
    and the input is short enough that reading 4-bit codes per row beats dequantizing once
    (``C.NF4_FUSED_MAX_ROWS``, measured in docs/BENCHMARKS.md, bench_head)."""
    from lct.kernels import native
    return native.available() and 0 < rows <= C.NF4_FUSED_MAX_ROWS


def fused_call(x2: torch.Tensor, n: int, out_dtype: torch.dtype, run) -> torch.Tensor:
    """Prepare a compiled fused matmul's buffers and call it: ``x2`` [M, K] made contiguous in
    bfloat16 or float32, an ``out_dtype`` [M, n] output, then ``run(x, x_bf16, out, out_bf16)``
    with numpy views (bfloat16 as its int16 bits)."""
    if x2.dtype not in _FUSED_DTYPES:
        x2 = x2.float()
    x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=out_dtype)
    xb, ob = x2.dtype == torch.bfloat16, out_dtype == torch.bfloat16
    run(x2.view(torch.int16).numpy() if xb else x2.numpy(), xb,
        out.view(torch.int16).numpy() if ob else out.numpy(), ob)
    return out


def fused_nf4_matmul(x2: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                     blocksize: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``x2 [M, K] @ W.T`` for ``W`` [N, K] in NF4 (``packed`` [N, K/2], float32 ``absmax``
    [N, K/blocksize]) through the compiled fused kernel: 4-bit codes are read straight from
    ``packed`` and turned into float32 in registers, products are summed in float32, and
    ``out_dtype`` (bfloat16 or float32) is written once. Uses torch's intra-op thread count."""
    from lct.format.nf4 import code_array
    from lct.kernels import native
    m, k = x2.shape
    n = packed.shape[0]
    return fused_call(x2, n, out_dtype, lambda x, xb, out, ob: native.nf4_matmul(
        x, xb, packed.contiguous().numpy(), absmax.float().contiguous().numpy(), code_array(),
        out, ob, (m, n, k), blocksize, torch.get_num_threads()))

# Dequantized rows per CPU chunk are capped by bytes: 128 MiB is 32,768 rows of a 2048-wide bf16
# head. Fewer, larger chunks matter on the CPU: after every matmul torch's OpenMP threads spin a
# while and slow the next chunk's dequantize (8,192 rows: 0.72 s per 256k x 2048 forward;
# 32,768: 0.52 s).
DEFAULT_CHUNK_BYTES = C.NF4_HEAD_CHUNK_BYTES


def quantized_forward(mod, x: torch.Tensor, fused_ok, fused) -> torch.Tensor:
    """The CPU forward of a quantized linear ``mod`` (``in_features``, ``out_features``,
    ``dtype``, ``bias``, ``_chunked``): the fused kernel ``fused(x2, out_dtype)`` when
    ``fused_ok(rows)`` and the output dtype suits it, else ``mod._chunked(x2, out_dtype)``.
    Always on 2-D input: torch's CPU linear of a 3-D input (generate's prefill slice
    ``hidden[:, -1:, :]`` above all) takes a path 100x slower than the same data as 2-D."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, mod.in_features)
    odt = torch.result_type(x, torch.empty(0, dtype=mod.dtype))
    if fused_ok(x2.shape[0]) and odt in _FUSED_DTYPES:
        if mod.bias is None:
            out = fused(x2, odt)
        else:   # the bias joins the float32 sums, so the output is rounded once, as F.linear's
            out = fused(x2, torch.float32).add_(mod.bias).to(odt)
    else:
        out = mod._chunked(x2, odt)
    return out.view(*lead, mod.out_features)


class FlatLinear(nn.Linear):
    """``nn.Linear`` that hands torch its input as 2-D: on the CPU, torch's linear of a 3-D
    activation (the ``hidden[:, -1:, :]`` slice that ``generate`` gives the LM head) takes a
    path about 100x slower than the same data viewed as [tokens, features]. Same weights, same
    state dict, same result as ``nn.Linear`` on the same data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the weight's own shape, not the attributes: a head whose table was replaced after
        # construction keeps stale ones (Marian's, built for vocab_size, holds its decoder's)
        y = F.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


def flatten_head(model) -> None:
    """Make a model's dense LM head (an exact ``nn.Linear``) a ``FlatLinear`` in place."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is nn.Linear:
        head.__class__ = FlatLinear


class NF4Linear(nn.Module):
    """``y = x @ W.T`` with ``W`` [out_features, in_features] kept in NF4.

    Args:
        packed, absmax: the NF4 weight in bitsandbytes layout (blocksize divides in_features).
        chunk_rows: output rows dequantized at a time on CPU (default: as many as fit in
            ``DEFAULT_CHUNK_BYTES`` of ``dtype``).
    """

    def __init__(self, packed, absmax, out_features: int, in_features: int, blocksize: int,
                 dtype: torch.dtype, bias: torch.Tensor | None = None,
                 chunk_rows: int | None = None):
        super().__init__()
        if in_features % blocksize:
            raise OptionError(f"blocksize {blocksize} must divide in_features {in_features}",
                              option="blocksize")
        self.in_features, self.out_features = in_features, out_features
        if chunk_rows is None:
            width = in_features * dtype.itemsize
            chunk_rows = max(1, DEFAULT_CHUNK_BYTES // width)
        self.blocksize, self.dtype, self.chunk_rows = blocksize, dtype, chunk_rows
        self.register_buffer("packed", packed.reshape(out_features, in_features // 2))
        self.register_buffer("absmax", absmax.reshape(out_features, in_features // blocksize))
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight dequantized (costs memory; forward never builds it on CPU)."""
        return dequantize_rows(self.packed, self.absmax, self.blocksize, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            import bitsandbytes as bnb
            state = quant_state(self.absmax.reshape(-1), (self.out_features, self.in_features),
                                self.blocksize, self.dtype)
            return bnb.matmul_4bit(x.to(self.dtype), self.packed.reshape(-1, 1).t(),
                                   quant_state=state, bias=self.bias)
        return quantized_forward(self, x, lambda rows: use_fused(rows), lambda x2, odt:
                                 fused_nf4_matmul(x2, self.packed, self.absmax, self.blocksize, odt))

    def _chunked(self, x2: torch.Tensor, odt: torch.dtype) -> torch.Tensor:
        """Dequantize ``chunk_rows`` rows at a time into one scratch buffer and multiply (the
        path for many rows of input, where one dequantize serves them all)."""
        out = x2.new_empty(x2.shape[0], self.out_features, dtype=odt)
        # One scratch buffer for every chunk: fresh pages cost more than the dequantize.
        scratch = torch.empty(min(self.chunk_rows, self.out_features) * self.in_features,
                              dtype=self.dtype)
        for r0 in range(0, self.out_features, self.chunk_rows):
            r1 = min(self.out_features, r0 + self.chunk_rows)
            w = dequantize_rows_into(self.packed[r0:r1], self.absmax[r0:r1], self.blocksize,
                                     self.dtype, scratch[: (r1 - r0) * self.in_features])
            out[:, r0:r1] = F.linear(x2, w, None if self.bias is None else self.bias[r0:r1])
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"nf4 blocksize={self.blocksize}, chunk_rows={self.chunk_rows}")
