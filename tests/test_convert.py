"""Convert -> read/export -> transformers: lossless parts bit-exact, NF4 parts equal bitsandbytes'
dequantization; policies, ties, shards, and bad input."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import lct
from lct.conversion.converter import Policy
from lct.errors import LCTError, PolicyError, SourceError, SourceNotFoundError
from lct.format import constants as C


def _source_tensors(src):
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _logits(path, ids, **kw):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).eval()
    with torch.no_grad():
        return model(ids).logits, model


IDS = torch.tensor([[1, 5, 9, 200, 17, 3, 44, 100]])


@pytest.mark.parametrize("fixture", ["gemma_art", "llama_art"])
def test_lossless_tensors_bit_exact_and_nf4_equals_reference(fixture, request):
    art_path = request.getfixturevalue(fixture)
    src = request.getfixturevalue(fixture.replace("_art", "_src"))
    ref = _source_tensors(src)
    with lct.open(art_path) as art:
        for name, t in ref.items():
            info = art.tensor_info(name)
            got = art.read_tensor(name)
            if info.encoding == "plain":
                assert got.dtype == t.dtype and torch.equal(got, t), name
            else:
                packed, absmax = lct.format.nf4.quantize(t, 64)
                assert torch.equal(got, lct.format.nf4.dequantize(packed, absmax, t.shape, 64, t.dtype))
        assert set(ref) <= set(art.tensor_names)


def test_gemma_tied_head_stored_once(gemma_art):
    with lct.open(gemma_art) as art:
        m = art.manifest
        assert m.ties == {"lm_head.weight": "model.embed_tokens.weight"}
        assert C.GROUP_HEAD not in m.groups
        assert m.groups[0] == "embed" and m.groups[-1] == "norm"
        assert m.tensors["model.embed_tokens.weight"].encoding == "nf4"
        assert torch.equal(art.read_tensor("lm_head.weight"),
                           art.read_tensor("model.embed_tokens.weight"))


def test_llama_untied_head_in_nf4(llama_art):
    with lct.open(llama_art) as art:
        m = art.manifest
        assert not m.ties and "head" in m.groups
        assert m.tensors["lm_head.weight"].encoding == "nf4"
        assert m.tensors["lm_head.weight"].group == "head"
        layer = art.read_group("layers.1")
        assert all(n.startswith("model.layers.1.") for n in layer)
        assert len(layer) == 9


def test_manifest_records_source_and_policy(gemma_art, gemma_src):
    import hashlib
    m = json.loads((gemma_art / C.MANIFEST_NAME).read_text())
    assert m["format_version"] == list(C.FORMAT_VERSION)
    digest = hashlib.sha256((gemma_src / "model.safetensors").read_bytes()).hexdigest()
    assert m["source"]["files"]["model.safetensors"]["sha256"] == digest
    assert m["policy"]["nf4"] == ["embed", "head"] and m["policy"]["codec"] == "planes"
    for c in m["chunks"]:
        assert c["offset"] % C.CHUNK_ALIGNMENT == 0
    for name in ("config.json", "generation_config.json"):
        assert (gemma_art / name).read_bytes() == (gemma_src / name).read_bytes()


def test_chunks_decode_independently_by_byte_range(gemma_art):
    """A chunk decodes from its own byte range and manifest entry alone."""
    with lct.open(gemma_art) as art:
        for chunk in reversed(art.manifest.chunks):
            path = gemma_art / art.manifest.files[chunk.file]["name"]
            with open(path, "rb") as f:
                f.seek(chunk.offset)
                stored = f.read(chunk.stored_size)
            art.check(chunk, stored)
            assert art.decode(chunk, stored).nbytes == chunk.decoded_size


@pytest.mark.parametrize("arch", ["gemma", "llama"])
def test_export_without_nf4_gives_identical_logits(arch, tmp_path, request):
    src = request.getfixturevalue(f"{arch}_src")
    lct.convert(str(src), tmp_path / "a.lct", policy=Policy(nf4=()))
    lct.export(tmp_path / "a.lct", tmp_path / "hf")
    ref, _ = _logits(src, IDS)
    got, _ = _logits(tmp_path / "hf", IDS)
    assert torch.equal(ref, got)
    exported = _source_tensors(tmp_path / "hf")
    for name, t in _source_tensors(src).items():
        if name in exported:
            assert torch.equal(exported[name], t)


def test_export_with_nf4_equals_bnb_dequantized_reference(llama_src, llama_art, tmp_path):
    lct.export(llama_art, tmp_path / "hf")
    got, _ = _logits(tmp_path / "hf", IDS)
    _, ref_model = _logits(llama_src, IDS)
    F = pytest.importorskip("bitsandbytes.functional")
    with torch.no_grad():
        for mod in (ref_model.model.embed_tokens, ref_model.lm_head):
            q, st = F.quantize_4bit(mod.weight.data, quant_type="nf4", blocksize=64,
                                    compress_statistics=False)
            mod.weight.data = F.dequantize_4bit(q, st)
        ref = ref_model(IDS).logits
    assert torch.equal(ref, got)


def test_sharded_source_and_several_data_files(tmp_path):
    from lct.demo import tiny
    config = tiny.config_for("llama")
    model = tiny.build_model(config, dtype=torch.bfloat16)
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="150KB")
    assert (src / "model.safetensors.index.json").exists()
    rep = lct.convert(str(src), tmp_path / "a.lct", max_file_size=200_000)
    assert len(rep.manifest.files) > 1
    ref = _source_tensors(src)
    with lct.open(tmp_path / "a.lct") as art:
        for name, t in ref.items():
            if art.tensor_info(name).encoding == "plain":
                assert torch.equal(art.read_tensor(name), t)


def test_a_tensor_the_model_has_no_place_for_is_refused(gemma_src, tmp_path):
    """A stored tensor the built model cannot take would be dropped by every load (a partial
    model when it is half of one, as a Whisper encoder built as a causal LM was): refused at
    convert, naming it and its file."""
    src = tmp_path / "src"
    shutil.copytree(gemma_src, src)
    extra = {"custom.scale": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    save_file(extra, src / "extra.safetensors")
    with pytest.raises(SourceError, match=r"'custom\.scale': GemmaForCausalLM has no parameter"):
        lct.convert(str(src), tmp_path / "a.lct")
    assert not (tmp_path / "a.lct").exists()


@pytest.mark.parametrize("name", ["modle", "models/lama"])
def test_a_mistyped_folder_says_so_offline(tmp_path, monkeypatch, name):
    """A single name, or one that reads as org/name, is a folder or a Hub id: offline, the
    error says both were looked for. Given as hf://, it is a repo only."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError, match=f"and there is no folder .{name}. here"):
        lct.convert(name, tmp_path / "a.lct")
    with pytest.raises(SourceError) as e:
        lct.convert(f"hf://{name}", tmp_path / "a.lct")
    assert "no folder" not in str(e.value)


