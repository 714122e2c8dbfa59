"""LCT: Layer-wise Compressed Tensor format, converter and loader.

Reading a manifest needs only the standard library, numpy, zstandard and xxhash; torch,
safetensors and huggingface_hub are imported where they are needed.

Layers, bottom to top. A module imports only its own layer and those below, and nothing imports
in a cycle; tests/test_layers.py walks every import (those inside functions too) to keep it so:

    leaves      lct.errors, lct.units, lct.proc, lct.hashing, lct.compat, lct._version
    format      lct.format
    io          lct.io
    kernels     lct.kernels
    hub         lct.hub
    cloud       lct.cloud
    arch        lct.arch
    loader      lct.loader
    conversion  lct.conversion
    plan        lct.plan
    demo        lct.demo
    cli         lct.cli, lct.__main__
    api         lct

``format`` is what an artifact is byte for byte; ``io`` reads and writes artifacts; ``kernels``
are the torch modules that compute on LCT's encodings; ``hub`` speaks to the Hugging Face Hub
(addresses, pull, push, model cards, range reads); ``cloud`` does the same with object stores
(``s3://``, ``gs://``, ``az://``); ``arch`` is what transformers knows about an
architecture (stacks, embeddings, ties, experts, checkpoint renames); ``loader`` builds ready
models; ``conversion`` turns checkpoints into artifacts and back and measures what that costs;
``plan`` is the memory planner; ``demo`` builds tiny models; ``cli`` is the ``lct`` command; ``lct`` itself is the API.
The leaves are helpers every layer may use; ``lct.compat`` holds each private API of another
library that LCT calls, behind one wrapper.

Example:
    >>> import lct
    >>> lct.convert("google/gemma-2b", "gemma-2b.lct")
    >>> with lct.open("gemma-2b.lct") as art:
    ...     print(art.groups)
"""

import logging as _logging

from lct._version import __version__

# Module loggers live under "lct" and are silent unless the program configures logging (or
# `lct -v` does), as huggingface_hub's are.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = ["__version__", "open", "convert", "export", "verify", "load", "LoadStats", "Policy",
           "NF4Weight", "Int8Weight", "Int8B128Weight", "Q8_0Weight", "Q6_KWeight"]


def open(path, *, verify: bool = True, workers=None, stream: bool = False):  # noqa: A001
    """Open an LCT artifact to read its tensors without building a model.

    Args:
        path: the artifact folder, ``hf://org/name[@revision]`` (pulled into the Hugging
            Face cache and its files checked, or with ``stream=True`` read chunk by chunk by
            HTTP range requests), or an object store's ``s3://``, ``gs://`` or
            ``az://bucket/prefix`` (always read chunk by chunk).
        verify: check every chunk's checksum as it is read (a mismatch is a ``ChecksumError``
            naming the chunk).
        workers: decode threads (default: all cores).
        stream: for ``hf://``, fetch chunks on demand instead of pulling the files.

    Returns:
        An ``Artifact``: ``.manifest``, ``.groups``, ``read_group(name)``,
        ``read_tensor(name)``, ``stream(prefetch=2)`` (groups decoded ahead). Close it, or use
        ``with``, to release its threads and mappings.

    Example:
        >>> with lct.open("gemma-2b.lct") as art:
        ...     for group in art.stream(prefetch=2):
        ...         print(group.name, list(group.tensors))
    """
    from lct.loader.source import open_source
    return open_source(path, verify=verify, workers=workers, stream=stream)


# The API's functions and classes are their modules' own (``help(lct.convert)`` shows every
# option), imported on first use so that ``import lct`` stays light.
_API = {
    "convert": "lct.conversion.converter",    # Hugging Face checkpoint -> artifact
    "export": "lct.conversion.exporter",      # artifact -> Hugging Face folder
    "verify": "lct.conversion.verifier",      # checksums, and tensors against the source
    "load": "lct.loader.entry",               # artifact -> ready model (TP and device maps too)
    "LoadStats": "lct.loader.source",         # load(..., stats=LoadStats()): time and bytes
    "Policy": "lct.conversion.converter",
    # what read_tensor(..., dequantize=False) returns for each lossy encoding
    "NF4Weight": "lct.format.encodings",
    "Int8Weight": "lct.format.encodings",
    "Int8B128Weight": "lct.format.encodings",
    "Q8_0Weight": "lct.format.encodings",
    "Q6_KWeight": "lct.format.encodings",
}


def __getattr__(name):
    if name in _API:
        import importlib
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lct' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_API))
