"""`lct plan`: exact figures against the real thing (transformers models on the meta device, real
KV caches, real optimizer states, saved tensors of real forwards, real artifacts' manifests), the
documented estimates' structure, the CLI, and one-line errors."""

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import lct
from lct.conversion.converter import Policy
from lct.demo import tiny
from lct.errors import ConfigNotFoundError, PlanError
from lct.format.manifest import Manifest
from lct.plan.memory import (
    kv_cache_bytes,
    model_dims,
    nf4_bytes,
    parameter_specs,
    parse_bytes,
    parse_resident,
    plan,
    train_activations,
)

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
             eos_token_id=1, bos_token_id=1)

# Real shapes, built in code (no network).
REAL = {
    "gemma-2b": ("gemma", dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                               num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                               vocab_size=256000, tie_word_embeddings=True)),
    "llama-2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32,
                                 vocab_size=32000)),
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, vocab_size=32000,
                                   sliding_window=4096)),
    "qwen2-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2,
                                 vocab_size=151936, tie_word_embeddings=True)),
}


def _config(name):
    if name in REAL:
        arch, kw = REAL[name]
        return AutoConfig.for_model(arch, **kw)
    if name in tiny.TINY_CONFIGS:
        return tiny.config_for(name)
    if name == "llama-bias":
        return AutoConfig.for_model("llama", attention_bias=True, mlp_bias=True, **SMALL)
    if name == "gpt2-untied":
        return tiny.config_for("gpt2", tie_word_embeddings=False)
    return AutoConfig.for_model(name, **SMALL)


def _meta_model(cfg):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


NAMES = [*tiny.TINY_CONFIGS, *REAL, "mistral", "phi3", "qwen3", "gemma2", "gemma3_text",
         "llama-bias", "gpt2-untied"]


@pytest.mark.parametrize("name", NAMES)
def test_parameter_counts_equal_transformers(name):
    cfg = _config(name)
    model = _meta_model(cfg)
    p = plan(cfg.to_dict())
    assert p.params == sum(t.numel() for t in model.parameters())
    # Every checkpoint tensor is named and shaped as the model's state dict has it.
    dims = model_dims(cfg.to_dict())
    specs = {s.name: s.shape for s in parameter_specs(dims)}
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()
             if not (dims.tied and k == "lm_head.weight")}
    assert specs == state
    parts = {q.name: q for q in p.parts}
    assert parts["embedding"].params == dims.vocab * dims.hidden
    assert parts["head"].params == (0 if dims.tied else dims.vocab * dims.hidden)


def test_gemma_2b():
    p = plan(dict(tiny.GEMMA_2B, model_type="gemma"), precision="bf16")
    assert p.params == 2_506_172_416
    assert p.weights == 2 * 2_506_172_416
    assert {q.name: q.params for q in p.parts}["head"] == 0   # tied


@pytest.mark.parametrize("precision,item", [("bf16", 2), ("fp16", 2), ("fp32", 4)])
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_weight_bytes_equal_a_real_model(arch, precision, item):
    cfg = tiny.config_for(arch)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    model = tiny.build_model(cfg, dtype=dtype)
    real = sum(t.untyped_storage().nbytes() for t in
               {id(p): p for p in model.parameters()}.values())
    p = plan(cfg.to_dict(), precision=precision)
    assert p.weights == real == p.params * item


# --------------------------------------------------------------------------------------------
# KV cache


def _cache_bytes(out):
    cache = getattr(out, "cache", None) or out.past_key_values
    held, logical, seen = 0, 0, set()
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            logical += t.numel() * t.element_size()
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                held += s.nbytes()
    return held, logical


