"""Runtime kernels: the torch modules that compute on LCT's encodings. NF4, int8 and Q8_0
dequantization, NF4, int8, Q8_0 and padding-aware embedding lookups, the NF4, int8 and Q8_0 LM
heads, and
``MaximusEmbedding`` (with saving and restoring its shard state), and quantized tables split
by rows over a tensor-parallel group (``sharded``). The fused CPU matmuls of the NF4 and int8
heads are the kernels' own compiled loops (``native``, over ``_native.c``).

May import: ``lct.format`` (the codecs, the format's native loops and their ``LCT_NATIVE``
switch, the Maximus state file) and the leaves.
"""

from lct.kernels.embedding import NF4Embedding, PaddedEmbedding, padded_lookup
from lct.kernels.int8 import Int8Embedding, Int8Linear
from lct.kernels.linear import FlatLinear, NF4Linear, flatten_head
from lct.kernels.maximus import (
                                 MaximusEmbedding,
                                 MaximusPolicy,
                                 MaximusStats,
                                 load_maximus_state,
                                 save_maximus_state,
)
from lct.kernels.nf4 import dequantize, dequantize_rows
from lct.kernels.q8_0 import Q8_0Embedding, Q8_0Linear

__all__ = ["FlatLinear", "Int8Embedding", "Int8Linear", "flatten_head", "MaximusEmbedding",
           "MaximusPolicy", "MaximusStats", "NF4Embedding", "NF4Linear", "PaddedEmbedding",
           "padded_lookup", "Q8_0Embedding", "Q8_0Linear",
           "dequantize", "dequantize_rows", "load_maximus_state", "save_maximus_state"]
