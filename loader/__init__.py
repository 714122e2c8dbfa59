"""The streaming loader: prefetching group stream, ``lct.load`` and the layer-wise executor."""

from .build import LoadStats, load
from .layerwise import LayerwiseModel
from .stream import Group, GroupStream, StreamStats

__all__ = ["load", "LayerwiseModel", "LoadStats", "GroupStream", "Group", "StreamStats"]