@pytest.mark.parametrize("arch,kw,dtype,precision", [
    ("llama", {}, torch.bfloat16, "bf16"),
    ("gemma", {}, torch.bfloat16, "bf16"),
    ("qwen2", {}, torch.float32, "fp32"),
    ("gpt2", {}, torch.float32, "fp32"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     torch.bfloat16, "bf16"),
    ("mistral", dict(sliding_window=16), torch.bfloat16, "bf16"),
    ("gemma2", dict(sliding_window=16), torch.float16, "fp16"),
])
def test_kv_cache_equals_dynamic_cache(arch, kw, dtype, precision):
    cfg = tiny.config_for(arch, **kw) if arch in tiny.TINY_CONFIGS else \
        AutoConfig.for_model(arch, **dict(SMALL, **kw))
    model = tiny.build_model(cfg, dtype=dtype)
    B, S = 2, 40
    with torch.no_grad():
        out = model(input_ids=torch.randint(1, cfg.vocab_size, (B, S)), use_cache=True)
    held, logical = _cache_bytes(out)
    p = plan(cfg.to_dict(), batch=B, seq=S, precision=precision)
    assert p.kv_cache == held
    assert p.kv_cache_window == logical
    d = model_dims(cfg.to_dict())
    assert held == 2 * d.layers * B * S * d.kv_heads * d.head_dim * dtype.itemsize
    assert plan(cfg.to_dict(), batch=B, seq=S, precision=precision, kv_dtype="fp8").kv_cache == \
        held // dtype.itemsize


def test_kv_cache_formula_real_shape():
    d = model_dims(REAL["gemma-2b"][1] | {"model_type": "gemma"})
    held, window = kv_cache_bytes(d, batch=4, seq=8192, item=2)
    assert held == window == 2 * 18 * 4 * 8192 * 1 * 256 * 2


# --------------------------------------------------------------------------------------------
# LCT artifacts: weight bytes equal the manifest's decoded sizes


def _group_part(group):
    return "layers" if group.startswith("layers.") else {"embed": "embed", "norm": "norm",
                                                         "head": "head"}[group]


@pytest.mark.parametrize("arch,kw,policy", [
    ("gemma", {}, Policy()),
    ("llama", {}, Policy()),
    ("llama", {}, Policy(nf4=())),
    ("llama", {}, Policy(maximus_shards=5)),
    ("gpt2", {}, Policy(blocksize=32)),
    ("gpt2", {}, Policy(nf4=())),
    ("llama", {}, Policy(int8=("embed", "head"))),
    ("llama", {}, Policy(nf4=("embed",), int8=("head",), maximus_shards=3)),
    ("gpt2", {}, Policy(int8=("embed", "head"))),
    # odd sizes: 40-element biases, 20-row k/v projections -> 64-byte alignment padding
    ("qwen2", dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=72, vocab_size=250), Policy(blocksize=8)),
])
def test_lct_weights_equal_manifest(tmp_path, arch, kw, policy):
    src = tiny.save_tiny(tmp_path / "src", arch, **kw)
    out = tmp_path / "m.lct"
    lct.convert(str(src), out, policy=policy)
    m = Manifest.from_json((out / "lct.json").read_bytes())
    decoded, tensor_bytes, stored = {}, {}, {}
    for c in m.chunks:
        key = _group_part(c.group)
        decoded[key] = decoded.get(key, 0) + c.decoded_size
        stored[key] = stored.get(key, 0) + c.stored_size
    for t in m.tensors.values():
        key = _group_part(t.group)
        tensor_bytes[key] = tensor_bytes.get(key, 0) + sum(
            pl.nbytes + (pl.scales_span() or (0, 0))[1] for pl in t.placements())

    # the source planned with the encodings the converter chose (the auto policy's, or forced)
    planned = plan(src, format="lct", nf4=tuple(m.policy["nf4"]), int8=tuple(m.policy["int8"]),
                   blocksize=policy.blocksize,
                   maximus_resident=(1, policy.maximus_shards) if policy.maximus_shards else None)
    for p in (plan(out), planned):
        parts = {q.name: q for q in p.parts}
        parts["embed"] = parts["embedding"]
        if "pos_embedding" in parts:     # GPT-2: wpe lives in group embed
            for attr in ("weights", "padding"):
                setattr(parts["embed"], attr, getattr(parts["embedding"], attr) +
                        getattr(parts["pos_embedding"], attr))
        for key in decoded:
            # decoded chunk bytes (codes, absmax, alignment) and exact tensor bytes, per group
            q = parts[key]
            full = q.weights if key != "embed" or p.maximus is None else \
                q.host + (parts["pos_embedding"].weights if "pos_embedding" in parts else 0)
            assert full == decoded[key], key
            assert q.weights - q.padding == tensor_bytes[key] or p.maximus, key
        assert p.weights + (p.host - parts["embedding"].weights if p.maximus else 0) == \
            m.decoded_bytes
    p = plan(out)
    assert p.format == "lct" and p.stored == m.stored_bytes and p.decoded == m.decoded_bytes
    by_part = {q.name: q for q in p.parts}
    assert by_part["layers"].stored == stored["layers"]
    assert sum(q.stored for q in p.parts) == m.stored_bytes
    assert sum(q.decoded for q in p.parts) == m.decoded_bytes
    if kw:
        assert sum(q.padding for q in p.parts) > 0


