"""Runtime kernels: the torch modules that compute on LCT's encodings. NF4, int8, Q8_0 and Q6_K
dequantization, NF4, int8, Q8_0, Q6_K and padding-aware embedding lookups, the NF4, int8, Q8_0
and Q6_K LM heads (``QuantizedLinear``, their CPU path measured per input size by ``paths``),
``MaximusEmbedding`` (with saving and restoring its shard state), and quantized tables split
by rows over a tensor-parallel group (``sharded``). The heads' CPU matmuls, fused and tiled,
are the kernels' own compiled loops (``native``, over ``_native.c``). Which modules compute on
which encoding is the kernels' registry (``registry``: each kernel module registers its own
under the encoding's name), which ``embedding_for`` and ``linear_for`` ask.

May import: ``lct.format`` (the codecs, the format's native loops and their ``LCT_NATIVE``
switch, the Maximus state file) and the leaves.
"""

if __name__ == "kernels":
    # This folder is lct.kernels. Only a checkout's root on sys.path (``python -m pytest`` or
    # ``python -m lct`` run there) makes it importable as a top-level ``kernels``, where it
    # shadows the ``kernels`` distribution that transformers imports (its hub kernels): load
    # that one in this module's place. Without the distribution this module stays what it is
    # (transformers, finding no version, takes it for no hub kernels).
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys
    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root])
    if _spec is not None:
        _real = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _real     # what `import kernels` returns once this body ends
        _spec.loader.exec_module(_real)

from lct.kernels.blocks import Q6_KEmbedding, Q6_KLinear, Q8_0Embedding, Q8_0Linear
from lct.kernels.embedding import NF4Embedding, PaddedEmbedding, padded_lookup
from lct.kernels.int8 import Int8Embedding, Int8Linear
from lct.kernels.linear import FlatLinear, NF4Linear, QuantizedLinear, flatten_head
from lct.kernels.maximus import (
                                 MaximusEmbedding,
                                 MaximusPolicy,
                                 MaximusStats,
                                 load_maximus_state,
                                 save_maximus_state,
)
from lct.kernels.nf4 import dequantize, dequantize_rows
from lct.kernels.registry import (QuantizedEmbedding, kernels_for, register_kernels,
                                  unregister_kernels)

__all__ = ["FlatLinear", "Int8Embedding", "Int8Linear", "flatten_head", "MaximusEmbedding",
           "MaximusPolicy", "MaximusStats", "NF4Embedding", "NF4Linear", "PaddedEmbedding",
           "padded_lookup", "Q6_KEmbedding", "Q6_KLinear", "Q8_0Embedding", "Q8_0Linear",
           "QuantizedLinear",
           "QuantizedEmbedding", "dequantize", "dequantize_rows", "embedding_for", "has_kernels",
           "kernels_for", "linear_for", "load_maximus_state", "register_kernels",
           "save_maximus_state", "unregister_kernels"]


def embedding_for(weight, dtype, pad_ids=(), scale=None):
    """The embedding module over a stored lossy ``weight`` (``lct.format.encodings``'
    ``NF4Weight``, ``Int8Weight``, a ``BlocksWeight`` or another registered encoding's; its
    tensors as they are, no copy), as the kernels registered for its encoding build it
    (``register_kernels``): ``dtype`` out, ``pad_ids`` looked up as zero rows, ``scale`` a
    multiplier as Gemma's scaled embedding.

    Raises:
        OptionError: no kernels are registered for the weight's encoding (``has_kernels``).
    """
    return _kernels(weight).embedding(weight, dtype, pad_ids=pad_ids, scale=scale)


def linear_for(weight, dtype, bias=None):
    """The LM head module (``y = x @ W.T + bias``) over a stored lossy ``weight``, as the
    kernels registered for its encoding build it."""
    return _kernels(weight).linear(weight, dtype, bias=bias)


def has_kernels(encoding: str) -> bool:
    """Whether modules compute on ``encoding`` as it is stored (else its tables load
    dequantized)."""
    return kernels_for(encoding) is not None


def _kernels(weight):
    k = kernels_for(weight.encoding)
    if k is None:
        from lct.errors import OptionError
        raise OptionError(f"{weight.name}: no kernels are registered for encoding "
                          f"{weight.encoding!r}; load with nf4='dequantize'", option="nf4")
    return k
