"""Model architecture facts for the planner, from ``config.json`` alone: reading the config
(local folder, artifact, file or Hub id), the dimensions, and every parameter's shape and role —
exact against the transformers model built from the same config (tests/test_plan.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from lct.errors import ConfigNotFoundError, MissingDependencyError, PlanError
from lct.format import constants as C

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2")


# --------------------------------------------------------------------------------------------
# Reading the config


def read_config(model, revision: str | None = None) -> tuple:
    """``(config dict, where, artifact folder or None)`` for MODEL.

    MODEL is a dict, a transformers config, a ``config.json`` path, a model folder, an LCT
    artifact folder or a Hub repo id (only ``config.json`` is fetched; ``HF_HUB_OFFLINE=1`` uses
    the local cache only).

    Raises:
        ConfigNotFoundError: nothing at MODEL, or no config.json there.
        PlanError: the file is not a JSON object, or the download failed.
    """
    if isinstance(model, dict):
        return dict(model), "config", None
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):
        return model.to_dict(), type(model).__name__, None
    text = str(model)
    path = Path(text).expanduser()
    artifact = None
    if path.is_dir():
        artifact = path if (path / C.MANIFEST_NAME).is_file() else None
        path = path / "config.json"
        if not path.is_file():
            raise ConfigNotFoundError(f"{path.parent}: no config.json (the planner reads only "
                                      f"config.json; an LCT artifact copies it from its source)")
    elif not path.is_file():
        from lct.hub.address import is_repo_id
        if not is_repo_id(text):
            raise ConfigNotFoundError(f"{text}: no such folder or file (and not a Hub repo id "
                                      f"like org/name)")
        path = _download_config(text, revision)
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(d, dict):
        raise PlanError(f"{path}: must hold a JSON object")
    return d, str(path), artifact


def _download_config(repo_id: str, revision: str | None) -> Path:
    from lct.hub.client import hub_fetch

    # snapshot_download asks the Hub for the repo's file list first, a request that fails at
    # once without a network (then the cached snapshot is used); hf_hub_download's HEAD would be
    # retried with backoff for 15-25 s before giving up.
    def fetch():
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=["config.json"]))
    folder = hub_fetch(fetch, repo_id, revision, not_found=ConfigNotFoundError, error=PlanError,
                       offline=ConfigNotFoundError)
    if not (folder / "config.json").is_file():
        raise ConfigNotFoundError(f"{repo_id}: the Hub repo has no config.json")
    return folder / "config.json"


@dataclass(frozen=True)
class Dims:
    """The shape of a model as the planner needs it, taken from a transformers config."""

    family: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    tied: bool
    positions: int = 0                 # learned position embeddings (GPT-2)
    layer_types: tuple = ()            # "full_attention" / "sliding_attention" per layer
    sliding_window: int | None = None
    attn: str = "sdpa"                 # attention implementation transformers picks by default
    dtype: str | None = None           # the checkpoint dtype in config.json
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    softcap: float | None = None       # final logit soft-capping (Gemma-2)
    attn_softcap: float | None = None  # attention score soft-capping (Gemma-2, eager)
    dropout: float = 0.0               # GPT-2's dropout (saves masks in training)


def model_dims(d: dict, where: str = "config.json", vocab_size: int | None = None) -> Dims:
    """Build the transformers config of ``d`` (defaults filled exactly as the model would) and
    take the dimensions from it; ``vocab_size`` overrides the vocabulary."""
    mt = d.get("model_type")
    if mt not in FAMILIES:
        raise PlanError(f"{where}: model_type {mt!r} is not one the planner knows; known: "
                        f"{', '.join(FAMILIES)}")
    try:
        from transformers import AutoConfig
    except ImportError as e:  # pragma: no cover
        raise MissingDependencyError("transformers is needed to read configs: "
                                     "pip install transformers") from e
    kw = {k: v for k, v in d.items() if k != "model_type"}
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    try:
        cfg = AutoConfig.for_model(mt, **kw)
    except (TypeError, ValueError, KeyError) as e:
        raise PlanError(f"{where}: not a valid {mt} config ({e})") from e
    get = lambda k, default=None: getattr(cfg, k, default)  # noqa: E731
    dtype = d.get("dtype") or d.get("torch_dtype")
    dtype = dtype if isinstance(dtype, str) else None
    if mt == "gpt2":
        h, heads = cfg.n_embd, cfg.n_head
        return Dims("gpt2", cfg.vocab_size, h, cfg.n_layer, heads, heads, h // heads,
                    cfg.n_inner or 4 * h, bool(cfg.tie_word_embeddings), positions=cfg.n_positions,
                    layer_types=("full_attention",) * cfg.n_layer, dtype=dtype,
                    qkv_bias=True, o_bias=True, mlp_bias=True,
                    dropout=max(cfg.attn_pdrop, cfg.resid_pdrop, cfg.embd_pdrop))
    heads = cfg.num_attention_heads
    kv = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or cfg.hidden_size // heads
    if mt == "phi3":
        head_dim = cfg.hidden_size // heads
    window = get("sliding_window")
    types = get("layer_types")
    if not types:
        types = ["sliding_attention" if window is not None else "full_attention"] * \
            cfg.num_hidden_layers
    bias = bool(get("attention_bias", False))
    return Dims(
        mt, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, heads, kv, head_dim,
        cfg.intermediate_size, bool(cfg.tie_word_embeddings), layer_types=tuple(types),
        sliding_window=window, attn="eager" if mt == "gemma2" else "sdpa", dtype=dtype,
        qkv_bias=True if mt == "qwen2" else bias, o_bias=False if mt == "qwen2" else bias,
        mlp_bias=bool(get("mlp_bias", False)),
        softcap=get("final_logit_softcapping") if mt in ("gemma2", "gemma3_text") else None,
        attn_softcap=get("attn_logit_softcapping") if mt == "gemma2" else None)


# --------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor as the checkpoint holds it."""

    name: str
    shape: tuple
    role: str          # embed, pos_embed, layer, norm, head (as lct.conversion.mapping classifies it)
    group: str         # the LCT group

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parameter_specs(dims: Dims) -> list:
    """Every parameter of the model, named as in its checkpoint (a tied head is absent)."""
    d = dims
    if d.family == "gpt2":
        return _gpt2_specs(d)
    h, hd, out = d.hidden, d.head_dim, []
    out.append(ParamSpec("model.embed_tokens.weight", (d.vocab, h), "embed", C.GROUP_EMBED))
    for i in range(d.layers):
        g, p = f"{C.GROUP_LAYER_PREFIX}{i}", f"model.layers.{i}."
        shapes = []
        if d.family == "phi3":
            shapes += [("self_attn.qkv_proj.weight", ((d.heads + 2 * d.kv_heads) * hd, h)),
                       ("mlp.gate_up_proj.weight", (2 * d.inter, h))]
        else:
            for name, rows in (("q", d.heads * hd), ("k", d.kv_heads * hd), ("v", d.kv_heads * hd)):
                shapes.append((f"self_attn.{name}_proj.weight", (rows, h)))
                if d.qkv_bias:
                    shapes.append((f"self_attn.{name}_proj.bias", (rows,)))
            for name in ("gate", "up"):
                shapes.append((f"mlp.{name}_proj.weight", (d.inter, h)))
                if d.mlp_bias:
                    shapes.append((f"mlp.{name}_proj.bias", (d.inter,)))
        shapes.append(("self_attn.o_proj.weight", (h, d.heads * hd)))
        if d.o_bias:
            shapes.append(("self_attn.o_proj.bias", (h,)))
        shapes.append(("mlp.down_proj.weight", (h, d.inter)))
        if d.mlp_bias:
            shapes.append(("mlp.down_proj.bias", (h,)))
        norms = ["input_layernorm", "post_attention_layernorm"]
        if d.family in ("gemma2", "gemma3_text"):
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        shapes += [(f"{n}.weight", (h,)) for n in norms]
        if d.family in ("qwen3", "gemma3_text"):
            shapes += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
        out += [ParamSpec(p + n, s, "layer", g) for n, s in shapes]
    out.append(ParamSpec("model.norm.weight", (h,), "norm", C.GROUP_NORM))
    if not d.tied:
        out.append(ParamSpec("lm_head.weight", (d.vocab, h), "head", C.GROUP_HEAD))
    return out


