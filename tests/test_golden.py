"""Golden tests: the format as docs/FORMAT.md writes it, independent of lct's writer.

``test_hand_built_artifact_reads_back`` lays out an artifact byte by byte with ``struct``,
``zstandard`` and ``xxhash`` only (data file header, a ``raw`` chunk holding an NF4 tensor and its
absmax, a ``zstd`` chunk with its frame table, a ``planes`` chunk with its frame table, the JSON
manifest) and checks that ``lct.open`` reads exactly the tensors that went in. The other tests go
the other way: lct's encoders on tiny known inputs must produce the bytes the spec describes.
"""

from __future__ import annotations

import json
import re
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

    decoded_bytes = [c0, c1, c2, c3]
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
    if tuple(manifest["format_version"]) >= (1, 6):     # section 6: each chunk's decoded bytes
        for c, raw in zip(chunks, decoded_bytes):
            c["decoded_checksum"] = "xxh3_64:" + xxhash.xxh3_64_hexdigest(raw)
    text = json.dumps(manifest, indent=1)
    if tuple(manifest["format_version"]) >= (1, 1):
        text = _seal_by_the_spec(manifest)
    (root / "lct.json").write_text(text)
    (root / "README.md").write_text("a file the reader must ignore\n")
    return expected, (x, packed, absmax)


def _seal_by_the_spec(manifest: dict) -> str:
    """FORMAT.md section 6, written out here from the text (not lct's code): each chunk's
    binding (a sharded tensor is listed once per piece, with the piece's rows or columns and
    place), then the manifest checksum over the bytes with its value as 16 zeros."""
    placed = []                     # (chunk, [name, span, shape, ..., row_order])
    for t in manifest["tensors"]:
        for p in t.get("pieces") or [t]:
            placed.append((p["chunk"], [
                t["name"], p.get("rows", p.get("cols")), t["shape"], t["dtype"], t["stored_dtype"],
                t["encoding"], t["role"], t["group"], p["offset"], p["nbytes"], p.get("nf4"),
                p.get("int8"), t.get("row_order")]))
    for c in manifest["chunks"]:
        held = [e for chunk, e in placed if chunk == c["id"]]
        held.sort(key=lambda e: (e[8], e[0]))
        names = {e[0] for e in held}
        desc = {k: c[k] for k in ("id", "group", "file", "offset", "stored_size",
                                  "decoded_size", "codec", "params", "checksum")}
        desc["tensors"] = held
        desc["ties"] = sorted([v, k] for k, v in manifest["ties"].items() if v in names)
        if "decoded_checksum" in c:         # since 1.6
            desc["decoded_checksum"] = c["decoded_checksum"]
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


def test_decoded_checksums_pin_each_chunks_decoded_bytes(tmp_path):
    """Section 6, since 1.6: each chunk's ``decoded_checksum`` is the xxh3_64 of its decoded
    bytes, bound into its binding; a 1.6 manifest without one is refused, and one edited (the
    manifest resealed, the binding left) fails on the binding."""
    from lct.errors import ManifestError
    from lct.format.manifest import seal
    expected, _ = _build(tmp_path / "golden.lct", extra_manifest={"format_version": [1, 6]})
    with lct.open(tmp_path / "golden.lct") as art:
        assert art.manifest.chunks[1].decoded_checksum == \
            "xxh3_64:" + xxhash.xxh3_64_hexdigest(bytes(art.read_chunk(1)))
        assert _same(art.read_tensor("model.layers.0.bf"), expected["model.layers.0.bf"])
    path = tmp_path / "golden.lct" / "lct.json"
    good = json.loads(path.read_text())
    m = json.loads(path.read_text())
    m["chunks"][2]["decoded_checksum"] = "xxh3_64:" + "1" * 16
    path.write_text(seal(json.dumps(m, indent=1)))
    with pytest.raises(ManifestError, match="chunk 2 .*binding"):
        lct.open(tmp_path / "golden.lct")
    del good["chunks"][3]["decoded_checksum"]
    path.write_text(seal(json.dumps(good, indent=1)))
    with pytest.raises(ManifestError, match="chunk 3 \\(norm\\) has no 'decoded_checksum', "
                                            "which format 1.6 requires"):
        lct.open(tmp_path / "golden.lct")


def test_writer_decoded_checksums_are_the_decoded_bytes(gemma_art):
    """What the converter writes: every chunk's decoded_checksum is its decode's xxh3_64."""
    with lct.open(gemma_art) as art:
        assert art.manifest.format_version >= (1, 6)
        for c in art.manifest.chunks:
            assert c.decoded_checksum == \
                "xxh3_64:" + xxhash.xxh3_64_hexdigest(bytes(art.read_chunk(c.id))), c.id


def test_verify_checks_each_chunks_decode_against_its_pin(gemma_art, tmp_path):
    """A manifest whose decoded_checksum of a chunk is not what the chunk decodes to (bindings
    and seal made again, so that it reads): lct.verify names the chunk and both checksums."""
    import shutil
    from dataclasses import replace

    from lct.format.manifest import Manifest
    art = tmp_path / "a.lct"
    shutil.copytree(gemma_art, art)
    m = Manifest.from_json((art / "lct.json").read_bytes())
    m.chunks[1] = replace(m.chunks[1], decoded_checksum="xxh3_64:" + "ab" * 8, binding=None)
    (art / "lct.json").write_text(m.to_json())
    report = lct.verify(art)
    assert not report.ok
    assert any(f"chunk 1 ({m.chunks[1].group}) decodes to bytes whose checksum is" in f and
               f"the manifest pins xxh3_64:{'ab' * 8}" in f for f in report.failures)
    assert lct.verify(gemma_art).ok


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


