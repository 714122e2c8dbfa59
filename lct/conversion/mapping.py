"""Hugging Face tensor names -> LCT groups and roles, one table per architecture family.

A name no table knows goes to group ``misc`` with role ``misc`` and is reported: no tensor is
ever dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lct.format import constants as C


@dataclass(frozen=True)
class Mapping:
    """The naming scheme of one architecture family."""

    name: str
    embed: tuple[str, ...]       # regexes for the token embedding
    pos_embed: tuple[str, ...]   # learned position embeddings (stored losslessly in group embed)
    layer: str                   # regex whose group 1 is the layer index
    norm: tuple[str, ...]        # final norm
    head: tuple[str, ...]        # LM head
    tied_head: str = "lm_head.weight"  # the name a tied head is recorded under


# Llama family: Llama, Mistral, Mixtral, Qwen2/Qwen3, Gemma/Gemma2, Phi-3, and most decoders since
# follow `model.embed_tokens` / `model.layers.N` / `model.norm` / `lm_head`.
LLAMA = Mapping(
    name="llama",
    embed=(r"model\.embed_tokens\.weight",),
    pos_embed=(),
    layer=r"model\.layers\.(\d+)\.",
    norm=(r"model\.norm\.(weight|bias)",),
    head=(r"lm_head\.weight",),
)

# GPT-2: `transformer.` prefix when saved from GPT2LMHeadModel, none when saved from GPT2Model.
GPT2 = Mapping(
    name="gpt2",
    embed=(r"(transformer\.)?wte\.weight",),
    pos_embed=(r"(transformer\.)?wpe\.weight",),
    layer=r"(?:transformer\.)?h\.(\d+)\.",
    norm=(r"(transformer\.)?ln_f\.(weight|bias)",),
    head=(r"lm_head\.weight",),
)

MODEL_TYPES = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "mixtral": LLAMA,
    "qwen2": LLAMA,
    "qwen2_moe": LLAMA,
    "qwen3": LLAMA,
    "gemma": LLAMA,
    "gemma2": LLAMA,
    "phi3": LLAMA,
    "gpt2": GPT2,
}


def mapping_for(model_type: str | None) -> Mapping:
    """The table for ``model_type`` (from config.json); unknown types use the Llama table."""
    return MODEL_TYPES.get(model_type or "", LLAMA)


def layer_group(index: int) -> str:
    """Group name of transformer layer ``index``."""
    return f"{C.GROUP_LAYER_PREFIX}{index}"


def classify(name: str, mapping: Mapping) -> tuple[str, str]:
    """Return ``(group, role)`` for tensor ``name``."""
    if any(re.fullmatch(p, name) for p in mapping.embed):
        return C.GROUP_EMBED, "embed"
    if any(re.fullmatch(p, name) for p in mapping.pos_embed):
        return C.GROUP_EMBED, "pos_embed"
    m = re.match(mapping.layer, name)
    if m:
        return layer_group(int(m.group(1))), "layer"
    if any(re.fullmatch(p, name) for p in mapping.norm):
        return C.GROUP_NORM, "norm"
    if any(re.fullmatch(p, name) for p in mapping.head):
        return C.GROUP_HEAD, "head"
    return C.GROUP_MISC, "misc"


def group_order(groups) -> list[str]:
    """Sort group names into load order: embed, layers by index, norm, head, misc."""
    def key(g: str):
        if g == C.GROUP_EMBED:
            return (0, 0)
        if g.startswith(C.GROUP_LAYER_PREFIX):
            return (1, int(g[len(C.GROUP_LAYER_PREFIX):]))
        return ({C.GROUP_NORM: 2, C.GROUP_HEAD: 3}.get(g, 4), 0)
    return sorted(set(groups), key=key)
