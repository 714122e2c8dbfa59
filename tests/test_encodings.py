"""The encoding registry (lct/format/encodings.py): every encoding sizes, places, validates,
quantizes and reads itself, and the rest of the code asks the registry instead of comparing
encoding names."""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from lct.errors import ManifestError, UnsupportedVersionError
from lct.format import constants as C
from lct.format.encodings import _REGISTRY, get_encoding, is_lossy, lossy_encodings
from lct.format.layout import TensorSpec, encoded_bytes, layout_group
from lct.format.manifest import TensorInfo

ROOT = Path(__file__).resolve().parents[1]


def test_the_registry_holds_the_spec_encodings():
    assert list(_REGISTRY) == [C.ENCODING_PLAIN, C.ENCODING_NF4, C.ENCODING_INT8,
                               C.ENCODING_INT8_B128, C.ENCODING_Q8_0, C.ENCODING_Q6_K]
    assert lossy_encodings() == (C.ENCODING_NF4, C.ENCODING_INT8, C.ENCODING_INT8_B128,
                                 C.ENCODING_Q8_0, C.ENCODING_Q6_K)
    assert not is_lossy(C.ENCODING_PLAIN) and is_lossy("nf4") and not is_lossy("q4_0")
    with pytest.raises(UnsupportedVersionError, match="unknown encoding 'q4_0'"):
        get_encoding("q4_0", "m.lct/lct.json")


@pytest.mark.parametrize("name", lossy_encodings())
def test_a_lossy_encoding_round_trips_through_its_own_bytes(name):
    """quantize -> a decoded chunk laid out by the layout -> the manifest object it records,
    validated as a reader does -> the weight read back from the chunk: the same codes and
    scales, and a dequantized value equal to the policy's roundtrip."""
    enc = get_encoding(name)
    cols = max(64, getattr(enc, "block", 0) or 0)   # Q6_K's rows are whole blocks of 256
    w = torch.randn(24, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    bs = 32 if enc.blocked else None
    codes, scales = enc.quantize(w, bs, "t")
    spec = TensorSpec("t", (24, cols), "bfloat16", enc.stored_dtype("bfloat16"), name, "head",
                      "head", bs)
    (lay,) = layout_group("head", [spec])
    assert spec.nbytes == codes.numel() * codes.element_size()
    assert spec.absmax_nbytes == 4 * scales.numel()
    assert encoded_bytes(name, (24, cols), "bfloat16", bs or C.DEFAULT_BLOCKSIZE) == \
        spec.nbytes + spec.absmax_nbytes
    buf = lay.allocate()
    # Q8_0 keeps its scales inside its blocks: no scale span, no placement object.
    off = lay.offsets["t"]
    a = lay.absmax_offsets.get("t", off + spec.nbytes)
    assert ("t" in lay.absmax_offsets) == bool(spec.absmax_nbytes) == (enc.key is not None)
    buf[off:off + spec.nbytes] = codes.reshape(-1).view(torch.uint8).numpy()
    buf[a:a + spec.absmax_nbytes] = scales.reshape(-1).view(torch.uint8).numpy()
    obj = enc.placement(bs, a, spec.absmax_nbytes)
    checked, span = enc.check(obj, "tensor 't'", (24, cols), "bfloat16", spec.stored_dtype,
                              spec.nbytes, "m/lct.json")
    assert checked == obj and span == ((a, spec.absmax_nbytes) if enc.key else None)
    info = TensorInfo("t", (24, cols), "bfloat16", spec.stored_dtype, name, "head", "head", 0,
                      off, spec.nbytes, **({enc.key: obj} if enc.key else {}))
    raw = torch.from_numpy(buf[off:off + spec.nbytes])
    got = enc.weight(info, raw, torch.from_numpy(buf[a:a + spec.absmax_nbytes])
                     .view(torch.float32), "bfloat16")
    c, s = enc.parts(got)
    assert torch.equal(c.reshape(-1), codes.reshape(-1)) and torch.equal(s.reshape(-1),
                                                                          scales.reshape(-1))
    assert torch.equal(got.dequantize(torch.float32), enc.roundtrip(w, bs))
    # and as two row pieces joined
    from dataclasses import replace
    piece = replace(info, shape=(12, cols))
    half = [enc.weight(piece, r, sc, "bfloat16") for r, sc in _halves(enc, w, bs)]
    joined = enc.join(info, half, None, "bfloat16")
    assert torch.equal(joined.dequantize(torch.float32), got.dequantize(torch.float32))


def _halves(enc, w, bs):
    for part in (w[:12], w[12:]):
        codes, scales = enc.quantize(part, bs, "t")
        yield codes.reshape(-1).view(torch.uint8), scales


@pytest.mark.parametrize("name,edit,msg", [
    ("nf4", {"blocksize": 48}, "blocksize 48 must be even and divide the row length"),
    ("nf4", {"absmax_nbytes": 4}, "absmax_nbytes 4 != 192"),
    ("int8", {"scale_nbytes": 8}, r"scale_nbytes 8 != 96 \(one float32 per row\)"),
])
def test_an_encoding_validates_its_own_fields(name, edit, msg):
    enc = get_encoding(name)
    bs = 32 if enc.blocked else None
    spec = TensorSpec("t", (24, 64), "bfloat16", name, name, "head", "head", bs)
    obj = {**enc.placement(bs, 1024, spec.absmax_nbytes), **edit}
    with pytest.raises(ManifestError, match=msg):
        enc.check(obj, "tensor 't'", (24, 64), "bfloat16", name, spec.nbytes, "m/lct.json")


def test_plain_is_sized_by_its_stored_dtype():
    enc = get_encoding("plain")
    assert enc.nbytes((3, 5), "float32") == 60 and enc.scale_nbytes((3, 5), None) == 0
    assert enc.stored_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ManifestError, match=r"nbytes 30 != 60"):
        enc.check(None, "tensor 't'", (3, 5), "float32", "float32", 30, "m/lct.json")


def test_no_code_outside_the_registry_compares_an_encoding_to_a_literal_name():
    """``x.encoding == "plain"`` (or ``!= "nf4"``, ``in ("nf4", "int8")``) outside the
    registry: what a new encoding would have to find and change. Code asks the registry
    (``get_encoding(name).lossy``, ``is_lossy``) or names the constant it means."""
    names = set(_REGISTRY)
    found = []
    for folder in ("lct", "loader", "kernels", "cli"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name in ("encodings.py", "constants.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                about = any(isinstance(s, ast.Attribute) and s.attr == "encoding" or
                            isinstance(s, ast.Name) and s.id in ("encoding", "enc")
                            for s in sides)
                literal = any(isinstance(s, ast.Constant) and s.value in names for s in sides) \
                    or any(isinstance(s, (ast.Tuple, ast.List, ast.Set)) and
                           any(isinstance(e, ast.Constant) and e.value in names for e in s.elts)
                           for s in sides)
                if about and literal:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "\n".join(found)


def test_layout_puts_each_lossy_encoding_in_a_chunk_of_its_own():
    specs = [TensorSpec("a", (4, 64), "bfloat16", "nf4", "nf4", "embed", "embed", 64),
             TensorSpec("b", (4, 64), "bfloat16", "int8", "int8", "embed", "embed"),
             TensorSpec("c", (4,), "bfloat16", "bfloat16", "plain", "norm", "embed")]
    lays = layout_group("embed", specs)
    assert [lay.width_class for lay in lays] == ["nf4", "int8", 2]
    assert all(lay.decoded_size % 1 == 0 and isinstance(lay.allocate(), np.ndarray)
               for lay in lays)
