"""Tensor encodings: small registered classes, one per way a tensor's values are kept in a decoded
chunk (docs/FORMAT.md section 2.2), shaped like the codec registry of ``lct/format/codecs.py``.

An encoding sizes itself (``nbytes``, ``scale_nbytes``: the codes and the float32 scales after
them), names what the manifest records (``stored_dtype``, its placement object under ``key``),
validates that object when a manifest is read (``check``), quantizes a source tensor
(``quantize``, bit-exact and deterministic, so that verify compares bytes), builds the stored
weight from a decoded chunk and joins pieces (``weight``, ``join``), and says which parts of a
stored weight a verify compares (``parts``). ``plain`` keeps the values as they are, in a
dtype; the lossy ones (``lossy``) are the embedding and head tables' candidates, which the
policy measures and the planner counts.

Adding an encoding is adding one class, registered with ``register`` (here, or in any module:
``unregister`` takes it back). Everything else derives from the registry: the converter's
``Policy`` and the planner's ``plan()`` take each lossy encoding's name as a keyword (a
``{encoding: parts}`` map, ``encoding_keywords``), ``lct convert`` and ``lct plan`` an option
of each (``--nf4 PARTS`` ..., in registry order), the manifest its policy key, and the kernels
that compute on it register under its name (``lct.kernels.register_kernels``; an encoding
without kernels loads dequantized).
"""

from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass
from typing import ClassVar

from lct.errors import OptionError, UnsupportedVersionError
from lct.format import constants as C
from lct.format.rules import fail as _fail
from lct.format.rules import integer as _int

def torch_dtype(name: str):
    """The torch dtype for an LCT dtype name (LCT's names are torch's)."""
    import torch
    if name not in C.DTYPE_SIZES:
        raise UnsupportedVersionError(f"unknown dtype {name!r}: expected one of "
                                      f"{', '.join(C.DTYPE_SIZES)}")
    return getattr(torch, name)


@dataclass
class NF4Weight:
    """An NF4-encoded tensor as stored: packed codes, absmax, and what it dequantizes to."""

    name: str
    packed: object       # torch.uint8 [ceil(n/2)]
    absmax: object       # torch.float32 [ceil(n/blocksize)]
    shape: tuple
    blocksize: int
    dtype: str
    encoding: ClassVar[str] = C.ENCODING_NF4

    def dequantize(self, dtype=None, out=None):
        """Dequantize to ``dtype`` (default: the source dtype), exactly as bitsandbytes does;
        into ``out`` (a contiguous tensor of that size and dtype) if given."""
        from lct.format import nf4
        return nf4.dequantize(self.packed, self.absmax, self.shape, self.blocksize,
                              dtype or torch_dtype(self.dtype), out=out)

    def bnb_state_dict(self, prefix: str) -> dict:
        """bitsandbytes state-dict keys for module path ``prefix`` (``prefix.weight...``)."""
        from lct.format import nf4
        return nf4.bnb_state_dict(prefix, self.packed, self.absmax, self.shape,
                                  self.blocksize, self.dtype)


@dataclass
class Int8Weight:
    """An int8-encoded tensor as stored: codes, one float32 scale per row (``int8``) or per block
    of a row (``Int8B128Weight``), and what it dequantizes to."""

    name: str
    q: object            # torch.int8 [rows, cols]
    scale: object        # torch.float32 [rows]; per block [rows, cols / block]
    shape: tuple
    dtype: str
    encoding: ClassVar[str] = C.ENCODING_INT8

    def dequantize(self, dtype=None, out=None):
        """Dequantize to ``dtype`` (default: the source dtype): ``q * scale`` in float32; into
        ``out`` (a contiguous tensor of that size and dtype) if given."""
        from lct.format import int8
        return int8.dequantize(self.q, self.scale, self.shape, dtype or torch_dtype(self.dtype),
                               out=out)


class Int8B128Weight(Int8Weight):
    """An ``int8_b128`` tensor as stored: int8 codes and one float32 scale per block of 128
    values of a row (``scale`` [rows, cols / 128])."""

    encoding = C.ENCODING_INT8_B128


