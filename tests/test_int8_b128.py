"""int8 with one scale per 128 values of a row (``int8_b128``), end to end: the spec's worked
example byte for byte, the codec as int8's rule per block (compiled and fallback), artifacts
that load kept (the int8 modules over per-block scales, a tied head sharing the embedding's
codes) or dequantized with the same answers, verify naming a changed scale, export, the
manifest's checks, Maximus pieces, the planner, the policy's options and its measuring it where
the rows are whole blocks. Tiny models with a hidden size of 256."""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import manifest_text
from test_block_artifacts import _source_tensor

import lct
from lct.conversion.converter import Policy
from lct.errors import ManifestError, PolicyError
from lct.format import constants as C
from lct.format import int8
from lct.format.encodings import get_encoding

ENC = C.ENCODING_INT8_B128
# FORMAT.md section 2.2, int8_b128's worked example.
SPEC_ROW0 = [0.5, -1.0, 0.25, 0.0, 0.333984375, -0.75, 0.010009765625, 0.98828125]
SPEC_ROW1 = [254.0, -127.0, 1.0, -0.5]
SPEC_SHA256 = "6895256a86b0957052d0ff6158a119bb5d679787e4e85bdc6b25130042c8aa03"


def test_spec_example_bytes(native_mode):
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    x[0, :8] = torch.tensor(SPEC_ROW0)
    x[0, 128:132] = torch.tensor(SPEC_ROW1)
    q, scale = get_encoding(ENC).quantize(x, None, "t")
    assert scale.shape == (1, 2)
    assert bytes(scale.numpy().view(np.uint8).reshape(-1)) == bytes.fromhex("0402013c00000040")
    codes = q.numpy().view(np.uint8)
    assert bytes(codes[0, :8]) == bytes.fromhex("408120002aa1017e")
    assert bytes(codes[0, 128:132]) == bytes.fromhex("7fc00000")
    blob = codes.tobytes() + scale.numpy().tobytes()
    assert len(blob) == 264 and hashlib.sha256(blob).hexdigest() == SPEC_SHA256


def test_each_block_is_a_row_of_int8(native_mode):
    w = torch.randn(9, 384, generator=torch.Generator().manual_seed(3)) * 3
    w[2, 128:256] = 0                                       # an all-zero block
    q, scale = int8.quantize(w, block=128)
    q1, s1 = int8.quantize(w.reshape(-1, 128))
    assert torch.equal(q.reshape(-1, 128), q1) and torch.equal(scale.reshape(-1), s1)
    assert scale[2, 1] == 0 and q[2, 128:256].abs().sum() == 0
    deq = int8.dequantize(q, scale, (9, 384), torch.float32)
    assert torch.equal(deq, (q.float().view(9, 3, 128) * scale[:, :, None]).view(9, 384))
    with pytest.raises(PolicyError, match="multiple of 128"):
        int8.quantize(torch.randn(4, 200), "t", block=128)


@pytest.fixture(scope="module")
def sources(wide_srcs):
    return wide_srcs


@pytest.fixture(scope="module")
def arts(sources, tmp_path_factory):
    d = tmp_path_factory.mktemp("b128-arts")
    out = {}
    for arch, src in sources.items():
        lct.convert(str(src), d / f"{arch}.lct", policy=Policy(int8_b128=("embed", "head")))
        out[arch] = (src, d / f"{arch}.lct")
    return out


@pytest.mark.parametrize("arch", ["gemma", "llama"])
def test_artifact_loads_kept_and_dequantized(arts, arch):
    src, art = arts[arch]
    m = json.loads((art / "lct.json").read_text())
    assert m["format_version"] == list(C.FORMAT_VERSION)
    encs = {t["role"]: t["encoding"] for t in m["tensors"] if t["role"] in ("embed", "head")}
    assert set(encs.values()) == {ENC}
    assert m["policy"][ENC] == ["embed", "head"] and m["policy"]["int8"] == []
    table = _source_tensor(src, "model.embed_tokens.weight")
    with lct.open(art) as a:                 # the stored bytes are the source quantized
        info = a.tensor_info("model.embed_tokens.weight")
        w = a.read_tensor("model.embed_tokens.weight", dequantize=False)
    q, scale = int8.quantize(table, block=128)
    assert info.nbytes == table.numel() and info.int8["scale_nbytes"] == 4 * table.numel() // 128
    assert torch.equal(w.q, q) and torch.equal(w.scale, scale)
    kept = lct.load(art)
    deq = lct.load(art, nf4="dequantize")
    emb, head = kept.get_input_embeddings(), kept.get_output_embeddings()
    assert type(emb).__name__ == "Int8Embedding" and type(head).__name__ == "Int8Linear"
    assert head.block == emb.block == 128 and head.encoding == ENC
    if arch == "gemma":                     # tied: one table, the head shares its codes
        assert head.q.data_ptr() == emb.q.data_ptr()
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        a, b = kept(ids).logits, deq(ids).logits
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a.float() - b.float()).abs().max() <= 2 ** -6 * max(1.0, b.float().abs().max())
    # generation runs on the kept modules (random weights: greedy steps past the first may
    # differ between float32 and bfloat16 sums, so only the length is compared)
    assert kept.generate(ids, max_new_tokens=5, do_sample=False).shape == (1, 11)
    assert torch.equal(emb(ids), deq.get_input_embeddings()(ids))


