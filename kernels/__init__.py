"""Runtime kernels: the torch modules that compute on LCT's encodings. NF4, int8, Q8_0 and Q6_K
dequantization, NF4, int8, Q8_0, Q6_K and padding-aware embedding lookups, the NF4, int8, Q8_0
and Q6_K LM heads (``QuantizedLinear``, their CPU path measured per input size by ``paths``),
``MaximusEmbedding`` (with saving and restoring its shard state), and quantized tables split
by rows over a tensor-parallel group (``sharded``). The heads' CPU matmuls, fused and tiled,
are the kernels' own compiled loops (``native``, over ``_native.c``).

May import: ``lct.format`` (the codecs, the format's native loops and their ``LCT_NATIVE``
switch, the Maximus state file) and the leaves.
"""

from lct.format import constants as C
from lct.kernels.blocks import Q6_KEmbedding, Q6_KLinear, Q8_0Embedding, Q8_0Linear
from lct.kernels.embedding import NF4Embedding, PaddedEmbedding, padded_lookup
from lct.kernels.int8 import Int8Embedding, Int8Linear
from lct.kernels.linear import FlatLinear, NF4Linear, QuantizedLinear, flatten_head
from lct.kernels.maximus import (
                                 MaximusEmbedding,
                                 MaximusPolicy,
                                 MaximusStats,
                                 load_maximus_state,
                                 save_maximus_state,
)
from lct.kernels.nf4 import dequantize, dequantize_rows

__all__ = ["FlatLinear", "Int8Embedding", "Int8Linear", "flatten_head", "MaximusEmbedding",
           "MaximusPolicy", "MaximusStats", "NF4Embedding", "NF4Linear", "PaddedEmbedding",
           "padded_lookup", "Q6_KEmbedding", "Q6_KLinear", "Q8_0Embedding", "Q8_0Linear",
           "QuantizedLinear",
           "dequantize", "dequantize_rows", "embedding_for", "linear_for", "load_maximus_state",
           "save_maximus_state"]


def embedding_for(weight, dtype, pad_ids=(), scale=None):
    """The embedding module over a stored lossy ``weight`` (``lct.format.encodings``'
    ``NF4Weight``, ``Int8Weight`` or a ``BlocksWeight``; its tensors as they are, no copy):
    ``dtype`` out, ``pad_ids`` looked up as zero rows, ``scale`` a multiplier as Gemma's scaled
    embedding."""
    e = weight.encoding
    if e == C.ENCODING_NF4:
        rows, cols = weight.shape
        return NF4Embedding(weight.packed, weight.absmax, rows, cols, weight.blocksize, dtype,
                            pad_ids=pad_ids, scale=scale)
    if e in (C.ENCODING_INT8, C.ENCODING_INT8_B128):
        return Int8Embedding(weight.q, weight.scale, dtype, pad_ids=pad_ids, scale_by=scale)
    return _BLOCKS[e][0](weight.blocks, dtype, pad_ids=pad_ids, scale_by=scale)


def linear_for(weight, dtype, bias=None):
    """The LM head module (``y = x @ W.T + bias``) over a stored lossy ``weight``."""
    e = weight.encoding
    if e == C.ENCODING_NF4:
        rows, cols = weight.shape
        return NF4Linear(weight.packed, weight.absmax, rows, cols, weight.blocksize, dtype,
                         bias=bias)
    if e in (C.ENCODING_INT8, C.ENCODING_INT8_B128):
        return Int8Linear(weight.q, weight.scale, dtype, bias=bias)
    return _BLOCKS[e][1](weight.blocks, dtype, bias=bias)


_BLOCKS = {C.ENCODING_Q8_0: (Q8_0Embedding, Q8_0Linear),
           C.ENCODING_Q6_K: (Q6_KEmbedding, Q6_KLinear)}