def test_nf4_bytes_match_quantizer():
    from lct.format import nf4
    for shape, bs in (((384, 128), 64), ((250, 40), 8), ((3, 64), 32)):
        packed, absmax = nf4.quantize(torch.randn(shape), bs)
        n = math.prod(shape)
        assert nf4_bytes(n, bs) == packed.numel() + absmax.numel() * 4


def test_nf4_saving(llama_src):
    hf = plan(llama_src, seq=16)
    lc = plan(llama_src, seq=16, format="lct")
    assert hf.nf4_saving == lc.nf4_saving == hf.weights - lc.weights > 0
    train = plan(llama_src, seq=16, format="lct", mode="train")
    # frozen NF4 tables: no gradients or optimizer states for them
    parts = {q.name: q for q in train.parts}
    assert parts["embedding"].grads == parts["head"].grads == 0
    assert parts["embedding"].optimizer == 0 and parts["layers"].grads > 0


# --------------------------------------------------------------------------------------------
# Training: optimizer states, gradients, saved activations


def _optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False)
    import bitsandbytes as bnb
    return bnb.optim.AdamW8bit(params)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "adafactor", "adamw-8bit"])
@pytest.mark.parametrize("precision", ["bf16", "fp32", "mixed"])
def test_optimizer_states_gradients_master(optimizer, precision):
    cfg = tiny.config_for("gemma")
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = tiny.build_model(cfg, dtype=dtype).train()
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() for p in params] \
        if precision == "mixed" else None
    opt = _optimizer(optimizer, masters or params)
    ids = torch.randint(1, cfg.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = sum(p.grad.untyped_storage().nbytes() for p in params)
    if masters:
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
    opt.step()
    seen, states = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                states += v.untyped_storage().nbytes()
    p = plan(cfg.to_dict(), mode="train", batch=2, seq=16, precision=precision,
             optimizer=optimizer)
    assert p.optimizer_states == states
    assert p.grads == grads
    assert p.master == (sum(m.untyped_storage().nbytes() for m in masters) if masters else 0)
    assert p.trainable_params == p.params


def _saved_bytes(model, ids):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("arch", ["llama", "gemma", "qwen2", "gpt2", "mistral", "qwen3", "phi3",
                                  "gemma2", "gemma3_text"])
@pytest.mark.parametrize("dtype,item", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_saved_activations_equal_autograd(arch, dtype, item):
    cfg = tiny.config_for(arch) if arch in tiny.TINY_CONFIGS else AutoConfig.for_model(arch,
                                                                                        **SMALL)
    model = tiny.build_model(cfg, dtype=dtype).train()
    B, S = 2, 24
    real = _saved_bytes(model, torch.randint(1, cfg.vocab_size, (B, S)))
    acts = train_activations(model_dims(cfg.to_dict()), B, S, item, device="cpu")
    assert acts["layers"] + acts["other"] + acts["logprobs"] == real


def test_training_phases_and_chunked_loss():
    cfg = dict(REAL["llama-2-7b"][1], model_type="llama")
    p = plan(cfg, mode="train", batch=4, seq=4096, precision="mixed", memory="80GiB")
    assert p.total == max(p.phases.values()) and p.peak_phase in p.phases
    assert p.loss == 12 * 4 * 4096 * 32000 and p.loss_chunked == 12 * 1024 * 32000
    assert p.logits == 2 * 4 * 4096 * 32000
    assert 0 < p.logits_saving < p.loss
    assert p.fits is False and p.remedies
    assert p.master == 4 * p.params and p.optimizer_states == 8 * p.params + 4 * 291
    sgd = plan(cfg, mode="train", optimizer="sgd", precision="bf16")
    assert sgd.optimizer_states == 0 and sgd.master == 0 and sgd.grads == 2 * sgd.params


# --------------------------------------------------------------------------------------------
# Maximus and vocabulary growth


def test_maximus_resident_bytes_equal_module(llama_src):
    from lct.format.maximus import initial_state
    from lct.kernels import MaximusEmbedding
    from lct.kernels.maximus import MaximusPolicy
    V, H = 384, 128
    p = plan(llama_src, mode="infer", seq=16, maximus_resident="3/5")
    counts = torch.arange(V, 0, -1)
    m = MaximusEmbedding(V, H, policy=MaximusPolicy(num_shards=5, budget_shards=3), counts=counts,
                         weight=torch.zeros(V, H, dtype=torch.bfloat16))
    m.load_state_tensors(initial_state(counts, 5))
    emb = {q.name: q for q in p.parts}["embedding"]
    assert emb.weights == m.resident_bytes == 3 * 77 * H * 2
    assert emb.host == V * H * 2
    assert p.maximus_saving == V * H * 2 - emb.weights
    # in training the table, its gradient rows and its optimizer states stay on the host
    t = plan(llama_src, mode="train", seq=16, maximus_resident="3/5", precision="bf16")
    emb = {q.name: q for q in t.parts}["embedding"]
    assert emb.grads == emb.optimizer == 0 and emb.host > V * H * 2 * 3
    # a tied model keeps the whole table for its head: Maximus adds a copy
    g = plan(dict(tiny.TINY_CONFIGS["gemma"], model_type="gemma"), maximus_resident="1/4")
    assert g.maximus_saving < 0 and {q.name: q for q in g.parts}["head"].weights == 512 * 128 * 2


def test_add_tokens_delta(llama_src):
    base = plan(llama_src, seq=32)
    grown = plan(llama_src, seq=32, add_tokens=128)
    assert grown.vocab_size == 384 + 128 and grown.base_vocab_size == 384
    assert grown.weights - base.weights == 2 * 128 * 128 * 2       # embedding and head, bf16
    assert grown.vocab_delta["infer"] == grown.total - base.total
    train = plan(llama_src, seq=32, mode="train")
    assert grown.vocab_delta["train"] == plan(llama_src, seq=32, mode="train",
                                              vocab_size=512).total - train.total
    assert plan(llama_src, vocab_size=384).vocab_delta is None


# --------------------------------------------------------------------------------------------
# Inputs, errors, the CLI


def test_parse_bytes_and_resident():
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5 TiB") == int(1.5 * 2**40)
    assert parse_bytes(1000) == 1000
    assert parse_resident("8/32") == (8, 32)
    for bad in ("16 GiBs", "lots", "-1GB"):
        with pytest.raises(PlanError):
            parse_bytes(bad)
    for bad in ("3", "5/4", "1/0"):
        with pytest.raises(PlanError):
            parse_resident(bad)


def test_config_sources_and_errors(tmp_path, llama_src, monkeypatch):
    assert plan(llama_src / "config.json").params == plan(llama_src).params
    with pytest.raises(ConfigNotFoundError, match="no config.json"):
        plan(tmp_path)
    with pytest.raises(ConfigNotFoundError, match="no such folder"):
        plan(tmp_path / "missing")
    with pytest.raises(ConfigNotFoundError, match="local Hugging Face cache"):
        plan("some-org/not-cached-model")               # HF_HUB_OFFLINE=1 (conftest)
    (tmp_path / "x.json").write_text(json.dumps({"model_type": "no-such-type"}))
    with pytest.raises(PlanError, match="model_type 'no-such-type' is not one transformers"):
        plan(tmp_path / "x.json")
    with pytest.raises(PlanError, match="not both"):
        plan(llama_src, vocab_size=10, add_tokens=3)
    with pytest.raises(PlanError, match="optimizer"):
        plan(llama_src, optimizer="lion")
    with pytest.raises(PlanError, match="blocksize"):
        plan(dict(tiny.TINY_CONFIGS["gemma"], model_type="gemma", hidden_size=96), format="lct",
             nf4=("embed", "head"))
    with pytest.raises(PlanError, match="same part"):
        plan(llama_src, format="lct", nf4=("head",), int8=("head",))
    # planned without an artifact or parts: both tables in int8, as the auto policy usually picks
    p = plan(llama_src, format="lct")
    emb = next(q for q in p.parts if q.name == "embedding")
    v, h = tiny.TINY_CONFIGS["llama"]["vocab_size"], tiny.TINY_CONFIGS["llama"]["hidden_size"]
    assert emb.weights >= v * h + 4 * v and emb.weights < v * h * 2
    # A Hub id from the local cache: only config.json is needed.
    import huggingface_hub.constants as hc
    sha = "a" * 40
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "snapshots" / sha / "config.json").write_text((llama_src / "config.json").read_text())
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert plan("org/tiny").params == plan(llama_src).params


def test_cli_table_and_verdict(run, llama_src, llama_art):
    res = run("plan", llama_src, "--mode", "train", "--seq", "64", "--memory", "1GiB")
    assert res.exit_code == 0, res.output
    for word in ("embedding", "layers", "norm", "head", "gradients", "optimizer", "master",
                 "logits", "chunked loss", "peak:", "fits in 1.07 GB", "largest items"):
        assert word in res.output, word
    res = run("plan", llama_src, "--seq", "64", "--memory", "512KiB", "--add-tokens", "100")
    assert "does not fit in 524.29 KB" in res.output and "to cut:" in res.output
    assert "KV cache" in res.output and "vocabulary +100 tokens: infer +" in res.output
    res = run("plan", llama_art, "--seq", "64")
    assert "format lct" in res.output and "stored" in res.output and "artifact:" in res.output
    res = run("plan", llama_src, "--maximus-resident", "2/8", "--seq", "8")
    assert "host (Maximus)" in res.output


def test_cli_json(run, gemma_src):
    res = run("plan", gemma_src, "--json", "--mode", "train", "--optimizer", "adafactor",
              "--batch", "2", "--seq", "32", "--memory", "24GB")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["params"] == 484224 and d["memory"] == 24 * 10**9 and d["fits"] is True
    ints = [d[k] for k in ("params", "weights", "grads", "optimizer_states", "activations",
                           "logits", "loss", "total", "nf4_saving")]
    ints += [v for part in d["parts"] for k, v in part.items() if k not in ("name", "note")
             and v is not None]
    ints += list(d["phases"].values())
    assert all(isinstance(v, int) and not isinstance(v, bool) for v in ints)
    assert d["peak_phase"] in d["phases"] and d["total"] == max(d["phases"].values())


def test_cli_errors_one_line(run, tmp_path):
    res = run("plan", tmp_path / "nothing")
    assert res.exit_code == 1 and res.output.startswith("error:") and \
        res.output.count("\n") == 1
    res = run("plan", tmp_path, "--memory", "12XB")
    assert res.exit_code == 2 and "--memory" in res.output
    res = run("plan", tmp_path, "--maximus-resident", "9/4")
    assert res.exit_code == 2 and "--maximus-resident" in res.output
    assert "plan" in run("--help").output
    assert "--add-tokens" in run("plan", "--help").output


@pytest.mark.parametrize("model_type", ["mixtral", "t5", "mamba", "bert", "qwen2_moe"])
def test_any_architecture_is_planned_with_its_exact_parameters(model_type):
    """Architectures outside the dense decoders the activation counts were checked on: the
    parameters are the built model's exactly, and the plan says what it only estimates; a
    mixture of experts says how many of them a token uses."""
    from lct.arch import hf
    cfg = tiny.config_for(model_type)
    model = hf.build_meta(hf.candidate_classes(cfg)[0] if model_type == "t5" else
                          type(tiny.build_model(cfg)), cfg)
    model.tie_weights()         # as a loaded model is: a tied parameter counts once
    p = plan(cfg.to_dict())
    assert p.params == sum(t.numel() for t in model.parameters())
    assert p.model_type == model_type and p.total > p.weights > 0
    if model_type in ("mixtral", "qwen2_moe"):
        assert any(n.startswith("experts: 4 per layer, 2 of them per token") for n in p.notes)
    if model_type != "bert":
        assert any("estimated as for a dense decoder" in n for n in p.notes), p.notes


def test_quantized_head_temporaries_are_among_the_items(llama_art):
    """The int8/NF4 head's dequantize-and-matmul temporaries count in the peak; they were left
    out of the items the CLI lists as the largest, so the peak looked unexplained."""
    p = plan(str(llama_art), seq=2048)
    assert p.head_temp > 0
    assert p.items()["quantized-head temporaries"] == p.head_temp


@pytest.mark.parametrize("model, fmt", [("llama_src", "hf"), ("llama_src", "lct"),
                                         ("gemma_src", "hf"), ("llama_art", None)])
def test_the_peak_line_adds_up_the_items_of_its_own_table(model, fmt, request, run):
    """Issue 37: `lct plan`'s peak line disagreed with its own table: "logits 4.03 MB" at the
    logits phase beside a table whose logits were 1.57 MB, the phase holding the weights, the
    KV cache and the final hidden states too, which no line listed. Each inference phase is now
    the sum of items the report lists, and the peak line says which."""
    from lct.cli.plan import render
    from lct.units import human
    path = str(request.getfixturevalue(model))
    kw = {"format": fmt} if fmt else {}
    p = plan(path, seq=2048, device="cpu", **kw)
    assert set(p.phase_items) == set(p.phases)
    listed = p.items()
    for phase, held in p.phase_items.items():
        assert sum(held.values()) == p.phases[phase], phase
        assert all(listed[k] == v for k, v in held.items()), (phase, held, listed)
    assert p.phase_items["logits"]["final hidden states"] == p.final_hidden > 0
    text = "\n".join(render(p))
    for k, v in listed.items():     # every item a phase sums is a line (or column) above it
        start = "total" if k == "weights" else k.split("-")[0][:12]
        line = next(ln for ln in text.splitlines() if ln.startswith(start))
        assert (human(v) in line) if k == "weights" else line.endswith(human(v)), (k, line)
    peak = next(ln for ln in text.splitlines() if ln.startswith("peak:"))
    held = p.phase_items[p.peak_phase]
    assert peak == (f"peak: {human(p.total)} at the {p.peak_phase} = "
                    + " + ".join(f"{k} {human(v)}" for k, v in held.items())), peak
    out = run("plan", path, "--seq", "2048", "--device", "cpu",
              *(["--format", fmt] if fmt else [])).output
    assert peak in out and "at the logits: " in out, out


def test_the_device_defaults_to_this_machines(llama_src, run, monkeypatch):
    """Issue 22.17: `lct plan` planned CUDA's temporaries on a machine without CUDA. The
    default is decided when a plan needs it: cuda where torch sees a CUDA device, else cpu; an
    explicit --device wins; --help says so."""
    for cuda, want in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda c=cuda: c)
        assert plan(str(llama_src), seq=8).device == want
        res = run("plan", llama_src, "--seq", "8")
        assert res.exit_code == 0 and f"format hf, {want}" in res.output, res.output
    assert plan(str(llama_src), seq=8, device="cpu").device == "cpu"
    helptext = " ".join(run("plan", "--help").output.split())
    assert "Default: cuda if this machine has a CUDA device" in helptext, helptext


