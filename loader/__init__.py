"""The runtime: an artifact to a ready transformers model. ``entry.load`` (``lct.load``)
dispatches to the streaming loader (``build``: group by group, decoding ``prefetch`` groups
ahead), the tensor-parallel one (``tensor_parallel``) or the device-mapped one (``device_map``);
``source`` is what they share, ``install`` puts decoded groups into a model; the layer-wise executor for models larger than memory
(``layerwise``) and timed generation (``generate``) sit beside them.

May import: ``lct.arch`` (the skeleton and its checkpoint names), ``lct.hub`` (hf:// sources),
``lct.kernels``, ``lct.io``, ``lct.format`` and the leaves.
"""

from lct.io.stream import Group, GroupStream, StreamStats
from lct.loader.entry import load
from lct.loader.source import LoadStats

__all__ = ["load", "LayerwiseModel", "LoadStats", "GroupStream", "Group", "StreamStats"]


def __getattr__(name: str):
    # imported on first use: a plain load needs neither the layer-wise executor nor the
    # routed experts' code it brings (their modules are memory every process keeps)
    if name == "LayerwiseModel":
        from lct.loader.layerwise import LayerwiseModel
        return LayerwiseModel
    raise AttributeError(f"module 'lct.loader' has no attribute {name!r}")
