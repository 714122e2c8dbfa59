"""Model architecture facts for the planner, from ``config.json`` alone (no weights): reading
the config (local folder, artifact, file or Hub id), then the model transformers builds from
it on the meta device (``lct.arch``): the dimensions, the block features the activation counts
depend on, and every parameter's shape and role (tests/test_plan.py checks them against the
built models). Any architecture transformers can build.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from lct.errors import ConfigNotFoundError, MissingDependencyError, PlanError
from lct.format import constants as C

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
    from lct.format.jsontext import read_json
    d = read_json(path, PlanError)
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
    """The shape of a model as the planner needs it, read from the model transformers builds
    from the config (``lct.arch``, on the meta device): sizes from the text config, and the
    features the activation counts depend on from the built blocks themselves."""

    family: str                        # the config's model_type (shown, never branched on)
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    tied: bool
    positions: int = 0                 # learned position embeddings (GPT-2's wpe)
    layer_types: tuple = ()            # "full_attention" / "sliding_attention" per layer
    sliding_window: int | None = None
    attn: str = "sdpa"                 # the attention implementation the built model uses
    dtype: str | None = None           # the checkpoint dtype in config.json
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    softcap: float | None = None       # final logit soft-capping (Gemma-2)
    attn_softcap: float | None = None  # attention score soft-capping (Gemma-2, eager)
    dropout: float = 0.0               # dropout of a GPT-2-style block (saves masks in training)
    norm: str = "rms"                  # the blocks' norms: "rms", "plus_one" (1 + w), "layer"
    block_norms: int = 2               # norms in a block besides q/k norms (Gemma-2: 4)
    qk_norm: bool = False              # RMSNorms over q and k (Qwen3, Gemma-3)
    fused_qkv: bool = False            # one qkv projection (Phi-3)
    conv1d: bool = False               # GPT-2's Conv1D projections (c_attn, c_fc)
    measured: bool = True              # a dense decoder of the kind the counts were checked on
    shape: str = ""                    # what makes it another kind, for the planner's note
    specs: tuple = ()                  # every parameter (ParamSpec), a tied head left out
    experts: dict | None = None        # {"count", "active", "params"} of a mixture of experts


def model_dims(d: dict, where: str = "config.json", vocab_size: int | None = None) -> Dims:
    """Build the transformers config of ``d`` (defaults filled exactly as the model would),
    the model on the meta device, and take the dimensions from them; ``vocab_size``
    overrides the vocabulary. Any model type transformers knows."""
    key = json.dumps(d, sort_keys=True, default=str) + f"|{vocab_size}|{where}"
    if key not in _DIMS:
        _DIMS[key] = _model_dims(d, where, vocab_size)
    return _DIMS[key]


_DIMS: dict = {}        # a plan asks again for each remedy it prices: built once


def _model_dims(d: dict, where: str, vocab_size: int | None) -> Dims:
    mt = d.get("model_type")
    try:
        from transformers import CONFIG_MAPPING, AutoConfig
    except ImportError as e:  # pragma: no cover
        raise MissingDependencyError("transformers is needed to read configs: "
                                     "pip install transformers") from e
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING:
        raise PlanError(f"{where}: model_type {mt!r} is not one transformers knows (it builds "
                        f"the planner's model)")
    kw = {k: v for k, v in d.items() if k != "model_type"}
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
        for sub in ("text_config", "decoder"):
            if isinstance(kw.get(sub), dict):
                kw[sub] = dict(kw[sub], vocab_size=vocab_size)
    try:
        cfg = AutoConfig.for_model(mt, **kw)
    except (TypeError, ValueError, KeyError) as e:
        raise PlanError(f"{where}: not a valid {mt} config ({e})") from e
    from lct.arch.model import Architecture
    from lct.errors import ArchitectureError
    try:
        arch = Architecture.from_config(cfg)
    except ArchitectureError as e:
        raise PlanError(f"{where}: {e}") from e
    return _dims_of(arch, cfg, d)


def _dims_of(arch, cfg, d: dict) -> Dims:
    """The planner's ``Dims`` of a built architecture."""
    import torch
    text = arch.text_config
    get = lambda k, default=None: getattr(text, k, default)  # noqa: E731
    first = lambda *keys: next((get(k) for k in keys if isinstance(get(k), int)), None)  # noqa: E731
    model = arch.model
    specs = parameter_specs_of(arch)
    embed = next(s for s in specs if s.role == "embed")
    main = arch.main
    block = model.get_submodule(main.path)[0] if main is not None else None
    names = {n for n, _ in block.named_parameters()} if block is not None else set()
    heads = first("num_attention_heads", "n_head", "num_heads") or 1
    kv = first("num_key_value_heads", "n_kv_heads", "num_kv_heads") or heads
    hidden = first("hidden_size", "n_embd", "d_model") or embed.shape[1]
    attn = next((m for n, m in block.named_modules() if n.endswith(("self_attn", "attn",
                                                                   "attention"))), None) \
        if block is not None else None
    head_dim = getattr(attn, "head_dim", None) or first("head_dim") or hidden // heads
    layers = main.count if main is not None else first("num_hidden_layers", "n_layer") or 0
    types = get("layer_types")
    window = get("sliding_window")
    if not types:
        types = ["sliding_attention" if window is not None else "full_attention"] * layers
    from transformers.pytorch_utils import Conv1D
    conv1d = block is not None and any(isinstance(m, Conv1D) for m in block.modules())
    norms = [m for n, m in block.named_children()] if block is not None else []
    block_norms = sum(1 for n, m in block.named_children() if "norm" in n or "ln" in n) \
        if block is not None else 2
    layer_norm = any(isinstance(m, torch.nn.LayerNorm) for m in norms)
    dense = bool(names & {"self_attn.q_proj.weight", "self_attn.qkv_proj.weight",
                          "attn.c_attn.weight"}) and bool(
        names & {"mlp.down_proj.weight", "mlp.c_proj.weight"})
    why = "routed experts" if arch.experts else f"{len(arch.stacks)} layer stacks" \
        if len(arch.stacks) != 1 else "" if dense else "blocks unlike the dense decoders the " \
        "counts were checked on (state-space or other layers)"
    dtype = d.get("dtype") or d.get("torch_dtype")
    pos = next((s for s in specs if s.role == "pos_embed"), None)
    experts = None
    if arch.experts:
        eparams = sum(s.numel for s in specs if ".experts." in f".{s.name}")
        experts = {"count": arch.experts.count, "active": arch.experts.active,
                   "params": eparams}
    dropout = max((float(get(k) or 0.0) for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop")),
                  default=0.0) if conv1d else 0.0
    return Dims(
        str(cfg.model_type), embed.shape[0], hidden, layers, heads, kv, head_dim,
        first("intermediate_size", "n_inner", "ffn_dim") or 4 * hidden,
        not any(s.role == "head" for s in specs), positions=pos.shape[0] if pos else 0,
        layer_types=tuple(types), sliding_window=window,
        attn=getattr(model.config, "_attn_implementation", None) or "sdpa",
        dtype=dtype if isinstance(dtype, str) else None,
        qkv_bias=conv1d or "self_attn.q_proj.bias" in names,
        o_bias=conv1d or "self_attn.o_proj.bias" in names,
        mlp_bias=conv1d or bool(names & {"mlp.up_proj.bias", "mlp.down_proj.bias"}),
        softcap=get("final_logit_softcapping"), attn_softcap=get("attn_logit_softcapping"),
        dropout=dropout, norm="layer" if layer_norm else "plus_one" if arch.plus_one else "rms",
        block_norms=block_norms, qk_norm="self_attn.q_norm.weight" in names,
        fused_qkv="self_attn.qkv_proj.weight" in names, conv1d=conv1d,
        measured=not why, shape=why, specs=tuple(specs), experts=experts)


# --------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of the model."""

    name: str
    shape: tuple
    role: str          # embed, pos_embed, layer, norm, head, misc (as lct.arch places it)
    group: str         # the LCT group

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parameter_specs_of(arch) -> list:
    """Every parameter of the built model by its name in the model (a tied parameter once:
    a tied head is absent), placed in its LCT group and role."""
    out = []
    for name, p in arch.model.named_parameters():
        if name in arch.ties:
            continue
        group, role = arch.place_param(name)
        out.append(ParamSpec(name, tuple(p.shape), role, group))
    return out


def parameter_specs(dims: Dims) -> list:
    """Every parameter of the model (a tied head is absent)."""
    return list(dims.specs)
