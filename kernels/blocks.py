"""Kernels over llama.cpp's block encodings, Q8_0 and Q6_K (``lct.format.q8_0``, ``lct.format.q6_k``:
rows of self-contained blocks, each its codes and scales): the LM head's matmul (on the CPU the
compiled fused or tiled kernel or the chunked dequantize-and-matmul, whichever
``kernels/paths.py`` measures fastest; chunked on a GPU) and the embedding's row gather. One
class of each per encoding, which names it: its label, block geometry and codec are the
encoding's own (``lct.format.encodings``), its compiled kernels ``native``'s of its name."""

from __future__ import annotations

import torch
from lct.kernels.embedding import masked_gather
from lct.kernels.linear import DEFAULT_CHUNK_BYTES, QuantizedLinear
from lct.kernels.registry import QuantizedEmbedding, register_kernels

from lct.format import constants as C
from lct.format.encodings import get_encoding


class _OfEncoding:
    """A class attribute that is the registered encoding's attribute of the same name."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner):
        return getattr(owner._format(), self.name)


class _Blocks:
    """What a block encoding's modules know of it: its name (``encoding``); the rest, its label,
    block geometry and codec, is the registered encoding's (``lct.format.encodings``)."""

    encoding: str = ""
    label, block, block_bytes = _OfEncoding(), _OfEncoding(), _OfEncoding()

    @classmethod
    def _format(cls):
        return get_encoding(cls.encoding)

    @classmethod
    def _cols(cls, blocks) -> int:
        return blocks.shape[1] // cls.block_bytes * cls.block

    def dequantize_rows(self, blocks: torch.Tensor, dtype: torch.dtype,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``blocks`` [k, row bytes] (uint8) -> [k, K] of ``dtype`` (into ``out``, k*K
        of ``dtype``, if given): bit-identical to dequantizing the table and indexing (the
        codec's compiled loop if built)."""
        return self._format().codec().dequantize(blocks, (blocks.shape[0], self._cols(blocks)),
                                                 dtype, out=out)


class BlocksLinear(_Blocks, QuantizedLinear):
    """``y = x @ W.T`` with ``W`` [out_features, in_features] kept as blocks of the subclass's
    encoding.

    Args:
        blocks: uint8 [out_features, in_features / block * block_bytes].
        dtype: the weight's dtype when dequantized (and the output's, with an input of it).
        chunk_rows: output rows dequantized at a time on the chunked path (default: as many
            as fit in ``DEFAULT_CHUNK_BYTES`` of ``dtype``).
    """

    def __init__(self, blocks, dtype: torch.dtype, bias: torch.Tensor | None = None,
                 chunk_rows: int | None = None):
        super().__init__()
        self.out_features = blocks.shape[0]
        self.in_features = self._cols(blocks)
        self.dtype = dtype
        self.chunk_rows = chunk_rows or max(1, DEFAULT_CHUNK_BYTES // (self.in_features
                                                                         * dtype.itemsize))
        self.register_buffer("blocks", blocks)
        self.bias = bias

    @property
    def compiled(self) -> bool:
        """Whether ``native`` has this encoding's fused and tiled loops (Q8_0's, Q6_K's); a block
        encoding without them takes the chunked path, over its codec."""
        from lct.kernels import native
        return self.encoding in native.TILED_KINDS

    @classmethod
    def from_weight(cls, weight, dtype: torch.dtype, bias=None) -> BlocksLinear:
        """Over a stored ``BlocksWeight`` (``lct.kernels.registry.Kernels``)."""
        return cls(weight.blocks, dtype, bias=bias)

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight dequantized (costs memory; forward never builds it)."""
        return self.dequantize_rows(self.blocks, self.dtype)

    def _dequantizer(self, dtype, elements, device):
        return lambda r0, r1, out: self.dequantize_rows(self.blocks[r0:r1], dtype, out=out)

    def _native(self, path, x, xb, out, ob, r0, r1, w_bf16):
        from lct.kernels import native
        blocks = self.blocks[r0:r1].contiguous().numpy()
        shape = (x.shape[0], r1 - r0, self.in_features)
        threads = torch.get_num_threads()
        if path == "fused":
            native.blocks_matmul(self.encoding, x, xb, blocks, out, ob, shape, threads)
        else:
            native.tiled_matmul(self.encoding, x, xb, blocks, None, None, out, ob, shape, 0,
                                w_bf16, threads)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.label}, chunk_rows={self.chunk_rows}")


class BlocksEmbedding(_Blocks, QuantizedEmbedding):
    """An embedding table kept as blocks of the subclass's encoding; a lookup dequantizes only
    the rows it gathers (bit-identical to dequantizing the table and indexing).

    Args:
        blocks: uint8 [num_embeddings, embedding_dim / block * block_bytes].
        dtype: output dtype (the table's source dtype).
        pad_ids: ids that yield zero rows without being gathered.
        scale_by: optional multiplier applied like Gemma's scaled embedding.
    """

    def __init__(self, blocks, dtype: torch.dtype, pad_ids=(),
                 scale_by: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = self._cols(blocks)
        self.dtype = dtype
        self.register_buffer("blocks", blocks)
        self.register_buffer("pad_ids", torch.tensor(sorted(set(pad_ids)), dtype=torch.long,
                                                     device=blocks.device), persistent=False)
        self.register_buffer("embed_scale", scale_by, persistent=False)

    @classmethod
    def from_weight(cls, weight, dtype: torch.dtype, pad_ids=(), scale=None) -> BlocksEmbedding:
        """Over a stored ``BlocksWeight`` (``lct.kernels.registry.Kernels``)."""
        return cls(weight.blocks, dtype, pad_ids=pad_ids, scale_by=scale)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (for code that insists on ``.weight``; costs memory)."""
        return self.dequantize_rows(self.blocks, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return masked_gather(ids, self.num_embeddings, self.embedding_dim, self.pad_ids,
                             lambda sel: self.dequantize_rows(self.blocks[sel], self.dtype),
                             self.embed_scale)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self.label}, dtype={self.dtype}, "
                f"pad_ids={self.pad_ids.tolist()}")


class Q8_0Linear(BlocksLinear):
    """The LM head over Q8_0 blocks (per 32 values a float16 scale and 32 int8 codes)."""

    encoding = C.ENCODING_Q8_0


class Q8_0Embedding(BlocksEmbedding):
    """An embedding table of Q8_0 blocks."""

    encoding = C.ENCODING_Q8_0


class Q6_KLinear(BlocksLinear):
    """The LM head over Q6_K blocks (per 256 values 6-bit codes, 16 int8 scales, a float16
    scale)."""

    encoding = C.ENCODING_Q6_K


class Q6_KEmbedding(BlocksEmbedding):
    """An embedding table of Q6_K blocks."""

    encoding = C.ENCODING_Q6_K


for _embedding, _linear in ((Q8_0Embedding, Q8_0Linear), (Q6_KEmbedding, Q6_KLinear)):
    register_kernels(_linear.encoding, embedding=_embedding.from_weight,
                     linear=_linear.from_weight)
