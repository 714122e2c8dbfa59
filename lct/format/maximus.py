"""Maximus shard state on disk: a safetensors file of ``maximus.*`` tensors plus JSON metadata,
written atomically next to the weights (an LCT artifact or a ``save_pretrained`` folder).

``save_pretrained`` does not know about shard state, and a lost permutation silently scrambles
the vocabulary; so the state travels in its own file, is validated on load (permutation, offsets,
sizes, geometry), and a mismatch with the model is an error, never a scrambled embedding.
See docs/FORMAT.md, section 9.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from lct.errors import MaximusStateError, OptionError
from lct.format import constants as C

STATS_FIELDS = C.MAXIMUS_STATS_FIELDS

# The state file's fields (FORMAT.md section 9): dtype, and shape in terms of V (rows), N (shards),
# k (any length) and the number of counters.
STATE_FIELDS = {
    "id_to_row": ("int64", ("V",)),
    "row_to_id": ("int64", ("V",)),
    "shard_offsets": ("int64", ("N+1",)),
    "token_freq": ("int64", ("V",)),
    "shard_score": ("float32", ("N",)),
    "shard_last_access_step": ("int64", ("N",)),
    "resident": ("uint8", ("N",)),
    "pad_ids": ("int64", ("k",)),
    "step": ("int64", (2,)),
    "stats": ("int64", (len(C.MAXIMUS_STATS_FIELDS),)),
}


def default_budget(num_shards: int) -> int:
    """Shards resident on the accelerator unless told otherwise: a quarter, at least one."""
    return max(1, num_shards // 4)



def shard_offsets(num_rows: int, num_shards: int):
    """Row boundaries of ``num_shards`` equal shards (the last may be shorter): int64 [N+1]."""
    import torch
    return torch.tensor(shard_bounds(num_rows, num_shards), dtype=torch.int64)


def shard_bounds(num_rows: int, num_shards: int) -> list:
    """``shard_offsets`` as a list of ints (for code that does not import torch)."""
    if not 1 <= num_shards <= num_rows:
        raise OptionError(f"the number of shards must be in 1..{num_rows}, got {num_shards}",
                          option="maximus_shards")
    size = -(-num_rows // num_shards)
    return [min(i * size, num_rows) for i in range(num_shards + 1)]


def frequency_order(counts):
    """``row_to_id``: ids by descending count, ties by ascending id (stable, reproducible)."""
    import torch
    counts = torch.as_tensor(counts, dtype=torch.int64)
    return torch.sort(-counts, stable=True).indices


def invert_permutation(row_to_id):
    """``id_to_row`` for a permutation ``row_to_id`` (int64)."""
    import torch
    id_to_row = torch.empty_like(row_to_id)
    id_to_row[row_to_id] = torch.arange(row_to_id.numel())
    return id_to_row


def initial_state(counts, num_shards: int, pad_ids=()) -> dict:
    """The ``maximus.*`` tensors of a fresh shard plan: frequency order, offsets, zero scores."""
    import torch
    counts = torch.as_tensor(counts, dtype=torch.int64)
    rows = counts.numel()
    row_to_id = frequency_order(counts)
    id_to_row = invert_permutation(row_to_id)
    offsets = shard_offsets(rows, num_shards)
    n = offsets.numel() - 1
    return {
        "maximus.id_to_row": id_to_row, "maximus.row_to_id": row_to_id,
        "maximus.shard_offsets": offsets, "maximus.token_freq": counts.clone(),
        "maximus.shard_score": torch.zeros(n, dtype=torch.float32),
        "maximus.shard_last_access_step": torch.full((n,), -1, dtype=torch.int64),
        "maximus.resident": torch.zeros(n, dtype=torch.uint8),
        "maximus.pad_ids": torch.tensor(sorted(set(pad_ids)), dtype=torch.int64),
        "maximus.step": torch.zeros(2, dtype=torch.int64),
        "maximus.stats": torch.zeros(len(STATS_FIELDS), dtype=torch.int64),
    }


def state_key(module_path: str, name: str) -> str:
    """The state file's key of tensor ``name`` of the module at ``module_path``:
    "maximus.id_to_row" for a bare module, "maximus.model.embed_tokens.id_to_row" in a model."""
    return name if not module_path else name.replace("maximus.", f"maximus.{module_path}.", 1)


def module_tensors(tensors: dict, prefix: str) -> dict:
    """One module's ``maximus.*`` tensors out of a state file's, whose keys carry the module's
    ``prefix`` (``state_key(module_path, "maximus.")``)."""
    return {"maximus." + k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def write_state_file(per_module: dict, path) -> Path:
    """Write ``{module_path: (tensors, meta)}`` as one state file, atomically."""
    from lct.format.files import save_safetensors
    tensors, meta = {}, {}
    for mp, (t, m) in per_module.items():
        for k, v in t.items():
            tensors[state_key(mp, k)] = v.contiguous()
        meta[mp] = m
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        save_safetensors(tensors, tmp, {"format": C.MAXIMUS_STATE_FORMAT,
                                        "version": C.MAXIMUS_STATE_VERSION,
                                        "modules": json.dumps(meta)})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_state_file(path) -> tuple:
    """Read and check a state file's header: ``(tensors, metadata)``."""
    from safetensors import SafetensorError, safe_open
    path = Path(path)
    if path.is_dir():
        path = path / C.MAXIMUS_FILE
    if not path.is_file():
        raise MaximusStateError(f"{path}: no Maximus state file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise MaximusStateError(f"{path}: not a readable Maximus state file ({e})") from e
    if meta.get("format") != C.MAXIMUS_STATE_FORMAT:
        raise MaximusStateError(f"{path}: format {meta.get('format')!r}, expected {C.MAXIMUS_STATE_FORMAT!r}")
    if meta.get("version") != C.MAXIMUS_STATE_VERSION:
        raise MaximusStateError(f"{path}: state version {meta.get('version')!r}, this LCT reads "
                                f"{C.MAXIMUS_STATE_VERSION!r}")
    bad = [k for k in tensors if not k.startswith("maximus.") or ".weight." in k]
    if bad:
        raise MaximusStateError(f"{path}: tensor {bad[0]!r} is outside the maximus.* namespace")
    from lct.format.jsontext import parse_json
    modules = parse_json(meta.get("modules", "{}"), f"{path}: metadata 'modules'",
                         MaximusStateError)
    return tensors, modules, path


def validate_permutation(t: dict, rows: int, where: str) -> None:
    """Raise ``MaximusStateError`` unless ``t`` holds inverse permutations of ``0..rows-1``."""
    import torch
    try:
        id_to_row = t["maximus.id_to_row"].long()
        row_to_id = t["maximus.row_to_id"].long()
    except KeyError as e:
        raise MaximusStateError(f"{where}: missing {e.args[0]}") from None
    if id_to_row.shape != (rows,) or row_to_id.shape != (rows,):
        raise MaximusStateError(f"{where}: permutation of length {id_to_row.numel()}, the "
                                f"table has {rows} rows")
    if not torch.equal(torch.sort(row_to_id).values, torch.arange(rows)) or \
            not torch.equal(row_to_id[id_to_row], torch.arange(rows)):
        raise MaximusStateError(f"{where}: id_to_row/row_to_id are not inverse permutations of "
                                f"0..{rows - 1}; refusing to scramble the vocabulary")


def validate_offsets(t: dict, rows: int, num_shards: int, where: str) -> None:
    """Raise ``MaximusStateError`` unless ``t["maximus.shard_offsets"]`` is exactly
    ``shard_bounds(rows, num_shards)``: ``min(k * ceil(rows / num_shards), rows)`` for k = 0..N
    (FORMAT.md section 9). Wrong offsets would put rows in the wrong shard."""
    off = t.get("maximus.shard_offsets")
    if off is None:
        raise MaximusStateError(f"{where}: missing maximus.shard_offsets")
    if not 1 <= num_shards <= rows:
        raise MaximusStateError(f"{where}: {num_shards} shards for a table of {rows} rows; "
                                f"need 1..{rows}")
    want = shard_bounds(rows, num_shards)
    got = off.tolist() if off.dim() == 1 else None
    if got != want:
        shown = off.flatten().tolist()
        raise MaximusStateError(
            f"{where}: shard_offsets {shown[:8]}{'...' if len(shown) > 8 else ''} do not match "
            f"{rows} rows in {num_shards} shards of ceil({rows}/{num_shards}) = "
            f"{-(-rows // num_shards)} rows (the last may be shorter): expected "
            f"{want[:8]}{'...' if len(want) > 8 else ''}")


def validate_state(t: dict, modules: dict, module_path: str, rows: int, dim: int,
                   num_shards: int, where: str) -> None:
    """Check one module's state as a reader of an artifact must (FORMAT.md section 9): its
    metadata says V = ``rows``, H = ``dim`` and N = ``num_shards``; every field of the table is
    there with its dtype and shape; ``id_to_row``/``row_to_id`` are inverse permutations; the
    shard offsets are the ones V and N give; pad ids are token ids. ``t`` holds the module's
    tensors as ``maximus.<field>``. Raises ``MaximusStateError`` naming what is wrong."""
    entry = modules.get(module_path) if isinstance(modules, dict) else None
    label = module_path or "(the bare module)"
    if not isinstance(entry, dict) or not isinstance(entry.get("policy"), dict):
        raise MaximusStateError(f"{where}: metadata 'modules' has no policy for module {label}")
    policy = entry["policy"]
    for key, want in (("num_embeddings", rows), ("embedding_dim", dim), ("num_shards", num_shards)):
        got = policy.get(key)
        if not isinstance(got, int) or isinstance(got, bool) or got != want:
            raise MaximusStateError(f"{where}: module {label}: policy {key} is {got!r}, the "
                                    f"artifact has {want}")
    sizes = {"V": rows, "N": num_shards, "N+1": num_shards + 1}
    for field, (dtype, shape) in STATE_FIELDS.items():
        key = "maximus." + field
        v = t.get(key)
        if v is None:
            raise MaximusStateError(f"{where}: missing {key}")
        if str(v.dtype) != f"torch.{dtype}":
            raise MaximusStateError(f"{where}: {key} is {str(v.dtype).replace('torch.', '')}, "
                                    f"the format says {dtype}")
        if v.dim() != len(shape) or any(d not in ("k",) and v.shape[i] != sizes.get(d, d)
                                        for i, d in enumerate(shape)):
            want = [sizes.get(d, d) for d in shape]
            raise MaximusStateError(f"{where}: {key} has shape {list(v.shape)}, expected {want} "
                                    f"(V={rows}, N={num_shards})")
    validate_permutation(t, rows, where)
    validate_offsets(t, rows, num_shards, where)
    pads = t["maximus.pad_ids"]
    if pads.numel() and not bool(((pads >= 0) & (pads < rows)).all()):
        raise MaximusStateError(f"{where}: pad_ids must be token ids in 0..{rows - 1}")
