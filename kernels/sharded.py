"""Quantized vocabulary tables split by rows over a tensor-parallel group: each rank holds its
rows in NF4, int8 or Q8_0 (``NF4Embedding``/``Int8Embedding``/``Q8_0Embedding``, the matching
linears) and the
group completes the result, as transformers' ``embedding_rowwise`` and
``colwise_gather_output`` styles do for dense tables."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lct.errors import TokenIdError


def _collective_dtype(dtype: torch.dtype, group) -> torch.dtype:
    """gloo reduces and gathers no bfloat16: float32 carries it there, exactly."""
    return torch.float32 if dtype == torch.bfloat16 and \
        dist.get_backend(group) == "gloo" else dtype


class ShardedEmbedding(nn.Module):
    """Rows ``[start, end)`` of a vocabulary table on this rank (``local``, a quantized
    embedding); an id outside them gives zeros here, and the sum over the group gives every
    rank the whole lookup. ``scale`` multiplies after the sum (Gemma's scaled embedding)."""

    def __init__(self, local: nn.Module, start: int, end: int, num_embeddings: int,
                 embedding_dim: int, scale: torch.Tensor | None = None, group=None):
        super().__init__()
        self.local, self.start, self.end = local, start, end
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("embed_scale", scale, persistent=False)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise TokenIdError(f"ids must be in [0, {self.num_embeddings}), got "
                             f"{int(ids.min())}..{int(ids.max())}")
        inside = (ids >= self.start) & (ids < self.end)
        out = self.local(torch.where(inside, ids - self.start, 0))
        out = out * inside.unsqueeze(-1).to(out.dtype)
        wire = _collective_dtype(out.dtype, self.group)
        total = out.to(wire)
        dist.all_reduce(total, group=self.group)
        out = total.to(out.dtype)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.end} of {self.num_embeddings}, {self.embedding_dim}"


class GatheredHead(nn.Module):
    """An LM head whose rows (the vocabulary) are split over the group: each rank computes the
    logits of its rows with ``local`` (a quantized linear), and the gather gives every rank all
    of them. ``sizes`` are the rows of every rank, in rank order."""

    def __init__(self, local: nn.Module, sizes: list, group=None):
        super().__init__()
        self.local, self.sizes, self.group = local, list(sizes), group
        self.out_features = sum(self.sizes)
        self.in_features = local.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        wire = _collective_dtype(y.dtype, self.group)
        width = max(self.sizes)
        y_pad = torch.nn.functional.pad(y.to(wire), (0, width - y.shape[-1])).contiguous()
        parts = [torch.empty_like(y_pad) for _ in self.sizes]
        dist.all_gather(parts, y_pad, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, self.sizes)], dim=-1).to(y.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features} over {len(self.sizes)} ranks"
