"""Every JSON LCT parses from an artifact, a source or a server gets the manifest's caps
(issue 22): a hostile Maximus state header (100,000 nested brackets, its hash and the manifest
resealed), a hostile config.json in a source or an artifact, and a hostile safetensors index
are one-line errors naming the file, never a RecursionError."""

import hashlib
import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import lct
from conftest import manifest_text
from lct.errors import LCTError, SourceError

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def mx_art(llama_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("mx") / "mx.lct"
    lct.convert(str(llama_src), out, policy=lct.Policy(nf4=(), int8=(), maximus_shards=4))
    return out


def _reseal_file(art, name: str, data: bytes) -> None:
    """Replace ``name`` and record its new hash as a tool that rewrites everything would."""
    (art / name).write_bytes(data)
    m = json.loads((art / "lct.json").read_text())
    digest = hashlib.sha256(data).hexdigest()
    if name == "maximus.safetensors":
        m["maximus"]["sha256"] = digest
    else:
        m["source"]["files"][name] = {"sha256": digest, "size": len(data)}
    (art / "lct.json").write_text(manifest_text(m))


def test_a_hostile_maximus_header(mx_art, tmp_path):
    art = tmp_path / "a.lct"
    shutil.copytree(mx_art, art)
    with safe_open(str(art / "maximus.safetensors"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta["modules"] = DEEP
    save_file(tensors, str(tmp_path / "state"), metadata=meta)
    _reseal_file(art, "maximus.safetensors", (tmp_path / "state").read_bytes())
    said = r"maximus\.safetensors: metadata 'modules': .*JSON objects/arrays"
    for attempt in (lambda: lct.open(art).maximus_state(), lambda: lct.load(art, maximus=True)):
        with pytest.raises(LCTError, match=said):
            attempt()
    try:
        report = lct.verify(art)
    except LCTError as e:      # refused at open, or reported: either names the file
        assert re.search(said, str(e)), e
    else:
        assert not report.ok and any(re.search(said, f) for f in report.failures), \
            report.failures


def test_a_hostile_config_in_a_source_and_an_artifact(llama_src, llama_art, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama_src, src)
    (src / "config.json").write_text(DEEP)
    with pytest.raises(SourceError, match=r"config\.json: .*JSON objects/arrays"):
        lct.convert(str(src), tmp_path / "a.lct")
    art = tmp_path / "b.lct"
    shutil.copytree(llama_art, art)
    _reseal_file(art, "config.json", DEEP.encode())
    with pytest.raises(LCTError, match=r"config\.json: .*JSON objects/arrays"):
        lct.load(art)
    assert not lct.verify(art).ok


def test_a_hostile_safetensors_index(llama_src, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama_src, src)
    (src / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    with pytest.raises(SourceError, match=r"index\.json: .*JSON objects/arrays"):
        lct.convert(str(src), tmp_path / "a.lct")


def test_a_plain_maximus_state_still_reads(mx_art):
    """The caps leave a writer's own files alone (their metadata is a few objects)."""
    with lct.open(mx_art) as a:
        assert a.maximus_state()["maximus.row_to_id"].numel() == a.manifest.tensors[
            "model.embed_tokens.weight"].shape[0]
    assert torch.is_tensor(lct.load(mx_art, maximus=True).get_input_embeddings().weight)
