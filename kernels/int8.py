"""Kernels over int8 weights with one float32 scale per row (``lct.format.int8``): the LM head's matmul
(fused in the C extension on the CPU for short inputs, chunked dequantize-and-matmul otherwise and
on a GPU) and the embedding's row gather."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lct.format import constants as C
from lct.kernels.embedding import masked_gather
from lct.kernels.linear import DEFAULT_CHUNK_BYTES, fused_call, quantized_forward


def dequantize_rows(q_rows: torch.Tensor, scale_rows: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None,
                    tmp: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``q_rows`` [k, H] int8 with ``scale_rows`` [k] float32 -> [k, H] of ``dtype``:
    ``q * scale`` in float32, then cast (bit-identical to dequantizing the table and indexing).
    ``out`` (k*H of ``dtype``) and ``tmp`` (k*H float32) are written into if given."""
    shape = q_rows.shape
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=q_rows.device)
    out = out.view(shape)
    f32 = out if dtype == torch.float32 else (
        tmp.view(shape) if tmp is not None else torch.empty(shape, device=q_rows.device))
    # Widen, scale and round as three same-dtype passes: torch's mixed int8 x float32 multiply
    # is 5x slower on the CPU than this.
    f32.copy_(q_rows)
    f32.mul_(scale_rows.to(torch.float32).unsqueeze(1))
    if f32 is not out:
        out.copy_(f32)
    return out


def use_fused(rows: int) -> bool:
    """Whether a CPU int8 matmul over ``rows`` input rows takes the fused kernel (built, and
    few enough rows that reading codes per row beats one dequantize for all)."""
    from lct.kernels import native
    return native.available() and 0 < rows <= C.INT8_FUSED_MAX_ROWS


def fused_int8_matmul(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """``x2 [M, K] @ (q * scale).T`` through the compiled kernel: codes widened to float32 in
    registers, float32 sums, each row's scale applied once, ``out_dtype`` (bfloat16 or float32)
    written once. Uses torch's intra-op thread count."""
    from lct.kernels import native
    m, k = x2.shape
    n = q.shape[0]
    return fused_call(x2, n, out_dtype, lambda x, xb, out, ob: native.int8_matmul(
        x, xb, q.contiguous().view(torch.uint8).numpy(), scale.float().contiguous().numpy(),
        out, ob, (m, n, k), torch.get_num_threads()))


class Int8Linear(nn.Module):
    """``y = x @ W.T`` with ``W`` [out_features, in_features] kept as int8 codes and one float32
    scale per output row.

    Args:
        q: int8 codes [out_features, in_features]; scale: float32 [out_features].
        dtype: the weight's dtype when dequantized (and the output's, with an input of it).
        chunk_rows: output rows dequantized at a time on the chunked path (default: as many
            as fit in ``DEFAULT_CHUNK_BYTES`` of ``dtype``).
    """

    def __init__(self, q, scale, dtype: torch.dtype, bias: torch.Tensor | None = None,
                 chunk_rows: int | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.dtype = dtype
        self.chunk_rows = chunk_rows or max(1, DEFAULT_CHUNK_BYTES // (self.in_features
                                                                         * dtype.itemsize))
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.reshape(-1))
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight dequantized (costs memory; forward never builds it)."""
        return dequantize_rows(self.q, self.scale, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_forward(self, x, lambda rows: not x.is_cuda and use_fused(rows),
                                 lambda x2, odt: fused_int8_matmul(x2, self.q, self.scale, odt))

    def _chunked(self, x2: torch.Tensor, odt: torch.dtype) -> torch.Tensor:
        """Dequantize ``chunk_rows`` rows at a time and multiply: the path for many input rows,
        and the GPU path (torch kernels on any device)."""
        out = x2.new_empty(x2.shape[0], self.out_features, dtype=odt)
        # One scratch buffer for every chunk: fresh pages cost more than the dequantize.
        size = min(self.chunk_rows, self.out_features) * self.in_features
        scratch = torch.empty(size, dtype=odt, device=x2.device)
        tmp = None if odt == torch.float32 else torch.empty(size, device=x2.device)
        for r0 in range(0, self.out_features, self.chunk_rows):
            r1 = min(self.out_features, r0 + self.chunk_rows)
            n = (r1 - r0) * self.in_features
            w = dequantize_rows(self.q[r0:r1], self.scale[r0:r1], odt, out=scratch[:n],
                                tmp=None if tmp is None else tmp[:n])
            out[:, r0:r1] = F.linear(x2.to(odt), w,
                                     None if self.bias is None else self.bias[r0:r1])
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per "
                f"row, chunk_rows={self.chunk_rows}")


class Int8Embedding(nn.Module):
    """An embedding table kept as int8 codes with one float32 scale per row; a lookup
    dequantizes only the rows it gathers (bit-identical to dequantizing the table and indexing).

    Args:
        q: int8 [num_embeddings, embedding_dim]; scale: float32 [num_embeddings].
        dtype: output dtype (the table's source dtype).
        pad_ids: ids that yield zero rows without being gathered.
        scale_by: optional multiplier applied like Gemma's scaled embedding.
    """

    def __init__(self, q, scale, dtype: torch.dtype, pad_ids=(),
                 scale_by: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.dtype = dtype
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.reshape(-1))
        self.register_buffer("pad_ids", torch.tensor(sorted(set(pad_ids)), dtype=torch.long,
                                                     device=q.device), persistent=False)
        self.register_buffer("embed_scale", scale_by, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (for code that insists on ``.weight``; costs memory)."""
        return dequantize_rows(self.q, self.scale, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return masked_gather(
            ids, self.num_embeddings, self.embedding_dim, self.pad_ids,
            lambda sel: dequantize_rows(self.q[sel], self.scale[sel], self.dtype), self.embed_scale)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, int8 per row, "
                f"dtype={self.dtype}, pad_ids={self.pad_ids.tolist()}")
