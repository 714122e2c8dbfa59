"""The layout of a group's chunks before their bytes exist (docs/FORMAT.md sections 2 and 4):
which tensors share a chunk, where each starts (64-byte aligned), how many bytes each encoding
takes, and the decoded size of every chunk. The writer follows it; the planner and the policy
count with it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lct.format import constants as C
from lct.format.encodings import get_encoding


def align(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a


@dataclass
class TensorSpec:
    """A tensor to place in a chunk: what the manifest will say, minus the chunk and offsets."""

    name: str
    shape: tuple
    dtype: str
    stored_dtype: str
    encoding: str
    role: str
    group: str
    blocksize: int | None = None
    piece_of: str | None = None     # the sharded tensor this spec is a row-range piece of
    rows: tuple | None = None       # (r0, r1) of that piece
    cols: tuple | None = None       # or (c0, c1) of a column piece

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return get_encoding(self.encoding).nbytes(self.shape, self.stored_dtype)

    @property
    def absmax_nbytes(self) -> int:
        """Bytes of the float32 scales after the codes: NF4's absmax per block, int8's scale
        per row; 0 for plain tensors."""
        return get_encoding(self.encoding).scale_nbytes(self.shape, self.blocksize)

    @property
    def width_class(self):
        """Tensors of one class share a chunk: each lossy encoding apart, plain tensors by
        element width."""
        if get_encoding(self.encoding).lossy:
            return self.encoding
        return C.DTYPE_SIZES[self.stored_dtype]


def encoded_bytes(encoding: str, shape: tuple, dtype: str,
                  blocksize: int = C.DEFAULT_BLOCKSIZE) -> int:
    """Bytes a tensor of ``shape`` takes in ``encoding`` in its decoded chunk: codes plus
    scales (NF4 absmax, int8 row scales), alignment gaps not counted."""
    enc = get_encoding(encoding)
    return enc.nbytes(tuple(shape), enc.stored_dtype(dtype)) + \
        enc.scale_nbytes(tuple(shape), blocksize)


@dataclass
class ChunkLayout:
    """The layout of one chunk before its bytes exist: tensor offsets and the decoded size."""

    group: str
    width_class: object
    specs: list = field(default_factory=list)
    offsets: dict = field(default_factory=dict)        # name -> offset
    absmax_offsets: dict = field(default_factory=dict)  # name -> offset of its scales (lossy)
    decoded_size: int = 0

    def allocate(self) -> np.ndarray:
        """A zeroed decoded buffer for this chunk."""
        return np.zeros(self.decoded_size, dtype=np.uint8)


def layout_group(group: str, specs: list, max_bytes: int | None = None) -> list:
    """Split a group's tensors into chunks by width class and place them 64-byte aligned:
    ``[ChunkLayout]``. With ``max_bytes`` (a block's routed experts, FORMAT.md section 4) a
    width class takes a new chunk when the next tensor would take its chunk past that size
    (a tensor larger than it is alone in its chunk)."""
    layouts: list = []
    current: dict = {}
    for spec in specs:
        lay = current.get(spec.width_class)
        size = spec.nbytes + spec.absmax_nbytes
        if lay is None or (max_bytes is not None and lay.specs and
                           align(lay.decoded_size, C.TENSOR_ALIGNMENT) + size > max_bytes):
            lay = current[spec.width_class] = ChunkLayout(group, spec.width_class)
            layouts.append(lay)
        pos = align(lay.decoded_size, C.TENSOR_ALIGNMENT)
        lay.offsets[spec.name] = pos
        pos += spec.nbytes
        if spec.absmax_nbytes:
            pos = align(pos, C.TENSOR_ALIGNMENT)
            lay.absmax_offsets[spec.name] = pos
            pos += spec.absmax_nbytes
        lay.decoded_size = pos
        lay.specs.append(spec)
    return layouts
