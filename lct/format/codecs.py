"""Chunk codecs: small registered classes that turn a chunk's decoded bytes into stored bytes and back.

Each codec follows docs/FORMAT.md section 5. ``encode`` takes the decoded bytes (a 1-D uint8
numpy array) and returns the stored bytes; ``decode`` checks every declared size before it
allocates or copies and writes exactly ``decoded_size`` bytes into a caller-provided buffer.
Frames are independent, so ``encode``/``decode`` take a ``map_fn`` (``executor.map``) to spread
them over threads; zstandard and numpy release the GIL.
"""

from __future__ import annotations

import abc
import struct
import threading
from typing import Callable, Iterable

import numpy as np

from lct.errors import CorruptChunkError, ManifestError, UnsupportedVersionError
from lct.format import constants as C

MapFn = Callable[..., Iterable]

_REGISTRY: dict[str, type["Codec"]] = {}
_local = threading.local()


def register(cls: type["Codec"]) -> type["Codec"]:
    """Class decorator: make a codec available under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def get_codec(name: str) -> "Codec":
    """Return the codec registered as ``name``.

    Raises:
        UnsupportedVersionError: no codec of that name is known to this reader.
    """
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise UnsupportedVersionError(
            f"unknown codec {name!r}; this reader knows {sorted(_REGISTRY)}") from None


# Bytes hashed per call: xxhash holds the GIL while it hashes, so a chunk is hashed in pieces,
# between which the decode threads beside it (Artifact.decode_verified) take theirs.
CHECKSUM_PIECE = 4 << 20


def checksum(data) -> str:
    """The manifest checksum string of a chunk's stored bytes (xxh3_64), hashed
    ``CHECKSUM_PIECE`` bytes per call (the same digest as one call)."""
    import xxhash
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if len(view) <= CHECKSUM_PIECE:
        return f"{C.CHECKSUM_ALGO}:{xxhash.xxh3_64_hexdigest(view)}"
    h = xxhash.xxh3_64()
    for at in range(0, len(view), CHECKSUM_PIECE):
        h.update(view[at:at + CHECKSUM_PIECE])
    return f"{C.CHECKSUM_ALGO}:{h.hexdigest()}"


def _zstd():
    try:
        import zstandard
    except ImportError as e:  # pragma: no cover - zstandard is a hard dependency
        from lct.errors import MissingDependencyError
        raise MissingDependencyError("zstandard is required: pip install zstandard") from e
    return zstandard


# The exponent plane is an order-0 source (a few dozen symbols, no repeats worth finding):
# zstd's Huffman-coded literals are what compress it, and match finding only costs time and
# ratio. These parameters make matches rare: the whole artifact is smaller and encodes faster
# than with the plane at zstd's own levels (docs/BENCHMARKS.md, bench_format: the "hi plane at
# zstd-N" rows are the writer before this).
ENTROPY_ONLY = "entropy-only"


def _cctx(level):
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    if level not in cache:
        zstandard = _zstd()
        if level == ENTROPY_ONLY:
            params = zstandard.ZstdCompressionParameters(
                strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, search_log=1,
                min_match=7, target_length=0, write_content_size=1)
            cache[level] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _dctx():
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = _zstd().ZstdDecompressor()
    return d


def _zstd_compress(data, level) -> bytes:
    return _cctx(level).compress(data)


def _check_frame_header(data, expected: int, what: str) -> None:
    """Raise ``CorruptChunkError`` unless ``data`` starts a zstd frame declaring ``expected`` bytes."""
    zstandard = _zstd()
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise CorruptChunkError(f"{what}: not a zstd frame ({e})") from e
    if declared != expected:
        raise CorruptChunkError(f"{what}: zstd frame declares {declared} bytes, expected {expected}")


def _zstd_decompress(data, expected: int, what: str) -> bytes:
    zstandard = _zstd()
    _check_frame_header(data, expected, what)
    try:
        out = _dctx().decompress(data, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptChunkError(f"{what}: zstd error: {e}") from e
    if len(out) != expected:
        raise CorruptChunkError(f"{what}: decoded {len(out)} bytes, expected {expected}")
    return out


def _frames(decoded_size: int, frame_size: int) -> list[tuple[int, int]]:
    return [(s, min(frame_size, decoded_size - s)) for s in range(0, decoded_size, frame_size)]


def _check_frame_size(params: dict, multiple: int = 1) -> int:
    fs = params.get("frame_size")
    if not isinstance(fs, int) or isinstance(fs, bool) or fs <= 0 or fs > C.MAX_FRAME_SIZE \
            or fs % multiple:
        raise ManifestError(f"frame_size {fs!r} must be an int in 1..{C.MAX_FRAME_SIZE} "
                            f"and a multiple of {multiple}")
    return fs


def _check_table_fits(decoded_size: int, frame_size: int, entry_size: int, stored_size: int) -> None:
    count = -(-decoded_size // frame_size)
    need = 4 + count * entry_size
    if need > stored_size:
        raise ManifestError(f"frame table of {count} frames needs {need} bytes, "
                            f"stored_size is {stored_size}")


def _check_level(params: dict) -> int:
    level = params.get("level")
    lo, hi = C.ZSTD_LEVELS
    if not isinstance(level, int) or isinstance(level, bool) or not lo <= level <= hi:
        raise ManifestError(f"zstd level {level!r} must be an int in {lo}..{hi}")
    return level


class Codec(abc.ABC):
    """Base class: one codec, identified by ``name`` in the manifest."""

    name = ""

    def check_params(self, params: dict, decoded_size: int, stored_size: int) -> None:
        """Raise ``ManifestError`` if ``params`` or the sizes are impossible for this codec."""

    @abc.abstractmethod
    def encode(self, data: np.ndarray, params: dict, map_fn: MapFn = map) -> bytes:
        """Encode the decoded bytes ``data`` (1-D uint8) to stored bytes."""

    def check_stored(self, stored, decoded_size: int, params: dict, what: str = "chunk") -> None:
        """Raise ``CorruptChunkError`` unless the framing of ``stored`` (frame table, zstd frame
        headers) matches ``decoded_size``; cheap, and run before the output is allocated."""

    @abc.abstractmethod
    def decode(self, stored, out: np.ndarray, params: dict, map_fn: MapFn = map,
               what: str = "chunk") -> None:
        """Decode ``stored`` into ``out`` (1-D uint8 of exactly the decoded size)."""


@register
class RawCodec(Codec):
    """Bytes stored as they are."""

    name = C.CODEC_RAW

    def check_params(self, params, decoded_size, stored_size):
        if stored_size != decoded_size:
            raise ManifestError(f"raw chunk: stored_size {stored_size} != decoded_size {decoded_size}")

    def encode(self, data, params, map_fn=map):
        return data.tobytes()

    def check_stored(self, stored, decoded_size, params, what="chunk"):
        if len(stored) != decoded_size:
            raise CorruptChunkError(f"{what}: raw chunk has {len(stored)} bytes, expected {decoded_size}")

    def decode(self, stored, out, params, map_fn=map, what="chunk"):
        self.check_stored(stored, out.nbytes, params, what)
        out[:] = np.frombuffer(stored, dtype=np.uint8)


def _read_table(stored, decoded_size: int, frame_size: int, entry: struct.Struct,
                what: str) -> tuple[list, list[tuple], int]:
    """The frames ``(start, size)``, the table entries and the end of the table, all checked."""
    mv = memoryview(stored)
    if len(mv) < 4:
        raise CorruptChunkError(f"{what}: too short for a frame table")
    (n,) = struct.unpack_from("<I", mv, 0)
    count = -(-decoded_size // frame_size)
    if n != count:
        raise CorruptChunkError(f"{what}: frame table says {n} frames, expected {count}")
    end = 4 + n * entry.size
    if end > len(mv):
        raise CorruptChunkError(f"{what}: frame table runs past the chunk ({end} > {len(mv)})")
    return (_frames(decoded_size, frame_size),
            [entry.unpack_from(mv, 4 + i * entry.size) for i in range(n)], end)


@register
class ZstdCodec(Codec):
    """Independent zstd frames of ``frame_size`` decoded bytes each."""

    name = C.CODEC_ZSTD
    _entry = struct.Struct("<I")

    def check_params(self, params, decoded_size, stored_size):
        _check_level(params)
        fs = _check_frame_size(params)
        _check_table_fits(decoded_size, fs, self._entry.size, stored_size)

    def encode(self, data, params, map_fn=map):
        level, fs = params["level"], params["frame_size"]
        frames = list(map_fn(lambda f: _zstd_compress(data[f[0]:f[0] + f[1]], level),
                             _frames(data.nbytes, fs)))
        table = struct.pack("<I", len(frames)) + b"".join(self._entry.pack(len(f)) for f in frames)
        return table + b"".join(frames)

    def _spans(self, stored, decoded_size, params, what):
        frames, table, pos = _read_table(stored, decoded_size, params["frame_size"], self._entry,
                                         what)
        spans = []
        for (start, size), (length,) in zip(frames, table):
            spans.append((start, size, pos, length))
            pos += length
        if pos != len(stored):
            raise CorruptChunkError(f"{what}: frames cover {pos} bytes, chunk has {len(stored)}")
        return spans

    def check_stored(self, stored, decoded_size, params, what="chunk"):
        mv = memoryview(stored)
        for start, size, at, length in self._spans(stored, decoded_size, params, what):
            _check_frame_header(mv[at:at + length], size, f"{what} frame at {start}")

    def decode(self, stored, out, params, map_fn=map, what="chunk"):
        from lct.format import native
        spans = self._spans(stored, out.nbytes, params, what)
        if native.frames_available():
            _decode_native(stored, out, [(s, n, at, ln, 0, 0) for s, n, at, ln in spans], 0,
                           map_fn, what)
            return
        mv = memoryview(stored)

        def one(span):
            start, size, at, length = span
            out[start:start + size] = np.frombuffer(
                _zstd_decompress(mv[at:at + length], size, f"{what} frame at {start}"), np.uint8)

        for _ in map_fn(one, spans):
            pass


_UINT = {2: np.uint16, 4: np.uint32}

# Frames per native call: few enough GIL round trips that a busy Python thread (an import
# running beside the loader) cannot starve the decoders, enough calls to spread a chunk over
# the worker pool.
NATIVE_BATCH = 16


def _decode_native(stored, out, spans, width: int, map_fn, what: str) -> None:
    """Decode ``spans`` (rows of start, n, at, hi_len, lo_len, mode) in C, in batches."""
    from lct.format import native
    rows = np.asarray(spans, dtype=np.int64).reshape(-1, 6)

    def one(b0):
        bad = native.decode_frames(stored, out, rows[b0:b0 + NATIVE_BATCH], width)
        if bad is not None:
            row, message = bad
            raise CorruptChunkError(f"{what} frame at {rows[b0 + row, 0]}: {message}")

    for _ in map_fn(one, range(0, len(rows), NATIVE_BATCH)):
        pass


LO_SAMPLE = 64 * 1024
LO_SAMPLE_GAIN = 0.97


@register
class PlanesCodec(Codec):
    """Lossless exponent / sign-mantissa planes for 16- and 32-bit floats (FORMAT.md 5)."""

    name = C.CODEC_PLANES
    _entry = struct.Struct("<IIB3s")    # hi length, lo length, mode, three zero bytes

    def check_params(self, params, decoded_size, stored_size):
        width = params.get("width")
        if not isinstance(width, int) or isinstance(width, bool) or width not in _UINT:
            raise ManifestError(f"planes codec: width {width!r} must be 2 or 4")
        _check_level(params)
        fs = _check_frame_size(params, width)
        if decoded_size % width:
            raise ManifestError(f"planes codec: decoded_size {decoded_size} is not a multiple "
                                f"of width {width}")
        _check_table_fits(decoded_size, fs, self._entry.size, stored_size)

    def encode(self, data, params, map_fn=map):
        width, level = params["width"], params["level"]

        def one(f):
            start, size = f
            x = data[start:start + size].view(_UINT[width])
            y = (x << 1) | (x >> (8 * width - 1))
            yb = y.view(np.uint8).reshape(-1, width)
            hi = _zstd_compress(np.ascontiguousarray(yb[:, width - 1]), ENTROPY_ONLY)
            lo_raw = np.ascontiguousarray(yb[:, :width - 1]).tobytes()
            # Sign/mantissa bytes of trained weights are close to random: try a sample first and
            # compress the whole plane only if the sample shrinks (saves ~40% of encode time).
            sample = lo_raw[:LO_SAMPLE]
            if len(_zstd_compress(sample, level)) > LO_SAMPLE_GAIN * len(sample):
                return hi, lo_raw, 0
            lo_z = _zstd_compress(lo_raw, level)
            return (hi, lo_z, 1) if len(lo_z) < len(lo_raw) else (hi, lo_raw, 0)

        frames = list(map_fn(one, _frames(data.nbytes, params["frame_size"])))
        table = struct.pack("<I", len(frames)) + b"".join(
            self._entry.pack(len(h), len(lo), mode, b"\0\0\0") for h, lo, mode in frames)
        return table + b"".join(h + lo for h, lo, _ in frames)

    def _spans(self, stored, decoded_size, params, what):
        width = params["width"]
        frames, table, pos = _read_table(stored, decoded_size, params["frame_size"], self._entry,
                                         what)
        spans = []
        for (start, size), (hi_len, lo_len, mode, pad) in zip(frames, table):
            n = size // width
            if pad != b"\0\0\0":
                raise CorruptChunkError(f"{what}: frame at {start}: reserved table bytes "
                                        f"{pad.hex()} are not zero")
            if mode not in (0, 1) or (mode == 0 and lo_len != n * (width - 1)):
                raise CorruptChunkError(f"{what}: frame at {start}: bad lo plane "
                                        f"(mode {mode}, {lo_len} bytes)")
            spans.append((start, n, pos, hi_len, lo_len, mode))
            pos += hi_len + lo_len
        if pos != len(stored):
            raise CorruptChunkError(f"{what}: frames cover {pos} bytes, chunk has {len(stored)}")
        return spans

    def check_stored(self, stored, decoded_size, params, what="chunk"):
        width = params["width"]
        mv = memoryview(stored)
        for start, n, at, hi_len, lo_len, mode in self._spans(stored, decoded_size, params, what):
            _check_frame_header(mv[at:at + hi_len], n, f"{what} frame at {start}")
            if mode == 1:
                _check_frame_header(mv[at + hi_len:at + hi_len + lo_len], n * (width - 1),
                                    f"{what} frame at {start}")

    def decode(self, stored, out, params, map_fn=map, what="chunk"):
        from lct.format import native
        width = params["width"]
        spans = self._spans(stored, out.nbytes, params, what)
        if native.frames_available():
            _decode_native(stored, out, spans, width, map_fn, what)
            return
        mv = memoryview(stored)

        def one(span):
            start, n, at, hi_len, lo_len, mode = span
            where = f"{what} frame at {start}"
            hi = _zstd_decompress(mv[at:at + hi_len], n, where)
            lo = mv[at + hi_len:at + hi_len + lo_len]
            if mode == 1:
                lo = _zstd_decompress(lo, n * (width - 1), where)
            frame = out[start:start + n * width]
            if width == 2:
                native.join_planes16(np.frombuffer(hi, np.uint8), np.frombuffer(lo, np.uint8),
                                     frame.view(np.uint16))
                return
            native.join_planes32(np.frombuffer(hi, np.uint8), np.frombuffer(lo, np.uint8),
                                 frame.view(np.uint32))

        for _ in map_fn(one, spans):
            pass


def choose_codec(width: int | None, codec: str) -> tuple[str, dict]:
    """Pick the codec for a chunk whose tensors share element ``width`` (None: mixed/bytes).

    ``codec`` is the policy's codec: ``planes`` falls back to ``zstd`` for chunks that are not
    16/32-bit floats.
    """
    if codec == C.CODEC_PLANES and width not in _UINT:
        return C.CODEC_ZSTD, {}
    if codec == C.CODEC_PLANES:
        return C.CODEC_PLANES, {"width": width}
    return codec, {}