def test_a_source_without_config_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.layers.0.mlp.w": torch.ones(4, 4)}, src / "model.safetensors")
    with pytest.raises(SourceError, match="no config.json"):
        lct.convert(str(src), tmp_path / "a.lct")
    assert not (tmp_path / "a.lct").exists()


def test_present_head_equal_to_embedding_is_tied(gemma_src, tmp_path):
    """A tied head saved beside its embedding (equal contents) is stored once."""
    src = tmp_path / "src"
    shutil.copytree(gemma_src, src)
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, src / "model.safetensors")
    m = lct.convert(str(src), tmp_path / "a.lct").manifest
    assert m.ties == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in m.tensors


def test_cast_to_float16(gemma_src, tmp_path):
    lct.convert(str(gemma_src), tmp_path / "a.lct", policy=Policy(dtype="float16"))
    ref = _source_tensors(gemma_src)
    with lct.open(tmp_path / "a.lct") as art:
        t = art.read_tensor("model.layers.0.mlp.up_proj.weight")
        assert t.dtype == torch.float16
        assert torch.equal(t, ref["model.layers.0.mlp.up_proj.weight"].to(torch.float16))
        info = art.tensor_info("model.layers.0.mlp.up_proj.weight")
        assert info.dtype == "bfloat16" and info.stored_dtype == "float16"
    rep = lct.verify(tmp_path / "a.lct", against=str(gemma_src))
    assert rep.ok and rep.cast == "float16"


