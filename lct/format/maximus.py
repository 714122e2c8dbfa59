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

from lct.errors import MaximusStateError
from lct.format import constants as C

STATS_FIELDS = ("lookups", "hits", "misses", "shard_loads", "shard_evictions", "bytes_moved",
                "steps", "pad_lookups")


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
        raise ValueError(f"the number of shards must be in 1..{num_rows}, got {num_shards}")
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
    from safetensors.torch import save_file
    tensors, meta = {}, {}
    for mp, (t, m) in per_module.items():
        for k, v in t.items():
            tensors[state_key(mp, k)] = v.contiguous()
        meta[mp] = m
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        save_file(tensors, str(tmp), metadata={"format": C.MAXIMUS_STATE_FORMAT, "version": C.MAXIMUS_STATE_VERSION,
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
    try:
        modules = json.loads(meta.get("modules", "{}"))
    except ValueError as e:
        raise MaximusStateError(f"{path}: metadata 'modules' is not JSON") from e
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
