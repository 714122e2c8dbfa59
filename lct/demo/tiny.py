"""Tiny random Hugging Face models, built offline, for the demo, tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

# The shapes the tests and the demo use for four model types (a tied Gemma with one key/value
# head, an untied Llama, a Qwen2, a GPT-2); any other model type gets ``tiny_config``'s.
TINY_CONFIGS = {
    "gemma": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                  max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0),
    "llama": dict(vocab_size=384, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, pad_token_id=0),
    "qwen2": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False),
    "gpt2": dict(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}

# Gemma-2B's shape (the benchmark checkpoint; ~5 GB in bf16).
GEMMA_2B = dict(vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                max_position_embeddings=8192, tie_word_embeddings=True, pad_token_id=0)


def config_for(arch: str, **overrides):
    """A transformers config of model type ``arch`` with the tiny shape (``TINY_CONFIGS``, or
    ``tiny_config``'s for any other type) and ``overrides``."""
    from transformers import AutoConfig
    if arch not in TINY_CONFIGS:
        return tiny_config(arch, **overrides)
    kwargs = dict(TINY_CONFIGS[arch])
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def build_model(config, seed: int = 0, dtype=None, std: float = 0.02, model_class=None):
    """``model_class`` (default: the causal LM of the config's type, else the first class
    ``lct.arch.hf.candidate_classes`` gives) from ``config`` with seeded random normal weights
    (no slow init).

    Parameters are created on the meta device and then filled, so building is fast even for
    Gemma-2B's shape; buffers (rotary tables, masks) are built normally.
    """
    from lct.arch import hf
    if model_class is None:
        import transformers.models.auto.modeling_auto as auto
        name = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        model_class = (hf.class_by_name(name) if name else None) or \
            hf.candidate_classes(config)[0]
    return _fill(hf.build_meta(model_class, config), seed, dtype, std)


def _fill(model, seed: int, dtype, std: float):
    """Fill a meta-built model's parameters with seeded normal values (norms about 1), tie."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    seen = set()
    for name, p in list(model.named_parameters()):
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = torch.empty(p.shape, dtype=torch.float32)
        if p.dim() == 1 and ("norm" in name or "ln_" in name):
            t.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            t.normal_(0.0, std, generator=gen)
        mod_path, _, leaf = name.rpartition(".")
        module = model.get_submodule(mod_path) if mod_path else model
        module._parameters[leaf] = torch.nn.Parameter(t.to(dtype or p.dtype))
    model.tie_weights()
    return model.eval()


def save_tiny(out_dir, arch: str = "gemma", seed: int = 0, dtype=None, model_class=None,
              **overrides) -> Path:
    """Build a tiny random model of model type ``arch`` (``config_for``: any type transformers
    knows) as ``model_class`` (default: ``build_model``'s) and save it as a Hugging Face folder
    with ``save_pretrained`` (safetensors; config.json's ``architectures`` names the class)."""
    import torch
    config = config_for(arch, **overrides)
    model = build_model(config, seed=seed, dtype=dtype or torch.bfloat16, model_class=model_class)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out


_CORPUS = """LCT converts a Hugging Face checkpoint once into the Layer-wise Compressed Tensor format,
and from then on loads it in seconds with a prefetching streaming loader. Each transformer layer
is an independent compressed chunk; the embedding and the LM head are stored in NF4. The loader
decodes layer i plus two while layer i is handed to the runtime kernels. Hello world, the quick
brown fox jumps over the lazy dog. Memory stays bounded by what is resident plus the window."""


def save_tokenizer(out_dir, vocab_size: int = 512) -> None:
    """Train a small byte-level BPE tokenizer on an embedded text and save it (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(out_dir)


# Sizes of a tiny model of any architecture: each config attribute that exists is set to its
# value (shrinking the defaults of ``CONFIG_MAPPING[model_type]()``), in the config and in each
# sub-config (text, vision, audio, encoder, decoder).
TINY_SIZES = {
    64: ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "n_embed",
         "word_embed_proj_dim", "projection_dim", "hidden_dim"),
    2: ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
        "encoder_layers", "num_decoder_layers", "depth"),
    4: ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
        "decoder_attention_heads", "num_heads", "num_local_experts", "num_experts",
        "n_routed_experts", "moe_num_experts"),
    16: ("head_dim", "d_kv", "kv_channels", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
         "rotary_dim", "attention_head_dim", "mamba_headdim"),
    128: ("intermediate_size", "d_ff", "n_inner", "ffn_dim", "encoder_ffn_dim",
          "decoder_ffn_dim", "ffn_hidden_size", "mlp_dim"),
    32: ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
         "kv_lora_rank", "q_lora_rank"),
    256: ("vocab_size",),
}
TINY_PAIRS = {"num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2,
              "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "n_shared_experts": 1,
              "first_k_dense_replace": 1}


def tiny_config(model_type: str, **overrides):
    """A config of ``model_type`` from transformers' defaults with tiny sizes (``TINY_SIZES``),
    special token ids kept inside the vocabulary, per-layer lists cut to the layers kept, and
    ``overrides`` on top. May raise whatever the config class raises for a combination it
    does not accept."""
    from transformers import CONFIG_MAPPING
    base = CONFIG_MAPPING[model_type]()
    d = _shrink(base.to_dict())
    d.update(overrides)
    d.pop("model_type", None)
    d.pop("transformers_version", None)
    return type(base)(**d)


def _shrink(d: dict) -> dict:
    """The config dict ``d`` with tiny sizes, recursively for sub-configs."""
    sizes = {k: v for v, keys in TINY_SIZES.items() for k in keys}
    sizes.update(TINY_PAIRS)
    old_layers = next((d[k] for k in TINY_SIZES[2] if isinstance(d.get(k), int)), None)
    for key, value in list(d.items()):
        if isinstance(value, dict) and "model_type" in value:
            d[key] = _shrink(dict(value))
        elif key in sizes and isinstance(value, int) and not isinstance(value, bool) and \
                value > sizes[key]:
            d[key] = sizes[key]
    layers = next((d[k] for k in TINY_SIZES[2] if isinstance(d.get(k), int)), None)
    heads = next((d[k] for k in TINY_SIZES[4][:6] if isinstance(d.get(k), int)), None)
    hidden = next((d[k] for k in TINY_SIZES[64] if isinstance(d.get(k), int)), None)
    for key, value in list(d.items()):
        if isinstance(value, list) and old_layers and len(value) == old_layers and layers:
            d[key] = value[:layers]
        elif isinstance(value, str) and old_layers and old_layers >= 8 and \
                len(value) == old_layers and layers:
            d[key] = value[:layers]     # a per-layer pattern string ("M-M*-...")
    if heads and hidden and "mrope_section" in getattr(_config_class(d), "ignore_keys_at_rope_validation", ()):
        # multimodal rotary sections (Qwen2-VL's default 16/24/24) add up to half a head
        rope = dict(d.get("rope_parameters") or {})
        half = (d.get("head_dim") or hidden // heads) // 2
        sec = rope.get("mrope_section") or [16, 24, 24]
        cut = [max(1, half * v // sum(sec)) for v in sec]
        cut[0] += half - sum(cut)
        d["rope_parameters"] = {**rope, "mrope_section": cut}
    vocab = d.get("vocab_size")
    if isinstance(vocab, int):
        ids = sorted({k for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool)
                      and (k.endswith("token_id") or k.endswith("token_index")
                           or k.endswith("_token")) and v >= vocab})
        for n, k in enumerate(ids):
            d[k] = vocab - 1 - n
    return d


def _config_class(d: dict):
    from transformers import CONFIG_MAPPING
    return CONFIG_MAPPING[d["model_type"]] if d.get("model_type") in CONFIG_MAPPING else None


def probe_inputs(model, seed: int = 0, tokens: int = 6) -> dict:
    """Seeded inputs for one forward of ``model``: token ids (and decoder ids for an
    encoder-decoder), or audio features for a speech model."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(text, "vocab_size", None) or 256
    ids = torch.randint(3, max(4, min(vocab, 200)), (1, tokens), generator=gen)
    if getattr(model, "main_input_name", "input_ids") == "input_features":
        bins = getattr(cfg, "num_mel_bins", 80)
        frames = 2 * getattr(cfg, "max_source_positions", 1500)
        return {"input_features": torch.randn(1, bins, frames, generator=gen).to(model.dtype),
                "decoder_input_ids": ids}
    if getattr(cfg, "is_encoder_decoder", False):
        return {"input_ids": ids, "decoder_input_ids": ids}
    return {"input_ids": ids}
