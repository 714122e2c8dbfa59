"""Mixtures of experts, multimodal and encoder-decoder models (issue 21): the grouping of
docs/FORMAT.md section 4 (experts in groups of their own, in bounded chunks; every stack's
blocks a group), read by every load path (streaming, layer-wise, device maps with disk,
tensor parallel) into the model ``from_pretrained`` builds, and shown by ``lct info``."""

import json

import pytest
import torch

import lct
from lct.arch import hf
from lct.demo.tiny import probe_inputs, save_tiny
from lct.format import constants as C


@pytest.fixture(scope="module")
def mixtral_src(tmp_path_factory):
    """A tiny random Mixtral: 2 layers of 4 experts, 2 per token, experts stored one by one."""
    return save_tiny(tmp_path_factory.mktemp("moe") / "mixtral", "mixtral",
                          num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def mixtral_art(mixtral_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-art") / "mixtral.lct"
    lct.convert(str(mixtral_src), out, policy=lct.Policy(nf4=()))
    return out


def _ref(src, cls="MixtralForCausalLM"):
    return hf.class_by_name(cls).from_pretrained(src, dtype=torch.bfloat16).eval()


def _logits(model, ids=None):
    ids = ids if ids is not None else torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        return model(ids).logits


def test_experts_groups_are_the_spec(mixtral_src, tmp_path, monkeypatch):
    """Section 4 in the writing direction: the groups in load order, a block's routed experts
    in a group of their own (the router stays with the block), their chunks at most
    EXPERT_CHUNK_BYTES unless one tensor is larger, and the architecture object."""
    from safetensors import safe_open
    with safe_open(str(mixtral_src / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        one = max(f.get_slice(n).get_shape()[0] * f.get_slice(n).get_shape()[1] * 2
                  for n in names if ".experts." in n)
    bound = 3 * one + 64        # three expert weights a chunk
    monkeypatch.setattr(C, "EXPERT_CHUNK_BYTES", bound)
    out = tmp_path / "m.lct"
    lct.convert(str(mixtral_src), out, policy=lct.Policy(nf4=()))
    m = json.loads((out / "lct.json").read_text())
    assert m["groups"] == ["embed", "layers.0", "layers.0.experts", "layers.1",
                           "layers.1.experts", "norm", "head"]
    for t in m["tensors"]:
        layer = t["name"].split(".")[2] if t["name"].startswith("model.layers.") else None
        if ".experts." in t["name"]:
            assert t["group"] == f"layers.{layer}.experts", t["name"]
        elif layer is not None:
            assert t["group"] == f"layers.{layer}", t["name"]     # the router too
    assert {t["name"] for t in m["tensors"]} == set(names)       # checkpoint names kept
    expert_chunks = [c for c in m["chunks"] if c["group"].endswith(".experts")]
    per_layer = [c for c in expert_chunks if c["group"] == "layers.0.experts"]
    assert len(per_layer) == -(-12 // 3)          # 4 experts x 3 weights, 3 to a chunk
    assert all(c["decoded_size"] <= bound for c in expert_chunks)
    a = m["architecture"]
    assert a["class"] == "MixtralForCausalLM" and a["mapping"].startswith("transformers ")
    assert a["experts"] == {"count": 4, "active": 2, "layers": 2}
    assert a["stacks"] == [{"path": "model.layers", "group_prefix": "layers.", "blocks": 2}]
    assert torch.equal(_logits(lct.load(out)), _logits(_ref(mixtral_src)))


def _expert_specs(experts: int, rows: int = 64, cols: int = 32) -> list:
    from lct.format.layout import TensorSpec
    return [TensorSpec(f"model.layers.0.mlp.experts.{e}.{w}.weight", (rows, cols), "bfloat16",
                       "bfloat16", C.ENCODING_PLAIN, "layer", "layers.0.experts")
            for w in ("w1", "w2", "w3") for e in range(experts)]      # not in expert order


def _experts_of(layout) -> list:
    return sorted({int(s.name.split(".experts.")[1].split(".")[0]) for s in layout.specs})


@pytest.mark.parametrize("experts,per_chunk", [(4, 1), (8, 1), (16, 2), (60, 8), (128, 16)])
def test_expert_chunks_hold_whole_experts_for_up_to_eight_expert_parallel_ranks(experts,
                                                                              per_chunk):
    """Section 4: a routed-expert group's chunks hold whole experts in expert order, at most
    ceil(experts / EXPERT_CHUNKS) of them, so that an expert-parallel rank of up to 8 reads
    only chunks of its own experts (a rank of E/8 experts: exactly its chunks)."""
    from lct.format.layout import layout_group
    layouts = layout_group("layers.0.experts", _expert_specs(experts))
    held = [_experts_of(lay) for lay in layouts]
    assert [e for h in held for e in h] == list(range(experts))      # each expert once, in order
    assert max(map(len, held)) == per_chunk and len(layouts) == -(-experts // per_chunk)
    for lay, h in zip(layouts, held):
        assert len(lay.specs) == 3 * len(h)                           # all of each expert's tensors


def test_an_expert_larger_than_the_bound_spans_chunks_alone(monkeypatch):
    from lct.format.layout import layout_group
    one = 64 * 32 * 2
    monkeypatch.setattr(C, "EXPERT_CHUNK_BYTES", 2 * one)     # two of an expert's three tensors
    layouts = layout_group("layers.0.experts", _expert_specs(3))
    assert [_experts_of(lay) for lay in layouts] == [[0], [0], [1], [1], [2], [2]]
    assert [len(lay.specs) for lay in layouts] == [2, 1] * 3
    assert all(lay.decoded_size <= 2 * one for lay in layouts)


def test_streamed_layerwise_and_dequantized_loads_equal_from_pretrained(mixtral_src,
                                                                        mixtral_art):
    from lct.loader import LayerwiseModel
    want = _logits(_ref(mixtral_src))
    assert torch.equal(_logits(lct.load(mixtral_art, prefetch=0)), want)
    with LayerwiseModel(mixtral_art, prefetch=2) as lw:
        assert torch.equal(_logits(lw), want)
        # the experts groups are read by routing, beside the stream (test_routed_experts)
        assert lw.layer_groups == ["layers.0", "layers.1"]
        assert sorted(lw.routed) == ["layers.0.experts", "layers.1.experts"]
        assert lw.max_resident_layers == 2      # layers, not groups (it said 3 of 2)


def test_device_map_reads_experts_without_the_block_and_the_block_without_experts(
        mixtral_src, mixtral_art):
    """A pipeline stage that leaves a layer's experts on disk never reads their chunks at load
    (and the same the other way round); the model runs and equals from_pretrained."""
    want = _logits(_ref(mixtral_src))
    block = ["self_attn", "mlp.gate", "input_layernorm", "post_attention_layernorm"]

    def dmap(layer, experts_on, block_on):
        out = {f"model.layers.{layer}.{m}": block_on for m in block}
        out[f"model.layers.{layer}.mlp.experts"] = experts_on
        out.update({"model.embed_tokens": "cpu", f"model.layers.{1 - layer}": "cpu",
                    "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})
        return out
    for layer, experts_on, block_on, unread in ((0, "disk", "cpu", "layers.0.experts"),
                                                (1, "cpu", "disk", "layers.1")):
        stats = lct.LoadStats()
        model = lct.load(mixtral_art, device_map=dmap(layer, experts_on, block_on),
                         stats=stats)
        assert any("6 of 7 groups read" in n for n in stats.notes), stats.notes
        assert torch.equal(_logits(model), want), unread


def test_info_shows_experts(mixtral_art, run):
    out = run("info", mixtral_art).output
    assert "model: MixtralForCausalLM" in out and "experts: 4 per layer, 2 active per token " \
        "in 2 layers" in out, out
    d = json.loads(run("info", mixtral_art, "--json").output)
    assert d["model_class"] == "MixtralForCausalLM"
    e = d["experts"]
    assert (e["count"], e["active"], e["layers"], e["groups"]) == (4, 2, 2, 2)
    with lct.open(mixtral_art) as art:
        chunks = [c for c in art.manifest.chunks if c.group.endswith(".experts")]
    assert e["stored_bytes"] == sum(c.stored_size for c in chunks) > 0


@pytest.mark.slow
def test_tensor_parallel_moe_equals_from_pretrained(mixtral_src, mixtral_art, tmp_path):
    from test_tensor_parallel import launch
    results = launch(2, mixtral_art, mixtral_src, tmp_path / "out")
    for r in results:
        assert "error" not in r, r
        assert r["max_diff"] == 0.0 and r["names_equal"], r


@pytest.mark.parametrize("model_type, cls, groups", [
    ("t5", "T5ForConditionalGeneration",
     ["embed", "encoder.block.0", "encoder.block.1", "layers.0", "layers.1", "norm"]),
    ("whisper", "WhisperForConditionalGeneration",
     ["embed", "model.encoder.layers.0", "model.encoder.layers.1", "layers.0", "layers.1",
      "norm", "misc"]),
    ("llava", "LlavaForConditionalGeneration",
     ["embed", "model.vision_tower.encoder.layers.0",
      "model.vision_tower.encoder.layers.1", "layers.0", "layers.1", "norm",
      "head", "misc"]),
])
def test_every_stack_is_grouped_and_loads_with_its_own_class(model_type, cls, groups,
                                                             tmp_path):
    """Encoder-decoder and multimodal models: each stack's blocks are groups (the text
    decoder's layers.N), the load builds the class the checkpoint was saved from with every
    tower (a Whisper was a decoder-only WhisperForCausalLM without its encoder), equal to
    from_pretrained; a device map and the layer-wise executor say what they cannot do."""
    kw = {"decoder_start_token_id": 0} if model_type == "t5" else {}
    src = save_tiny(tmp_path / "src", model_type, model_class=hf.class_by_name(cls), **kw)
    rep = lct.convert(str(src), tmp_path / "a.lct", policy=lct.Policy(nf4=()))
    assert rep.manifest.groups == groups
    model = lct.load(tmp_path / "a.lct")
    ref = _ref(src, cls)
    assert type(model).__name__ == cls
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    x = probe_inputs(ref)
    with torch.no_grad():
        assert torch.equal(model(**x).logits, ref(**x).logits)
    from lct.errors import LCTError
    from lct.loader import LayerwiseModel
    with pytest.raises(LCTError, match="layer-wise execution streams one stack"):
        LayerwiseModel(tmp_path / "a.lct")


def test_prompt_on_an_encoder_decoder_and_a_refusal_for_speech(tmp_path, run):
    from lct.demo.tiny import save_tokenizer
    src = save_tiny(tmp_path / "t5", "t5",
                         model_class=hf.class_by_name("T5ForConditionalGeneration"),
                         decoder_start_token_id=0)
    save_tokenizer(src, vocab_size=256)
    lct.convert(str(src), tmp_path / "t5.lct")
    r = run("load", tmp_path / "t5.lct", "--prompt", "Hello", "--max-new-tokens", "3", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["new_tokens"] == 3
    src = save_tiny(tmp_path / "wh", "whisper",
                         model_class=hf.class_by_name("WhisperForConditionalGeneration"))
    lct.convert(str(src), tmp_path / "wh.lct")
    from click.testing import CliRunner

    from lct.cli.main import cli
    r = CliRunner().invoke(cli, ["load", str(tmp_path / "wh.lct"), "--ids", "1,2"])
    assert r.exit_code != 0
    assert "WhisperForConditionalGeneration takes input_features (not text)" in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) <= 2


@pytest.mark.parametrize("edit, said", [
    (lambda m: next(t for t in m["tensors"] if t["name"] == "model.norm.weight")
     .__setitem__("name", "model.final.weight"),
     ["'model.final.weight': MixtralForCausalLM has no parameter for it",
      "parameter 'model.norm.weight' of MixtralForCausalLM: no stored tensor fills it"]),
    (lambda m: next(t for t in m["tensors"] if t["name"] == "lm_head.weight")
     .__setitem__("name", "lm_head.scale"),
     ["parameter 'lm_head.weight' of MixtralForCausalLM: no stored tensor fills it"]),
])
def test_verify_says_when_the_tensors_do_not_fill_the_model(mixtral_art, tmp_path, edit, said):
    """A consistently resealed manifest whose tensors no longer fill the model its config
    builds: every chunk checks out, but verify is not OK and names what does not fit (it said
    OK for artifacts that could not load), and the load refuses it in one line."""
    import shutil

    from conftest import manifest_text
    from lct.errors import ArchitectureError, LCTError
    art = tmp_path / "a.lct"
    shutil.copytree(mixtral_art, art)
    m = json.loads((art / "lct.json").read_text())
    edit(m)
    (art / "lct.json").write_text(manifest_text(m, rebind=True))
    report = lct.verify(art)
    assert not report.ok
    for line in said:
        assert any(line in f for f in report.failures), report.failures
    with pytest.raises((ArchitectureError, LCTError), match="MixtralForCausalLM"):
        lct.load(art)


def test_a_map_with_an_entry_inside_another_is_taken(mixtral_src, mixtral_art):
    """{"model.layers.0": "cpu", "model.layers.0.mlp.experts": "disk", ...}: the nearest entry
    decides (from_pretrained's dispatch fails on such a map: 'gate_up_proj is on the meta
    device')."""
    stats = lct.LoadStats()
    model = lct.load(mixtral_art, device_map={"": "cpu", "model.layers.0": "cpu",
                                              "model.layers.0.mlp.experts": "disk"},
                     stats=stats)
    assert model.hf_device_map["model.layers.0.mlp.experts"] == "disk"
    assert not any(k in model.hf_device_map for k in ("", "model.layers.0", "model.layers"))
    assert any("6 of 7 groups read" in n for n in stats.notes), stats.notes
    assert torch.equal(_logits(model), _logits(_ref(mixtral_src)))


def test_a_failing_generate_is_one_line(tmp_path):
    """A model whose own generate fails inside transformers (a tiny Jamba with no attention
    layer among its two: the cache has nothing to count) ends lct load in one line, not a
    112-line traceback."""
    from click.testing import CliRunner

    from lct.cli.main import cli
    src = save_tiny(tmp_path / "jamba", "jamba")
    lct.convert(str(src), tmp_path / "j.lct")
    r = CliRunner().invoke(cli, ["load", str(tmp_path / "j.lct"), "--ids", "1,2,3"])
    assert r.exit_code == 1
    assert "the model loaded, but JambaForCausalLM.generate failed inside transformers" \
        in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