def test_the_maximus_line_says_what_it_keeps_where(llama_src, gemma_src, run):
    """Issue 22.17: "Maximus 8/32 would cost 80 MiB" read as an extra cost. The line says
    where the table and the shards live and what that takes off (an untied embedding) or
    adds to (a tied one, whose head keeps the whole table there) the accelerator."""
    import re
    untied = run("plan", llama_src, "--seq", "8", "--maximus-resident", "8/32", "--device",
                 "cuda").output
    assert re.search(r"Maximus 8/32 \(8 of 32 embedding shards on the GPU, the whole "
                     r"table of [\d.]+ [KMG]B in host memory\) takes [\d.]+ [KMG]B off the "
                     r"GPU", untied), untied
    tied = run("plan", gemma_src, "--seq", "8", "--device", "cuda").output
    assert re.search(r"Maximus 8/32 \(8 of 32 embedding shards on the GPU, the whole "
                     r"table in host memory\) would add [\d.]+ [KMG]B on the GPU: the "
                     r"tied head keeps the whole table there", tied), tied
    assert "cost" not in tied and "cost" not in untied
    # planning for the CPU (issue 37: it spoke of 'the accelerator' there)
    cpu = run("plan", llama_src, "--seq", "8", "--maximus-resident", "8/32", "--device",
              "cpu").output
    assert "accelerator" not in cpu and "shards on the CPU" in cpu, cpu
    assert "host memory is the same memory: --device cuda plans for a GPU" in cpu, cpu


