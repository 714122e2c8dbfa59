"""Maximus shard state on disk: a safetensors file of ``maximus.*`` tensors plus JSON metadata,
written atomically next to the weights (an LCT artifact or a ``save_pretrained`` folder).

``save_pretrained`` does not know about shard state, and a lost permutation silently scrambles
the vocabulary; so the state travels in its own file, is validated on load (permutation, offsets,
sizes, geometry), and a mismatch with the model is an error, never a scrambled embedding.
See docs/FORMAT.md, section 9.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from dataclasses import dataclass, fields
from numbers import Integral, Real
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


@dataclass(frozen=True)
class MaximusPolicy:
    """How a ``MaximusEmbedding`` shards its table and keeps shards resident; checked once, here.

    Its fields, but ``budget_bytes``, are the residency keys of the state file's ``policy``
    metadata (FORMAT.md section 9); the defaults are ``DEFAULT_MAXIMUS_SHARDS`` and
    ``DEFAULT_MAXIMUS_POLICY``.

    Args:
        num_shards: shards N the vocabulary is split into (a module takes at most one a row).
        budget_shards: hard cap on resident shards (None: ``default_budget(N)``, or what
            ``budget_bytes`` allows).
        budget_bytes: the cap in bytes of shard copies instead (or as well: the smaller wins);
            a module resolves it to ``budget_shards``, which is what is saved.
        bucket_size: backward passes whose coalesced gradients are summed before they reach
            ``weight.grad`` (1: every step).
        load_rate / evict_rate: a shard is loaded above ``load_rate`` accesses per step and may
            be evicted below ``evict_rate`` (hysteresis: ``evict_rate <= load_rate``).
        decay: per-step decay of the access rate, in [0, 1].
        sparse: ``weight.grad`` as a sparse COO tensor (SGD, SparseAdam) or dense.

    Raises:
        OptionError: a field out of its range or of the wrong kind; ``option`` names it.

    Example:
        >>> policy = MaximusPolicy(num_shards=32, budget_shards=8, bucket_size=4)
        >>> MaximusPolicy.from_metadata(policy.to_metadata()) == policy
        True
    """

    num_shards: int = C.DEFAULT_MAXIMUS_SHARDS
    budget_shards: int | None = None
    budget_bytes: int | None = None
    bucket_size: int = C.DEFAULT_MAXIMUS_POLICY["bucket_size"]
    load_rate: float = C.DEFAULT_MAXIMUS_POLICY["load_rate"]
    evict_rate: float = C.DEFAULT_MAXIMUS_POLICY["evict_rate"]
    decay: float = C.DEFAULT_MAXIMUS_POLICY["decay"]
    sparse: bool = C.DEFAULT_MAXIMUS_POLICY["sparse"]

    def __post_init__(self):
        def whole(name, low, optional=False):
            v = getattr(self, name)
            if optional and v is None:
                return
            if not isinstance(v, Integral) or isinstance(v, bool) or v < low:
                raise OptionError(f"{name} must be an integer >= {low}, got {v!r}", option=name)
        whole("num_shards", 1)
        whole("budget_shards", 0, optional=True)
        whole("budget_bytes", 0, optional=True)
        whole("bucket_size", 1)
        for name in ("load_rate", "evict_rate", "decay"):
            v = getattr(self, name)
            if not isinstance(v, Real) or isinstance(v, bool) or math.isnan(v):
                raise OptionError(f"{name} must be a number, got {v!r}", option=name)
        if not 0 <= self.decay <= 1:
            raise OptionError(f"decay must be in [0, 1], got {self.decay}", option="decay")
        if self.evict_rate > self.load_rate:
            raise OptionError(f"evict_rate {self.evict_rate} must not exceed load_rate "
                              f"{self.load_rate} (hysteresis)", option="evict_rate")
        if not isinstance(self.sparse, bool):
            raise OptionError(f"sparse must be True or False, got {self.sparse!r}",
                              option="sparse")

    def to_metadata(self) -> dict:
        """The residency keys of the state file's ``policy`` (FORMAT.md section 9), in order.

        Raises:
            OptionError: ``budget_bytes`` is set: the file holds a budget in shards, which a
                module resolves (``MaximusEmbedding.policy`` is resolved).
        """
        if self.budget_bytes is not None:
            raise OptionError("budget_bytes is not saved: resolve it to budget_shards first "
                              "(a MaximusEmbedding's policy is resolved)", option="budget_bytes")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "budget_bytes"}

    @classmethod
    def from_metadata(cls, policy: dict, where: str | None = None) -> MaximusPolicy:
        """The policy of a state file's ``policy`` dict; keys it lacks take their defaults and
        the geometry keys (``num_embeddings``, ``embedding_dim``, ``padding_idx``) are not
        policy. With ``where`` (the file), a bad value is a ``MaximusStateError`` naming it.

        Raises:
            OptionError: a value out of range (``MaximusStateError`` when ``where`` is given).
        """
        keys = {f.name for f in fields(cls)} - {"budget_bytes"}
        try:
            return cls(**{k: v for k, v in policy.items() if k in keys})
        except OptionError as e:
            if where is None:
                raise
            raise MaximusStateError(f"{where}: policy {e}") from e


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