def test_a_cast_artifact_with_lossy_tables_runs_and_exports_in_the_cast_dtype(llama_src,
                                                                               tmp_path):
    """--dtype float16 with the default policy (lossy embedding/head): the tables dequantize to
    float16 like the layers, so generate runs (it failed: 'expected m1 and m2 to have the same
    dtype, but got: float != c10::Half'), kept or dequantized, and the export says float16 in
    its config, so from_pretrained gives the same logits as the LCT load."""
    from transformers import AutoModelForCausalLM
    art = tmp_path / "a.lct"
    lct.convert(str(llama_src), art, policy=Policy(dtype="float16"))
    m = lct.open(art).manifest
    assert any(t.encoding != "plain" for t in m.tensors.values())
    for nf4 in ("keep", "dequantize"):
        model = lct.load(art, nf4=nf4)
        assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.float16}
        out = model.generate(IDS, max_new_tokens=3, do_sample=False)
        assert out.shape[1] == IDS.shape[1] + 3
    lct.export(art, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float16"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert {p.dtype for p in hf.parameters()} == {torch.float16}
    with torch.no_grad():
        assert torch.equal(hf(IDS).logits, lct.load(art, nf4="dequantize")(IDS).logits)


def test_overflowing_cast_is_refused_and_leaves_nothing(tmp_path):
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "src", "llama", dtype=torch.float32)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e6
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(PolicyError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*overflows"):
        lct.convert(str(src), tmp_path / "out" / "a.lct", policy=Policy(dtype="float16"))
    assert not any((tmp_path / "out").iterdir())


def test_bad_blocksize_names_tensor(gemma_src, tmp_path):
    with pytest.raises(PolicyError, match=r"model\.embed_tokens\.weight.*blocksize 48"):
        lct.convert(str(gemma_src), tmp_path / "a.lct", policy=Policy(nf4=("embed", "head"), blocksize=48))
    assert not (tmp_path / "a.lct").exists()


def test_failure_midway_leaves_no_artifact(gemma_src, tmp_path, monkeypatch):
    from lct.io import writer
    calls = []
    real = writer.ArtifactWriter.write_chunk

    def flaky(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(self, *a, **kw)

    monkeypatch.setattr(writer.ArtifactWriter, "write_chunk", flaky)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        lct.convert(str(gemma_src), out / "a.lct")
    assert list(out.iterdir()) == []


def test_existing_output_needs_overwrite(gemma_src, tmp_path):
    lct.convert(str(gemma_src), tmp_path / "a.lct")
    with pytest.raises(LCTError, match="already exists"):
        lct.convert(str(gemma_src), tmp_path / "a.lct")
    lct.convert(str(gemma_src), tmp_path / "a.lct", overwrite=True, policy=Policy(nf4=()))
    with lct.open(tmp_path / "a.lct") as art:
        assert art.manifest.policy["nf4"] == []
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    with pytest.raises(LCTError, match="not an LCT artifact"):
        lct.convert(str(gemma_src), tmp_path / "plain", overwrite=True)
    assert (tmp_path / "plain" / "notes.txt").exists()


@pytest.mark.parametrize("size", [0, 1000, "half"])
def test_a_truncated_source_file_is_named_for_convert_and_verify(llama_src, llama_art, tmp_path,
                                                                 size):
    """safetensors' own error for a damaged header (SafetensorError, a plain Exception) came
    out as a traceback that named no file."""
    import shutil
    src = tmp_path / "src"
    shutil.copytree(llama_src, src)
    f = src / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2 if size == "half" else size)
    with pytest.raises(SourceError, match=r"model\.safetensors: not a readable safetensors"):
        lct.convert(str(src), tmp_path / "a.lct")
    assert not (tmp_path / "a.lct").exists()
    with pytest.raises(SourceError, match=r"model\.safetensors: not a readable safetensors"):
        lct.verify(llama_art, against=str(src))


@pytest.mark.parametrize("config, match", [
    ({"model_type": "llama"}, r"tensor '[\w.]+' is \[\d+, \d+\], but config.json builds"),
    ({"model_type": "nonexistent_arch"}, "transformers cannot read this config"),
])
def test_a_config_that_cannot_build_the_model_is_refused_at_convert(llama_src, tmp_path, config,
                                                                   match):
    """Before, convert wrote the artifact and only the load failed (late, or with a
    transformers traceback)."""
    import shutil
    src = tmp_path / "src"
    shutil.copytree(llama_src, src)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError, match=match):
        lct.convert(str(src), tmp_path / "a.lct")
    assert not (tmp_path / "a.lct").exists()


