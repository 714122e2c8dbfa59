"""What a reader may rely on, checked when the manifest is read or by ``lct verify`` (issue 37.4):
an encoding is refused in a manifest older than the version that introduced it (FORMAT.md 2.2,
section 8 still reads a newer minor), a stored scale that is NaN or Inf fails verify naming the
file, the tensor and the first block (and no writer writes one), and a tensor whose type the
model cannot hold fails verify with the message ``lct.load`` refuses it with. Each damaged
artifact is consistent otherwise: chunks rewritten with their checksums and decoded checksums,
the manifest rebound and resealed, so that only the check under test can catch it."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import manifest_text

import lct
from lct.conversion.converter import Policy
from lct.errors import LCTError, ManifestError, PolicyError
from lct.format import constants as C
from lct.format.encodings import get_encoding

LOSSY = (C.ENCODING_NF4, C.ENCODING_INT8, C.ENCODING_INT8_B128, C.ENCODING_Q8_0,
         C.ENCODING_Q6_K)
HEAD = "lm_head.weight"
# the version that introduced each encoding, as FORMAT.md 2.2 says it (independent of the code)
SINCE = {C.ENCODING_NF4: (1, 0), C.ENCODING_INT8: (1, 1), C.ENCODING_Q8_0: (1, 3),
         C.ENCODING_Q6_K: (1, 4), C.ENCODING_INT8_B128: (1, 5)}
# what each encoding's stored scale is called in FORMAT.md 2.2
SCALE = {C.ENCODING_NF4: "absmax", C.ENCODING_INT8: "scale", C.ENCODING_INT8_B128: "scale",
         C.ENCODING_Q8_0: "d", C.ENCODING_Q6_K: "d"}


@pytest.fixture(scope="module")
def arts(wide_srcs, tmp_path_factory):
    """``{encoding: (source, artifact)}``: the wide Llama (rows of 256 values, whole blocks of
    every encoding) with its embedding and head in that encoding."""
    d = tmp_path_factory.mktemp("spec-arts")
    src = wide_srcs["llama"]
    out = {}
    for enc in LOSSY:
        art = d / f"{enc}.lct"
        lct.convert(str(src), art, policy=Policy(**{enc: ("embed", "head")}))
        out[enc] = (src, art)
    return out


def _edit(path, fn, rebind=False):
    m = json.loads((path / "lct.json").read_text())
    fn(m)
    (path / "lct.json").write_text(manifest_text(m, rebind=rebind))


def _rewrite_chunk(path, chunk, buf):
    """Store ``buf`` as chunk ``chunk`` (raw codec, at the end of its data file, its old bytes
    zeroed as a gap is) with its checksum and decoded checksum, the manifest rebound and
    resealed."""
    from lct.format.codecs import checksum
    m = json.loads((path / "lct.json").read_text())
    f = path / m["files"][chunk.file]["name"]
    off = -(-f.stat().st_size // 4096) * 4096
    data = buf.tobytes()
    with open(f, "r+b") as fh:
        fh.seek(chunk.offset)
        fh.write(bytes(chunk.stored_size))
        fh.seek(off)
        fh.write(data)
    m["files"][chunk.file]["size"] = off + len(data)
    m["chunks"][chunk.id].update(offset=off, stored_size=len(data), codec="raw", params={},
                                 checksum=checksum(data), decoded_checksum=checksum(data))
    (path / "lct.json").write_text(manifest_text(m, rebind=True))


# (a) an encoding needs the version that introduced it ------------------------------------------
@pytest.mark.parametrize("enc", [e for e in LOSSY if SINCE[e] > (1, 0)])
def test_an_encoding_in_a_manifest_older_than_it_is_refused(arts, enc, tmp_path):
    """Refused when the manifest is read, naming the tensor, the encoding and the version it
    needs; at that version it reads, and so it does at a newer minor (FORMAT.md section 8: a
    reader of 1.6 reads 1.99, ignoring keys it does not know)."""
    _, art = arts[enc]
    major, minor = SINCE[enc]
    for ver in ([major, minor - 1], [major, minor], [1, 99]):
        path = tmp_path / f"{ver[0]}.{ver[1]}.lct"
        shutil.copytree(art, path)
        _edit(path, lambda m: m.__setitem__("format_version", ver))
        if ver[1] < minor:
            with pytest.raises(ManifestError, match=rf"tensor '[^']+': encoding '{enc}' needs "
                                                    rf"format_version {major}\.{minor} or later, "
                                                    rf"the manifest declares {ver[0]}\.{ver[1]}"):
                lct.open(path)
            with pytest.raises(ManifestError, match=f"encoding '{enc}' needs"):
                lct.verify(path)
            continue
        with lct.open(path) as a, lct.open(art) as b:
            assert a.manifest.format_version == tuple(ver)
            assert torch.equal(a.read_tensor(HEAD), b.read_tensor(HEAD))
        assert lct.verify(path).ok


# (b) every stored scale is finite --------------------------------------------------------------
def _scale_place(info, enc: str, row: int, block: int) -> tuple:
    """``(byte offset in the decoded chunk, numpy dtype, scales a row)`` of the scale of block
    ``block`` of row ``row`` of tensor ``info``, from FORMAT.md 2.2's layouts."""
    cols = info.shape[-1]
    if enc == C.ENCODING_NF4:
        per_row = cols // info.nf4["blocksize"]
        return info.nf4["absmax_offset"] + 4 * (row * per_row + block), np.float32, per_row
    if enc in (C.ENCODING_INT8, C.ENCODING_INT8_B128):
        per_row = 1 if enc == C.ENCODING_INT8 else cols // C.INT8_BLOCK
        return info.int8["scale_offset"] + 4 * (row * per_row + block), np.float32, per_row
    block_values, block_bytes, d_at = {C.ENCODING_Q8_0: (C.Q8_0_BLOCK, C.Q8_0_BLOCK_BYTES, 0),
                                       C.ENCODING_Q6_K: (C.Q6_K_BLOCK, C.Q6_K_BLOCK_BYTES,
                                                         C.Q6_K_BLOCK_BYTES - 2)}[enc]
    per_row = cols // block_values
    return info.offset + block_bytes * (row * per_row + block) + d_at, np.float16, per_row


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("enc", LOSSY)
def test_a_scale_that_is_not_finite_fails_verify(arts, enc, value, tmp_path, run):
    from lct.io.reader import open_artifact
    _, art = arts[enc]
    assert lct.verify(art).ok
    bad = tmp_path / "bad.lct"
    shutil.copytree(art, bad)
    with open_artifact(bad) as a:
        info = a.tensor_info(HEAD)
        chunk = a.manifest.chunks[info.chunk]
        buf = a.read_chunk(chunk.id).copy()
    row = 2
    at, kind, per_row = _scale_place(info, enc, row, 0)
    block = min(1, per_row - 1)              # the second block of the row where there is one
    at, kind, _ = _scale_place(info, enc, row, block)
    buf[at:at + np.dtype(kind).itemsize] = np.frombuffer(np.array([value], kind).tobytes(),
                                                         np.uint8)
    _rewrite_chunk(bad, chunk, buf)
    with lct.open(bad) as a:                  # consistent: it opens and reads
        a.read_tensor(HEAD, dequantize=False)
    rep = lct.verify(bad)
    assert not rep.ok
    (line,) = [f for f in rep.failures if HEAD in f]
    assert str(bad / "model-00000.lct") in line and f"chunk {chunk.id} (head)" in line, line
    where = f"row {row}" + (f", block {block}" if per_row > 1 else "")
    assert f"first at {where}: {SCALE[enc]} = {value}" in line, line
    res = run("verify", bad)
    assert res.exit_code == 1 and "stores a scale that is not finite" in res.output
    # a tensor whose scales are not finite is not compared with the source as well
    assert not lct.verify(bad, against=str(arts[enc][0])).ok


