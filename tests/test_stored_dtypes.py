"""A stored dtype edited to another of the same width (issue 22.3): a layer tensor of a
bfloat16 artifact relabelled float16 or int16 (the manifest resealed and its bindings redone,
as a tool that rewrites everything would) is refused at load by every path, naming the tensor
(it loaded, then failed in the first forward, or in 2 of 27 cases gave other logits)."""

import json
import shutil

import pytest
import torch

import lct
from conftest import manifest_text
from lct.errors import LCTError

NAME = "model.layers.0.mlp.up_proj.weight"


def _relabel(src, dst, stored: str, source: str | None) -> None:
    shutil.copytree(src, dst)
    m = json.loads((dst / "lct.json").read_text())
    t = next(t for t in m["tensors"] if t["name"] == NAME)
    t["stored_dtype"] = stored
    if source is not None:
        t["dtype"] = source
    (dst / "lct.json").write_text(manifest_text(m, rebind=True))


@pytest.mark.parametrize("stored, source, said", [
    ("float16", None, "its source dtype is bfloat16 and the conversion cast nothing"),
    ("float16", "float16", "LlamaForCausalLM holds 'model.layers.0.mlp.up_proj.weight' as "
                           "bfloat16 or float32 or float64"),
    ("int16", "int16", "as bfloat16 or float32 or float64"),
])
def test_a_relabelled_layer_tensor_is_refused(llama_art, tmp_path, stored, source, said):
    from lct.loader import LayerwiseModel
    art = tmp_path / "a.lct"
    _relabel(llama_art, art, stored, source)
    with lct.open(art) as a:                       # the manifest itself is consistent
        assert a.manifest.tensors[NAME].stored_dtype == stored
    for load in (lambda: lct.load(art), lambda: lct.load(art, prefetch=0),
                 lambda: LayerwiseModel(art),
                 lambda: lct.load(art, device_map={"": "cpu"})):
        with pytest.raises(LCTError, match=rf"tensor '{NAME}' is stored as {stored}, but "
                                           rf".*{said}"):
            load()


def test_the_artifacts_own_dtypes_load(llama_art, tmp_path):
    """What a writer writes passes: a cast artifact, float32 weights, a lossy table."""
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "f32", "llama", dtype=torch.float32)
    lct.convert(str(src), tmp_path / "f16.lct", policy=lct.Policy(dtype="float16"))
    assert lct.load(tmp_path / "f16.lct").dtype == torch.float16
    lct.convert(str(src), tmp_path / "f32.lct", policy=lct.Policy(nf4=("embed", "head")))
    assert lct.load(tmp_path / "f32.lct").dtype == torch.float32
    assert lct.load(llama_art).dtype == torch.bfloat16


def test_an_artifact_is_pinned_by_its_digest(llama_art, tmp_path, run):
    """Issue 22.7: two tensors of one shape exchanged and the manifest resealed load other
    weights and verify says OK (its checksums are xxh3, recomputable by anyone); the digest lct
    info prints pins the manifest: verify --expect and lct.load(expect=) refuse the edit."""
    from lct.loader import LayerwiseModel
    with lct.open(llama_art) as a:
        digest = a.digest
    assert f"digest: {digest}" in run("info", llama_art).output
    assert json.loads(run("info", llama_art, "--json").output)["digest"] == digest
    art = tmp_path / "swapped.lct"
    shutil.copytree(llama_art, art)
    m = json.loads((art / "lct.json").read_text())
    a_, b_ = (next(t for t in m["tensors"] if t["name"] == n)
              for n in ("model.layers.0.self_attn.q_proj.weight",
                        "model.layers.0.self_attn.o_proj.weight"))
    a_["name"], b_["name"] = b_["name"], a_["name"]
    (art / "lct.json").write_text(manifest_text(m, rebind=True))
    assert lct.verify(art).ok                              # what verify alone cannot see
    report = lct.verify(art, expect=digest)
    assert not report.ok and any("is not the expected" in f for f in report.failures)
    assert lct.verify(llama_art, expect=digest).ok
    assert lct.verify(llama_art, expect=digest.removeprefix("sha256:")).ok
    for load in (lambda: lct.load(art, expect=digest), lambda: LayerwiseModel(art, expect=digest),
                 lambda: lct.load(art, expect=digest, device_map={"": "cpu"})):
        with pytest.raises(LCTError, match=f"digest sha256:[0-9a-f]{{64}} is not the expected "
                                           f"{digest}"):
            load()
    lct.load(llama_art, expect=digest)
    r = run("verify", art, "--expect", digest)
    assert r.exit_code == 1
    with pytest.raises(LCTError, match="give sha256:<64 hex digits>"):
        lct.load(llama_art, expect="abc")
