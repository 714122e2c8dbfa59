"""Runtime kernels: the torch modules that compute on LCT's encodings. NF4, int8, Q8_0 and Q6_K
dequantization, NF4, int8, Q8_0, Q6_K and padding-aware embedding lookups, the NF4, int8, Q8_0
and Q6_K LM heads (``QuantizedLinear``, their CPU path measured per input size by ``paths``),
``MaximusEmbedding`` (with saving and restoring its shard state), and quantized tables split
by rows over a tensor-parallel group (``sharded``), and the dense LM head's ``FlatLinear``
(``dense``). The modules are imported on first use of a name: a load of plain weights imports
``dense`` alone. The heads' CPU matmuls, fused and tiled, are the kernels' own compiled loops
(``native``, over ``_native.c``). Which modules compute on which encoding is the kernels'
registry (``registry``: each kernel module registers its own under the encoding's name), which
``embedding_for`` and ``linear_for`` ask.

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

import importlib

# Where each public name lives. The package imports its modules on first use (PEP 562): a load
# of plain weights needs only ``dense`` (the LM head's ``FlatLinear``), and the encodings'
# kernels are over 0.3 MB of a process's memory (docs/BENCHMARKS.md, peak RSS).
_HOMES = {
    "Q6_KEmbedding": "blocks", "Q6_KLinear": "blocks", "Q8_0Embedding": "blocks",
    "Q8_0Linear": "blocks",
    "FlatLinear": "dense", "flatten_head": "dense",
    "NF4Embedding": "embedding", "PaddedEmbedding": "embedding", "padded_lookup": "embedding",
    "Int8Embedding": "int8", "Int8Linear": "int8",
    "NF4Linear": "linear", "QuantizedLinear": "linear",
    "MaximusEmbedding": "maximus", "MaximusPolicy": "maximus", "MaximusStats": "maximus",
    "load_maximus_state": "maximus", "save_maximus_state": "maximus",
    "dequantize": "nf4", "dequantize_rows": "nf4",
    "QuantizedEmbedding": "registry", "register_kernels": "registry",
    "unregister_kernels": "registry",
}
__all__ = sorted([*_HOMES, "embedding_for", "has_kernels", "kernels_for", "linear_for"])


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lct.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lct.kernels.{home}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


def _registered():
    """The registry, once every module of the package is imported (those that register kernels
    for an encoding do so as they are imported; no second list of them to keep)."""
    for home in sorted(set(_HOMES.values())):
        importlib.import_module(f"lct.kernels.{home}")
    from lct.kernels import registry
    return registry


def kernels_for(encoding: str):
    """The ``Kernels`` registered for ``encoding`` (``lct.kernels.registry``), or ``None``."""
    return _registered().kernels_for(encoding)


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