# Section 2: the informative objects ------------------------------------------------------------
@pytest.mark.parametrize("edit,key", [
    ({"source": []}, "'source' must be an object"),
    ({"source": {"id": 5}}, "'source.id'"),
    ({"source": {"revision": 1}}, "'source.revision'"),
    ({"source": {"files": {"config.json": 1}}}, "'source.files'"),
    ({"source": {"files": {"config.json": {"sha256": "ab", "size": 3}}}}, "'source.files'"),
    ({"source": {"files": {"config.json": {"sha256": "a" * 64, "size": -1}}}}, "'source.files'"),
    ({"architecture": "llama"}, "'architecture' must be an object"),
    ({"architecture": {"tie_word_embeddings": "yes"}}, "'architecture.tie_word_embeddings'"),
    ({"architecture": {"model_type": ["llama"]}}, "'architecture.model_type'"),
    ({"architecture": {"class": 5}}, "'architecture.class'"),
    ({"architecture": {"stacks": [{"path": "model.layers", "blocks": 2}]}},
     "'architecture.stacks'"),
    ({"architecture": {"experts": {"count": "8"}}}, "'architecture.experts.count'"),
    ({"policy": None}, "'policy' must be an object"),
    ({"policy": {"blocksize": "64"}}, "'policy.blocksize'"),
    ({"policy": {"nf4": "embed"}}, "'policy.nf4'"),
    ({"policy": {"int8": [1]}}, "'policy.int8'"),
    ({"policy": {"dtype": 16}}, "'policy.dtype'"),
    ({"policy": {"level": True}}, "'policy.level'"),
    ({"policy": {"frame_size": 1.5}}, "'policy.frame_size'"),
    ({"policy": {"maximus_shards": "5"}}, "'policy.maximus_shards'"),
    ({"policy": {"tp_pieces": "lots"}}, "'policy.tp_pieces'"),
    ({"policy": {"measured": []}}, "'policy.measured'"),
    ({"policy": {"measured": {"cost_kl": "0.1"}}}, "'policy.measured.cost_kl'"),
    ({"policy": {"measured": {"costs": {"embed": {"nf4": "x"}}}}}, "'policy.measured.costs'"),
    ({"created_by": 5}, "'created_by'"),
    ({"unmapped": ["a", 1]}, "'unmapped' name"),
    ({"format_version": [True, 0]}, "'format_version'"),
])
def test_informative_object_of_wrong_type_is_refused_naming_the_key(tmp_path, edit, key):
    """Section 2: source, architecture and policy are objects whose defined keys have the types
    the spec gives; junk is a ManifestError naming the key, never silently replaced."""
    from lct.errors import ManifestError
    _build(tmp_path / "golden.lct", extra_manifest=edit)
    with pytest.raises(ManifestError, match=re.escape(key)):
        lct.open(tmp_path / "golden.lct")


def test_informative_objects_by_the_spec(tmp_path):
    """Keys the spec does not define are ignored (section 8); absent objects read as empty; every
    key LCT's writer writes is typed as the spec's tables say."""
    policy = {"mode": "auto", "nf4": ["embed"], "int8": [], "blocksize": 64, "dtype": None,
              "codec": "planes", "level": -7, "frame_size": 128, "maximus_shards": None,
              "measured": {"method": "proxy", "mode": "auto", "budget_kl": 0.01, "cost_kl": 0,
                           "tied": True, "tokens": 0, "seconds": 0.5,
                           "costs": {"embed+head": {"nf4": 0.002, "int8": 1e-05}},
                           "x_future": [1]},
              "x_future": {"a": 1}}
    source = {"id": "hand", "kind": "local", "revision": None, "x_future": 1,
              "files": {"model.safetensors": {"sha256": "0" * 64, "size": 0, "x": 1}}}
    _build(tmp_path / "a.lct", extra_manifest={"policy": policy, "source": source})
    with lct.open(tmp_path / "a.lct") as art:
        assert art.manifest.policy == policy and art.manifest.source == source
    m = json.loads((tmp_path / "a.lct" / "lct.json").read_text())
    for key in ("source", "architecture", "policy", "created_by", "unmapped"):
        del m[key]
    (tmp_path / "a.lct" / "lct.json").write_text(json.dumps(m))
    with lct.open(tmp_path / "a.lct") as art:
        assert (art.manifest.source, art.manifest.architecture, art.manifest.policy,
                art.manifest.unmapped, art.manifest.created_by) == ({}, {}, {}, [], "")


