"""Codec round trips are bit-exact for every dtype, size and frame split; bad inputs are refused."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from lct.errors import CorruptChunkError, UnsupportedVersionError
from lct.format import codecs


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8).numpy().copy()


def _specials(dtype):
    vals = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3.5],
                        dtype=torch.float32)
    return vals.to(dtype)


CASES = [
    ("planes", 2, torch.bfloat16), ("planes", 2, torch.float16), ("planes", 4, torch.float32),
    ("zstd", None, torch.bfloat16), ("zstd", None, torch.int64), ("raw", None, torch.float32),
]


@pytest.mark.parametrize("name,width,dtype", CASES)
@pytest.mark.parametrize("n", [0, 1, 7, 4096, 100_003])
@pytest.mark.parametrize("frame_size", [4096, 1 << 20])
def test_round_trip_bit_exact(name, width, dtype, n, frame_size, native_mode):
    gen = torch.Generator().manual_seed(n)
    if dtype.is_floating_point:
        t = torch.cat([_specials(dtype), (torch.randn(n, generator=gen) * 0.02).to(dtype)])
    else:
        t = torch.randint(-1000, 1000, (n,), generator=gen, dtype=dtype)
    data = _bytes(t)
    params = {"level": 1, "frame_size": frame_size}
    if width:
        params["width"] = width
    codec = codecs.get_codec(name)
    with ThreadPoolExecutor(2) as pool:
        stored = codec.encode(data, params, pool.map)
        out = np.empty_like(data)
        codec.decode(stored, out, params, pool.map)
    assert np.array_equal(out, data)


def test_nan_payloads_survive_planes(native_mode):
    raw = np.array([0x7FC1, 0xFFFF, 0x7F81, 0x0001, 0x8000], dtype=np.uint16).view(np.uint8)
    params = {"width": 2, "level": 1, "frame_size": 4096}
    c = codecs.get_codec("planes")
    out = np.empty_like(raw)
    c.decode(c.encode(raw, params), out, params)
    assert np.array_equal(out, raw)


@pytest.mark.parametrize("width", [2, 4])
def test_native_join_equals_numpy_on_every_byte_pattern(width):
    """The compiled planes join and the numpy passes agree on all 2**16 hi/lo byte pairs (and
    random 32-bit patterns), so the two decoders can never disagree on an artifact."""
    from lct.format import native
    if not native.available():
        pytest.fail("lct.format._native was not built")
    rng = np.random.default_rng(width)
    if width == 2:
        hi = np.repeat(np.arange(256, dtype=np.uint8), 256)
        lo = np.tile(np.arange(256, dtype=np.uint8), 256)
    else:
        hi = rng.integers(0, 256, 100_003, dtype=np.uint8)
        lo = rng.integers(0, 256, 3 * 100_003, dtype=np.uint8)
    n = hi.size
    fast = np.empty(n, np.uint16 if width == 2 else np.uint32)
    slow = np.empty_like(fast)
    if width == 2:
        native.join_planes16(hi, lo, fast)
        native._ENABLED = False
        try:
            native.join_planes16(hi, lo, slow)
        finally:
            native._ENABLED = True
        assert np.unique(fast).size == 65536  # a bijection
    else:
        native.join_planes32(hi, lo, fast)
        native._ENABLED = False
        try:
            native.join_planes32(hi, lo, slow)
        finally:
            native._ENABLED = True
    assert np.array_equal(fast, slow)


def test_native_join_checks_lengths():
    from lct.format import native
    if native._native is None:
        pytest.fail("lct.format._native was not built")
    hi = np.zeros(8, np.uint8)
    with pytest.raises(ValueError, match="mantissa bytes"):
        native._native.join_planes(hi, np.zeros(7, np.uint8), np.zeros(8, np.uint16), 2)
    with pytest.raises(ValueError, match="width"):
        native._native.join_planes(hi, np.zeros(8, np.uint8), np.zeros(8, np.uint16), 3)
    with pytest.raises(ValueError, match="mantissa bytes"):
        native._native.join_planes(hi, np.zeros(24, np.uint8), np.zeros(4, np.uint32), 4)


@pytest.mark.parametrize("width", [0, 2])
def test_native_decode_frames_checks_every_row_before_decoding(width):
    from lct.format import native
    if not native.frames_available():
        pytest.fail("lct.format._native was not built or libzstd was not found")
    data = (torch.randn(8192) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().copy()
    name = "planes" if width else "zstd"
    params = {"level": 1, "frame_size": 4096, **({"width": 2} if width else {})}
    codec = codecs.get_codec(name)
    stored = codec.encode(data, params)
    spans = codec._spans(stored, data.nbytes, params, "x")
    rows = np.array([s if width else (*s, 0, 0) for s in spans], dtype=np.int64)
    out = np.zeros_like(data)
    assert native.decode_frames(stored, out, rows, width) is None
    assert np.array_equal(out, data)
    for col, value in [(0, data.nbytes), (2, len(stored)), (3, 1 << 40), (0, -2), (5, 7)]:
        bad = rows.copy()
        bad[-1, col] = value
        out[:] = 0
        assert native.decode_frames(stored, out, bad, width) == (len(rows) - 1, "frame table "
                                                                 "row does not fit the chunk")
        assert not out.any()                       # refused before anything was decoded
    if not width:                                  # a second (empty) frame after the first
        import zstandard
        extra = zstandard.ZstdCompressor(write_content_size=True).compress(b"")
        one = rows[:1].copy()
        one[0, 3] += len(extra)
        first = bytes(stored[:rows[0, 2] + rows[0, 3]]) + extra
        assert native.decode_frames(first, out, one, 0) == (0, "zstd error: data after the frame")
    broken = bytearray(stored)
    broken[rows[1, 2] + 20] ^= 0xFF                # inside the second frame's zstd data
    got = native.decode_frames(bytes(broken), out, rows, width)
    assert got is None or got[0] == 1              # a flip may still decode (checksums catch it)


def test_planes_compresses_bf16_weights():
    t = (torch.randn(1 << 20) * 0.02).to(torch.bfloat16)
    data = _bytes(t)
    stored = codecs.get_codec("planes").encode(data, {"width": 2, "level": 1, "frame_size": 1 << 20})
    assert data.nbytes / len(stored) > 1.4


def test_planes_reserved_table_bytes_must_be_zero():
    """FORMAT.md 5: each frame-table entry ends in three zero bytes; anything else is corrupt."""
    data = _bytes((torch.randn(10_000) * 0.02).to(torch.bfloat16))
    params = {"width": 2, "level": 1, "frame_size": 4096}
    c = codecs.get_codec("planes")
    stored = bytearray(c.encode(data, params))
    assert stored[4 + 9: 4 + 12] == b"\0\0\0"       # count, then hi, lo, mode, reserved
    out = np.empty_like(data)
    c.decode(bytes(stored), out, params)
    assert np.array_equal(out, data)
    stored[4 + 10] = 1
    with pytest.raises(CorruptChunkError, match="reserved table bytes 000100 are not zero"):
        c.decode(bytes(stored), np.empty_like(data), params)


def test_unknown_codec():
    with pytest.raises(UnsupportedVersionError, match="brotli"):
        codecs.get_codec("brotli")


def test_truncated_stream_is_an_error():
    data = _bytes((torch.randn(10_000) * 0.02).to(torch.bfloat16))
    params = {"width": 2, "level": 1, "frame_size": 4096}
    c = codecs.get_codec("planes")
    stored = c.encode(data, params)
    with pytest.raises(CorruptChunkError):
        c.decode(stored[:-10], np.empty_like(data), params)
    with pytest.raises(CorruptChunkError):
        c.decode(stored + b"x", np.empty_like(data), params)


def test_choose_codec():
    assert codecs.choose_codec(2, "planes") == ("planes", {"width": 2})
    assert codecs.choose_codec(None, "planes") == ("zstd", {})
    assert codecs.choose_codec(8, "planes") == ("zstd", {})
    assert codecs.choose_codec(2, "zstd") == ("zstd", {})


def test_checksum_in_pieces_is_the_one_call_digest():
    """Chunks are hashed CHECKSUM_PIECE bytes per call (the decode threads beside the hash take
    the GIL between pieces): the digest is xxh3_64 of the whole, for any length and any
    buffer type."""
    import xxhash
    rng = np.random.default_rng(0)
    for n in (0, 1, codecs.CHECKSUM_PIECE, codecs.CHECKSUM_PIECE + 1, 3 * codecs.CHECKSUM_PIECE + 5):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        want = f"xxh3_64:{xxhash.xxh3_64_hexdigest(data.tobytes())}"
        assert codecs.checksum(data) == codecs.checksum(memoryview(data.tobytes())) == want
    wide = rng.integers(0, 1 << 15, codecs.CHECKSUM_PIECE, dtype=np.int16)   # not bytes: cast
    assert codecs.checksum(wide) == f"xxh3_64:{xxhash.xxh3_64_hexdigest(wide.tobytes())}"