def _gpt2_specs(d: Dims) -> list:
    h, out = d.hidden, []
    out.append(ParamSpec("transformer.wte.weight", (d.vocab, h), "embed", C.GROUP_EMBED))
    out.append(ParamSpec("transformer.wpe.weight", (d.positions, h), "pos_embed", C.GROUP_EMBED))
    for i in range(d.layers):
        g, p = f"{C.GROUP_LAYER_PREFIX}{i}", f"transformer.h.{i}."
        shapes = [("ln_1.weight", (h,)), ("ln_1.bias", (h,)),
                  ("attn.c_attn.weight", (h, 3 * h)), ("attn.c_attn.bias", (3 * h,)),
                  ("attn.c_proj.weight", (h, h)), ("attn.c_proj.bias", (h,)),
                  ("ln_2.weight", (h,)), ("ln_2.bias", (h,)),
                  ("mlp.c_fc.weight", (h, d.inter)), ("mlp.c_fc.bias", (d.inter,)),
                  ("mlp.c_proj.weight", (d.inter, h)), ("mlp.c_proj.bias", (h,))]
        out += [ParamSpec(p + n, s, "layer", g) for n, s in shapes]
    out += [ParamSpec("transformer.ln_f.weight", (h,), "norm", C.GROUP_NORM),
            ParamSpec("transformer.ln_f.bias", (h,), "norm", C.GROUP_NORM)]
    if not d.tied:
        out.append(ParamSpec("lm_head.weight", (d.vocab, h), "head", C.GROUP_HEAD))
    return out
