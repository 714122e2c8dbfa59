"""The streaming loader: prefetching group stream, ``lct.load`` and the layer-wise executor."""

from .build import LoadStats, load
from .stream import Group, GroupStream, StreamStats

__all__ = ["load", "LoadStats", "GroupStream", "Group", "StreamStats"]