@pytest.mark.parametrize("kw, option", [(dict(int8=("head",)), "int8"),
                                        (dict(nf4=("embed",)), "nf4")])
def test_one_part_of_a_tied_table_names_the_option_given(gemma_src, tmp_path, kw, option):
    """The refusal named --nf4 when --int8 was the option given."""
    with pytest.raises(PolicyError, match="cannot both be honoured") as e:
        lct.convert(str(gemma_src), tmp_path / "a.lct", policy=Policy(**kw))
    assert e.value.option == option


def test_a_config_linked_from_outside_the_folder_is_refused_with_the_remedy(llama_src,
                                                                             tmp_path):
    """A folder of links (``ln -s SRC/* dir/``): the config, a side file LCT does not copy
    from outside the folder, was dropped with a note and the artifact could not load; now
    the conversion stops and says how to bring the file in."""
    src = tmp_path / "links"
    src.mkdir()
    for f in llama_src.iterdir():
        (src / f.name).symlink_to(f)
    with pytest.raises(SourceError, match=r"config\.json is a link that leaves the model "
                                          r"folder .*cp --dereference"):
        lct.convert(str(src), tmp_path / "a.lct")
    assert not (tmp_path / "a.lct").exists()


def test_pickle_checkpoints_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SourceError, match="pickle"):
        lct.convert(str(tmp_path), tmp_path / "a.lct")


def test_missing_and_non_model_sources(tmp_path):
    with pytest.raises(SourceNotFoundError):
        lct.convert(str(tmp_path / "nope"), tmp_path / "a.lct")
    with pytest.raises(SourceError, match="not a model folder"):
        lct.convert(str(tmp_path), tmp_path / "a.lct")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(SourceError, match="is a file"):
        lct.convert(str(tmp_path / "f.txt"), tmp_path / "a.lct")


def test_unsupported_dtype_names_tensor(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.layers.0.w": torch.zeros(4, dtype=torch.float8_e4m3fn)},
              src / "model.safetensors")
    with pytest.raises(PolicyError, match=r"model\.layers\.0\.w.*F8_E4M3"):
        lct.convert(str(src), tmp_path / "a.lct")


def test_hub_id_offline_uses_cache_or_says_offline(gemma_src, tmp_path, monkeypatch):
    import huggingface_hub.constants as hc
    cache = tmp_path / "hub"
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    with pytest.raises(SourceError, match="offline"):
        lct.convert("someorg/tiny-gemma", tmp_path / "a.lct")
    sha = "a" * 40
    repo = cache / "models--someorg--tiny-gemma"
    shutil.copytree(gemma_src, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    m = lct.convert("someorg/tiny-gemma", tmp_path / "a.lct").manifest
    assert m.source["id"] == "someorg/tiny-gemma" and m.source["kind"] == "hub"
    assert "model.safetensors" in m.source["files"]


def test_gpt2_naming(tmp_path):
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "src", "gpt2")
    rep = lct.convert(str(src), tmp_path / "a.lct")
    m = rep.manifest
    assert rep.unmapped == []
    assert m.tensors["transformer.wte.weight"].encoding == "nf4"
    assert m.tensors["transformer.wpe.weight"].role == "pos_embed"
    assert m.tensors["transformer.wpe.weight"].encoding == "plain"
    assert m.tensors["transformer.h.1.mlp.c_fc.weight"].group == "layers.1"
    assert m.tensors["transformer.ln_f.weight"].group == "norm"