@dataclass
class BlocksWeight:
    """A tensor kept as llama.cpp-style blocks along its rows (each block its codes and scales,
    as a GGUF tensor holds them): the blocks, and what they dequantize to. Subclassed per
    encoding (``encoding``: its registry name)."""

    name: str
    blocks: object       # torch.uint8 [rows, row bytes]
    shape: tuple
    dtype: str
    encoding: ClassVar[str] = ""

    def dequantize(self, dtype=None, out=None):
        """Dequantize to ``dtype`` (default: the source dtype) as the encoding's codec does;
        into ``out`` (a contiguous tensor of that size and dtype) if given."""
        return get_encoding(self.encoding).codec().dequantize(
            self.blocks, self.shape, dtype or torch_dtype(self.dtype), out=out)


class Q8_0Weight(BlocksWeight):
    """A Q8_0-encoded tensor as stored: per 32 values a float16 scale and 32 int8 codes
    (llama.cpp's layout); dequantized ``float32(d) * q``."""

    encoding = C.ENCODING_Q8_0


class Q6_KWeight(BlocksWeight):
    """A Q6_K-encoded tensor as stored: per 256 values 6-bit codes, 16 int8 sub-block scales
    and a float16 scale (llama.cpp's layout); dequantized ``float32(d) * scale * (q - 32)``."""

    encoding = C.ENCODING_Q6_K


def map_tensors(weight, fn):
    """A copy of the stored ``weight`` (``NF4Weight``, ``Int8Weight``, a ``BlocksWeight``) with
    ``fn`` applied to each of its tensors (a move to a device, say)."""
    import dataclasses

    import torch
    return dataclasses.replace(weight, **{
        f.name: fn(getattr(weight, f.name)) for f in dataclasses.fields(weight)
        if isinstance(getattr(weight, f.name), torch.Tensor)})


_REGISTRY: dict[str, "Encoding"] = {}


def register(cls: type["Encoding"]) -> type["Encoding"]:
    """Class decorator: make an encoding available under ``cls.name``, after those registered
    before it (the order the policy measures them and the CLI lists their options in).

    Raises:
        OptionError: the name is taken, or is not a lowercase identifier (it is a keyword of
            ``Policy`` and ``plan()`` and an option of ``lct convert``).

    Example:
        >>> @register
        ... class Toy(BlockEncoding):
        ...     name = "toy"
        ...     ...
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        raise OptionError(f"an encoding's name is a lowercase identifier, got {name!r}",
                          option="name")
    if name in _REGISTRY:
        raise OptionError(f"encoding {name!r} is already registered "
                          f"({type(_REGISTRY[name]).__name__})", option="name")
    _REGISTRY[name] = cls()
    return cls


def unregister(name: str) -> None:
    """Take back the encoding registered as ``name`` (a plugin's or a test's); the format's
    own encodings stay."""
    if name in _BUILTIN:
        raise OptionError(f"encoding {name!r} is the format's own and stays registered",
                          option="name")
    _REGISTRY.pop(name, None)


def get_encoding(name: str, where: str = "") -> "Encoding":
    """The encoding registered as ``name``; ``UnsupportedVersionError`` for another."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        at = f"{where}: " if where else ""
        raise UnsupportedVersionError(f"{at}unknown encoding {name!r}; this reader knows "
                                      f"{', '.join(_REGISTRY)}") from None


def lossy_encodings() -> tuple:
    """Names of the lossy encodings, in the order the policy measures them."""
    return tuple(n for n, e in _REGISTRY.items() if e.lossy)


def is_lossy(name: str) -> bool:
    """Whether ``name`` is a registered lossy encoding."""
    e = _REGISTRY.get(name) if isinstance(name, str) else None
    return e is not None and e.lossy


def encoding_keywords(field: str):
    """Class decorator for a dataclass whose ``field`` is a ``{lossy encoding: parts}`` map
    (``Policy.lossy``, ``PlanOptions.lossy``): its constructor also takes each registered lossy
    encoding's name as a keyword, folded into the map (``Policy(nf4=("embed",))`` is
    ``Policy(lossy={"nf4": ("embed",)})``; a keyword wins over the map's entry, as
    ``dataclasses.replace`` needs), and an instance reads each back as an attribute
    (``policy.nf4``: the parts, or None where that encoding was not given). The map keeps the
    encodings given (a None value is not given), a list of parts as a tuple. Other keywords
    stay the dataclass's own: an unknown one is a ``TypeError``.

    Example:
        >>> Policy(q8_0=["head"]).lossy
        {'q8_0': ('head',)}
    """
    def decorate(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kw):
            given = kw.get(field) or {}
            if isinstance(given, dict):     # else the class's own check names it
                named = {k: kw.pop(k) for k in list(kw) if k != field and is_lossy(k)}
                kw[field] = {e: tuple(p) if isinstance(p, list) else p
                             for e, p in {**given, **named}.items() if p is not None}
            init(self, *args, **kw)

        def __getattr__(self, name):
            if is_lossy(name):
                given = self.__dict__.get(field)
                return given.get(name) if isinstance(given, dict) else None
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        cls.__init__ = __init__
        cls.__getattr__ = __getattr__
        return cls
    return decorate


