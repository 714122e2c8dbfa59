"""A summary of an artifact for ``lct info``: per group, tensors, encodings and sizes."""

from __future__ import annotations

from dataclasses import dataclass

from lct.format.encodings import is_lossy


@dataclass
class GroupRow:
    group: str
    tensors: int
    encodings: str
    codecs: str
    stored: int
    decoded: int


# What every size ratio LCT prints means (``size_ratio``), in the words the CLI shows.
RATIO_DEFINITION = "size ratio: the artifact's .lct data files ÷ the source's .safetensors files"


def source_weight_bytes(manifest) -> int | None:
    """Bytes of the source's ``*.safetensors`` files, as recorded in ``source.files`` (None
    when the manifest records none)."""
    files = manifest.source.get("files")
    sizes = [f.get("size") for n, f in files.items() if n.endswith(".safetensors")] \
        if isinstance(files, dict) else []
    return sum(sizes) if sizes and all(isinstance(s, int) for s in sizes) else None


def data_bytes(manifest) -> int:
    """Bytes of the artifact's data files on disk (chunks, headers and alignment padding)."""
    return sum(f["size"] for f in manifest.files)


def size_ratio(manifest) -> float | None:
    """The one size ratio LCT prints (``lct convert``, ``lct info``, ``lct demo``, their
    ``--json``): ``RATIO_DEFINITION``, the bytes of the artifact's data files over those of the
    source's safetensors files. Both count headers and padding; the side files (config,
    tokenizer), copied unchanged, count in neither. None when the source sizes are unknown.

    Example:
        >>> size_ratio(lct.open("gemma.lct").manifest)
        0.614
    """
    src = source_weight_bytes(manifest)
    return data_bytes(manifest) / src if src else None


def summarize(manifest) -> list:
    """One ``GroupRow`` per group of ``manifest``, in load order."""
    rows = []
    for g in manifest.groups:
        chunks = manifest.group_chunks(g)
        tensors = manifest.group_tensors(g)
        rows.append(GroupRow(
            g, len(tensors),
            ",".join(sorted({t.encoding if is_lossy(t.encoding) else t.stored_dtype for t in tensors})),
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


def estimate_against_budget(cost: float, margin: float, budget: float) -> tuple:
    """``(text, within)``: the estimated mean KL as ``lct convert`` and ``lct info`` print it
    (with what the policy held to the budget, the estimate times ``margin``, where that is not
    1) and whether that is within ``budget`` (a NaN is not)."""
    text = f"estimated mean KL {cost:.4f} nats" + (
        f" (x{margin:g} for the estimate's measured error: {cost * margin:.4f})"
        if margin != 1.0 else "")
    return text, bool(cost * margin <= budget)


# Said once on a line whose candidate costs carry "≥" (the manifest's policy.measured.partial).
LOWER_BOUND = "; ≥: a lower bound, the head's cost alone (measuring the embedding too could " \
    "not change the choice)"


def measured_line(measured) -> str:
    """The policy's measurement (the manifest's ``policy.measured``) as one line: what it
    measured on, the estimated cost against the budget, and each candidate's cost and stored
    size; '' when absent or malformed (the object is informative, untrusted)."""
    from lct.units import human
    try:
        sizes = measured.get("sizes") or {}
        partial = measured.get("partial") or {}

        def cand(part, e, v):
            size = (sizes.get(part) or {}).get(e)
            low = "≥" if e in (partial.get(part) or ()) else ""
            return f"{e} {low}{float(v):.4f}" + (f" ({human(int(size))})" if size is not None
                                                 else "")
        costs = "; ".join(f"{part}: " + ", ".join(cand(part, e, v) for e, v in c.items())
                          for part, c in measured["costs"].items())
        cost, budget = float(measured["cost_kl"]), float(measured["budget_kl"])
        margin = float(measured.get("margin", 1.0))
        how = str(measured["method"]) + (f"; {measured['note']}" if measured.get("note") else "")
        if measured.get("tokens"):
            how += f", {int(measured['tokens'])} tokens"
        est, within = estimate_against_budget(cost, margin, budget)
        return (f"measured ({how}): {est}, {'within' if within else 'OVER'} the budget "
                f"{budget:g}; candidates (mean KL, stored size) {costs}"
                + (LOWER_BOUND if any(partial.values()) else ""))
    except (TypeError, KeyError, ValueError, AttributeError):
        return ""


def summary(manifest, path, digest: str | None = None) -> dict:
    """What ``lct info --json`` prints (fields in docs/CLI.md): the artifact at a glance, not
    its manifest (``--manifest`` prints that); ``digest`` is the open artifact's."""
    m = manifest
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
        "source_bytes": source_weight_bytes(m),
        "data_bytes": data_bytes(m),
        "ratio": size_ratio(m),
        "data_files": len(m.files),
        "side_files": m.side_files(),
        "ties": m.ties,
        "unmapped": m.unmapped,
        "maximus_shards": m.maximus["num_shards"] if m.maximus else None,
        "model_class": m.architecture.get("class"),
        "digest": digest,
        "experts": experts(m),
    }
