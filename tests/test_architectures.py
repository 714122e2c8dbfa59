"""Every architecture transformers can build (issue 21): tiny random models of many model types,
built from their configs' defaults in the test, converted and loaded by LCT, against
``from_pretrained`` of the same checkpoint: the state dict, the logits and the greedy tokens
equal, for causal LMs, mixtures of experts, multimodal and encoder-decoder models alike."""

import pytest
import torch

import lct
from lct.arch import hf
from lct.demo.tiny import probe_inputs, save_tiny

# model type -> the class to build (None: the causal LM of its type). Chosen for breadth: dense
# decoders of many families, mixtures of experts (fused by transformers at load), hybrids with
# state-space or linear-attention layers, tied heads outside the Llama naming, multimodal and
# encoder-decoder models. benchmarks/bench_architectures.py sweeps every model type.
ARCHS = {
    # dense decoders
    "llama": None, "mistral": None, "qwen2": None, "qwen3": None, "gemma": None,
    "gemma2": None, "gemma3_text": None, "phi": None, "phi3": None, "gpt2": None,
    "gpt_neox": None, "gpt_neo": None, "gptj": None, "falcon": None, "bloom": None,
    "opt": None, "mpt": None, "gpt_bigcode": None, "starcoder2": None, "stablelm": None,
    "olmo": None, "olmo2": None, "cohere": None, "granite": None, "helium": None,
    "exaone": None, "glm": None, "glm4": None, "persimmon": None, "smollm3": None,
    "xglm": None, "biogpt": None, "codegen": None, "ctrl": None, "nemotron_h": None,
    "marian": None, "inkling_text": None,
    # mixtures of experts
    "mixtral": None, "qwen2_moe": None, "qwen3_moe": None, "olmoe": None, "phimoe": None,
    "granitemoe": None, "granitemoeshared": None, "glm4_moe": None, "ernie4_5_moe": None,
    "jetmoe": None, "gpt_oss": None, "llama4_text": None, "minimax_m2": None,
    "flex_olmo": None, "exaone_moe": None, "minimax": None,
    # state-space, recurrent and hybrid layers
    "mamba": None, "falcon_mamba": None, "jamba": None, "falcon_h1": None,
    "recurrent_gemma": None, "lfm2": None,
    # multimodal and encoder-decoder
    "gemma3": "Gemma3ForConditionalGeneration", "llava": "LlavaForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "t5": "T5ForConditionalGeneration",
    "bart": "BartForConditionalGeneration", "whisper": "WhisperForConditionalGeneration",
}
# The fast tier's sample (``-m "not slow"``): a dense decoder, a mixture of experts and a tied
# encoder-decoder; every other model type is marked slow (CI runs them all).
FAST = ("llama", "mixtral", "t5")


def _tiered(model_types) -> list:
    return [pytest.param(t, marks=() if t in FAST else pytest.mark.slow) for t in model_types]


# Sizes a model type needs beyond the tiny defaults (an attention layer among 2 or 3, heads
# its latent attention divides, a start token).
OVERRIDES = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=0),
    "recurrent_gemma": dict(num_hidden_layers=3),
    "t5": dict(decoder_start_token_id=0),
}


def _class(model_type):
    import transformers.models.auto.modeling_auto as auto
    return hf.class_by_name(ARCHS[model_type] or
                            auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``source(model_type) -> folder``: a tiny random model saved once per module."""
    made = {}

    def source(model_type):
        if model_type not in made:
            folder = tmp_path_factory.mktemp(f"arch-{model_type}") / "src"
            made[model_type] = save_tiny(folder, model_type, model_class=_class(model_type),
                                              **OVERRIDES.get(model_type, {}))
        return made[model_type]
    return source


def _greedy(model, inputs, n=3):
    if not model.can_generate() or getattr(model, "main_input_name", "") != "input_ids":
        return None
    kw = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
    with torch.no_grad():
        return model.generate(**kw, max_new_tokens=n, do_sample=False,
                              pad_token_id=0).tolist()


@pytest.mark.parametrize("model_type", _tiered(sorted(ARCHS)))
def test_lossless_round_trip_equals_from_pretrained(model_type, sources, tmp_path, monkeypatch):
    """Converted and loaded, the model equals ``from_pretrained``'s, state dict, logits and greedy
    tokens; and so does a load that maps the decoded cache's entry a first load filled."""
    src = sources(model_type)
    cls = _class(model_type)
    ref = cls.from_pretrained(src, dtype=torch.bfloat16).eval()
    art = tmp_path / "a.lct"
    rep = lct.convert(str(src), art, policy=lct.Policy(nf4=()))
    assert rep.manifest.architecture["class"] == cls.__name__
    assert lct.verify(art).ok
    model = lct.load(art)
    assert type(model) is cls
    want, got = ref.state_dict(), model.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    inputs = probe_inputs(ref)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, ref(**inputs).logits)
    assert _greedy(model, inputs) == _greedy(ref, inputs)
    from lct.io import cache
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "cache"))
    lct.load(art, cache=True)
    assert [f.done for f in cache.wait_fills()] == [True]
    stats = lct.LoadStats()
    got = lct.load(art, cache=True, stats=stats).state_dict()
    assert stats.cache.startswith("hit: mapped") and set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("model_type", _tiered(sorted(ARCHS)))