# Each bad option: (keywords, the one-line message plan() has always given, the option it names).
BAD_OPTIONS = [
    (dict(mode="x"), "mode 'x' is not one of infer, train", "mode"),
    (dict(format="x"), "format 'x' is not one of hf, lct", "format"),
    (dict(device="x"), "device 'x' is not one of cuda, cpu", "device"),
    (dict(optimizer="lion"), "optimizer 'lion' is not one of adamw, sgd, adafactor, adamw-8bit",
     "optimizer"),
    (dict(precision="x"), "precision 'x' is not one of bf16, fp16, fp32, mixed", "precision"),
    (dict(kv_dtype="x"), "KV dtype 'x' is not one of bf16, fp16, fp32, fp8", "kv_dtype"),
    (dict(batch=0), "batch must be a positive integer, got 0", "batch"),
    (dict(seq="3"), "seq must be a positive integer, got '3'", "seq"),
    (dict(loss_chunk=0), "loss chunk must be a positive integer, got 0", "loss_chunk"),
    (dict(vocab_size=3, add_tokens=3),
     "give a new vocabulary size or a number of tokens to add, not both", "add_tokens"),
    (dict(vocab_size=0), "the vocabulary size must be >= 1, got 0", "vocab_size"),
    (dict(maximus_resident="x"), "maximus resident fraction 'x' must be K/N, like 8/32",
     "maximus_resident"),
    (dict(maximus_resident="5/4"), "maximus resident fraction 5/4: need 0 <= K <= N and N >= 1",
     "maximus_resident"),
    (dict(memory="12XB"), "memory '12XB' needs a number with a unit: 5GB or 500MB (decimal) or "
     "16GiB or 512MiB (binary)", "memory"),
    (dict(nf4=("x",)), "nf4 parts ('x',) must be among ('embed', 'head')", "nf4"),
    (dict(int8=("x",)), "int8 parts ('x',) must be among ('embed', 'head')", "int8"),
    (dict(nf4=("head",), int8=("head",)), "nf4 ('head',) and int8 ('head',) name the same part",
     "nf4"),
    (dict(blocksize=3), "NF4 blocksize 3 must be a positive even integer", "blocksize"),
]


