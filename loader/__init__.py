"""The streaming loader: prefetching group stream, ``lct.load`` and the layer-wise executor."""

from lct.loader.build import LoadStats, load
from lct.loader.layerwise import LayerwiseModel
from lct.io.stream import Group, GroupStream, StreamStats

__all__ = ["load", "LayerwiseModel", "LoadStats", "GroupStream", "Group", "StreamStats"]