class Encoding(abc.ABC):
    """How a tensor's values are kept (FORMAT.md 2.2)."""

    name: str
    since: tuple = (1, 0)           # the format version that introduced it (FORMAT.md 2.2)
    lossy: bool = False
    key: str | None = None          # the tensor entry's placement object (its scales), if any
    label: str = ""                 # for messages: "NF4", "int8"
    described: str = ""             # for the model card ({blocksize}: the policy's)
    summary: str = ""               # for an option's help: what a value becomes (default label)
    blocked: bool = False           # whether it takes the policy's blocksize (NF4's)

    def stored_dtype(self, dtype: str) -> str:
        """What the manifest's ``stored_dtype`` says of a ``dtype`` tensor so encoded."""
        return self.name

    def fits(self, shape: tuple, blocksize: int | None) -> bool:
        """Whether a tensor of ``shape`` can take this encoding (``blocksize``: NF4's)."""
        return True

    def candidate(self, shape: tuple, blocksize: int | None) -> bool:
        """Whether the auto policy measures this encoding for a table of ``shape``: where it
        fits and is not another candidate's bytes under a second name."""
        return self.fits(shape, blocksize)

    def check_source(self, shape: tuple, blocksize: int | None, where: str) -> None:
        """Refuse, with a ``PolicyError`` naming ``where``, a source tensor this encoding
        cannot take."""

    @abc.abstractmethod
    def nbytes(self, shape: tuple, stored_dtype: str) -> int:
        """Bytes of the codes (or values) of a tensor of ``shape``."""

    def scale_nbytes(self, shape: tuple, blocksize: int | None) -> int:
        """Bytes of the float32 scales placed after the codes (0: none)."""
        return 0

    def placement(self, blocksize: int | None, scale_offset: int, scale_nbytes: int):
        """The tensor entry's ``key`` object the writer records (None: no object)."""
        return None

    @abc.abstractmethod
    def check(self, obj, w: str, shape: tuple, dtype: str, stored_dtype, nbytes: int,
              where: str) -> tuple:
        """Validate a tensor entry's encoding fields read from a manifest (FORMAT.md 2.2);
        returns ``(placement object or None, (scale offset, scale nbytes) or None)``. Raises
        ``ManifestError`` naming the tensor ``w``."""

    def check_version(self, version: tuple, w: str, where: str) -> None:
        """Refuse (``ManifestError`` naming the tensor ``w``) this encoding in a manifest whose
        ``format_version`` is older than the version that introduced it (FORMAT.md 2.2): a
        reader of that version could not have read it."""
        if tuple(version) < self.since:
            _fail(where, f"{w}: encoding {self.name!r} needs format_version "
                         f"{self.since[0]}.{self.since[1]} or later, the manifest declares "
                         f"{version[0]}.{version[1]}")


