"""Golden tests: the format as docs/FORMAT.md writes it, independent of lct's writer.

``test_hand_built_artifact_reads_back`` lays out an artifact byte by byte with ``struct``,
``zstandard`` and ``xxhash`` only (data file header, a ``raw`` chunk holding an NF4 tensor and its
absmax, a ``zstd`` chunk with its frame table, a ``planes`` chunk with its frame table, the JSON
manifest) and checks that ``lct.open`` reads exactly the tensors that went in. The other tests go
the other way: lct's encoders on tiny known inputs must produce the bytes the spec describes.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
import xxhash
import zstandard

import lct
from lct.format import constants as C
from lct.format import nf4
from lct.format.codecs import get_codec

ARTIFACT_ID = "0123456789abcdef0123456789abcdef"
NF4_TABLE = np.array(C.NF4_CODE, dtype=np.float32)
MIDPOINTS = (NF4_TABLE[:-1] + NF4_TABLE[1:]) / np.float32(2)  # float32, as bitsandbytes


# Hand encoders (spec section 5), written from the text, not from lct.format.codecs ------------------
def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)


def _zstd_chunk(decoded: bytes, frame_size: int) -> bytes:
    frames = [_zstd(decoded[s:s + frame_size]) for s in range(0, len(decoded), frame_size)]
    return struct.pack("<I", len(frames)) + b"".join(struct.pack("<I", len(f)) for f in frames) \
        + b"".join(frames)


def _rotl16(u16: np.ndarray) -> np.ndarray:
    return ((u16.astype(np.uint32) << 1) | (u16.astype(np.uint32) >> 15)).astype(np.uint16)


def _planes_chunk(decoded: bytes, frame_size: int, lo_modes: list) -> bytes:
    """width 2: hi plane one zstd frame; lo plane raw (mode 0) or zstd (mode 1) as ``lo_modes``."""
    entries, bodies = [], []
    for k, s in enumerate(range(0, len(decoded), frame_size)):
        y = _rotl16(np.frombuffer(decoded[s:s + frame_size], dtype="<u2"))
        hi = bytes((y >> 8).astype(np.uint8))
        lo = bytes((y & 0xFF).astype(np.uint8))
        hi_z = _zstd(hi)
        lo_s = _zstd(lo) if lo_modes[k] else lo
        entries.append(struct.pack("<IIB3x", len(hi_z), len(lo_s), lo_modes[k]))
        bodies.append(hi_z + lo_s)
    return struct.pack("<I", len(entries)) + b"".join(entries) + b"".join(bodies)


def _pad(b: bytes, n: int) -> bytes:
    assert len(b) <= n
    return b + b"\0" * (n - len(b))


# The hand-built artifact -----------------------------------------------------------------------
def _nf4_input():
    """[2, 64], blocksize 64: row 0 = NF4_CODE[i % 16] * 2 (absmax 2, code i % 16); row 1 zeros."""
    row0 = np.array([C.NF4_CODE[i % 16] * 2.0 for i in range(64)], dtype=np.float32)
    x = np.stack([row0, np.zeros(64, np.float32)])
    # Codes by hand: pairs (0,1),(2,3),...,(14,15) -> 0x01 0x23 ... 0xEF, four times; row 1: 0x77.
    packed = bytes([0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF] * 4) + b"\x77" * 32
    absmax = struct.pack("<2f", 2.0, 0.0)
    return x, packed, absmax


def _build(root, *, extra_manifest=None):
    """Write the golden artifact into ``root``; return ``(expected tensors, nf4 parts)``."""
    root.mkdir(parents=True)
    expected = {}

    # chunk 0, group "embed", raw: an NF4 tensor [2, 64] at 0 and its absmax at 64.
    x, packed, absmax = _nf4_input()
    c0 = _pad(packed, 64) + absmax                    # decoded 72 bytes
    # chunk 1, group "layers.0", zstd, frame_size 32 -> frames of 32, 32, 24 bytes.
    f32 = np.arange(15, dtype="<f4").reshape(3, 5) * np.float32(-1.5)
    i32 = np.array([[1, -2, 3], [2**31 - 1, -2**31, 0]], dtype="<i4")
    c1 = _pad(f32.tobytes(), 64) + i32.tobytes()      # decoded 88 bytes
    expected["model.layers.0.w"] = torch.from_numpy(f32.copy())
    expected["model.layers.0.idx"] = torch.from_numpy(i32.copy())
    # chunk 2, group "layers.0", planes width 2, frame_size 128 -> frames of 128, 128, 64 bytes.
    bits = np.array([0x3F80, 0xBF80, 0x0000, 0x8000, 0x7FC1, 0xFF81, 0x0001, 0x4049] * 20,
                    dtype="<u2")                     # 1, -1, 0, -0, NaN payloads, denormal, pi
    bits[8:] ^= np.arange(8, 160, dtype=np.uint16) & 0x00FF  # vary the mantissas
    c2 = bits.tobytes()                               # [4, 40] bfloat16, decoded 320 bytes
    expected["model.layers.0.bf"] = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16) \
        .reshape(4, 40)
    # chunk 3, group "norm", raw: a float16 vector and a bool vector.
    f16 = np.array([0.5, -0.25, 65504, -0.0, 1e-7, 3.0], dtype="<f2")
    bl = np.array([True, False, True], dtype=np.bool_)
    c3 = _pad(f16.tobytes(), 64) + bl.tobytes()        # decoded 67 bytes
    expected["model.norm.weight"] = torch.from_numpy(f16.copy())
    expected["model.norm.mask"] = torch.from_numpy(bl.copy())

    stored = [
        (c0, len(c0), "raw", {}, "embed"),
        (_zstd_chunk(c1, 32), len(c1), "zstd", {"level": 3, "frame_size": 32}, "layers.0"),
        (_planes_chunk(c2, 128, [0, 1, 0]), len(c2), "planes",
         {"width": 2, "level": 3, "frame_size": 128}, "layers.0"),
        (c3, len(c3), "raw", {}, "norm"),
    ]
    header = C.DATA_MAGIC + struct.pack("<HHI", 1, 0, 0) + bytes.fromhex(ARTIFACT_ID)
    data = bytearray(_pad(header, 4096))
    chunks = []
    for i, (blob, decoded, codec, params, group) in enumerate(stored):
        offset = len(data)
        assert offset % 4096 == 0
        data += blob
        if i + 1 < len(stored):
            data += b"\0" * (-len(data) % 4096)
        chunks.append({"id": i, "group": group, "file": 0, "offset": offset,
                       "stored_size": len(blob), "decoded_size": decoded, "codec": codec,
                       "params": params, "checksum": "xxh3_64:" + xxhash.xxh3_64_hexdigest(blob)})
    (root / "model-00000.lct").write_bytes(bytes(data))

    def plain(name, shape, dtype, group, chunk, offset, nbytes, role="layer"):
        return {"name": name, "shape": shape, "dtype": dtype, "stored_dtype": dtype,
                "encoding": "plain", "role": role, "group": group, "chunk": chunk,
                "offset": offset, "nbytes": nbytes}

    manifest = {
        "format": "lct",
        "format_version": [1, 0],
        "created_by": "hand (tests/test_golden.py)",
        "artifact_id": ARTIFACT_ID,
        "source": {"id": "hand", "kind": "local", "revision": None, "files": {}},
        "architecture": {"model_type": "llama", "tie_word_embeddings": True, "mapping": "llama"},
        "policy": {"nf4": ["embed"], "blocksize": 64, "dtype": None, "codec": "planes",
                   "level": 3, "frame_size": 128},
        "files": [{"name": "model-00000.lct", "size": len(data)}],
        "groups": ["embed", "layers.0", "norm"],
        "chunks": chunks,
        "tensors": [
            {"name": "model.embed_tokens.weight", "shape": [2, 64], "dtype": "float32",
             "stored_dtype": "nf4", "encoding": "nf4", "role": "embed", "group": "embed",
             "chunk": 0, "offset": 0, "nbytes": 64,
             "nf4": {"blocksize": 64, "absmax_offset": 64, "absmax_nbytes": 8}},
            plain("model.layers.0.w", [3, 5], "float32", "layers.0", 1, 0, 60),
            plain("model.layers.0.idx", [2, 3], "int32", "layers.0", 1, 64, 24),
            plain("model.layers.0.bf", [4, 40], "bfloat16", "layers.0", 2, 0, 320),
            plain("model.norm.weight", [6], "float16", "norm", 3, 0, 12, role="norm"),
            plain("model.norm.mask", [3], "bool", "norm", 3, 64, 3, role="norm"),
        ],
        "ties": {"lm_head.weight": "model.embed_tokens.weight"},
        "unmapped": [],
    }
    manifest.update(extra_manifest or {})
    text = json.dumps(manifest, indent=1)
    if tuple(manifest["format_version"]) >= (1, 1):
        text = _seal_by_the_spec(manifest)
    (root / "lct.json").write_text(text)
    (root / "README.md").write_text("a file the reader must ignore\n")
    return expected, (x, packed, absmax)


def _seal_by_the_spec(manifest: dict) -> str:
    """FORMAT.md section 6, written out here from the text (not lct's code): each chunk's
    binding, then the manifest checksum over the bytes with its value as 16 zeros."""
    for c in manifest["chunks"]:
        held = [[t["name"], None, t["shape"], t["dtype"], t["stored_dtype"], t["encoding"],
                 t["role"], t["group"], t["offset"], t["nbytes"], t.get("nf4"), t.get("int8"),
                 t.get("row_order")] for t in manifest["tensors"] if t["chunk"] == c["id"]]
        held.sort(key=lambda e: (e[8], e[0]))
        names = {e[0] for e in held}
        desc = {k: c[k] for k in ("id", "group", "file", "offset", "stored_size",
                                  "decoded_size", "codec", "params", "checksum")}
        desc["tensors"] = held
        desc["ties"] = sorted([v, k] for k, v in manifest["ties"].items() if v in names)
        canon = json.dumps(desc, sort_keys=True, separators=(",", ":"))
        c["binding"] = "xxh3_64:" + xxhash.xxh3_64_hexdigest(canon.encode())
    manifest["manifest_checksum"] = "xxh3_64:" + "0" * 16
    zeroed = json.dumps(manifest, indent=1)
    digest = "xxh3_64:" + xxhash.xxh3_64_hexdigest(zeroed.encode())
    return zeroed.replace("xxh3_64:" + "0" * 16, digest)


def test_sealed_hand_built_artifact_reads_back_and_refuses_edits(tmp_path):
    """A 1.1 manifest sealed as the spec says is read; an edit that is resealed but leaves the
    bindings (a tensor's shape transposed, same bytes) fails on the binding, and an unsealed edit
    on the manifest checksum."""
    from lct.errors import ManifestChecksumError, ManifestError
    from lct.format.manifest import seal
    expected, _ = _build(tmp_path / "golden.lct", extra_manifest={"format_version": [1, 1]})
    with lct.open(tmp_path / "golden.lct") as art:
        assert _same(art.read_tensor("model.layers.0.w"), expected["model.layers.0.w"])
    path = tmp_path / "golden.lct" / "lct.json"
    good = path.read_text()
    m = json.loads(good)
    next(t for t in m["tensors"] if t["name"] == "model.layers.0.w")["shape"] = [5, 3]
    path.write_text(seal(json.dumps(m, indent=1)))
    with pytest.raises(ManifestError, match="chunk 1 .*binding"):
        lct.open(tmp_path / "golden.lct")
    path.write_text(good.replace('"level": 3', '"level": 4', 1))
    with pytest.raises(ManifestChecksumError, match="manifest checksum mismatch"):
        lct.open(tmp_path / "golden.lct")
    path.write_text(good.replace('"manifest_checksum"', '"manifest_checksum_"'))
    with pytest.raises(ManifestError, match="exactly one top-level 'manifest_checksum'"):
        lct.open(tmp_path / "golden.lct")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_hand_built_artifact_reads_back(tmp_path):
    expected, (x, packed, absmax) = _build(tmp_path / "golden.lct")
    with lct.open(tmp_path / "golden.lct") as art:
        assert art.groups == ["embed", "layers.0", "norm"]
        assert set(art.tensor_names) == set(expected) | {"model.embed_tokens.weight",
                                                         "lm_head.weight"}
        for name, want in expected.items():
            got = art.read_tensor(name)
            assert _same(got, want), name
        layer = art.read_group("layers.0")
        assert set(layer) == {"model.layers.0.w", "model.layers.0.idx", "model.layers.0.bf"}
        for name, got in layer.items():
            assert _same(got, expected[name]), name

        # NF4: packed codes and absmax exactly as written by hand ...
        w = art.read_tensor("model.embed_tokens.weight", dequantize=False)
        assert w.shape == (2, 64) and w.blocksize == 64
        assert bytes(w.packed.numpy()) == packed
        assert bytes(w.absmax.numpy().tobytes()) == absmax
        # ... and dequantization is code_table[nibble] * absmax[block] (here: x exactly).
        nib = np.frombuffer(packed, np.uint8)
        codes = np.stack([nib >> 4, nib & 0x0F], axis=1).reshape(2, 64)
        am = np.frombuffer(absmax, "<f4")[:, None]
        want = torch.from_numpy(NF4_TABLE[codes] * am)
        deq = art.read_tensor("model.embed_tokens.weight")
        assert deq.dtype == torch.float32 and torch.equal(deq, want)
        assert torch.equal(deq, torch.from_numpy(x))
        # The tie resolves to the same stored tensor.
        assert torch.equal(art.read_tensor("lm_head.weight"), want)
        emb = art.read_group("embed")
        assert set(emb) == {"model.embed_tokens.weight", "lm_head.weight"}

    # lct's own NF4 quantizer agrees with the hand-computed bytes.
    q_packed, q_absmax = nf4.quantize(torch.from_numpy(x), 64)
    assert bytes(q_packed.numpy()) == packed
    assert q_absmax.numpy().tobytes() == absmax


def test_hand_built_artifact_bitsandbytes_state_dict(tmp_path):
    _build(tmp_path / "golden.lct")
    with lct.open(tmp_path / "golden.lct") as art:
        sd = art.read_tensor("model.embed_tokens.weight", dequantize=False) \
            .bnb_state_dict("model.embed_tokens")
    assert set(sd) == {"model.embed_tokens.weight", "model.embed_tokens.weight.absmax",
                       "model.embed_tokens.weight.quant_map",
                       "model.embed_tokens.weight.quant_state.bitsandbytes__nf4"}
    assert sd["model.embed_tokens.weight"].shape == (64, 1)
    assert torch.equal(sd["model.embed_tokens.weight.quant_map"], torch.from_numpy(NF4_TABLE))
    qs = json.loads(bytes(sd["model.embed_tokens.weight.quant_state.bitsandbytes__nf4"].numpy()))
    assert qs == {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2, 64]}


def test_newer_minor_version_with_unknown_keys_still_reads(tmp_path):
    """Section 8: a 1.x reader reads a (1, n > m) artifact, ignoring keys it does not know."""
    expected, _ = _build(tmp_path / "golden.lct",
                         extra_manifest={"format_version": [1, 9], "x_future": {"a": [1, 2]}})
    with lct.open(tmp_path / "golden.lct") as art:
        assert art.manifest.format_version == (1, 9)
        assert _same(art.read_tensor("model.layers.0.bf"), expected["model.layers.0.bf"])


# lct's encoders -> the bytes the spec describes --------------------------------------------
BF16_IN = np.array([0x3F80, 0xBF80, 0x0000, 0x8000, 0x7FC1, 0x4049], dtype="<u2")
# y = rotl1(x): 7F00 7F01 0000 0001 FF82 8092 -> hi = top byte, lo = low byte.
BF16_HI = bytes([0x7F, 0x7F, 0x00, 0x00, 0xFF, 0x80])
BF16_LO = bytes([0x00, 0x01, 0x00, 0x01, 0x82, 0x92])


def _table(stored: bytes, entry: str):
    (count,) = struct.unpack_from("<I", stored, 0)
    size = struct.calcsize(entry)
    return count, [struct.unpack_from(entry, stored, 4 + k * size) for k in range(count)], \
        4 + count * size


def test_planes_golden_bytes_bf16():
    data = BF16_IN.view(np.uint8)
    stored = get_codec("planes").encode(data, {"width": 2, "level": 1, "frame_size": 4096})
    count, entries, pos = _table(stored, "<IIBBBB")
    assert count == 1
    hi_len, lo_len, mode, *pad = entries[0]
    assert pad == [0, 0, 0]
    assert mode == 0 and lo_len == 6          # 6 bytes compress worse than raw: stored raw
    assert len(stored) == pos + hi_len + lo_len
    hi_frame = stored[pos:pos + hi_len]
    assert zstandard.frame_content_size(hi_frame) == 6     # content size in the header
    assert zstandard.ZstdDecompressor().decompress(hi_frame) == BF16_HI
    assert stored[pos + hi_len:] == BF16_LO
    # And it decodes back bit-exactly (NaN payload included).
    out = np.empty(data.nbytes, np.uint8)
    get_codec("planes").decode(stored, out, {"width": 2, "level": 1, "frame_size": 4096})
    assert out.tobytes() == data.tobytes()


def test_planes_golden_bytes_multiframe_and_lo_zstd():
    # frame_size 4 bytes = 2 elements per frame -> 3 frames.
    data = BF16_IN.view(np.uint8)
    stored = get_codec("planes").encode(data, {"width": 2, "level": 1, "frame_size": 4})
    count, entries, pos = _table(stored, "<IIB3x")
    assert count == 3
    d = zstandard.ZstdDecompressor()
    for k, (hi_len, lo_len, mode) in enumerate(entries):
        assert mode == 0 and lo_len == 2
        assert d.decompress(stored[pos:pos + hi_len]) == BF16_HI[2 * k:2 * k + 2]
        assert stored[pos + hi_len:pos + hi_len + lo_len] == BF16_LO[2 * k:2 * k + 2]
        pos += hi_len + lo_len
    assert pos == len(stored)

    # 4096 x 1.0: the lo plane is all zero and compresses, so it is stored as zstd (mode 1).
    ones = np.full(4096, 0x3F80, dtype="<u2").view(np.uint8)
    stored = get_codec("planes").encode(ones, {"width": 2, "level": 1, "frame_size": 8192})
    count, entries, pos = _table(stored, "<IIB3x")
    (hi_len, lo_len, mode), = entries
    assert count == 1 and mode == 1
    assert d.decompress(stored[pos:pos + hi_len]) == b"\x7f" * 4096
    assert d.decompress(stored[pos + hi_len:pos + hi_len + lo_len]) == b"\0" * 4096
    assert pos + hi_len + lo_len == len(stored)


def test_planes_golden_bytes_float32():
    # 1.0f = 3F800000 -> rotl 7F000000; -2.0f = C0000000 -> 80000001.
    data = np.array([0x3F800000, 0xC0000000], dtype="<u4").view(np.uint8)
    stored = get_codec("planes").encode(data, {"width": 4, "level": 1, "frame_size": 4096})
    count, ((hi_len, lo_len, mode),), pos = _table(stored, "<IIB3x")
    assert count == 1 and mode == 0 and lo_len == 6
    assert zstandard.ZstdDecompressor().decompress(stored[pos:pos + hi_len]) == b"\x7f\x80"
    assert stored[pos + hi_len:] == b"\0\0\0" + b"\x01\0\0"


def test_zstd_golden_frame_table():
    data = np.arange(100, dtype=np.uint8)
    stored = get_codec("zstd").encode(data, {"level": 1, "frame_size": 40})
    count, entries, pos = _table(stored, "<I")
    assert count == 3                                   # ceil(100 / 40)
    d = zstandard.ZstdDecompressor()
    for k, (length,) in enumerate(entries):
        frame = stored[pos:pos + length]
        want = data[40 * k:40 * k + 40].tobytes()
        assert zstandard.frame_content_size(frame) == len(want)
        assert d.decompress(frame) == want
        pos += length
    assert pos == len(stored)


def test_checksum_is_xxh3_64_of_stored_bytes():
    from lct.io.writer import checksum
    assert checksum(b"lct") == "xxh3_64:" + xxhash.xxh3_64_hexdigest(b"lct")
    assert checksum(b"") == "xxh3_64:2d06800538d394c2"    # xxh3_64 of the empty string


# NF4 golden bytes ------------------------------------------------------------------------------
def test_nf4_midpoints_take_the_lower_code():
    # absmax 1 (the block holds 1.0), so the scaled value is the value itself (x * (1/1)).
    vals = [1.0] + [float(m) for m in MIDPOINTS] \
        + [float(np.nextafter(m, np.float32(2))) for m in MIDPOINTS]
    vals += [0.0] * (64 - len(vals))
    x = torch.tensor(vals, dtype=torch.float32).reshape(1, 64)
    packed, absmax = nf4.quantize(x, 64)
    assert absmax.tolist() == [1.0]
    # code = number of midpoints strictly below: on midpoint k -> k; just above -> k + 1.
    codes = [15] + list(range(15)) + list(range(1, 16)) + [7] * 33
    want = bytes((codes[2 * i] << 4) | codes[2 * i + 1] for i in range(32))
    assert bytes(packed.numpy()) == want


def test_nf4_zero_block_and_scaling():
    # Block 0: all zero -> 0x77 and absmax 0. Block 1: absmax 4, x = 4 * code[k] -> code k.
    row = [0.0] * 64 + [4.0 * C.NF4_CODE[(3 * i) % 16] for i in range(64)]
    packed, absmax = nf4.quantize(torch.tensor(row, dtype=torch.float32).reshape(2, 64), 64)
    assert absmax.tolist() == [0.0, 4.0]
    assert bytes(packed[:32].numpy()) == b"\x77" * 32
    codes = [(3 * i) % 16 for i in range(64)]
    assert bytes(packed[32:].numpy()) == bytes((codes[2 * i] << 4) | codes[2 * i + 1]
                                               for i in range(32))
    # Dequantization: code_table[nibble] * absmax[block].
    deq = nf4.dequantize(packed, absmax, (2, 64), 64, torch.float32)
    assert torch.equal(deq[0], torch.zeros(64))
    assert torch.equal(deq[1], torch.tensor([4.0 * NF4_TABLE[c] for c in codes],
                                            dtype=torch.float32))


def test_nf4_negative_block_and_bfloat16_input():
    # absmax is of |x|: a block of negatives with -1 at its extreme maps -1 -> code 0.
    x = torch.tensor([[-1.0, -0.5, 0.25, 0.0] * 16], dtype=torch.bfloat16)
    packed, absmax = nf4.quantize(x, 64)
    assert absmax.tolist() == [1.0]
    # -0.5 lies between codes 2 (-0.5251) and 3 (-0.3949), below their midpoint -0.4600: code 2;
    # 0.25 lies between codes 10 (0.2461) and 11 (0.3379), below their midpoint 0.2920: code 10.
    code = {v: int(np.sum(MIDPOINTS < np.float32(v))) for v in (-1.0, -0.5, 0.25, 0.0)}
    assert code == {-1.0: 0, -0.5: 2, 0.25: 10, 0.0: 7}
    assert bytes(packed.numpy()) == bytes([0x02, 0xA7] * 16)


def test_nf4_odd_tail_is_unreachable():
    """The spec pads an odd tail with code 7, but blocksize is even and divides the row, so the
    element count is always even: quantize refuses any shape that could give an odd count."""
    from lct.errors import PolicyError
    with pytest.raises(PolicyError, match="blocksize"):
        nf4.quantize(torch.zeros(3, 5), 5)
    with pytest.raises(PolicyError, match="divide the row length"):
        nf4.quantize(torch.zeros(1, 65), 64)
