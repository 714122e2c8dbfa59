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


def human(n: float) -> str:
    """Bytes as a short human string (1.5 MB)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)