@pytest.mark.parametrize("part", ["embed", "head"])
def test_nf4_for_one_side_of_a_tied_table_is_refused(gemma_src, tmp_path, part, run):
    """A tied embedding/head is one table: NF4 for only one of them cannot be what the user
    asked for, so it is refused instead of silently doing one or the other."""
    from lct.errors import PolicyError
    with pytest.raises(PolicyError, match="one tied table"):
        lct.convert(str(gemma_src), tmp_path / "a.lct", policy=Policy(nf4=(part,)))
    assert not (tmp_path / "a.lct").exists()
    res = run("convert", gemma_src, "-o", tmp_path / "b.lct", "--nf4", part)
    assert res.exit_code == 1 and "one tied table" in res.output


def test_chat_template_survives_convert_and_export(tmp_path):
    """A chat model's template (chat_template.jinja) is carried into the artifact and back out."""
    from transformers import AutoTokenizer

    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "src", "llama")
    tiny.save_tokenizer(src, vocab_size=256)
    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(src)
    assert (src / "chat_template.jinja").is_file()
    lct.convert(str(src), tmp_path / "a.lct")
    lct.export(tmp_path / "a.lct", tmp_path / "hf")
    msgs = [{"role": "user", "content": "hi"}]
    for folder in (tmp_path / "a.lct", tmp_path / "hf"):
        text = AutoTokenizer.from_pretrained(folder).apply_chat_template(msgs, tokenize=False)
        assert text == "<user>hi"


@pytest.mark.parametrize("command", ["convert", "export"])
def test_a_second_writer_of_the_same_output_fails_and_dead_runs_litter_is_cleaned(
        command, llama_src, llama_art, tmp_path):
    """Two LCT processes writing one output: the second fails naming the lock, instead of both
    exiting 0 and one silently replacing the other (issue 12 item 3); temporary folders of a run
    that died are removed by the next run (item 14)."""
    from lct.io.writer import OutputLock

    out = tmp_path / "out"
    # (an .old-* beside a missing target is put back instead: see the replacement test below)
    litter = [tmp_path / ".out.tmp-0123456789ab", tmp_path / ".out.tmp-ba9876543210"]
    keep = tmp_path / ".out.notes"  # not LCT's pattern: left alone
    keep.write_text("mine")

    def write():
        if command == "convert":
            lct.convert(str(llama_src), out)
        else:
            lct.export(llama_art, out)

    with OutputLock(out):  # another writer holds the output (flock: per open file, as a process)
        for d in litter:  # what a run killed by SIGKILL leaves
            d.mkdir()
            (d / "model-00000.lct").write_bytes(b"half")
        with pytest.raises(LCTError, match="another LCT process is writing it"):
            write()
    assert not out.exists() and all(d.exists() for d in litter)
    write()
    assert out.is_dir() and not any(d.exists() for d in litter) and keep.read_text() == "mine"
    assert not (tmp_path / ".out.lock").exists()  # released and deleted


