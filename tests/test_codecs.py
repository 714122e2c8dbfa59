"""Codec round trips are bit-exact for every dtype, size and frame split; bad inputs are refused."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from lct import codecs
from lct.errors import CorruptChunkError, UnsupportedVersionError


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
def test_round_trip_bit_exact(name, width, dtype, n, frame_size):
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


def test_nan_payloads_survive_planes():
    raw = np.array([0x7FC1, 0xFFFF, 0x7F81, 0x0001, 0x8000], dtype=np.uint16).view(np.uint8)
    params = {"width": 2, "level": 1, "frame_size": 4096}
    c = codecs.get_codec("planes")
    out = np.empty_like(raw)
    c.decode(c.encode(raw, params), out, params)
    assert np.array_equal(out, raw)


def test_planes_compresses_bf16_weights():
    t = (torch.randn(1 << 20) * 0.02).to(torch.bfloat16)
    data = _bytes(t)
    stored = codecs.get_codec("planes").encode(data, {"width": 2, "level": 1, "frame_size": 1 << 20})
    assert data.nbytes / len(stored) > 1.4


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
