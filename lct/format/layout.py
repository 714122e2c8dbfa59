"""The layout of a group's chunks before their bytes exist (docs/FORMAT.md sections 2 and 4):
which tensors share a chunk, where each starts (64-byte aligned), how many bytes each encoding
takes, and the decoded size of every chunk. The writer follows it; the planner and the policy
count with it."""

from __future__ import annotations

import re
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


def layout_group(group: str, specs: list) -> list:
    """Split a group's tensors into chunks by width class and place them 64-byte aligned:
    ``[ChunkLayout]``. A block's routed experts (group ``*.experts``, FORMAT.md section 4) are
    chunked by whole experts, in expert order (``expert_units``): at most
    ``EXPERT_CHUNK_BYTES`` and ``ceil(experts / EXPERT_CHUNKS)`` experts to a chunk (an expert
    larger than the bound spans chunks, split between its tensors; a tensor larger than it is
    alone in its chunk), then the fused tensors of all experts in chunks within the bound."""
    if not group.endswith(C.GROUP_EXPERTS_SUFFIX):
        return _layout_units(group, [specs])
    experts, fused = expert_units(specs)
    return _layout_units(group, experts, C.EXPERT_CHUNK_BYTES,
                         -(-len(experts) // C.EXPERT_CHUNKS)) + \
        _layout_units(group, fused, C.EXPERT_CHUNK_BYTES)


def expert_units(specs: list) -> tuple:
    """``(experts, fused)``: a routed-expert group's tensors stored one expert at a time
    (checkpoint names ``….experts.{E}.…``) as one list of specs per expert, in expert order;
    and the others (tensors of all experts at once), one list per tensor."""
    by_expert: dict = {}
    fused = []
    for spec in specs:
        m = EXPERT_INDEX.search(spec.name)
        if m is None:
            fused.append([spec])
        else:
            by_expert.setdefault(int(m.group(1)), []).append(spec)
    return [by_expert[e] for e in sorted(by_expert)], fused


def _layout_units(group: str, units: list, max_bytes: int | None = None,
                  per_chunk: int | None = None) -> list:
    """Lay out ``units`` (lists of specs, in order) by width class: a unit starts a new chunk
    of its width when the chunk holds ``per_chunk`` units already or the whole unit would take
    it past ``max_bytes``; inside a unit, a tensor that would take it past ``max_bytes`` does."""
    layouts: list = []
    current: dict = {}          # width class -> (ChunkLayout, units in it)

    def size(spec):
        return spec.nbytes + spec.absmax_nbytes

    for unit in units:
        started = set()
        for spec in unit:
            wc = spec.width_class
            lay, n = current.get(wc, (None, 0))
            if wc not in started:       # the unit's first tensor of this width: whole unit?
                whole = sum(align(size(s), C.TENSOR_ALIGNMENT) for s in unit
                            if s.width_class == wc)
                full = lay is not None and lay.specs and (
                    per_chunk is not None and n >= per_chunk or max_bytes is not None and
                    align(lay.decoded_size, C.TENSOR_ALIGNMENT) + whole > max_bytes)
                if lay is None or full:
                    lay, n = ChunkLayout(group, wc), 0
                    layouts.append(lay)
                n += 1
                started.add(wc)
            elif max_bytes is not None and lay.specs and \
                    align(lay.decoded_size, C.TENSOR_ALIGNMENT) + size(spec) > max_bytes:
                lay, n = ChunkLayout(group, wc), 1      # an expert larger than the bound
                layouts.append(lay)
            current[wc] = (lay, n)
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


# An expert stored one by one: its index in the checkpoint name ("….experts.3.w1.weight"),
# group 1; the experts module's path ends where group 1 starts, less its dot.
EXPERT_INDEX = re.compile(rf"(?:^|\.){C.EXPERTS_MODULE}\.(\d+)\.")
