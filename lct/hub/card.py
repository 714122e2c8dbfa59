"""The model card ``lct push`` writes: front matter the Hub renders (base model, library,
tags) and the page (sizes, the policy's measured cost, how to load it)."""

from __future__ import annotations

from pathlib import Path

from lct.format import constants as C
from lct.hub.client import _hub
from lct.units import human

CARD_NAME = "README.md"


def _source_license(manifest, token=None, endpoint=None) -> str | None:
    """The license of the artifact's source, from its model card, when it can be found cheaply:
    the local source folder, the local Hugging Face cache, or (online) the source repo's info."""
    src = manifest.source or {}
    sid, kind, rev = src.get("id"), src.get("kind"), src.get("revision")
    if not isinstance(sid, str):
        return None
    try:
        from huggingface_hub.repocard import metadata_load
        if kind == "local":
            card = Path(sid) / CARD_NAME
            meta = metadata_load(card) if card.is_file() else None
            return _license_of(meta)
        if kind != "hub":
            return None
        hh = _hub()
        cached = hh.try_to_load_from_cache(sid, CARD_NAME, revision=rev)
        if isinstance(cached, str):
            lic = _license_of(metadata_load(cached))
            if lic:
                return lic
        if hh.constants.is_offline_mode():
            return None
        info = hh.HfApi(token=token, endpoint=endpoint).model_info(
            sid, revision=rev, expand=["cardData"], timeout=10)
        data = info.card_data.to_dict() if info.card_data is not None else {}
        return _license_of(data)
    except Exception:  # noqa: BLE001 - the license is a courtesy; never fail a push over it
        return None


def _license_of(meta) -> str | None:
    lic = (meta or {}).get("license")
    return lic if isinstance(lic, str) and lic.strip() else None


def model_card(manifest, repo_id: str, *, license: str | None = None) -> str:  # noqa: A002
    """The ``README.md`` published with an artifact: front matter (``library_name: lct``,
    ``base_model``, tags, license) and a body saying how it was converted, its sizes, and how
    to load it."""
    import yaml
    src = manifest.source or {}
    pol = manifest.policy or {}
    arch = manifest.architecture or {}
    meta: dict = {"library_name": "lct"}
    if src.get("kind") == "hub" and isinstance(src.get("id"), str):
        meta["base_model"] = src["id"]
    tags = ["lct", "compressed"]
    if arch.get("model_type"):
        tags.append(str(arch["model_type"]))
    from lct.format.encodings import lossy_encodings
    tags += [e for e in lossy_encodings() if pol.get(e)]      # nf4, int8, q8_0, q6_k
    if manifest.maximus:
        tags.append("maximus")
    meta["tags"] = tags
    if license:
        meta["license"] = license
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).strip()

    name = repo_id.split("/")[-1]
    if src.get("kind") == "hub":
        origin = f"[`{src['id']}`](https://huggingface.co/{src['id']})"
        if src.get("revision"):
            origin += f" (revision `{src['revision']}`)"
    else:
        origin = "a local checkpoint" + (f" (`{Path(str(src.get('id'))).name}`)"
                                         if src.get("id") else "")
    from lct.format.encodings import get_encoding
    lossy = []
    for e in lossy_encodings():
        roles = pol.get(e) if isinstance(pol.get(e), list) else []
        if roles:
            lossy.append(f"{', '.join(map(str, roles))} in "
                         f"{get_encoding(e).described.format(blocksize=pol.get('blocksize'))}")
    nf4_line = "; ".join(lossy) if lossy else "none (every tensor lossless)"
    measured = pol.get("measured") if isinstance(pol.get("measured"), dict) else {}
    from lct.io.info import measured_line
    line = measured_line(measured)
    if line:
        nf4_line += f"; chosen by the {pol.get('mode', 'manual')} policy, {line}"
    codec = pol.get("codec", "?")
    codec_line = f"`{codec}`"
    if codec != C.CODEC_RAW:
        codec_line += f", zstd level {pol.get('level')}, frame {human(pol.get('frame_size') or 0)}"
    if manifest.maximus:
        mx = manifest.maximus
        fs = mx.get("frequency_source") or {}
        order = (f"ordered by {fs.get('tokens', 0):,} counted tokens ({fs.get('kind')})"
                 if fs.get("kind") not in (None, "none") else "in token-id order")
        maximus_line = (f"{mx.get('num_shards')} shards of {', '.join(mx.get('tensors', []))}, "
                        f"{order}")
    else:
        maximus_line = "none"
    from lct.io.info import RATIO_DEFINITION, data_bytes as files_bytes, size_ratio, \
        source_weight_bytes
    source_bytes = source_weight_bytes(manifest)
    stored = manifest.stored_bytes
    data_bytes = files_bytes(manifest)  # opening checked them on disk
    r = size_ratio(manifest)
    ratio = "n/a" if r is None else f"{r:.3f}x, {RATIO_DEFINITION.partition(': ')[2]}"
    rows = [
        ("source", origin),
        ("architecture", f"{arch.get('model_type') or 'unknown'}"
                         + (f", `{arch['class']}`" if isinstance(arch.get("class"), str) else "")
                         + _experts_line(manifest)),
        ("lossless codec", codec_line),
        ("cast", f"`{pol['dtype']}`" if pol.get("dtype") else "none (source dtypes kept)"),
        ("lossy parts", nf4_line),
        ("Maximus shards", maximus_line),
        ("groups / tensors / chunks",
         f"{len(manifest.groups)} / {len(manifest.tensors)} / {len(manifest.chunks)}"),
        ("source safetensors", human(source_bytes) if source_bytes else "unknown"),
        ("stored chunks", human(stored)),
        ("decoded size", human(manifest.decoded_bytes)),
        ("data files", f"{len(manifest.files)} file(s), {human(data_bytes)} ({ratio})"),
        ("written by", f"`{manifest.created_by}`, format "
                       f"{'.'.join(map(str, manifest.format_version))}"),
    ]
    table = "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
    return f"""---
{front}
---

# {name} (LCT)

This repository holds {origin} converted to **LCT** (Layer-wise Compressed Tensor format): every
transformer layer is an independent compressed chunk with its own checksum, so a loader streams
the model group by group (and can fetch each chunk with one HTTP range request).

## Load it

```python
import lct
model = lct.load("hf://{repo_id}", prefetch=2)
```

`lct.load(..., stream=True)` (or `lct load hf://{repo_id} --stream`) fetches only the chunks by
HTTP range requests instead of downloading the files first; `lct pull {repo_id}` downloads the
artifact into the Hugging Face cache and verifies every checksum. `lct export` turns it back into
safetensors for `from_pretrained`.

## How it was converted

{table}

The manifest `lct.json` records the sha256 of every source file and the xxh3 checksum of every
chunk; `lct verify` checks them.
"""


def _experts_line(manifest) -> str:
    """``, 8 experts per layer (2 active)`` for a mixture of experts, else ``""``."""
    from lct.io.info import experts
    e = experts(manifest)
    if not e or not e["count"]:
        return ""
    return f", {e['count']} experts per layer" + (f" ({e['active']} active)" if e["active"]
                                                  else "")