def test_writer_policy_keys_are_the_spec_table(gemma_art):
    """What the writer writes in `policy`, `source` and `architecture` is exactly the keys of the
    spec's tables (docs/FORMAT.md section 2), with their types."""
    m = json.loads((gemma_art / "lct.json").read_text())
    assert set(m["policy"]) == {"mode", "nf4", "int8", "blocksize", "dtype", "codec", "level",
                                "frame_size", "maximus_shards", "measured"}
    assert set(m["policy"]["measured"]) == {"method", "mode", "budget_kl", "cost_kl", "tied",
                                            "tokens", "seconds", "costs", "sizes", "note"}
    assert m["policy"]["mode"] in ("auto", "manual") and m["policy"]["maximus_shards"] is None
    assert set(m["source"]) == {"id", "kind", "revision", "files"}
    assert all(re.fullmatch("[0-9a-f]{64}", f["sha256"]) and isinstance(f["size"], int)
               for f in m["source"]["files"].values())
    assert set(m["architecture"]) == {"model_type", "tie_word_embeddings", "mapping", "class",
                                      "stacks"}     # and "experts" for a mixture of experts
    assert isinstance(m["architecture"]["tie_word_embeddings"], bool)
    assert re.fullmatch("[0-9a-f]{32}", m["artifact_id"])


# Section 2.2: NF4 blocksize limits, keys that do not apply, row_order --------------------------
def _one_nf4_manifest(blocksize: int, cols: int) -> dict:
    """A manifest (never opened on disk) holding one NF4 tensor [1, cols] in one raw chunk."""
    packed = cols // 2
    a_off = -(-packed // 64) * 64
    n_abs = 4 * (cols // blocksize if blocksize else 1)
    decoded = a_off + n_abs
    return {"format": "lct", "format_version": [1, 0], "created_by": "hand",
            "artifact_id": ARTIFACT_ID, "files": [{"name": "model-00000.lct",
                                                   "size": 4096 + decoded}],
            "groups": ["embed"],
            "chunks": [{"id": 0, "group": "embed", "file": 0, "offset": 4096,
                        "stored_size": decoded, "decoded_size": decoded, "codec": "raw",
                        "params": {}, "checksum": "xxh3_64:" + "0" * 16}],
            "tensors": [{"name": "e", "shape": [1, cols], "dtype": "float32",
                         "stored_dtype": "nf4", "encoding": "nf4", "role": "embed",
                         "group": "embed", "chunk": 0, "offset": 0, "nbytes": packed,
                         "nf4": {"blocksize": blocksize, "absmax_offset": a_off,
                                 "absmax_nbytes": n_abs}}]}


def test_nf4_blocksize_limits_are_the_spec_constants():
    """Section 2.2: blocksize even, NF4_MIN_BLOCKSIZE (2) .. NF4_MAX_BLOCKSIZE (2^20), divides the
    row; the reader and the writer's check agree on the limits."""
    from lct.errors import ManifestError, PolicyError
    from lct.format.manifest import Manifest
    assert (C.NF4_MIN_BLOCKSIZE, C.NF4_MAX_BLOCKSIZE) == (2, 2**20)
    for bs in (2, 64, 2**20):
        Manifest.from_dict(_one_nf4_manifest(bs, max(bs, 64)))
        nf4.check_blocksize((1, max(bs, 64)), bs)
    for bs, cols in ((2**21, 2**21), (0, 64), (3, 6), (6, 64)):
        with pytest.raises(ManifestError, match="blocksize"):
            Manifest.from_dict(_one_nf4_manifest(bs, cols))
        with pytest.raises(PolicyError, match="blocksize"):
            nf4.check_blocksize((1, cols), bs)


@pytest.mark.parametrize("name,key,value,msg", [
    ("model.layers.0.w", "nf4", {"blocksize": 64, "absmax_offset": 0, "absmax_nbytes": 4},
     "has an 'nf4' object but its encoding is 'plain'"),
    ("model.layers.0.w", "int8", {"scale_offset": 0, "scale_nbytes": 4},
     "has an 'int8' object but its encoding is 'plain'"),
    ("model.embed_tokens.weight", "int8", None, "has an 'int8' object but its encoding is 'nf4'"),
    ("model.layers.0.w", "row_order", "maximus", "applies only to a tensor stored as pieces"),
    ("model.norm.weight", "row_order", None, "applies only to a tensor stored as pieces"),
])
def test_keys_a_tensor_does_not_use_are_refused(tmp_path, name, key, value, msg):
    """Section 2.2: `nf4`/`int8` only with that encoding; `row_order` only on pieced tensors."""
    from lct.errors import ManifestError
    _build(tmp_path / "g.lct")
    path = tmp_path / "g.lct" / "lct.json"
    m = json.loads(path.read_text())
    next(t for t in m["tensors"] if t["name"] == name)[key] = value
    path.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=re.escape(msg)) as ei:
        lct.open(tmp_path / "g.lct")
    assert name in str(ei.value)


def test_unknown_row_order_is_refused_as_unsupported(tmp_path):
    from lct.errors import UnsupportedVersionError
    _build(tmp_path / "g.lct")
    path = tmp_path / "g.lct" / "lct.json"
    m = json.loads(path.read_text())
    m["tensors"][1]["row_order"] = "x-future"
    path.write_text(json.dumps(m))
    with pytest.raises(UnsupportedVersionError, match="unknown row_order 'x-future'"):
        lct.open(tmp_path / "g.lct")


# Section 3: the data file header ---------------------------------------------------------------
def test_writer_data_file_header_is_the_spec(gemma_art):
    """Magic, u16 major, u16 minor, u32 index, the 16 id bytes, then zeros up to 4096."""
    m = json.loads((gemma_art / "lct.json").read_text())
    for i, f in enumerate(m["files"]):
        head = (gemma_art / f["name"]).read_bytes()[:4096]
        assert head[:8] == b"LCTDATA\0"
        assert struct.unpack_from("<HHI", head, 8) == (*C.FORMAT_VERSION, i)
        assert head[16:32] == bytes.fromhex(m["artifact_id"])
        assert head[32:] == b"\0" * (4096 - 32)
    assert struct.calcsize(C.DATA_HEADER_STRUCT) == C.DATA_HEADER_FIELDS_SIZE == 32


@pytest.mark.parametrize("at", [32, 100, 4095])
def test_reserved_header_byte_not_zero_is_refused(tmp_path, at):
    """Section 3: bytes 32..4095 of the header are reserved and MUST be zero; the error names the
    file and the offset."""
    from lct.errors import ManifestError
    _build(tmp_path / "g.lct")
    data = tmp_path / "g.lct" / "model-00000.lct"
    raw = bytearray(data.read_bytes())
    raw[at] = 0x5A
    data.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match=f"model-00000.lct: header byte at offset {at} is "
                                            f"0x5a; bytes 32..4095 .* reserved"):
        lct.open(tmp_path / "g.lct")


