"""The runtime: an artifact to a ready transformers model (``build``: ``lct.load``, streamed
group by group with decoding ``prefetch`` groups ahead), the layer-wise executor for models
larger than memory (``layerwise``), and timed generation (``generate``).

May import: ``lct.hub`` (hf:// sources), ``lct.kernels``, ``lct.io``, ``lct.format`` and the
leaves.
"""

from lct.io.stream import Group, GroupStream, StreamStats
from lct.loader.build import LoadStats, load
from lct.loader.layerwise import LayerwiseModel

__all__ = ["load", "LayerwiseModel", "LoadStats", "GroupStream", "Group", "StreamStats"]
