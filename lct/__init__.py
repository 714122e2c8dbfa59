"""LCT: Layer-wise Compressed Tensor format, converter and loader.

Reading a manifest needs only the standard library, numpy, zstandard and xxhash; torch,
safetensors and huggingface_hub are imported where they are needed.

Layers, bottom to top. A module imports only its own layer and those below, and nothing imports
in a cycle; tests/test_layers.py walks every import (those inside functions too) to keep it so:

    leaves      lct.errors, lct.units, lct.proc, lct.hashing, lct._version
    format      lct.format
    io          lct.io
    kernels     lct.kernels
    hub         lct.hub
    loader      lct.loader
    conversion  lct.conversion
    plan        lct.plan
    demo        lct.demo
    cli         lct.cli, lct.__main__
    api         lct

``format`` is what an artifact is byte for byte; ``io`` reads and writes artifacts; ``kernels``
are the torch modules that compute on LCT's encodings; ``hub`` speaks to the Hugging Face Hub
(addresses, pull, push, model cards, range reads); ``loader`` builds ready models; ``conversion``
turns checkpoints into artifacts and back and measures what that costs; ``plan`` is the memory
planner; ``demo`` builds tiny models; ``cli`` is the ``lct`` command; ``lct`` itself is the API.

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

__all__ = ["__version__", "open", "convert", "export", "verify", "load", "Policy", "NF4Weight",
           "Int8Weight"]


def open(path, *, verify: bool = True, workers=None, stream: bool = False):  # noqa: A001
    """Open an LCT artifact (a folder, or ``hf://org/name[@revision]``, pulled and verified or
    with ``stream=True`` read by HTTP range requests); see ``lct.loader.source.open_source``
    and ``lct.io.reader.open_artifact``."""
    from lct.loader.source import open_source
    return open_source(path, verify=verify, workers=workers, stream=stream)


def convert(source, out, **kwargs):
    """Convert a Hugging Face checkpoint; see ``lct.conversion.converter.convert``."""
    from lct.conversion.converter import convert as _convert
    return _convert(source, out, **kwargs)


def export(artifact, out_dir, **kwargs):
    """Export an artifact to a Hugging Face folder; see ``lct.conversion.exporter.export``."""
    from lct.conversion.exporter import export as _export
    return _export(artifact, out_dir, **kwargs)


def verify(artifact, **kwargs):
    """Verify an artifact's checksums (and against its source); see ``lct.conversion.verifier.verify``."""
    from lct.conversion.verifier import verify as _verify
    return _verify(artifact, **kwargs)


def load(path, prefetch: int = 2, device="cpu", dtype=None, nf4: str = "keep", workers=None,
         stream: bool = False, **kwargs):
    """Load an artifact into a ready transformers model; see ``lct.loader.entry.load`` (and
    ``lct.loader.build.load`` for the streaming options).

    ``path`` may be ``hf://org/name[@revision]``: pulled from the Hub and verified, or with
    ``stream=True`` its chunks are fetched by HTTP range requests as they load.
    ``maximus=True`` (or a budget in shards) installs a ``MaximusEmbedding`` from the artifact's
    shard state."""
    from lct.loader import load as _load
    return _load(path, prefetch=prefetch, device=device, dtype=dtype, nf4=nf4, workers=workers,
                 stream=stream, **kwargs)


def __getattr__(name):
    if name == "Policy":
        from lct.conversion.converter import Policy
        return Policy
    if name in ("NF4Weight", "Int8Weight"):
        from lct.io import reader
        return getattr(reader, name)
    raise AttributeError(f"module 'lct' has no attribute {name!r}")