@pytest.mark.parametrize("enc, big", [(C.ENCODING_Q8_0, 1e7), (C.ENCODING_Q6_K, 1e9)])
def test_no_writer_stores_a_scale_past_float16(enc, big, tmp_path):
    """Finite values can overflow a block's float16 d (llama.cpp writes Inf there): the writer
    refuses the tensor, naming the row and block, as FORMAT.md 2.2 says."""
    t = torch.randn(4, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    t[3, 300] = big
    e = get_encoding(enc)
    with pytest.raises(PolicyError, match=rf"w: {e.label} cannot encode values this large \(row "
                                          rf"3, block {300 // e.block}: d = inf"):
        e.quantize(t, None, "w")
    t[3, 300] = big / 1e3                    # what fits is written as before
    blocks, _ = e.quantize(t, None, "w")
    assert torch.equal(blocks, e.codec().quantize(t))
    from safetensors.torch import load_file, save_file

    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "src", "llama", dtype=torch.float32, hidden_size=256,
                         intermediate_size=256)
    policy = Policy(**{enc: ("head",)})
    lct.convert(str(src), tmp_path / "a.lct", policy=policy)
    (f,) = src.glob("*.safetensors")
    sd = load_file(f)
    sd[HEAD][5, 7] = big
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(PolicyError, match=f"{HEAD}.*cannot encode values this large"):
        lct.convert(str(src), tmp_path / "b.lct", policy=policy)
    # verify against a source no writer could store so: a failure naming it, not a traceback
    rep = lct.verify(tmp_path / "a.lct", against=str(src))
    assert not rep.ok and any(f.startswith(f"{HEAD}: ") and "cannot encode values this large"
                              in f for f in rep.failures), rep.failures


# (c) what lct.load refuses, verify refuses -----------------------------------------------------
@pytest.mark.parametrize("name, edit, said", [
    (HEAD, {"dtype": "float16"}, "is stored as float16, but LlamaForCausalLM holds "
                                 "'lm_head.weight' as bfloat16 or float32 or float64"),
    ("model.layers.0.mlp.up_proj.weight", {"stored_dtype": "float16"},
     "its source dtype is bfloat16 and the conversion cast nothing to float16"),
])
def test_a_type_the_model_cannot_hold_fails_verify_as_it_fails_load(arts, name, edit, said,
                                                                     tmp_path, run):
    _, art = arts[C.ENCODING_Q6_K]
    bad = tmp_path / "relabelled.lct"
    shutil.copytree(art, bad)

    def relabel(m):
        next(t for t in m["tensors"] if t["name"] == name).update(edit)
    _edit(bad, relabel, rebind=True)
    with pytest.raises(LCTError) as loaded:
        lct.load(bad)
    assert said in str(loaded.value)
    rep = lct.verify(bad)
    assert not rep.ok and str(loaded.value) in rep.failures, rep.failures
    res = run("verify", bad)
    assert res.exit_code == 1 and said in res.output
