"""Runtime kernels: NF4 dequantization, NF4 and padding-aware embedding lookups, the NF4 LM head."""

from .embedding import NF4Embedding, PaddedEmbedding, padded_lookup
from .linear import FlatLinear, NF4Linear, flatten_head
from .maximus import MaximusEmbedding, MaximusStats
from .nf4 import dequantize, dequantize_rows

__all__ = ["FlatLinear", "flatten_head", "MaximusEmbedding", "MaximusStats", "NF4Embedding", "NF4Linear", "PaddedEmbedding", "padded_lookup", "dequantize",
           "dequantize_rows"]