def test_data_file_shorter_than_its_header_is_refused(tmp_path):
    """A data file holding no chunk is the header alone: 4096 bytes read; 32 are not enough."""
    from lct.errors import ManifestError
    root = tmp_path / "empty.lct"
    root.mkdir()
    header = C.DATA_MAGIC + struct.pack("<HHI", 1, 0, 0) + bytes.fromhex(ARTIFACT_ID)
    m = {"format": "lct", "format_version": [1, 0], "created_by": "hand",
         "artifact_id": ARTIFACT_ID, "files": [{"name": "model-00000.lct", "size": 4096}],
         "groups": [], "chunks": [], "tensors": [], "ties": {}, "unmapped": []}
    (root / "lct.json").write_text(json.dumps(m))
    (root / "model-00000.lct").write_bytes(_pad(header, 4096))
    with lct.open(root) as art:
        assert art.tensor_names == []
    (root / "model-00000.lct").write_bytes(header)
    m["files"][0]["size"] = len(header)
    (root / "lct.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="shorter than its 4096-byte header"):
        lct.open(root)


# Sections 2.3, 2.4 and 9: pieces, the maximus entry and the state file, by hand -----------------
MX_COUNTS = [1, 5, 0, 5, 2]                       # V = 5 token counts
# Section 9: ids by descending count, ties by ascending id; id_to_row is the inverse.
MX_ROW_TO_ID = [1, 3, 4, 0, 2]
MX_ID_TO_ROW = [3, 0, 4, 1, 2]
MX_OFFSETS = [0, 3, 5]                            # N = 2 shards of ceil(5 / 2) = 3 rows
MX_PREFIX = "maximus.model.embed_tokens."
MX_HEAD = np.array([[1, -2, 0.5, 4], [0, 0, 0, 0], [-8, 1, 2, 3], [0.25, 0.5, -1, 0.75],
                    [3, 3, -3, 1.5]], dtype=np.float32)   # token-id order; row 1 all zero


def _mx_state(**override):
    """The state tensors of section 9's table (numpy), under the module's prefix."""
    fields = {
        "id_to_row": np.array(MX_ID_TO_ROW, np.int64),
        "row_to_id": np.array(MX_ROW_TO_ID, np.int64),
        "shard_offsets": np.array(MX_OFFSETS, np.int64),
        "token_freq": np.array(MX_COUNTS, np.int64),
        "shard_score": np.zeros(2, np.float32),
        "shard_last_access_step": np.full(2, -1, np.int64),
        "resident": np.zeros(2, np.uint8),
        "pad_ids": np.array([2], np.int64),
        "step": np.zeros(2, np.int64),
        "stats": np.zeros(8, np.int64),
    }
    fields.update(override)
    return {MX_PREFIX + k: v for k, v in fields.items() if v is not None}


MX_POLICY = {"num_embeddings": 5, "embedding_dim": 4, "num_shards": 2, "budget_shards": 1,
             "bucket_size": 1, "load_rate": 0.3, "evict_rate": 0.05, "decay": 0.9,
             "sparse": True, "padding_idx": None}


def _int8_by_the_spec(x: np.ndarray):
    """Section 2.2 in float32: scale = absmax(row) / 127, q = round-half-even(x / scale), and
    q = 0 for a row whose scale is 0."""
    x = x.astype(np.float32)
    scale = (np.abs(x).max(axis=1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.rint(x / safe[:, None]).clip(-127, 127).astype(np.int8)
    q[scale == 0] = 0
    return q, scale


def _build_maximus(root, *, state=None, policy=None, edit=None):
    """A 1.1 artifact holding a [5, 4] float32 embedding and a [5, 4] int8 head, each stored as
    two frequency-ordered pieces (one chunk each), a tie to the embedding, and its Maximus state
    file; sealed by the spec. Returns ``(embedding, head q, head scale)`` in token-id order."""
    import hashlib

    from safetensors.numpy import save_file
    root.mkdir(parents=True)
    emb = (np.arange(20, dtype=np.float32).reshape(5, 4) * np.float32(0.5) - np.float32(3))
    q, scale = _int8_by_the_spec(MX_HEAD)
    order = np.array(MX_ROW_TO_ID)
    e_rows, q_rows, s_rows = emb[order], q[order], scale[order]   # stored: frequency order
    chunks_src, pieces = [], {"emb": [], "head": []}
    for r0, r1 in zip(MX_OFFSETS, MX_OFFSETS[1:]):
        piece = e_rows[r0:r1].tobytes()
        pieces["emb"].append({"rows": [r0, r1], "chunk": len(chunks_src), "offset": 0,
                              "nbytes": len(piece)})
        chunks_src.append((piece, "embed"))
    for r0, r1 in zip(MX_OFFSETS, MX_OFFSETS[1:]):
        codes = q_rows[r0:r1].tobytes()
        scales = s_rows[r0:r1].tobytes()
        pieces["head"].append({"rows": [r0, r1], "chunk": len(chunks_src), "offset": 0,
                               "nbytes": len(codes),
                               "int8": {"scale_offset": 64, "scale_nbytes": len(scales)}})
        chunks_src.append((_pad(codes, 64) + scales, "head"))
    header = C.DATA_MAGIC + struct.pack("<HHI", 1, 1, 0) + bytes.fromhex(ARTIFACT_ID)
    data = bytearray(_pad(header, 4096))
    chunks = []
    for i, (blob, group) in enumerate(chunks_src):
        data += b"\0" * (-len(data) % 4096)
        stored, codec, params = blob, "raw", {}
        if i == 1:                                    # one piece zstd, to decode it alone
            stored, codec, params = _zstd_chunk(blob, 16), "zstd", {"level": 3, "frame_size": 16}
        chunks.append({"id": i, "group": group, "file": 0, "offset": len(data),
                       "stored_size": len(stored), "decoded_size": len(blob), "codec": codec,
                       "params": params,
                       "checksum": "xxh3_64:" + xxhash.xxh3_64_hexdigest(stored)})
        data += stored
    (root / "model-00000.lct").write_bytes(bytes(data))

    state_path = root / "maximus.safetensors"
    modules = {"model.embed_tokens": {"policy": policy or MX_POLICY, "frequency_source": {
        "kind": "counts-json", "path": None, "tokens": sum(MX_COUNTS)}}}
    save_file(_mx_state(**(state or {})), str(state_path),
              metadata={"format": "lct-maximus", "version": "1", "modules": json.dumps(modules)})

    def pieced(name, dtype, stored_dtype, encoding, role, group, ps):
        return {"name": name, "shape": [5, 4], "dtype": dtype, "stored_dtype": stored_dtype,
                "encoding": encoding, "role": role, "group": group, "row_order": "maximus",
                "pieces": ps}

    manifest = {
        "format": "lct", "format_version": [1, 1], "created_by": "hand (tests/test_golden.py)",
        "artifact_id": ARTIFACT_ID,
        "source": {"id": "hand", "kind": "local", "revision": None, "files": {}},
        "architecture": {"model_type": "llama", "tie_word_embeddings": False,
                         "mapping": "llama"},
        "policy": {"mode": "manual", "nf4": [], "int8": ["head"], "blocksize": 64,
                   "dtype": None, "codec": "raw", "level": 1, "frame_size": 1048576,
                   "maximus_shards": 2},
        "files": [{"name": "model-00000.lct", "size": len(data)}],
        "groups": ["embed", "head"],
        "chunks": chunks,
        "tensors": [
            pieced("model.embed_tokens.weight", "float32", "float32", "plain", "embed", "embed",
                   pieces["emb"]),
            pieced("lm_head.weight", "float32", "int8", "int8", "head", "head", pieces["head"]),
        ],
        "ties": {"model.alias.weight": "model.embed_tokens.weight"},
        "unmapped": [],
        "maximus": {"file": "maximus.safetensors",
                    "sha256": hashlib.sha256(state_path.read_bytes()).hexdigest(),
                    "num_shards": 2,
                    "tensors": ["model.embed_tokens.weight", "lm_head.weight"],
                    "prefix": MX_PREFIX,
                    "frequency_source": {"kind": "counts-json", "path": None,
                                         "tokens": sum(MX_COUNTS)}},
    }
    if edit:
        edit(manifest)
    (root / "lct.json").write_text(_seal_by_the_spec(manifest))
    return emb, q, scale


def test_hand_built_maximus_artifact_reads_back(tmp_path):
    """Sections 2.3, 2.4, 9 in the reading direction: pieces decode alone, rows come back in
    token-id order through the state's permutation (stored order on request), int8 piece codes
    and scales are exactly those rows of the table's, ties resolve, the state is the file's."""
    emb, q, scale = _build_maximus(tmp_path / "mx.lct")
    order = np.array(MX_ROW_TO_ID)
    with lct.open(tmp_path / "mx.lct") as art:
        info = art.tensor_info("model.embed_tokens.weight")
        assert [p.rows for p in info.pieces] == [(0, 3), (3, 5)]
        assert torch.equal(art.read_tensor("model.embed_tokens.weight"), torch.from_numpy(emb))
        assert torch.equal(art.read_tensor("model.alias.weight"), torch.from_numpy(emb))
        for piece in info.pieces:                      # each piece is one chunk, decoded alone
            got = art.tensor_from_buffer(piece, art.read_chunk(piece.chunk))
            assert torch.equal(got, torch.from_numpy(emb[order[piece.rows[0]:piece.rows[1]]]))
        bufs = {p.chunk: art.read_chunk(p.chunk) for p in info.pieces}
        assert torch.equal(art.assemble(info, bufs, id_order=False),
                           torch.from_numpy(emb[order]))
        w = art.read_tensor("lm_head.weight", dequantize=False)
        assert torch.equal(w.q, torch.from_numpy(q)) and torch.equal(w.scale,
                                                                     torch.from_numpy(scale))
        assert torch.equal(art.read_tensor("lm_head.weight"),
                           torch.from_numpy(q.astype(np.float32) * scale[:, None]))
        group = art.read_group("embed")
        assert set(group) == {"model.embed_tokens.weight", "model.alias.weight"}
        state = art.maximus_state()
        assert {k: v.tolist() for k, v in state.items()} == {
            "maximus." + k[len(MX_PREFIX):]: v.tolist() for k, v in _mx_state().items()}
        assert art.maximus_policy() == MX_POLICY
    # lct's own encoder and helpers agree with the spec's words (sections 2.2 and 9).
    from lct.format import int8
    from lct.format.maximus import frequency_order, invert_permutation, shard_bounds
    lq, ls = int8.quantize(torch.from_numpy(MX_HEAD))
    assert torch.equal(lq, torch.from_numpy(q)) and torch.equal(ls, torch.from_numpy(scale))
    assert frequency_order(MX_COUNTS).tolist() == MX_ROW_TO_ID
    assert invert_permutation(torch.tensor(MX_ROW_TO_ID)).tolist() == MX_ID_TO_ROW
    assert shard_bounds(5, 2) == MX_OFFSETS


@pytest.mark.parametrize("state,policy,msg", [
    ({"shard_offsets": np.array([0, 2, 5], np.int64)}, None,
     r"shard_offsets \[0, 2, 5\] do not match 5 rows in 2 shards .* expected \[0, 3, 5\]"),
    ({"shard_offsets": np.array([0, 3, 5, 5], np.int64)}, None,
     r"shard_offsets has shape \[4\], expected \[3\]"),
    ({"shard_offsets": np.array([0, 3, 5], np.int32)}, None,
     "shard_offsets is int32, the format says int64"),
    ({"row_to_id": np.array([1, 3, 4, 2, 0], np.int64)}, None, "not inverse permutations"),
    ({"stats": None}, None, "missing maximus.stats"),
    ({"shard_score": np.zeros(2, np.float64)}, None, "shard_score is float64"),
    ({"pad_ids": np.array([5], np.int64)}, None, "pad_ids must be token ids in 0..4"),
    (None, dict(MX_POLICY, num_shards=3), "policy num_shards is 3, the artifact has 2"),
    (None, dict(MX_POLICY, embedding_dim=8), "policy embedding_dim is 8, the artifact has 4"),
])
def test_bad_maximus_state_is_refused(tmp_path, state, policy, msg):
    """Section 9: a reader checks the state before using it; wrong offsets, a broken
    permutation, a missing or mistyped field or a policy that does not fit the artifact are a
    ManifestError naming the state file."""
    from lct.errors import ManifestError
    _build_maximus(tmp_path / "mx.lct", state=state, policy=policy)
    with lct.open(tmp_path / "mx.lct") as art:        # opening reads no state
        with pytest.raises(ManifestError, match=msg) as ei:
            art.read_tensor("model.embed_tokens.weight")
    assert "maximus.safetensors" in str(ei.value)


def _set_maximus(key, value):
    return lambda m: m["maximus"].__setitem__(key, value)


def _move_pieces(m):
    for t in m["tensors"]:
        t["pieces"][0]["rows"], t["pieces"][1]["rows"] = [0, 2], [2, 5]


@pytest.mark.parametrize("edit,msg", [
    (_set_maximus("num_shards", 3), "each piece is one shard"),
    (_set_maximus("num_shards", 4), "does not split 5 rows into non-empty shards"),
    (_set_maximus("tensors", ["model.embed_tokens.weight"]),
     "'lm_head.weight' has row_order 'maximus' but is not in maximus.tensors"),
    (_set_maximus("tensors", ["model.embed_tokens.weight"] * 2 + ["lm_head.weight"]),
     "names a tensor twice"),
    (_set_maximus("frequency_source", {"kind": "text", "tokens": 3, "path": 7}),
     "'maximus.frequency_source.path'"),
    (lambda m: m.pop("maximus"), "not in maximus.tensors"),
    (lambda m: m["tensors"][0].__setitem__("chunk", 0), "has no 'chunk' of its own"),
    (lambda m: m["tensors"][1].__setitem__("int8", {"scale_offset": 64, "scale_nbytes": 12}),
     "has no 'int8' of its own"),
])
def test_maximus_entry_that_breaks_the_spec_is_refused(tmp_path, edit, msg):
    """Sections 2.3 and 2.4 on the hand-built artifact (each edit sealed again by the spec, so the
    structural rule is what refuses it)."""
    from lct.errors import ManifestError
    _build_maximus(tmp_path / "mx.lct", edit=edit)
    with pytest.raises(ManifestError, match=re.escape(msg)):
        lct.open(tmp_path / "mx.lct")


def test_writer_maximus_artifact_is_the_spec(llama_src, tmp_path):
    """Sections 2.3, 2.4 and 9 in the writing direction: what the converter writes, checked
    against the spec's words with numpy, safetensors and hashlib (lct only to convert, and to
    decode chunks)."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import load_file
    src = load_file(llama_src / "model.safetensors")
    V, H = src["model.embed_tokens.weight"].shape
    N = 5
    counts = [(7 * i) % 11 for i in range(V)]
    (tmp_path / "counts.json").write_text(json.dumps(counts))
    out = tmp_path / "mx.lct"
    lct.convert(str(llama_src), out, token_freq=str(tmp_path / "counts.json"),
                policy=lct.Policy(nf4=(), int8=(), maximus_shards=N))
    m = json.loads((out / "lct.json").read_text())
    S = -(-V // N)
    shards = [[min(k * S, V), min((k + 1) * S, V)] for k in range(N)]
    ids = np.arange(V)
    row_to_id = np.lexsort((ids, -np.array(counts)))         # descending count, ties by id
    id_to_row = np.empty(V, np.int64)
    id_to_row[row_to_id] = ids

    # 2.4: the maximus entry.
    mx = m["maximus"]
    state_path = out / C.MAXIMUS_FILE
    assert mx["file"] == "maximus.safetensors" and mx["num_shards"] == N
    assert mx["sha256"] == hashlib.sha256(state_path.read_bytes()).hexdigest()
    assert sorted(mx["tensors"]) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert mx["prefix"] == "maximus.model.embed_tokens."
    assert mx["frequency_source"]["kind"] == "counts-json"
    assert mx["frequency_source"]["tokens"] == sum(counts)
    assert m["policy"]["maximus_shards"] == N
    # 2.3: pieces, one chunk each, holding that piece and nothing after it.
    chunks = m["chunks"]
    used = []
    with lct.open(out) as art:
        for name in mx["tensors"]:
            t = next(t for t in m["tensors"] if t["name"] == name)
            assert t["row_order"] == "maximus" and t["shape"] == [V, H]
            assert not {"chunk", "offset", "nbytes", "nf4", "int8"} & set(t)
            assert [p["rows"] for p in t["pieces"]] == shards
            for p in t["pieces"]:
                c = chunks[p["chunk"]]
                used.append(p["chunk"])
                assert c["group"] == t["group"] and c["decoded_size"] == p["offset"] + p["nbytes"]
                r0, r1 = p["rows"]
                buf = art.read_chunk(p["chunk"])
                got = torch.from_numpy(buf[p["offset"]:p["offset"] + p["nbytes"]].copy())
                want = src[name][torch.from_numpy(row_to_id[r0:r1])]
                assert torch.equal(got.view(want.dtype).view(r1 - r0, H), want)
            assert torch.equal(art.read_tensor(name), src[name])   # back in id order
    assert len(set(used)) == len(used) == 2 * N
    # 9: the state file.
    with safe_open(str(state_path), "np") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert meta["format"] == "lct-maximus" and meta["version"] == "1"
    modules = json.loads(meta["modules"])
    assert list(modules) == ["model.embed_tokens"]
    pol = modules["model.embed_tokens"]["policy"]
    assert (pol["num_embeddings"], pol["embedding_dim"], pol["num_shards"]) == (V, H, N)
    assert set(pol) == {"num_embeddings", "embedding_dim", "num_shards", "budget_shards",
                        "bucket_size", "load_rate", "evict_rate", "decay", "sparse",
                        "padding_idx"}
    assert all(k.startswith(mx["prefix"]) and ".weight." not in k for k in tensors)
    f = {k[len(mx["prefix"]):]: v for k, v in tensors.items()}
    table = {"id_to_row": ("int64", [V]), "row_to_id": ("int64", [V]),
             "shard_offsets": ("int64", [N + 1]), "token_freq": ("int64", [V]),
             "shard_score": ("float32", [N]), "shard_last_access_step": ("int64", [N]),
             "resident": ("uint8", [N]), "pad_ids": ("int64", [1]), "step": ("int64", [2]),
             "stats": ("int64", [8])}
    assert {k: (str(v.dtype), list(v.shape)) for k, v in f.items()} == table
    assert f["row_to_id"].tolist() == row_to_id.tolist()
    assert f["id_to_row"].tolist() == id_to_row.tolist()
    assert f["shard_offsets"].tolist() == [s[0] for s in shards] + [V]
    assert f["token_freq"].tolist() == counts
    assert f["pad_ids"].tolist() == [0]                        # the config's pad_token_id
    assert f["shard_last_access_step"].tolist() == [-1] * N
    assert not f["shard_score"].any() and not f["resident"].any()
    assert not f["step"].any() and not f["stats"].any()



def test_writer_bindings_of_column_pieces_are_the_spec(llama_src, tmp_path):
    """Section 6 on a tensor-parallel artifact (section 2.3's row and column pieces): every
    chunk's binding the converter wrote is the one the spec's words give, column pieces
    included (the spec said `rows` where the writer bound a column piece's `cols`)."""
    out = tmp_path / "tp.lct"
    lct.convert(str(llama_src), out, policy=lct.Policy(nf4=(), int8=(), tp_pieces=2))
    written = json.loads((out / "lct.json").read_text())
    kinds = {k for t in written["tensors"] for p in t.get("pieces", []) for k in ("rows", "cols")
             if k in p}
    assert kinds == {"rows", "cols"}
    by_spec = json.loads(_seal_by_the_spec(json.loads((out / "lct.json").read_text())))
    assert [c["binding"] for c in by_spec["chunks"]] == [c["binding"] for c in written["chunks"]]
    with lct.open(out, verify=True):
        pass

# Section 0: the numbers the spec names are the constants --------------------------------------
def test_the_docs_name_the_version_this_writer_writes():
    """A new user's trial: docs/CLI.md said 1.2 and FORMAT.md's key table [1, 4] while the
    writer wrote 1.5. Each place that names the current version names FORMAT_VERSION."""
    from pathlib import Path
    docs = Path(__file__).parent.parent / "docs"
    major, minor = C.FORMAT_VERSION
    spec, cli_md = (docs / "FORMAT.md").read_text(), (docs / "CLI.md").read_text()
    assert spec.startswith(f"# LCT format, version {major}.{minor}\n")
    assert f"`[{major}, {minor}]` for this text" in spec
    assert f"writes the current version, {major}.{minor})" in spec
    assert f"`PATH: LCT {major}.{minor}, N groups" in cli_md
    assert f"`\"{major}.{minor}\"` for what this version writes" in cli_md


def test_every_constant_the_spec_names_is_in_constants_with_its_value():
    from pathlib import Path
    text = (Path(__file__).parent.parent / "docs" / "FORMAT.md").read_text()
    named = set(re.findall(r"`([A-Z][A-Z0-9_]{3,})`", text)) - {"LICENSE", "NNNNN"}
    assert named and not [n for n in sorted(named) if not hasattr(C, n)]
    MiB, GiB = 1 << 20, 1 << 30
    assert {n: getattr(C, n) for n in (
        "DATA_HEADER_SIZE", "CHUNK_ALIGNMENT", "TENSOR_ALIGNMENT", "MAX_MANIFEST_BYTES",
        "MAX_RANK", "MAX_TENSORS", "MAX_CHUNKS", "MAX_FILES", "MAX_NAME_LEN",
        "MAX_CHUNK_DECODED", "MAX_FRAME_SIZE", "MAX_DIM", "MAX_MANIFEST_INT",
        "MANIFEST_BYTES_PER_CONTAINER", "MANIFEST_CONTAINER_SLACK", "NF4_MIN_BLOCKSIZE",
        "NF4_MAX_BLOCKSIZE", "ARTIFACT_ID_BYTES", "MAX_VERSION_NUMBER", "ZSTD_LEVELS",
        "MAX_SIDE_FILE_BYTES", "MAX_SIDE_FILES_BYTES", "DEFAULT_MAX_FILE_SIZE",
        "DATA_HEADER_STRUCT", "DATA_MAGIC", "MAXIMUS_FILE", "MAXIMUS_STATE_FORMAT",
        "MAXIMUS_STATE_VERSION")} == {
        "DATA_HEADER_SIZE": 4096, "CHUNK_ALIGNMENT": 4096, "TENSOR_ALIGNMENT": 64,
        "MAX_MANIFEST_BYTES": 64 * MiB, "MAX_RANK": 8, "MAX_TENSORS": 1_000_000,
        "MAX_CHUNKS": 1_000_000, "MAX_FILES": 100_000, "MAX_NAME_LEN": 1024,
        "MAX_CHUNK_DECODED": 64 * GiB, "MAX_FRAME_SIZE": 64 * MiB, "MAX_DIM": 2**40,
        "MAX_MANIFEST_INT": 2**62, "MANIFEST_BYTES_PER_CONTAINER": 24,
        "MANIFEST_CONTAINER_SLACK": 64, "NF4_MIN_BLOCKSIZE": 2, "NF4_MAX_BLOCKSIZE": 2**20,
        "ARTIFACT_ID_BYTES": 16, "MAX_VERSION_NUMBER": 65535, "ZSTD_LEVELS": (-7, 22),
        "MAX_SIDE_FILE_BYTES": 64 * MiB, "MAX_SIDE_FILES_BYTES": 512 * MiB,
        "DEFAULT_MAX_FILE_SIZE": 4 * GiB, "DATA_HEADER_STRUCT": "<8sHHI16s",
        "DATA_MAGIC": b"LCTDATA\0", "MAXIMUS_FILE": "maximus.safetensors",
        "MAXIMUS_STATE_FORMAT": "lct-maximus", "MAXIMUS_STATE_VERSION": "1"}
    assert C.MAXIMUS_STATS_FIELDS == ("lookups", "hits", "misses", "shard_loads",
                                      "shard_evictions", "bytes_moved", "steps", "pad_lookups")