def test_replacement_is_one_step_and_a_run_killed_midway_gets_the_old_artifact_back(
        llama_src, tmp_path, monkeypatch):
    """--force swaps the new artifact in atomically (renameat2 exchange); where that is not
    possible and a run dies between moving the old one aside and renaming the new one in, the
    next run puts the old one back (issue 12 item 4)."""
    from lct.io import writer
    out = tmp_path / "a.lct"
    lct.convert(str(llama_src), out)
    first = json.loads((out / "lct.json").read_text())["artifact_id"]
    lct.convert(str(llama_src), out, overwrite=True)
    second = json.loads((out / "lct.json").read_text())["artifact_id"]
    assert second != first and lct.verify(out).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.lct"]  # nothing left beside it

    # No exchange here, and the process dies right after moving the old artifact aside.
    monkeypatch.setattr(writer, "_exchange", lambda a, b: False)
    real_replace = writer.os.replace

    def die_after_moving_aside(src, dst):
        real_replace(src, dst)
        if ".old-" in str(dst):
            raise KeyboardInterrupt("killed")
    monkeypatch.setattr(writer.os, "replace", die_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        lct.convert(str(llama_src), out, overwrite=True)
    monkeypatch.setattr(writer.os, "replace", real_replace)
    assert not out.exists()  # the user sees neither until the next run
    with pytest.raises(LCTError, match="already exists"):
        lct.convert(str(llama_src), out)  # the next run first puts the old one back
    assert json.loads((out / "lct.json").read_text())["artifact_id"] == second
    assert lct.verify(out).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.lct"]


@pytest.mark.parametrize("command", ["convert", "export"])
def test_an_unwritable_folder_names_the_users_path(command, llama_src, llama_art, tmp_path,
                                                  monkeypatch):
    """Issue 12 item 12: the error named LCT's temporary folder; now the output the user gave.
    (Tests run as root, which writes anywhere: the refusal is played by mkdir.)"""
    import errno
    from pathlib import Path

    out = tmp_path / "ro" / "out"
    out.parent.mkdir()
    real_mkdir = Path.mkdir

    def deny_mkdir(self, *a, **kw):
        if str(self).startswith(str(out.parent) + "/."):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *a, **kw)
    monkeypatch.setattr(Path, "mkdir", deny_mkdir)
    with pytest.raises(LCTError, match=rf"^{out}: cannot write in {out.parent} \(Permission "
                                       rf"denied\)"):
        lct.convert(str(llama_src), out) if command == "convert" else lct.export(llama_art, out)
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("arch", ["llama", "gemma"])
@pytest.mark.parametrize("shard", ["50GB", "200KB"])
def test_export_writes_what_save_pretrained_writes(arch, shard, llama_src, gemma_src, tmp_path):
    """Issue 14: export shards with huggingface_hub's splitter as save_pretrained does: same
    shard names, same index layout, same bytes in every shard, for a lossless artifact."""
    import torch
    from transformers import AutoModelForCausalLM
    src = llama_src if arch == "llama" else gemma_src
    art = tmp_path / "a.lct"
    lct.convert(str(src), art, policy=Policy(nf4=()))
    lct.export(art, tmp_path / "lct-out", max_shard_size=shard)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "hf-out", max_shard_size=shard)
    ours = sorted(p.name for p in (tmp_path / "lct-out").glob("*.safetensors"))
    theirs = sorted(p.name for p in (tmp_path / "hf-out").glob("*.safetensors"))
    assert ours == theirs and (len(ours) > 1) == (shard == "200KB")
    for name in ours:
        assert (tmp_path / "lct-out" / name).read_bytes() == \
            (tmp_path / "hf-out" / name).read_bytes(), name
    index = tmp_path / "hf-out" / "model.safetensors.index.json"
    if index.exists():
        assert (tmp_path / "lct-out" / index.name).read_text() == index.read_text()


def test_a_failure_hashing_the_source_ends_the_conversion(gemma_src, tmp_path, monkeypatch):
    """Issue 22.5: the source files were hashed in a bare thread; its error was printed and the
    conversion succeeded with the side files unrecorded (which verify then skipped)."""
    from lct.conversion import converter

    def broken(path):
        raise OSError(5, "Input/output error", str(path))
    monkeypatch.setattr(converter, "sha256_file", broken)
    with pytest.raises(SourceError, match=r"cannot be read to record its hash \(Input/output "
                                          r"error\)"):
        lct.convert(str(gemma_src), tmp_path / "a.lct")
    assert not (tmp_path / "a.lct").exists()