class LossyEncoding(Encoding):
    """An encoding of the embedding and head tables: codes and float32 scales, quantized from
    the source and dequantized at load."""

    lossy = True
    scale_name = "scale"            # for messages: what a stored scale is called

    def _check_common(self, obj, w: str, dtype: str, stored_dtype, where: str) -> None:
        """What every lossy encoding's entry must say: its name as ``stored_dtype``, a float
        dtype to dequantize to, and its placement object (when it has one, ``key``)."""
        n = self.name
        if stored_dtype != n:
            _fail(where, f"{w}: {n} tensor must have stored_dtype {n!r}, got {stored_dtype!r}")
        if dtype not in C.FLOAT_DTYPES:
            _fail(where, f"{w}: {n} tensor must dequantize to one of {C.FLOAT_DTYPES}, got "
                         f"{dtype!r}")
        if self.key is not None and not isinstance(obj, dict):
            _fail(where, f"{w}: {n} tensor lacks its {self.key!r} object")

    # torch side (imports torch) ------------------------------------------------------------
    @abc.abstractmethod
    def quantize(self, t, blocksize: int | None, where: str) -> tuple:
        """``(codes, scales)`` of source tensor ``t`` (lossy encodings)."""

    @abc.abstractmethod
    def roundtrip(self, w, blocksize: int | None, wf=None):
        """``w`` quantized and dequantized again, as float32 (what the policy measures;
        ``wf``: ``w`` as float32 already, if the caller has it)."""

    @abc.abstractmethod
    def weight(self, info, raw, scales, dtype: str):
        """The stored weight of tensor ``info`` from its codes ``raw`` (uint8) and ``scales``
        (float32) in a decoded chunk: a view, no copy."""

    @abc.abstractmethod
    def join(self, info, parts: list, perm, dtype: str):
        """The stored weight of tensor ``info`` from its row pieces (``parts``: their weights,
        in row order; one part: the whole table), taking the rows ``perm`` lists, in its order
        (an index tensor: token-id order of a Maximus table, or a range of rows, which a
        tensor-parallel rank keeps), or all of them as stored (None). The weight says
        ``info.shape``; one part and no ``perm`` may be a view of it, else it is a copy."""

    @abc.abstractmethod
    def parts(self, weight) -> tuple:
        """``(codes, scales)`` of a stored weight, as ``quantize`` gives them (verify)."""

    def zero_marker(self, weight):
        """A ``[rows, k]`` tensor of the stored ``weight``'s scales: a row whose marker is all
        zero dequantizes to zeros (what padding detection reads instead of the whole table).
        Here: the scales ``parts`` gives (NF4's absmax, int8's scales), a row's together."""
        return self.parts(weight)[1].reshape(weight.shape[0], -1)

    def scales(self, weight):
        """The stored ``weight``'s scales as floats, ``[rows, scales a row]`` (NF4's absmax,
        int8's float32 scales, a block's float16 ``d``): what must be finite."""
        return self.parts(weight)[1].reshape(math.prod(weight.shape[:-1]), -1)

    def bad_scale(self, weight) -> str | None:
        """Where the first stored scale of ``weight`` that is NaN or Inf lies and what it is
        (``"row 17, block 3: d = inf"``), or None when every one is finite: FORMAT.md 2.2
        says a stored scale MUST be finite, a writer never writes another and a verifying
        reader refuses one.

        Example:
            >>> get_encoding("q8_0").bad_scale(weight)     # None: all finite
        """
        import torch
        grid = self.scales(weight)
        bad = ~torch.isfinite(grid)
        if not bool(bad.any()):
            return None
        per_row = grid.shape[1] if grid.dim() > 1 else 1
        first = int(bad.reshape(-1).to(torch.uint8).argmax())
        row, block = divmod(first, per_row)
        at = f"row {row}" + (f", block {block}" if per_row > 1 else "")
        return f"{at}: {self.scale_name} = {grid.reshape(-1)[first].item()}"


def _rows(tensors: list):
    """The rows of ``tensors`` one after another: the one tensor itself, else their ``cat``."""
    import torch
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


@register
class Plain(Encoding):
    """The values in their (stored) dtype, losslessly."""

    name = C.ENCODING_PLAIN

    def stored_dtype(self, dtype: str) -> str:
        return dtype

    def nbytes(self, shape, stored_dtype):
        return math.prod(shape) * C.DTYPE_SIZES[stored_dtype]

    def check(self, obj, w, shape, dtype, stored_dtype, nbytes, where):
        if not isinstance(stored_dtype, str) or stored_dtype not in C.DTYPE_SIZES:
            raise UnsupportedVersionError(f"{where}: {w}: unknown stored dtype {stored_dtype!r}")
        expected = math.prod(shape) * C.DTYPE_SIZES[stored_dtype]
        if nbytes != expected:
            _fail(where, f"{w}: nbytes {nbytes} != {expected} (shape {shape} x {stored_dtype})")
        return None, None