def test_default_artifact_loads_within_its_budget(model_type, sources, tmp_path):
    """The default (auto) policy: every lossless tensor as the source has it, the lossy table
    within the budget the policy measured, and a model that runs."""
    src = sources(model_type)
    rep = lct.convert(str(src), tmp_path / "a.lct")
    if rep.decision is not None:
        assert rep.decision.cost <= rep.decision.budget
    model = lct.load(tmp_path / "a.lct")
    ref = _class(model_type).from_pretrained(src, dtype=torch.bfloat16).eval()
    lossy = {t.name for t in rep.manifest.tensors.values() if t.encoding != "plain"}
    with lct.open(tmp_path / "a.lct") as a:
        plain = [n for n in a.manifest.tensors if n not in lossy]
        for name in plain:
            assert torch.equal(a.read_tensor(name), _source_tensor(src, name)), name
    inputs = probe_inputs(ref)
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits.float()).all()


def _source_tensor(src, name):
    from safetensors import safe_open
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            if name in h.keys():
                return h.get_tensor(name)
    raise KeyError(name)


def _partition(model, path: str, device: str) -> dict:
    """A device map putting module ``path`` on ``device`` and every other module on the CPU,
    as disjoint subtrees (accelerate wants no module under another one of the map)."""
    dmap, parts = {}, path.split(".")
    for k in range(len(parts)):
        parent = model.get_submodule(".".join(parts[:k])) if k else model
        prefix = ".".join(parts[:k])
        for name, _ in parent.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if name != parts[k]:
                dmap[full] = "cpu"
        for name, _ in parent.named_parameters(recurse=False):
            dmap[f"{prefix}.{name}" if prefix else name] = "cpu"
    dmap[path] = device
    return dmap


TIED = sorted(t for t in ARCHS if t in ("gemma", "gemma2", "gpt2", "bloom", "opt", "mpt",
                                        "gpt_bigcode", "mamba", "falcon_mamba", "t5", "gemma3"))


@pytest.mark.parametrize("model_type", _tiered(TIED))
def test_tied_embedding_on_disk(model_type, sources, tmp_path):
    """A device map with the tied embedding left in the artifact ("disk"): the head, tied to
    it, still answers as the whole model does."""
    src = sources(model_type)
    art = tmp_path / "a.lct"
    lct.convert(str(src), art, policy=lct.Policy(nf4=()))
    whole = lct.load(art)
    embed = next(n for n, m in whole.named_modules() if m is whole.get_input_embeddings())
    assert whole.get_output_embeddings().weight is whole.get_input_embeddings().weight
    model = lct.load(art, device_map=_partition(whole, embed, "disk"))
    inputs = probe_inputs(whole)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, whole(**inputs).logits)


@pytest.mark.parametrize("model_type", ["llama", "falcon_h1"])
def test_the_skeleton_allocates_no_parameter_and_computes_every_buffer(model_type, monkeypatch):
    """``hf.build_meta`` builds under the meta device as ``from_pretrained`` does: no
    parameter is ever allocated on the host (accelerate's ``init_empty_weights`` allocated each
    one and moved it to meta, which raised glibc's mmap threshold and left the first forward's
    temporaries in the heap), and every buffer is computed as the host-built model has it,
    including those a model's own init sets in its layers (FalconH1's ``mup_vector``)."""
    from lct.demo import tiny
    cfg = tiny.config_for(model_type, **OVERRIDES.get(model_type, {}))
    cls = _class(model_type)
    host = cls._from_config(cfg, dtype=torch.float32)
    allocated = []
    register = torch.nn.Module.register_parameter

    def recording_register(module, name, param):
        if param is not None and not param.is_meta:
            allocated.append(name)
        return register(module, name, param)
    # (not torch.empty: torch's meta device context caches the constructors it redirects)
    monkeypatch.setattr(torch.nn.Module, "register_parameter", recording_register)
    model = hf.build_meta(cls, cfg, torch.float32)
    monkeypatch.undo()
    assert allocated == []
    assert all(p.is_meta for p in model.parameters())
    want = dict(host.named_buffers())
    got = dict(model.named_buffers())
    assert set(got) == set(want) and want
    for name, buf in want.items():
        assert not got[name].is_meta and torch.equal(got[name], buf), name
