"""Padding-aware embedding lookups: over an NF4 table (gather packed rows, dequantize only those)
and over a dense table. Pad ids are never gathered; their output rows are zeros."""

from __future__ import annotations

import torch
from torch import nn

from lct.errors import OptionError, TokenIdError
from lct.kernels.nf4 import dequantize_rows
from lct.kernels.registry import QuantizedEmbedding


def masked_gather(ids: torch.Tensor, rows: int, dim: int, pad_ids, gather,
                  scale=None) -> torch.Tensor:
    """The lookup every LCT embedding shares: ``ids`` checked as ``nn.Embedding`` checks them,
    ``gather(kept_ids)`` gives the rows of the ids not in ``pad_ids`` (a pad id gives a zero
    row and is never gathered), then the optional Gemma-style ``scale`` multiplies.

    Returns:
        ``[*ids.shape, dim]``, on the device and in the dtype ``gather`` returns.
    """
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
        raise TokenIdError(f"ids must be in [0, {rows}), got "
                         f"{int(flat.min())}..{int(flat.max())}")  # as nn.Embedding refuses
    keep = None if pad_ids is None or pad_ids.numel() == 0 else ~torch.isin(flat, pad_ids)
    out = gather(flat if keep is None else flat[keep])
    if keep is not None and not bool(keep.all()):
        # index_put, not an in-place write: the gathered rows may carry a gradient.
        out = out.new_zeros(flat.numel(), dim).index_put(
            (keep.nonzero().squeeze(1).to(out.device),), out)
    if scale is not None:
        out = out * scale.to(out.dtype)
    return out.view(*ids.shape, dim)


def padded_lookup(weight: torch.Tensor, ids: torch.Tensor, pad_ids=None) -> torch.Tensor:
    """Dense embedding lookup where ids in ``pad_ids`` give zero rows and are not gathered."""
    return masked_gather(ids, weight.shape[0], weight.shape[1], pad_ids, lambda sel: weight[sel])


class PaddedEmbedding(nn.Embedding):
    """``nn.Embedding`` whose pad ids yield zeros and are never gathered (so they get no gradient)."""

    def __init__(self, num_embeddings, embedding_dim, pad_ids=(), **kw):
        super().__init__(num_embeddings, embedding_dim, **kw)
        self.register_buffer("pad_ids", torch.tensor(sorted(set(pad_ids)), dtype=torch.long),
                             persistent=False)

    def forward(self, ids):
        return padded_lookup(self.weight, ids, self.pad_ids)


class NF4Embedding(QuantizedEmbedding):
    """An embedding table kept in NF4 (bitsandbytes layout); lookups dequantize only the rows used.

    Args:
        packed: uint8 NF4 codes of the [num_embeddings, embedding_dim] table, ``[V*H/2]`` or
            ``[V*H/2, 1]``.
        absmax: float32 ``[V*H/blocksize]``.
        blocksize: must divide ``embedding_dim``.
        dtype: output dtype (the table's source dtype).
        pad_ids: ids that yield zero rows without being gathered.
        scale: optional multiplier applied like Gemma's scaled embedding (``out * scale``).

    The output for every non-pad id is bit-identical to dequantizing the whole table and indexing.
    """

    def __init__(self, packed, absmax, num_embeddings: int, embedding_dim: int, blocksize: int,
                 dtype: torch.dtype, pad_ids=(), scale: torch.Tensor | None = None):
        super().__init__()
        if embedding_dim % blocksize:
            raise OptionError(f"blocksize {blocksize} must divide embedding_dim {embedding_dim}",
                              option="blocksize")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.blocksize, self.dtype = blocksize, dtype
        self.register_buffer("packed", packed.reshape(num_embeddings, embedding_dim // 2))
        self.register_buffer("absmax", absmax.reshape(num_embeddings, embedding_dim // blocksize))
        self.register_buffer("pad_ids", torch.tensor(sorted(set(pad_ids)), dtype=torch.long,
                                                     device=packed.device), persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.gathered_rows = 0   # instrumentation: rows dequantized so far

    @classmethod
    def from_weight(cls, weight, dtype: torch.dtype, pad_ids=(), scale=None) -> NF4Embedding:
        """Over a stored ``NF4Weight`` (``lct.kernels.registry.Kernels``)."""
        rows, cols = weight.shape
        return cls(weight.packed, weight.absmax, rows, cols, weight.blocksize, dtype,
                   pad_ids=pad_ids, scale=scale)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (for code that insists on ``.weight``; costs memory)."""
        return dequantize_rows(self.packed, self.absmax, self.blocksize, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return masked_gather(ids, self.num_embeddings, self.embedding_dim, self.pad_ids,
                             self._gather, self.scale)

    def _gather(self, sel: torch.Tensor) -> torch.Tensor:
        self.gathered_rows += sel.numel()
        return dequantize_rows(self.packed[sel], self.absmax[sel], self.blocksize, self.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, nf4 blocksize={self.blocksize}, "
                f"dtype={self.dtype}, pad_ids={self.pad_ids.tolist()}")
