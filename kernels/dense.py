"""The dense LM head's kernel: ``FlatLinear``, which every load makes of a plain ``nn.Linear``
head (``flatten_head``). Kept apart from the encodings' kernels so that a load of plain weights
imports only this module of ``lct.kernels``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


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
