"""The LM head over an NF4 weight: on CPU a chunked dequantize-and-matmul whose memory does not
grow with the vocabulary beyond one chunk; on CUDA bitsandbytes' 4-bit matmul."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lct import constants as C

from .nf4 import dequantize_rows, dequantize_rows_into, quant_state

# Dequantized rows per CPU chunk are capped by bytes: 128 MiB is 32,768 rows of a 2048-wide bf16
# head. Fewer, larger chunks matter on the CPU: after every matmul torch's OpenMP threads spin a
# while and slow the next chunk's dequantize (8,192 rows: 0.72 s per 256k x 2048 forward;
# 32,768: 0.52 s).
DEFAULT_CHUNK_BYTES = C.NF4_HEAD_CHUNK_BYTES


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
            raise ValueError(f"blocksize {blocksize} must divide in_features {in_features}")
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
        out = x.new_empty(*x.shape[:-1], self.out_features, dtype=torch.result_type(
            x, torch.empty(0, dtype=self.dtype)))
        # One scratch buffer for every chunk: fresh pages cost more than the dequantize.
        scratch = torch.empty(min(self.chunk_rows, self.out_features) * self.in_features,
                              dtype=self.dtype)
        for r0 in range(0, self.out_features, self.chunk_rows):
            r1 = min(self.out_features, r0 + self.chunk_rows)
            w = dequantize_rows_into(self.packed[r0:r1], self.absmax[r0:r1], self.blocksize,
                                     self.dtype, scratch[: (r1 - r0) * self.in_features])
            out[..., r0:r1] = F.linear(x, w, None if self.bias is None else self.bias[r0:r1])
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"nf4 blocksize={self.blocksize}, chunk_rows={self.chunk_rows}")
