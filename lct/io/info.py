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


def summary(manifest, path) -> dict:
    """What ``lct info --json`` prints (fields in docs/CLI.md): the artifact at a glance, not
    its manifest (``--manifest`` prints that)."""
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
    }