def test_verify_export_and_a_changed_scale(arts, tmp_path):
    from safetensors.torch import load_file
    from test_int8 import _rewrite_chunk_raw

    from lct.io.reader import open_artifact
    src, art = arts["llama"]
    rep = lct.verify(art, against=str(src))
    assert rep.ok and ENC in {c.encoding for c in rep.tensors}
    out = tmp_path / "exp"
    lct.export(art, out)
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(f))
    head = _source_tensor(src, "lm_head.weight")
    q, scale = int8.quantize(head, block=128)
    assert torch.equal(tensors["lm_head.weight"],
                       int8.dequantize(q, scale, tuple(head.shape), torch.bfloat16))
    bad = tmp_path / "bad.lct"
    shutil.copytree(art, bad)
    with open_artifact(bad) as a:
        info = a.tensor_info("lm_head.weight")
        chunk = a.manifest.chunks[info.chunk]
        buf = a.read_chunk(chunk.id).copy()
    at = info.int8["scale_offset"] + 4 + 3         # the second block's scale, its high byte
    buf[at] ^= 1
    _rewrite_chunk_raw(bad, chunk, buf)
    rep = lct.verify(bad, against=str(src))
    assert not rep.ok and any("lm_head" in f for f in rep.failures), rep.failures


def _edit(path, fn):
    m = json.loads((path / "lct.json").read_text())
    fn(m)
    (path / "lct.json").write_text(manifest_text(m))


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: t["int8"].update(scale_nbytes=t["int8"]["scale_nbytes"] // 2),
     "one float32 per block of 128 values"),
    (lambda t: t.update(stored_dtype="int8"), "stored_dtype 'int8_b128'"),
    (lambda t: t.update(shape=[t["shape"][0] * 2, t["shape"][1] // 2 + 1]), "multiple of 128"),
    (lambda t: t.pop("int8"), "lacks its 'int8' object"),
])
def test_manifest_checks(arts, tmp_path, mutate, msg):
    _, art = arts["llama"]
    bad = tmp_path / "a.lct"
    shutil.copytree(art, bad)
    _edit(bad, lambda m: mutate(next(t for t in m["tensors"] if t["name"] == "lm_head.weight")))
    with pytest.raises(ManifestError, match=msg):
        lct.open(bad)


def test_maximus_pieces_and_plan(sources, arts, tmp_path):
    art = tmp_path / "m.lct"
    src = sources["llama"]
    lct.convert(str(src), art, policy=Policy(int8_b128=("embed", "head"), maximus_shards=3))
    table = _source_tensor(src, "model.embed_tokens.weight")
    with lct.open(art) as a:
        info = a.tensor_info("model.embed_tokens.weight")
        assert info.encoding == ENC and len(info.pieces) == 3
        whole = a.read_tensor("model.embed_tokens.weight")     # back in token-id order
    q, scale = int8.quantize(table, block=128)
    assert torch.equal(whole, int8.dequantize(q, scale, tuple(table.shape), table.dtype))
    m = lct.load(art, maximus=True)
    assert m(torch.tensor([[1, 2, 3]])).logits.shape[-1] == table.shape[0]
    from lct.plan import plan
    stored = table.numel() + 4 * table.numel() // 128
    parts = {pt.name: pt for pt in plan(arts["llama"][1]).parts}
    assert parts["embedding"].weights == parts["head"].weights == stored
    asked = {pt.name: pt for pt in plan(src, format="lct", int8_b128=("embed", "head")).parts}
    assert asked["head"].weights == stored


def test_policy_measures_it_where_rows_are_whole_blocks(sources, tmp_path):
    """A candidate of the auto policy for the 256-wide tables, between int8 per row and Q8_0
    in size; not for 64-wide ones (a tiny Qwen2), where forcing it is refused naming the tensor
    and the rule."""
    from lct.demo import tiny
    rep = lct.convert(str(sources["gemma"]), tmp_path / "auto.lct")
    assert all(ENC in c for c in rep.manifest.policy["measured"]["costs"].values())
    sizes = rep.manifest.policy["measured"]["sizes"]["embed+head"]
    assert sizes["int8"] < sizes[ENC] < sizes["q8_0"]
    narrow = tiny.save_tiny(tmp_path / "qwen2", "qwen2", hidden_size=64)
    rep = lct.convert(str(narrow), tmp_path / "small.lct")
    assert all(ENC not in c and "int8" in c
               for c in rep.manifest.policy["measured"]["costs"].values())
    with pytest.raises(PolicyError,
                       match=r"tensor .*\.weight.: int8_b128 needs rows of a multiple of 128"):
        lct.convert(str(narrow), tmp_path / "b.lct", policy=Policy(int8_b128=("embed", "head")))
    with pytest.raises(PolicyError, match="both name 'head'"):
        Policy(int8_b128=("head",), int8=("head",)).check()