@register
class NF4(LossyEncoding):
    """4-bit NormalFloat codes, two a byte, one float32 absmax per block of ``blocksize``
    values: bitsandbytes' ``quantize_4bit`` byte for byte."""

    name = C.ENCODING_NF4
    key = "nf4"
    label = "NF4"
    scale_name = "absmax"
    described = "NF4 (blocksize {blocksize}, bitsandbytes layout)"
    summary = "NF4 (bitsandbytes layout, --blocksize values a block)"
    blocked = True

    def fits(self, shape, blocksize):
        return bool(shape) and blocksize is not None and shape[-1] % blocksize == 0

    def check_source(self, shape, blocksize, where):
        from lct.format.nf4 import check_blocksize
        check_blocksize(shape, blocksize, where)

    def nbytes(self, shape, stored_dtype):
        from lct.format.nf4 import packed_size
        return packed_size(math.prod(shape))

    def scale_nbytes(self, shape, blocksize):
        from lct.format.nf4 import absmax_count
        return 4 * absmax_count(math.prod(shape), blocksize)

    def placement(self, blocksize, scale_offset, scale_nbytes):
        return {"blocksize": blocksize, "absmax_offset": scale_offset,
                "absmax_nbytes": scale_nbytes}

    def check(self, obj, w, shape, dtype, stored_dtype, nbytes, where):
        from lct.format.nf4 import absmax_count, packed_size
        self._check_common(obj, w, dtype, stored_dtype, where)
        bs = _int(obj.get("blocksize"), where, f"{w} blocksize", C.NF4_MIN_BLOCKSIZE,
                  C.NF4_MAX_BLOCKSIZE)
        if bs % 2 or not shape or shape[-1] % bs:
            _fail(where, f"{w}: blocksize {bs} must be even and divide the row length")
        n = math.prod(shape)
        if nbytes != packed_size(n):
            _fail(where, f"{w}: nf4 nbytes {nbytes} != {packed_size(n)}")
        a_off = _int(obj.get("absmax_offset"), where, f"{w} absmax_offset")
        a_n = _int(obj.get("absmax_nbytes"), where, f"{w} absmax_nbytes")
        if a_n != 4 * absmax_count(n, bs):
            _fail(where, f"{w}: absmax_nbytes {a_n} != {4 * absmax_count(n, bs)}")
        return self.placement(bs, a_off, a_n), (a_off, a_n)

    def quantize(self, t, blocksize, where):
        from lct.format.nf4 import quantize
        return quantize(t, blocksize, where)

    def roundtrip(self, w, blocksize, wf=None):
        import torch

        from lct.format import nf4
        packed, absmax = nf4.quantize(w, blocksize)
        return nf4.dequantize(packed, absmax, tuple(w.shape), blocksize, torch.float32)

    def weight(self, info, raw, scales, dtype):
        return NF4Weight(info.name, raw, scales, info.shape, info.nf4["blocksize"], dtype)

    def join(self, info, parts, perm, dtype):
        cols, bs = info.shape[1], info.nf4["blocksize"]
        packed = _rows([p.packed.view(-1, cols // 2) for p in parts])
        absmax = _rows([p.absmax.view(-1, cols // bs) for p in parts])
        if perm is not None:
            packed, absmax = packed[perm], absmax[perm]
        return NF4Weight(info.name, packed.reshape(-1), absmax.reshape(-1), info.shape, bs,
                         dtype)

    def parts(self, weight):
        return weight.packed, weight.absmax


@register
class Int8(LossyEncoding):
    """int8 codes, one float32 scale per row (absmax / 127), rounded half to even."""

    name = C.ENCODING_INT8
    since = (1, 1)
    key = "int8"
    label = "int8"
    described = "int8 with one scale per row"
    summary = "int8 with one scale per row"
    block: int | None = None        # values per scale; None: the whole row
    weight_class = Int8Weight

    def fits(self, shape, blocksize):
        return len(shape) >= 1 and (self.block is None or shape[-1] % self.block == 0)

    def check_source(self, shape, blocksize, where):
        if self.block is not None:
            from lct.format.blocks import check_rows
            check_rows(shape, where, self.label, self.block)

    def _scales(self, shape) -> int:
        """float32 scales of a tensor of ``shape``: one per row, or per block of a row."""
        rows = math.prod(shape[:-1])
        return rows if self.block is None else rows * (shape[-1] // self.block)

    def nbytes(self, shape, stored_dtype):
        return math.prod(shape)

    def scale_nbytes(self, shape, blocksize):
        return 4 * self._scales(shape)

    def placement(self, blocksize, scale_offset, scale_nbytes):
        return {"scale_offset": scale_offset, "scale_nbytes": scale_nbytes}

    def check(self, obj, w, shape, dtype, stored_dtype, nbytes, where):
        self._check_common(obj, w, dtype, stored_dtype, where)
        n = self.name
        if len(shape) < 1:
            _fail(where, f"{w}: an {n} tensor needs at least one dimension")
        if not self.fits(shape, None):
            _fail(where, f"{w}: an {n} tensor's rows must hold a multiple of {self.block} "
                         f"values, shape is {list(shape)}")
        if nbytes != math.prod(shape):
            _fail(where, f"{w}: {n} nbytes {nbytes} != {math.prod(shape)}")
        s_off = _int(obj.get("scale_offset"), where, f"{w} scale_offset")
        s_n = _int(obj.get("scale_nbytes"), where, f"{w} scale_nbytes")
        want = 4 * self._scales(shape)
        if s_n != want:
            per = "row" if self.block is None else f"block of {self.block} values"
            _fail(where, f"{w}: scale_nbytes {s_n} != {want} (one float32 per {per})")
        return self.placement(None, s_off, s_n), (s_off, s_n)

    def quantize(self, t, blocksize, where):
        from lct.format.int8 import quantize
        return quantize(t, where, self.block)

    def roundtrip(self, w, blocksize, wf=None):
        from lct.format import int8
        q, scale = int8.quantize(wf if wf is not None else w, block=self.block)  # compiled if built
        return int8.dequantize(q, scale, tuple(w.shape))

    def weight(self, info, raw, scales, dtype):
        import torch

        from lct.format.int8 import row_shape
        rows, cols = row_shape(info.shape)
        if self.block is not None:
            scales = scales.view(rows, cols // self.block)
        return self.weight_class(info.name, raw.view(torch.int8).view(rows, cols), scales,
                                 info.shape, dtype)

    def join(self, info, parts, perm, dtype):
        q = _rows([p.q for p in parts])
        scale = _rows([p.scale for p in parts])
        if perm is not None:
            q, scale = q[perm], scale[perm]
        return self.weight_class(info.name, q, scale, info.shape, dtype)

    def parts(self, weight):
        return weight.q, weight.scale


@register
class Int8B128(Int8):
    """int8 codes, one float32 scale per block of 128 values of a row: int8's rule applied to
    each block (8.25 bits a value), the scales ``[rows, cols / 128]`` after the codes."""

    name = C.ENCODING_INT8_B128
    since = (1, 5)
    key = "int8"                    # the same placement object as int8's
    label = "int8_b128"             # its registry name and flag: one name in every message
    described = "int8 with one scale per 128 values"
    summary = ("int8 with one scale per 128 values of a row (8.25 bits a value; rows must be "
               "whole blocks of 128)")
    block = C.INT8_BLOCK
    weight_class = Int8B128Weight

    def candidate(self, shape, blocksize):
        # a row of one block is int8 per row, byte for byte: measured as that
        return self.fits(shape, blocksize) and shape[-1] > self.block


class BlockEncoding(LossyEncoding):
    """An encoding of llama.cpp's whose rows are self-contained blocks of ``block`` values in
    ``block_bytes`` bytes (codes and scales together, as a GGUF tensor's bytes), quantized and
    dequantized by the codec module ``codec_module``. No scales after the codes: they are in
    the blocks."""

    block: int
    block_bytes: int
    d_bytes: slice          # where in a block its float16 scale ``d`` lies
    codec_module: str
    weight_class: type
    scale_name = "d"

    def codec(self):
        """The codec module (``quantize``, ``dequantize``)."""
        import importlib
        return importlib.import_module(self.codec_module)

    def fits(self, shape, blocksize):
        return bool(shape) and shape[-1] % self.block == 0

    def check_source(self, shape, blocksize, where):
        from lct.format.blocks import check_rows
        check_rows(shape, where, self.label, self.block)

    def nbytes(self, shape, stored_dtype):
        from lct.format.blocks import blocks_nbytes
        return blocks_nbytes(math.prod(shape), self.block, self.block_bytes)

    def check(self, obj, w, shape, dtype, stored_dtype, nbytes, where):
        self._check_common(obj, w, dtype, stored_dtype, where)
        n = self.name
        if not self.fits(shape, None):
            _fail(where, f"{w}: a {n} tensor's rows must hold a multiple of {self.block} "
                         f"values, shape is {list(shape)}")
        want = self.nbytes(shape, stored_dtype)
        if nbytes != want:
            _fail(where, f"{w}: {n} nbytes {nbytes} != {want} ({self.block_bytes} per block of "
                         f"{self.block})")
        return None, None

    def quantize(self, t, blocksize, where):
        import torch

        from lct.errors import PolicyError
        blocks = self.codec().quantize(t, where)
        # finite values can still give a float16 d past 65504 (Inf): refused, as the spec says
        bad = self.bad_scale(self.weight_class(where, blocks, tuple(t.shape), "float32"))
        if bad is not None:
            raise PolicyError(f"{where}: {self.label} cannot encode values this large ({bad}: "
                              f"its float16 scale overflows; a stored scale must be finite)")
        return blocks, torch.empty(0, dtype=torch.float32)

    def roundtrip(self, w, blocksize, wf=None):
        codec = self.codec()
        return codec.dequantize(codec.quantize(wf if wf is not None else w), tuple(w.shape))

    def weight(self, info, raw, scales, dtype):
        return self.weight_class(info.name, raw.view(-1, self.nbytes(info.shape[-1:], dtype)),
                                 info.shape, dtype)

    def join(self, info, parts, perm, dtype):
        blocks = _rows([p.blocks for p in parts])
        return self.weight_class(info.name, blocks[perm] if perm is not None else blocks,
                                 info.shape, dtype)

    def parts(self, weight):
        import torch
        return weight.blocks, torch.empty(0, dtype=torch.float32)

    def zero_marker(self, weight):
        # every block's float16 scale d: where it is zero, the block dequantizes to zeros
        return weight.blocks.view(weight.shape[0], -1, self.block_bytes)[:, :, self.d_bytes]

    def scales(self, weight):
        import torch
        rows = math.prod(weight.shape[:-1])
        d = weight.blocks.reshape(rows, -1, self.block_bytes)[:, :, self.d_bytes]
        return d.contiguous().view(torch.float16).squeeze(-1)


@register
class Q8_0(BlockEncoding):
    """llama.cpp's Q8_0: per block of 32 values of a row, a float16 scale (absmax / 127) and 32
    int8 codes rounded half away from zero, the scale first (34 bytes): a GGUF ``Q8_0``
    tensor's bytes."""

    name = C.ENCODING_Q8_0
    since = (1, 3)
    label = "Q8_0"
    described = "Q8_0 (llama.cpp's blocks: a float16 scale per 32 values)"
    summary = "Q8_0 (llama.cpp's 8-bit blocks: a float16 scale per 32 values, 8.5 bits a value)"
    block, block_bytes, d_bytes = C.Q8_0_BLOCK, C.Q8_0_BLOCK_BYTES, slice(0, 2)
    codec_module = "lct.format.q8_0"
    weight_class = Q8_0Weight


@register
class Q6_K(BlockEncoding):
    """llama.cpp's Q6_K: per block of 256 values of a row, 6-bit codes (low 4 bits, then high 2
    bits), 16 int8 scales of 16-value sub-blocks and a float16 super-block scale, last (210
    bytes, 6.5625 bits a value): a GGUF ``Q6_K`` tensor's bytes, quantized as llama.cpp's
    reference quantizer does."""

    name = C.ENCODING_Q6_K
    since = (1, 4)
    label = "Q6_K"
    described = ("Q6_K (llama.cpp's 6-bit blocks: 16 int8 scales and a float16 scale per 256 "
                 "values)")
    summary = ("Q6_K (llama.cpp's 6-bit k-quant: 16 int8 scales and a float16 scale per 256 "
               "values, 6.56 bits a value)")
    block, block_bytes = C.Q6_K_BLOCK, C.Q6_K_BLOCK_BYTES
    d_bytes = slice(C.Q6_K_BLOCK_BYTES - 2, C.Q6_K_BLOCK_BYTES)
    codec_module = "lct.format.q6_k"
    weight_class = Q6_KWeight


_BUILTIN = frozenset(_REGISTRY)     # the format's own (FORMAT.md 2.2): never unregistered
