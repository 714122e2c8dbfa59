"""The LM head over an NF4 weight: on CPU a chunked dequantize-and-matmul whose memory does not
grow with the vocabulary beyond one chunk; on CUDA bitsandbytes' 4-bit matmul."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .nf4 import dequantize_rows, quant_state

DEFAULT_CHUNK_ROWS = 8192


class NF4Linear(nn.Module):
    """``y = x @ W.T`` with ``W`` [out_features, in_features] kept in NF4.

    Args:
        packed, absmax: the NF4 weight in bitsandbytes layout (blocksize divides in_features).
        chunk_rows: output rows dequantized at a time on CPU.
    """

    def __init__(self, packed, absmax, out_features: int, in_features: int, blocksize: int,
                 dtype: torch.dtype, bias: torch.Tensor | None = None,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS):
        super().__init__()
        if in_features % blocksize:
            raise ValueError(f"blocksize {blocksize} must divide in_features {in_features}")
        self.in_features, self.out_features = in_features, out_features
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
            w = dequantize_rows(self.packed[r0:r1], self.absmax[r0:r1], self.blocksize, self.dtype,
                                out=scratch[: (r1 - r0) * self.in_features])
            out[..., r0:r1] = F.linear(x, w, None if self.bias is None else self.bias[r0:r1])
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"nf4 blocksize={self.blocksize}, chunk_rows={self.chunk_rows}")
