"""Which torch modules compute on each lossy encoding: the kernels' side of the encoding registry
(``lct.format.encodings``), keyed by the encoding's name. Each kernel module registers the
constructors of its modules (``register_kernels``), as an encoding registers its class; the
loader asks ``kernels_for`` (through ``lct.kernels.embedding_for`` and ``linear_for``) and
builds no module of its own per encoding. An encoding nobody registered kernels for loads
dequantized, into the model's own module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class Kernels:
    """The constructors of an encoding's modules over a stored weight (the encoding's
    ``weight`` class, its tensors used as they are, no copy):

    - ``embedding(weight, dtype, pad_ids=(), scale=None)``: the lookup, ``dtype`` out, the
      ``pad_ids`` giving zero rows without being gathered, ``scale`` a multiplier as Gemma's
      scaled embedding (a module with ``num_embeddings``, ``embedding_dim`` and ``weight``,
      the whole table dequantized, best a ``QuantizedEmbedding``);
    - ``linear(weight, dtype, bias=None)``: the LM head, ``y = x @ W.T + bias``.
    """

    embedding: Callable
    linear: Callable


class QuantizedEmbedding(nn.Module):
    """What every embedding over a lossy encoding is (``num_embeddings``, ``embedding_dim``,
    ``dtype`` and ``weight``, the whole table dequantized): a Maximus embedding takes one as it
    takes an ``nn.Embedding``."""


_KERNELS: dict[str, Kernels] = {}


def register_kernels(encoding: str, *, embedding: Callable, linear: Callable) -> None:
    """Make ``embedding`` and ``linear`` (see ``Kernels``) the modules the loader builds over a
    stored weight of ``encoding`` (a name of ``lct.format.encodings``' registry); a second
    registration replaces the first.

    Example:
        >>> register_kernels("q8_0", embedding=Q8_0Embedding.from_weight,
        ...                  linear=Q8_0Linear.from_weight)
    """
    _KERNELS[encoding] = Kernels(embedding, linear)


def unregister_kernels(encoding: str) -> None:
    """Take back the kernels registered for ``encoding`` (a plugin's or a test's)."""
    _KERNELS.pop(encoding, None)


def kernels_for(encoding: str) -> Kernels | None:
    """The kernels registered for ``encoding``, or None (its tables load dequantized)."""
    return _KERNELS.get(encoding)
