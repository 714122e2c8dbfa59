"""Kernels over int8 weights with one float32 scale per row, or per block of a row (``int8_b128``;
``lct.format.int8``): the LM head's matmul (on the CPU the compiled fused or tiled kernel or the
chunked dequantize-and-matmul, whichever ``kernels/paths.py`` measures fastest; chunked on a
GPU) and the embedding's row gather. The scales' shape says which: ``[rows]`` per row, ``[rows,
cols / block]`` per block."""

from __future__ import annotations

import torch

from lct.format import constants as C
from lct.kernels.embedding import masked_gather
from lct.kernels.linear import DEFAULT_CHUNK_BYTES, QuantizedLinear
from lct.kernels.registry import QuantizedEmbedding, register_kernels


def dequantize_rows(q_rows: torch.Tensor, scale_rows: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None,
                    tmp: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``q_rows`` [k, H] int8 with ``scale_rows`` [k] float32 (per block: [k, H / block])
    -> [k, H] of ``dtype``: ``q * scale`` in float32, then cast (bit-identical to dequantizing
    the table and indexing). ``out`` (k*H of ``dtype``) and ``tmp`` (k*H float32) are written
    into if given."""
    shape = q_rows.shape
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=q_rows.device)
    out = out.view(shape)
    f32 = out if dtype == torch.float32 else (
        tmp.view(shape) if tmp is not None else torch.empty(shape, device=q_rows.device))
    # Widen, scale and round as three same-dtype passes: torch's mixed int8 x float32 multiply
    # is 5x slower on the CPU than this.
    f32.copy_(q_rows)
    s = scale_rows.to(torch.float32).reshape(shape[0], -1)
    f32.view(shape[0], s.shape[1], -1).mul_(s.unsqueeze(2))
    if f32 is not out:
        out.copy_(f32)
    return out


def _scales(q, scale) -> tuple:
    """``(block, scale)`` of int8 codes ``q`` [rows, cols]: the values per scale, cols (one per
    row) or a block size dividing it, and the scales shaped as the kernels read them ([rows] or
    [rows, cols / block]); ``OptionError`` for scales that fit neither."""
    rows, cols = q.shape
    per_row = scale.numel() // rows if rows else 1
    if per_row * rows != scale.numel() or not per_row or cols % per_row:
        from lct.errors import OptionError
        raise OptionError(f"int8 scales {tuple(scale.shape)} fit neither one per row nor whole "
                          f"blocks of rows of {cols} codes ({rows} rows)", option="scale")
    block = cols // per_row
    return block, scale.reshape(rows, -1) if block != cols else scale.reshape(-1)


def _encoding(block: int, cols: int) -> str:
    return C.ENCODING_INT8 if block == cols else C.ENCODING_INT8_B128


class Int8Linear(QuantizedLinear):
    """``y = x @ W.T`` with ``W`` [out_features, in_features] kept as int8 codes and one float32
    scale per output row, or per block of a row.

    Args:
        q: int8 codes [out_features, in_features]; scale: float32 [out_features], or
            [out_features, in_features / block] (``int8_b128``).
        dtype: the weight's dtype when dequantized (and the output's, with an input of it).
        chunk_rows: output rows dequantized at a time on the chunked path (default: as many
            as fit in ``DEFAULT_CHUNK_BYTES`` of ``dtype``).
    """

    encoding = C.ENCODING_INT8

    def __init__(self, q, scale, dtype: torch.dtype, bias: torch.Tensor | None = None,
                 chunk_rows: int | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.block, scale = _scales(q, scale)
        self.encoding = _encoding(self.block, self.in_features)   # the path chooser's key
        self.dtype = dtype
        self.chunk_rows = chunk_rows or max(1, DEFAULT_CHUNK_BYTES // (self.in_features
                                                                         * dtype.itemsize))
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.bias = bias

    @classmethod
    def from_weight(cls, weight, dtype: torch.dtype, bias=None) -> Int8Linear:
        """Over a stored ``Int8Weight`` (``lct.kernels.registry.Kernels``)."""
        return cls(weight.q, weight.scale, dtype, bias=bias)

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight dequantized (costs memory; forward never builds it)."""
        return dequantize_rows(self.q, self.scale, self.dtype)

    def _dequantizer(self, dtype, elements, device):
        tmp = None if dtype == torch.float32 else torch.empty(elements, device=device)
        return lambda r0, r1, out: dequantize_rows(
            self.q[r0:r1], self.scale[r0:r1], dtype, out=out,
            tmp=None if tmp is None else tmp[:out.numel()])

    def _native(self, path, x, xb, out, ob, r0, r1, w_bf16):
        """Codes and scales as they are: per row, the codes are exact in bfloat16, so the tiled
        kernel keeps them so and scales each row's float32 sum once; per block it forms each
        weight ``q * scale`` as the chunked path does."""
        from lct.kernels import native
        q = self.q[r0:r1].contiguous().view(torch.uint8).numpy()
        scale = self.scale[r0:r1].float().contiguous().reshape(-1).numpy()
        shape = (x.shape[0], r1 - r0, self.in_features)
        threads = torch.get_num_threads()
        if path == "fused":
            native.int8_matmul(x, xb, q, scale, out, ob, shape, threads, block=self.block)
        else:
            native.tiled_matmul("int8", x, xb, q, scale, None, out, ob, shape, self.block,
                                w_bf16, threads)

    def extra_repr(self) -> str:
        per = "row" if self.block == self.in_features else f"{self.block} values"
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per "
                f"{per}, chunk_rows={self.chunk_rows}")


