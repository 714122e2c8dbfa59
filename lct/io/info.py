"""A summary of an artifact for ``lct info``: per group, tensors, encodings and sizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GroupRow:
    group: str
    tensors: int
    encodings: str
    codecs: str
    stored: int
    decoded: int


def summarize(manifest) -> list:
    """One ``GroupRow`` per group of ``manifest``, in load order."""
    rows = []
    for g in manifest.groups:
        chunks = manifest.group_chunks(g)
        tensors = manifest.group_tensors(g)
        rows.append(GroupRow(
            g, len(tensors),
            ",".join(sorted({t.stored_dtype if t.encoding == "plain" else t.encoding for t in tensors})),
            ",".join(sorted({c.codec for c in chunks})),
            sum(c.stored_size for c in chunks), sum(c.decoded_size for c in chunks)))
    return rows


def experts(manifest) -> dict | None:
    """The routed experts of an artifact (``architecture.experts``) with the bytes of their
    groups (``layers.N.experts``), or None for a model without them: ``{count, active,
    layers, groups, stored_bytes, decoded_bytes}``."""
    from lct.format import constants as C
    arch = manifest.architecture.get("experts")
    groups = [g for g in manifest.groups if g.endswith(C.GROUP_EXPERTS_SUFFIX)]
    if not isinstance(arch, dict) and not groups:
        return None
    chunks = [c for g in groups for c in manifest.group_chunks(g)]
    arch = arch if isinstance(arch, dict) else {}
    return {"count": arch.get("count"), "active": arch.get("active"),
            "layers": arch.get("layers", len(groups)), "groups": len(groups),
            "stored_bytes": sum(c.stored_size for c in chunks),
            "decoded_bytes": sum(c.decoded_size for c in chunks)}


def architecture_line(manifest) -> str:
    """One line for ``lct info``: the model class, its stacks and its experts."""
    from lct.units import human
    a = manifest.architecture
    stacks = a.get("stacks") if isinstance(a.get("stacks"), list) else []
    parts = [f"model: {a.get('class') or a.get('model_type') or 'unknown'}"]
    if stacks:
        parts.append(", ".join(f"{s.get('path')} ({s.get('blocks')} blocks)" for s in stacks
                               if isinstance(s, dict)))
    e = experts(manifest)
    if e:
        active = f", {e['active']} active per token" if e["active"] else ""
        parts.append(f"experts: {e['count']} per layer{active} in {e['layers']} layers, "
                     f"{human(e['stored_bytes'])} stored / {human(e['decoded_bytes'])} decoded")
    return "; ".join(parts)


def summary(manifest, path, digest: str | None = None) -> dict:
    """What ``lct info --json`` prints (fields in docs/CLI.md): the artifact at a glance, not
    its manifest (``--manifest`` prints that); ``digest`` is the open artifact's."""
    m = manifest
    src = m.source_bytes
    return {
        "path": str(path),
        "format_version": f"{m.format_version[0]}.{m.format_version[1]}",
        "created_by": m.created_by,
        "source": {"id": m.source.get("id"), "revision": m.source.get("revision")},
        "policy": m.policy,
        "groups": [{"group": r.group, "tensors": r.tensors, "stored_as": r.encodings,
                    "codecs": r.codecs, "stored_bytes": r.stored, "decoded_bytes": r.decoded}
                   for r in summarize(m)],
        "tensors": len(m.tensors),
        "stored_bytes": m.stored_bytes,
        "decoded_bytes": m.decoded_bytes,
        "source_bytes": src,
        "ratio": m.stored_bytes / src if src else None,
        "data_files": len(m.files),
        "side_files": m.side_files(),
        "ties": m.ties,
        "unmapped": m.unmapped,
        "maximus_shards": m.maximus["num_shards"] if m.maximus else None,
        "model_class": m.architecture.get("class"),
        "digest": digest,
        "experts": experts(m),
    }