def test_a_second_ctrl_c_during_the_cleanup_leaves_no_staging_folder(gemma_src, tmp_path,
                                                                     monkeypatch):
    """A new user's trial: `timeout -s INT` (which signals the process and its group) or two
    Ctrl-C in a row left an empty `.out.lct.tmp-*` folder: the second interrupt came while the
    first one's cleanup ran. The cleanup now runs to its end and the interrupt is raised after."""
    import shutil
    import signal
    from pathlib import Path

    from lct.io import writer
    real = shutil.rmtree

    def interrupted_again(path, **kw):
        for f in Path(path).iterdir():                  # the folder emptied...
            f.unlink()
        signal.raise_signal(signal.SIGINT)              # ...and the second Ctrl-C comes
        return real(path, **kw)
    with pytest.raises(KeyboardInterrupt):
        with writer.ArtifactWriter(tmp_path / "a.lct") as w:
            w.copy_file(gemma_src / "config.json")
            monkeypatch.setattr(writer.shutil, "rmtree", interrupted_again)
            raise KeyboardInterrupt                     # the first
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_writer_refuses_a_side_file_without_a_recorded_hash(gemma_src, tmp_path):
    from lct.io.writer import ArtifactWriter
    with ArtifactWriter(tmp_path / "a.lct") as w:
        w.copy_file(gemma_src / "config.json")
        with pytest.raises(LCTError, match="side file 'config.json' was copied but its hash is "
                                           "not recorded"):
            w.finish(groups=[], source={"files": {}}, architecture={}, policy={}, ties={},
                     unmapped=[], created_by="test")
    assert not (tmp_path / "a.lct").exists()


def test_every_stage_after_the_bar_is_announced(gemma_src, tmp_path, monkeypatch):
    """Issue 22.17: the bar reached 100 % and the conversion went on silently (waiting for the
    source's sha256, syncing and publishing; before the bar, measuring the lossy encodings).
    Each stage is told to ``stage`` as it starts, in the order of the work, and the CLI shows
    them as status lines beside its bar."""
    import time

    from click.testing import CliRunner

    from lct.cli.main import cli
    from lct.conversion import converter
    slow_hash = converter.sha256_file

    def sha(path):              # a source whose hashing outlasts the encoding
        time.sleep(0.3)
        return slow_hash(path)
    monkeypatch.setattr(converter, "sha256_file", sha)
    events = []
    lct.convert(str(gemma_src), tmp_path / "a.lct",
                progress=lambda group, done, total: events.append(("bar", group)),
                stage=lambda text: events.append(("stage", text)))
    stages = [text.split()[0] for kind, text in events if kind == "stage"]
    assert stages == ["reading", "measuring", "encoding", "hashing", "syncing"], events
    last_bar = max(i for i, (kind, _) in enumerate(events) if kind == "bar")
    assert [text.split()[0] for _, text in events[last_bar + 1:]] == ["hashing", "syncing"]
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    res = CliRunner().invoke(cli, ["convert", str(gemma_src), "-o", str(tmp_path / "b.lct")])
    assert res.exit_code == 0, res.output
    err = res.stderr
    for word in ("convert: reading", "convert: measuring NF4, int8, Q8_0", "convert: hashing",
                 "convert: syncing the data files to disk and publishing"):
        assert word in err, err
    assert err.index("100%") < err.index("convert: hashing"), err
    quiet = CliRunner().invoke(cli, ["convert", str(gemma_src), "-o", str(tmp_path / "c.lct"),
                                     "-q"])
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr


def test_a_blocksize_that_leaves_nf4_out_says_so(gemma_src, tmp_path, caplog):
    """A --blocksize that does not divide the tables' rows left NF4 out of the automatic choice
    without a word: the measuring line names what is not measured and why, and a warning says
    the default blocksize would have fit."""
    import logging
    stages = []
    with caplog.at_level(logging.WARNING, logger="lct"):
        lct.convert(str(gemma_src), tmp_path / "a.lct", policy=Policy(blocksize=48),
                    stage=stages.append)
    (line,) = [t for t in stages if t.startswith("measuring")]
    assert "not measured: NF4: rows of" in line and "not whole blocks of 48" in line, line
    assert "NF4" not in line.split(";")[0], line
    warned = [r.getMessage() for r in caplog.records if "NF4 is not a candidate" in r.getMessage()]
    assert len(warned) == 1 and "blocksize 48 must divide the row length" in warned[0], warned
    assert "model.embed_tokens.weight" in warned[0] and str(gemma_src) in warned[0], warned
    stages.clear()
    caplog.clear()
    lct.convert(str(gemma_src), tmp_path / "b.lct", stage=stages.append)
    (line,) = [t for t in stages if t.startswith("measuring")]
    assert "NF4" in line.split(";")[0] and "not measured: NF4" not in line, line
    assert not [r for r in caplog.records if "NF4 is not a candidate" in r.getMessage()]


def _config_edited(src, tmp_path, **edits):
    out = tmp_path / "edited"
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(edits)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("layers", [1, 3])
def test_a_layer_count_that_is_not_the_weights_is_named(llama_src, tmp_path, layers):
    """num_hidden_layers 1 (or 3) with 2 layers stored: the error said to remove tensors from
    the checkpoint or rename the class; it names the two counts now."""
    src = _config_edited(llama_src, tmp_path, num_hidden_layers=layers)
    with pytest.raises(SourceError, match=rf"config.json builds {layers} blocks of "
                                          rf"model.layers, the checkpoint holds 2"):
        lct.convert(str(src), tmp_path / "a.lct")


def test_more_experts_per_token_than_experts_is_refused(tmp_path):
    """num_experts_per_tok 8 of 4 experts converted and verified OK, then failed inside
    generate's router."""
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "mixtral", "mixtral")
    experts = json.loads((src / "config.json").read_text())["num_local_experts"]
    src = _config_edited(src, tmp_path, num_experts_per_tok=experts + 1)
    with pytest.raises(SourceError, match=rf"routes each token to {experts + 1} experts .* "
                                          rf"of the {experts} each layer has"):
        lct.convert(str(src), tmp_path / "a.lct")


def test_a_config_field_of_the_wrong_type_is_one_line(llama_src, tmp_path):
    """"hidden_size": "128" raised huggingface_hub's strict-dataclass error (a bare Exception)
    through transformers' config parser as a traceback."""
    src = _config_edited(llama_src, tmp_path, hidden_size=str(json.loads(
        (llama_src / "config.json").read_text())["hidden_size"]))
    with pytest.raises(SourceError, match=r"config.json: transformers cannot read this config "
                                          r"\(.*hidden_size.*expected int, got str"):
        lct.convert(str(src), tmp_path / "a.lct")


def test_an_output_folder_it_cannot_write_in_is_refused_before_any_work(tmp_path):
    """Issue found by a new user: an output below a folder LCT may not write in (here /proc/1,
    which not even root may) was reported after the source was read and calibrated; it is
    refused first, before the (here missing) source is even looked for."""
    import os
    if not os.path.isdir("/proc/1") or os.access("/proc/1", os.W_OK):
        pytest.skip("needs a folder this process may not write in (/proc/1 on Linux)")
    with pytest.raises(LCTError, match=r"/proc/1/x\.lct: cannot write in /proc/1 \("):
        lct.convert(str(tmp_path / "no-such-source"), "/proc/1/x.lct")


def test_a_revision_for_a_local_folder_is_refused(llama_src, tmp_path):
    """Found by a new user: --revision v1 on a local folder was dropped without a word."""
    with pytest.raises(SourceError, match="a local folder has no revision 'v1'"):
        lct.convert(str(llama_src), tmp_path / "a.lct", revision="v1")
    assert not (tmp_path / "a.lct").exists()