def test_plan_options_are_checked_once_when_built_and_frozen(llama_src):
    """Issue 22.11: the options were fanned through plan (18 parameters), _plan (20) and
    _remedies. They are one frozen PlanOptions now, checked and normalized when built, and
    passed down whole; plan()'s keywords build the same object."""
    import dataclasses
    import inspect

    from lct.plan.memory import PlanOptions, _plan, _remedies
    o = PlanOptions(mode="train", seq=16, memory="1GiB", maximus_resident="2/8", nf4=["head"])
    assert (o.memory, o.maximus_resident, o.nf4) == (2**30, (2, 8), ("head",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.batch = 2
    assert o == PlanOptions(mode="train", seq=16, memory=2**30, maximus_resident=(2, 8),
                            nf4=("head",))
    for kw, text, option in BAD_OPTIONS:
        with pytest.raises(PlanError) as built:
            PlanOptions(**kw)
        assert str(built.value) == text and built.value.option == option, kw
        with pytest.raises(PlanError) as planned:
            plan(llama_src, **kw)
        assert str(planned.value) == text and planned.value.option == option, kw
    # What needs the model is checked when planning, naming its option too.
    with pytest.raises(PlanError, match="more shards than the") as e:
        plan(llama_src, maximus_resident="1/100000")
    assert e.value.option == "maximus_resident"
    with pytest.raises(PlanError, match="must be >= 1") as e:
        plan(llama_src, add_tokens=-10**9)
    assert e.value.option == "add_tokens"

    # The keywords and the object agree, down to their defaults.
    kw = dict(mode="train", seq=16, memory="1GiB", maximus_resident="2/8", nf4=("head",),
              format="lct", device="cpu")
    assert plan(llama_src, options=PlanOptions(**kw)).to_dict() == plan(llama_src, **kw).to_dict()
    with pytest.raises(PlanError, match="not both") as e:
        plan(llama_src, options=o, batch=2)
    assert e.value.option == "options"
    params = inspect.signature(plan).parameters
    assert {k: p.default for k, p in params.items() if k not in ("model", "options")
            and p.kind != p.VAR_KEYWORD} == \
        {f.name: f.default for f in dataclasses.fields(PlanOptions)}
    # the lossy encodings' keywords (nf4=, int8= ...) are the registry's, into PlanOptions.lossy
    assert [p.name for p in params.values() if p.kind == p.VAR_KEYWORD] == ["encodings"]
    assert PlanOptions(q8_0=("head",), lossy={"nf4": ("embed",)}).lossy == \
        {"nf4": ("embed",), "q8_0": ("head",)}
    with pytest.raises(TypeError, match="'bogus'"):
        plan(llama_src, bogus=("head",))
    assert len(inspect.signature(_plan).parameters) <= 8
    assert len(inspect.signature(_remedies).parameters) <= 8


def test_cli_leaves_the_checks_to_the_library(run, llama_src):
    """Issue 22.11: `lct plan` builds PlanOptions and does not check again what it checks; a
    library error names its flag."""
    res = run("plan", llama_src, "--vocab-size", "10", "--add-tokens", "3")
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert "not both" in res.output and "--add-tokens" in res.output
    res = run("plan", llama_src, "--blocksize", "3")
    assert res.exit_code == 1 and "(--blocksize)" in res.output, res.output
    res = run("plan", llama_src, "--nf4", "bogus")
    assert res.exit_code == 2 and "--nf4" in res.output, res.output


@pytest.mark.parametrize("flag", ["--nf4", "--int8", "--q6_k"])
def test_an_artifacts_encodings_are_not_replaced_by_options(flag, llama_art, run):
    """A new user's trial: `lct plan ART --nf4 embed,head` mixed NF4 weights with the
    artifact's stored int8 size in one table; encoding options with an artifact are refused."""
    res = run("plan", str(llama_art), flag, "embed,head")
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert "an artifact's encodings are its own" in res.output and f"({flag})" in res.output
    assert run("plan", str(llama_art), "-q").exit_code == 0
