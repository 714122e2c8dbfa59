"""Kernels over Q8_0 weights (``lct.format.q8_0``: per 32 values a float16 scale and 32 int8 codes,
llama.cpp's layout): the LM head's matmul (fused in the C extension on the CPU for short inputs,
chunked dequantize-and-matmul otherwise and on a GPU) and the embedding's row gather."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lct.format import constants as C
from lct.format import q8_0
from lct.kernels.embedding import masked_gather
from lct.kernels.linear import DEFAULT_CHUNK_BYTES, fused_call, quantized_forward


def dequantize_rows(blocks: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of Q8_0 ``blocks`` [k, K/32*34] (uint8) -> [k, K] of ``dtype`` (into ``out``, k*K of
    ``dtype``, if given): bit-identical to dequantizing the table and indexing."""
    k = blocks.shape[0]
    cols = blocks.shape[1] // C.Q8_0_BLOCK_BYTES * C.Q8_0_BLOCK
    return q8_0.dequantize(blocks, (k, cols), dtype, out=out)     # the compiled loop if built


def use_fused(rows: int) -> bool:
    """Whether a CPU Q8_0 matmul over ``rows`` input rows takes the fused kernel (built, and
    few enough rows that reading codes per row beats one dequantize for all)."""
    from lct.kernels import native
    return native.available() and 0 < rows <= C.Q8_0_FUSED_MAX_ROWS


def fused_q8_0_matmul(x2: torch.Tensor, blocks: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """``x2 [M, K] @ W.T`` for ``W`` [N, K] in Q8_0 (``blocks`` [N, K/32*34]) through the
    compiled kernel: codes widened to float32 and scaled in registers (each ``q * d`` exact in
    float32), float32 sums, ``out_dtype`` (bfloat16 or float32) written once. Uses torch's
    intra-op threads."""
    from lct.kernels import native
    m, k = x2.shape
    n = blocks.shape[0]
    return fused_call(x2, n, out_dtype, lambda x, xb, out, ob: native.q8_0_matmul(
        x, xb, blocks.contiguous().numpy(), out, ob, (m, n, k), torch.get_num_threads()))


class Q8_0Linear(nn.Module):
    """``y = x @ W.T`` with ``W`` [out_features, in_features] kept as Q8_0 blocks.

    Args:
        blocks: uint8 [out_features, in_features / 32 * 34].
        dtype: the weight's dtype when dequantized (and the output's, with an input of it).
        chunk_rows: output rows dequantized at a time on the chunked path (default: as many
            as fit in ``DEFAULT_CHUNK_BYTES`` of ``dtype``).
    """

    def __init__(self, blocks, dtype: torch.dtype, bias: torch.Tensor | None = None,
                 chunk_rows: int | None = None):
        super().__init__()
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] // C.Q8_0_BLOCK_BYTES * C.Q8_0_BLOCK
        self.dtype = dtype
        self.chunk_rows = chunk_rows or max(1, DEFAULT_CHUNK_BYTES // (self.in_features
                                                                         * dtype.itemsize))
        self.register_buffer("blocks", blocks)
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight dequantized (costs memory; forward never builds it)."""
        return dequantize_rows(self.blocks, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_forward(self, x, lambda rows: not x.is_cuda and use_fused(rows),
                                 lambda x2, odt: fused_q8_0_matmul(x2, self.blocks, odt))

    def _chunked(self, x2: torch.Tensor, odt: torch.dtype) -> torch.Tensor:
        """Dequantize ``chunk_rows`` rows at a time and multiply: the path for many input rows,
        and the GPU path (torch kernels on any device)."""
        out = x2.new_empty(x2.shape[0], self.out_features, dtype=odt)
        size = min(self.chunk_rows, self.out_features) * self.in_features
        scratch = torch.empty(size, dtype=odt, device=x2.device)   # one for every chunk
        for r0 in range(0, self.out_features, self.chunk_rows):
            r1 = min(self.out_features, r0 + self.chunk_rows)
            w = dequantize_rows(self.blocks[r0:r1], odt,
                                out=scratch[:(r1 - r0) * self.in_features])
            out[:, r0:r1] = F.linear(x2.to(odt), w,
                                     None if self.bias is None else self.bias[r0:r1].to(odt))
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, Q8_0, "
                f"chunk_rows={self.chunk_rows}")


class Q8_0Embedding(nn.Module):
    """An embedding table kept as Q8_0 blocks; a lookup dequantizes only the rows it gathers
    (bit-identical to dequantizing the table and indexing).

    Args:
        blocks: uint8 [num_embeddings, embedding_dim / 32 * 34].
        dtype: output dtype (the table's source dtype).
        pad_ids: ids that yield zero rows without being gathered.
        scale_by: optional multiplier applied like Gemma's scaled embedding.
    """

    def __init__(self, blocks, dtype: torch.dtype, pad_ids=(),
                 scale_by: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = blocks.shape[1] // C.Q8_0_BLOCK_BYTES * C.Q8_0_BLOCK
        self.dtype = dtype
        self.register_buffer("blocks", blocks)
        self.register_buffer("pad_ids", torch.tensor(sorted(set(pad_ids)), dtype=torch.long,
                                                     device=blocks.device), persistent=False)
        self.register_buffer("embed_scale", scale_by, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (for code that insists on ``.weight``; costs memory)."""
        return dequantize_rows(self.blocks, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return masked_gather(ids, self.num_embeddings, self.embedding_dim, self.pad_ids,
                             lambda sel: dequantize_rows(self.blocks[sel], self.dtype),
                             self.embed_scale)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, Q8_0, dtype={self.dtype}, "
                f"pad_ids={self.pad_ids.tolist()}")