class Int8Embedding(QuantizedEmbedding):
    """An embedding table kept as int8 codes with one float32 scale per row (or per block of a
    row); a lookup dequantizes only the rows it gathers (bit-identical to dequantizing the table
    and indexing).

    Args:
        q: int8 [num_embeddings, embedding_dim]; scale: float32 [num_embeddings], or
            [num_embeddings, embedding_dim / block].
        dtype: output dtype (the table's source dtype).
        pad_ids: ids that yield zero rows without being gathered.
        scale_by: optional multiplier applied like Gemma's scaled embedding.
    """

    def __init__(self, q, scale, dtype: torch.dtype, pad_ids=(),
                 scale_by: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.block, scale = _scales(q, scale)
        self.dtype = dtype
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("pad_ids", torch.tensor(sorted(set(pad_ids)), dtype=torch.long,
                                                     device=q.device), persistent=False)
        self.register_buffer("embed_scale", scale_by, persistent=False)

    @classmethod
    def from_weight(cls, weight, dtype: torch.dtype, pad_ids=(), scale=None) -> Int8Embedding:
        """Over a stored ``Int8Weight`` (``lct.kernels.registry.Kernels``)."""
        return cls(weight.q, weight.scale, dtype, pad_ids=pad_ids, scale_by=scale)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (for code that insists on ``.weight``; costs memory)."""
        return dequantize_rows(self.q, self.scale, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return masked_gather(
            ids, self.num_embeddings, self.embedding_dim, self.pad_ids,
            lambda sel: dequantize_rows(self.q[sel], self.scale[sel], self.dtype), self.embed_scale)

    def extra_repr(self) -> str:
        per = "row" if self.block == self.embedding_dim else f"{self.block} values"
        return (f"{self.num_embeddings}, {self.embedding_dim}, int8 per {per}, "
                f"dtype={self.dtype}, pad_ids={self.pad_ids.tolist()}")


# The scales' shape tells the modules which of the two a weight is.
for _encoding_name in (C.ENCODING_INT8, C.ENCODING_INT8_B128):
    register_kernels(_encoding_name, embedding=Int8Embedding.from_weight,
                     linear=Int8Linear.from_weight)
