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
    """A causal LM from ``config`` with seeded random normal weights (no slow init)."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln_" in name):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(std * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if b.is_floating_point() and not b.is_meta:
                continue
    # Buffers such as rotary inv_freq must be recomputed after to_empty.
    _reset_buffers(model)
    if dtype is not None:
        model = model.to(dtype)
    model.tie_weights()
    return model.eval()


def _reset_buffers(model) -> None:
    import torch
    for module in model.modules():
        if hasattr(module, "rope_init_fn") and hasattr(module, "inv_freq"):
            inv_freq, scaling = module.rope_init_fn(module.config, torch.device("cpu"))
            module.inv_freq.copy_(inv_freq)
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq = module.inv_freq
            module.attention_scaling = scaling
        for name, b in list(module.named_buffers(recurse=False)):
            if name == "bias" and b.dtype == torch.bool:  # GPT-2 causal mask
                n = b.shape[-1]
                b.copy_(torch.tril(torch.ones(n, n, dtype=torch.bool)).view(b.shape))


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
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(out_dir)
