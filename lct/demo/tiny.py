"""Tiny random Hugging Face models, built offline, for the demo, tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

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
    """A transformers config of architecture ``arch`` with the tiny defaults and ``overrides``."""
    from transformers import AutoConfig
    kwargs = dict(TINY_CONFIGS[arch])
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def build_model(config, seed: int = 0, dtype=None, std: float = 0.02):
    """A causal LM from ``config`` with seeded random normal weights (no slow init).

    Parameters are created on the meta device and then filled, so building is fast even for
    Gemma-2B's shape; buffers (rotary tables, masks) are built normally.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
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


def save_tiny(out_dir, arch: str = "gemma", seed: int = 0, dtype=None, **overrides) -> Path:
    """Build a tiny random ``arch`` model and save it as a Hugging Face folder (safetensors)."""
    import torch
    config = config_for(arch, **overrides)
    model = build_model(config, seed=seed, dtype=dtype or torch.bfloat16)
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
