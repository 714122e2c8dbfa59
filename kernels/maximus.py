"""``MaximusEmbedding``: a drop-in ``nn.Embedding`` whose vocabulary is split into frequency-ordered
shards, the hot ones resident on the compute device and the cold ones in host memory.

Rows are stored in frequency order (``row = id_to_row[id]``) in one host parameter ``weight``
(the canonical copy, which optimizers update). Shard ``s`` holds rows
``shard_offsets[s]:shard_offsets[s+1]``. Resident shards have a copy on the compute device (a view
when the compute device is the host); lookups of ids in resident shards are hits and read that
copy, the rest are misses and read host memory.

Residency follows an exponentially decayed access rate per shard with hysteresis: a shard is loaded
when its rate rises above ``load_rate`` and may be evicted when it falls below ``evict_rate``,
under a hard budget of ``budget_shards`` that is never exceeded; a shard needed by the current
batch is never evicted. These knobs are one ``MaximusPolicy`` (``lct.format.maximus``), checked
when it is made and saved as the state file's ``policy``.

Forward equals ``nn.Embedding`` exactly. Gradients are coalesced per unique id within a batch with
the same kernel ``nn.Embedding`` uses, optionally accumulated over ``bucket_size`` steps before
they reach ``weight.grad`` (sparse or dense), so the result equals ``nn.Embedding``'s gradient
summed over the same steps. Pad ids are never gathered, yield zeros and get zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch import nn

from lct.errors import MaximusStateError, OptionError
from lct.format import constants as C
from lct.format.maximus import (
    STATS_FIELDS,
    MaximusPolicy,
    default_budget,
    frequency_order,
    invert_permutation,
    module_tensors,
    read_state_file,
    shard_offsets,
    state_key,
    validate_permutation,
    validate_state,
    write_state_file,
)
from lct.format.nf4 import encoded_size
from lct.kernels.embedding import masked_gather


@dataclass
class MaximusStats:
    """Counters since construction (or the last restore)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    shard_loads: int = 0
    shard_evictions: int = 0
    bytes_moved: int = 0
    steps: int = 0
    pad_lookups: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    def as_list(self) -> list:
        return [getattr(self, f.name) for f in fields(self)]


class _Lookup(torch.autograd.Function):
    """Gather rows; backward coalesces per unique row with ``nn.Embedding``'s own kernel."""

    @staticmethod
    def forward(ctx, weight, rows, module):
        ctx.module = module
        ctx.save_for_backward(rows)
        return module._gather(rows)

    @staticmethod
    def backward(ctx, grad_out):
        (rows,) = ctx.saved_tensors
        ctx.module._accumulate(rows, grad_out)
        return None, None, None


# The keywords MaximusEmbedding took before MaximusPolicy (0.1.0 development: max_shards=... is
# now policy=MaximusPolicy(num_shards=...)): accepted for one release, with a DeprecationWarning.
_LEGACY = {"max_shards": "num_shards", "bucket_size": "bucket_size",
           "budget_shards": "budget_shards", "budget_bytes": "budget_bytes", "sparse": "sparse",
           "load_rate": "load_rate", "evict_rate": "evict_rate", "decay": "decay"}


def _legacy_policy(policy, legacy: dict):
    """``policy``, or one built from the old keywords in ``legacy`` (warning that they go)."""
    if not legacy:
        return policy
    unknown = sorted(set(legacy) - set(_LEGACY))
    if unknown:
        raise OptionError(f"MaximusEmbedding() takes no keyword {unknown[0]!r}",
                          option=unknown[0])
    if policy is not None:
        raise OptionError(f"give policy=MaximusPolicy(...) or the old keywords "
                          f"({', '.join(sorted(legacy))}), not both", option="policy")
    import warnings
    new = ", ".join(f"{_LEGACY[k]}={v!r}" for k, v in legacy.items())
    warnings.warn(f"MaximusEmbedding({', '.join(f'{k}=...' for k in legacy)}) is deprecated and "
                  f"goes in the next release: pass policy=MaximusPolicy({new})",
                  DeprecationWarning, stacklevel=3)
    return MaximusPolicy(**{_LEGACY[k]: v for k, v in legacy.items()})


class MaximusEmbedding(nn.Module):
    """Frequency-sharded embedding; see the module docstring.

    Args:
        num_embeddings, embedding_dim, padding_idx: as ``nn.Embedding``.
        policy: the ``MaximusPolicy``: shards N (at most ``num_embeddings``; the last may be
            shorter), resident budget (default: a quarter of the shards), gradient bucket,
            load/evict rates, decay, sparse gradients (default: ``MaximusPolicy()``). The module
            keeps it resolved as ``self.policy``: N capped, the budget in shards.
        pad_ids: extra ids treated like ``padding_idx`` (zeros, never gathered, no gradient).
        device: the compute device for resident shards (default: the host, i.e. CPU).
        weight: initial weights in id order [V, H] (default: ``nn.Embedding``'s init).
        counts: token counts [V] that define the frequency order (default: id order).
        nf4: ``(packed, absmax, blocksize)`` to serve an NF4 table instead of a dense weight
            (inference: gather-then-dequantize, bit-identical to dequantizing the table).
        row_to_id: an explicit frequency order (overrides the one derived from ``counts``).
        ordered: ``weight``/``nf4`` are already in row (frequency) order.
        scale: optional output multiplier, like Gemma's scaled embedding.

    Raises:
        OptionError: a table, order or ``policy`` that does not fit (``option`` names it).

    Example:
        >>> m = MaximusEmbedding(V, H, 0, MaximusPolicy(num_shards=32, budget_shards=8),
        ...                      counts=counts, weight=old.weight.detach())
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 policy: MaximusPolicy | None = None, *, weight: torch.Tensor | None = None,
                 counts=None, dtype=None, nf4=None, row_to_id: torch.Tensor | None = None,
                 ordered: bool = False, scale: torch.Tensor | None = None, pad_ids=(),
                 device=None, **legacy):
        super().__init__()
        policy = _legacy_policy(policy, legacy)
        policy = MaximusPolicy() if policy is None else policy
        if not isinstance(policy, MaximusPolicy):
            raise OptionError(f"policy must be a MaximusPolicy, got {type(policy).__name__}",
                              option="policy")
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        num_shards = min(policy.num_shards, num_embeddings)
        self.compute_device = torch.device(device) if device is not None else torch.device("cpu")

        counts = torch.zeros(num_embeddings, dtype=torch.int64) if counts is None else \
            torch.as_tensor(counts, dtype=torch.int64).clone()
        if counts.shape != (num_embeddings,):
            raise OptionError(f"counts must have shape [{num_embeddings}], got "
                              f"{list(counts.shape)}", option="counts")
        row_to_id = frequency_order(counts) if row_to_id is None else \
            torch.as_tensor(row_to_id, dtype=torch.int64).clone()
        if not torch.equal(torch.sort(row_to_id).values, torch.arange(num_embeddings)):
            raise OptionError(f"row_to_id is not a permutation of 0..{num_embeddings - 1}",
                              option="row_to_id")
        id_to_row = invert_permutation(row_to_id)
        # Shard state is not part of the state dict (save_maximus_state writes it next to the
        # weights); the state dict holds the weight in token-id order, so save_pretrained of a
        # model using this module stays a plain, unscrambled embedding.
        buf = dict(persistent=False)
        self.register_buffer("row_to_id", row_to_id, **buf)
        self.register_buffer("id_to_row", id_to_row, **buf)
        self.register_buffer("token_counts", counts, **buf)
        self.register_buffer("shard_offsets", shard_offsets(num_embeddings, num_shards), **buf)
        # Equal shards (the last may be shorter); offsets never change after construction
        # (load_state_tensors refuses others), so the width is a plain int for the hot path.
        self.rows_per_shard = int(self.shard_offsets[1] - self.shard_offsets[0])
        self.register_buffer("shard_score", torch.zeros(num_shards, dtype=torch.float32), **buf)
        self.register_buffer("shard_last_access_step",
                             torch.full((num_shards,), -1, dtype=torch.int64), **buf)
        pads = set(int(p) for p in pad_ids)
        if padding_idx is not None:
            pads.add(padding_idx)
        self.register_buffer("pad_ids", torch.tensor(sorted(pads), dtype=torch.int64),
                             persistent=False)

        self.nf4 = None                   # (packed [V, H/2], absmax [V, H/bs], blocksize) by row
        if nf4 is not None:
            packed, absmax, bs = nf4
            if embedding_dim % bs:
                raise OptionError(f"NF4 blocksize {bs} must divide embedding_dim {embedding_dim}",
                                  option="nf4")
            packed = packed.reshape(num_embeddings, embedding_dim // 2)
            absmax = absmax.reshape(num_embeddings, embedding_dim // bs)
            if not ordered:
                packed, absmax = packed[row_to_id], absmax[row_to_id]
            self.nf4 = (packed, absmax, bs)
            self.weight = nn.Parameter(torch.empty(0, embedding_dim, dtype=dtype or torch.float32),
                                       requires_grad=False)
        elif weight is None:
            weight = torch.empty(num_embeddings, embedding_dim, dtype=dtype)
            nn.init.normal_(weight)
            if padding_idx is not None:
                with torch.no_grad():
                    weight[padding_idx].zero_()
        elif weight.shape != (num_embeddings, embedding_dim):
            raise OptionError(f"weight must be [{num_embeddings}, {embedding_dim}], "
                              f"got {list(weight.shape)}", option="weight")
        if nf4 is None:
            w = weight.detach() if ordered else weight.detach()[row_to_id]
            self.weight = nn.Parameter(w.clone() if ordered else w)

        shard_bytes = self.rows_per_shard * (
            encoded_size(embedding_dim, self.nf4[2]) if self.nf4 is not None
            else embedding_dim * self.weight.element_size())
        budget = policy.budget_shards
        if budget is None and policy.budget_bytes is None:
            budget = default_budget(num_shards)
        if policy.budget_bytes is not None:
            budget = min(budget or num_shards, policy.budget_bytes // shard_bytes)
        # The policy in effect, the one saved: N capped by the rows, the budget in shards.
        self.policy = replace(policy, num_shards=num_shards, budget_bytes=None,
                              budget_shards=max(0, min(int(budget), num_shards)))
        self.register_buffer("scale", scale, persistent=False)
        self.stats = MaximusStats()
        self.resident: dict = {}          # shard -> device copy of its rows
        self._dirty: set = set()          # shards whose host rows changed since their copy
        self._pending = None              # (rows, grads) accumulated within a bucket
        self._backwards = 0
        self._side_stream = None
        self._pin_host()

    # Geometry -------------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        """Shards N in effect (``policy.num_shards``)."""
        return self.policy.num_shards

    @property
    def budget_shards(self) -> int:
        """The hard cap on resident shards in effect (``policy.budget_shards``)."""
        return self.policy.budget_shards

    def shard_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Shard index of each row."""
        return torch.div(rows, self.rows_per_shard, rounding_mode="floor")

    @property
    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for copy in self.resident.values()
                   for t in (copy if isinstance(copy, tuple) else (copy,)))

    def _host(self):
        """The host table in row order: the weight, or (packed, absmax) for NF4."""
        return self.weight.detach() if self.nf4 is None else self.nf4[:2]

    def _take(self, source, rows: torch.Tensor) -> torch.Tensor:
        if self.nf4 is None:
            return source[rows]
        from lct.kernels.nf4 import dequantize_rows
        return dequantize_rows(source[0][rows], source[1][rows], self.nf4[2], self.weight.dtype)

    # Residency ------------------------------------------------------------------------------
    def _load(self, s: int) -> None:
        lo, hi = int(self.shard_offsets[s]), int(self.shard_offsets[s + 1])
        host = self._host()
        parts = (host,) if self.nf4 is None else host
        parts = tuple(p[lo:hi] for p in parts)
        if self.compute_device != parts[0].device:
            if self.compute_device.type == "cuda":
                # Host rows are pinned (see _pin_host); the copy goes on a side stream and the
                # next lookup waits for it (_sync_side_stream), so loads overlap compute.
                if self._side_stream is None:
                    self._side_stream = torch.cuda.Stream(self.compute_device)
                with torch.cuda.stream(self._side_stream):
                    parts = tuple(p.to(self.compute_device, non_blocking=True) for p in parts)
            else:
                parts = tuple(p.to(self.compute_device) for p in parts)
            self.stats.bytes_moved += sum(p.numel() * p.element_size() for p in parts)
        # On the host device the copy is a view: nothing moves, nothing goes stale.
        self.resident[s] = parts[0] if self.nf4 is None else parts
        self._dirty.discard(s)
        self.stats.shard_loads += 1

    def _evict(self, s: int) -> None:
        del self.resident[s]
        self.stats.shard_evictions += 1

    def _update_residency(self, needed: torch.Tensor) -> None:
        """Hysteresis under the budget; shards in ``needed`` are never evicted."""
        need = set(needed.tolist())
        score = self.shard_score
        for s in [s for s in self.resident if s not in need and score[s] < self.policy.evict_rate]:
            self._evict(s)
        candidates = [s for s in torch.argsort(score, descending=True, stable=True).tolist()
                      if s not in self.resident and score[s] > self.policy.load_rate]
        for s in candidates:
            if len(self.resident) >= self.budget_shards:
                # Make room only by evicting a colder shard that this batch does not need.
                victims = [v for v in self.resident if v not in need and score[v] < score[s]]
                if not victims:
                    break
                self._evict(min(victims, key=lambda v: (float(score[v]), v)))
            self._load(s)

    def _refresh_dirty(self) -> None:
        for s in list(self._dirty):
            if s in self.resident and self.nf4 is None and self.resident[s].data_ptr() != \
                    self.weight.detach()[int(self.shard_offsets[s])].data_ptr():
                self._load(s)
                self.stats.shard_loads -= 1  # a refresh, not a residency change
        self._dirty.clear()

    # Lookup ---------------------------------------------------------------------------------
    def _sync_side_stream(self) -> None:
        if self._side_stream is not None:
            torch.cuda.current_stream(self.compute_device).wait_stream(self._side_stream)

    def _pin_host(self) -> None:
        """Cold rows live in page-locked host memory when the compute device is a GPU."""
        if self.compute_device.type == "cuda" and self.nf4 is None and not self.weight.is_pinned():
            self.weight.data = self.weight.data.pin_memory()
        elif self.compute_device.type == "cuda" and self.nf4 is not None:
            self.nf4 = tuple(t.pin_memory() if torch.is_tensor(t) and not t.is_pinned() else t
                             for t in self.nf4)

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        self._sync_side_stream()
        out = torch.empty(rows.numel(), self.embedding_dim, dtype=self.weight.dtype,
                          device=self.compute_device)
        shards = self.shard_of_rows(rows)
        hit = torch.zeros(rows.numel(), dtype=torch.bool)
        for s, copy in self.resident.items():
            m = shards == s
            if m.any():
                dev = (copy if self.nf4 is None else copy[0]).device
                out[m.to(out.device)] = self._take(copy, (rows[m] - self.shard_offsets[s]).to(dev))
                hit |= m
        miss = ~hit
        if miss.any():
            out[miss.to(out.device)] = self._take(self._host(), rows[miss]).to(self.compute_device)
        self.stats.hits += int(hit.sum())
        self.stats.misses += int(miss.sum())
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.id_to_row.device)
        self.stats.lookups += ids.numel()
        return masked_gather(ids, self.num_embeddings, self.embedding_dim, self.pad_ids,
                             lambda sel: self._lookup(sel, ids.numel()), self.scale)

    def _lookup(self, ids: torch.Tensor, asked: int) -> torch.Tensor:
        """The rows of ``ids`` (no pad id among them), counted and gathered from the resident
        shards or host memory; ``asked`` ids were looked up in all."""
        rows = self.id_to_row[ids]
        self.stats.pad_lookups += asked - ids.numel()
        self._observe(rows)
        self._refresh_dirty()
        return _Lookup.apply(self.weight, rows, self) if torch.is_grad_enabled() and \
            self.weight.requires_grad and self.nf4 is None else self._gather(rows)

    def _observe(self, rows: torch.Tensor) -> None:
        """Count this step's accesses, decay the rates, decide residency."""
        step = self.stats.steps
        shards = self.shard_of_rows(rows)
        per_shard = torch.bincount(shards, minlength=self.num_shards).to(torch.float32)
        decay = self.policy.decay
        self.shard_score.mul_(decay).add_(per_shard * (1 - decay))
        touched = per_shard > 0
        self.shard_last_access_step[touched] = step
        self.stats.steps += 1
        self._update_residency(touched.nonzero().flatten())  # the shards of this batch, sorted

    # Gradients ------------------------------------------------------------------------------
    def _accumulate(self, rows: torch.Tensor, grad_out: torch.Tensor) -> None:
        uniq, inv = torch.unique(rows, return_inverse=True)
        # nn.Embedding's own backward kernel, over the batch's unique rows: same sums, same order.
        grad = torch.ops.aten.embedding_dense_backward(grad_out.to(self.weight.device), inv,
                                                       len(uniq), -1, False)
        if self._pending is None:
            self._pending = (uniq, grad)
        else:
            prev_rows, prev = self._pending
            all_rows, inv2 = torch.unique(torch.cat([prev_rows, uniq]), return_inverse=True)
            acc = torch.zeros(len(all_rows), self.embedding_dim, dtype=grad.dtype)
            acc.index_add_(0, inv2[: len(prev_rows)], prev)
            acc.index_add_(0, inv2[len(prev_rows):], grad)
            self._pending = (all_rows, acc)
        self._backwards += 1
        if self._backwards % self.policy.bucket_size == 0:
            self.flush_gradients()

    def flush_gradients(self) -> None:
        """Write the pending bucket into ``weight.grad`` (added to what is there)."""
        if self._pending is None:
            return
        rows, grad = self._pending
        self._pending = None
        if self.policy.sparse:
            g = torch.sparse_coo_tensor(rows.unsqueeze(0), grad, self.weight.shape,
                                        is_coalesced=True, check_invariants=False)
        else:
            g = torch.zeros_like(self.weight)
            g[rows] = grad
        self.weight.grad = g if self.weight.grad is None else self.weight.grad + g
        self._dirty.update(self.shard_of_rows(rows).unique().tolist()
                           if self.policy.sparse else range(self.num_shards))

    # Views and state -------------------------------------------------------------------------
    def id_ordered_weight(self) -> torch.Tensor:
        """The table in token-id order (what ``nn.Embedding.weight`` would hold)."""
        if self.nf4 is not None:
            from lct.kernels.nf4 import dequantize_rows
            packed, absmax, bs = self.nf4
            return dequantize_rows(packed[self.id_to_row], absmax[self.id_to_row], bs,
                                   self.weight.dtype)
        return self.weight.detach()[self.id_to_row]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.flush_gradients()
        destination[prefix + "weight"] = self.id_ordered_weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        w = state_dict[key]
        if tuple(w.shape) != (self.num_embeddings, self.embedding_dim):
            error_msgs.append(f"{key}: shape {list(w.shape)} != "
                              f"{[self.num_embeddings, self.embedding_dim]}")
            return
        with torch.no_grad():
            self.weight.copy_(w[self.row_to_id])
        self._reset_resident()

    def _reset_resident(self) -> None:
        keep = sorted(self.resident)
        self.resident.clear()
        for s in keep:
            self._load(s)
            self.stats.shard_loads -= 1  # re-materialised, not a residency decision

    def state_tensors(self) -> dict:
        """The shard state as named tensors (the ``maximus.*`` namespace of the state file)."""
        self.flush_gradients()
        resident = torch.zeros(self.num_shards, dtype=torch.uint8)
        resident[list(self.resident)] = 1
        return {
            "maximus.id_to_row": self.id_to_row.clone(),
            "maximus.row_to_id": self.row_to_id.clone(),
            "maximus.shard_offsets": self.shard_offsets.clone(),
            "maximus.token_freq": self.token_counts.clone(),
            "maximus.shard_score": self.shard_score.clone(),
            "maximus.shard_last_access_step": self.shard_last_access_step.clone(),
            "maximus.resident": resident,
            "maximus.pad_ids": self.pad_ids.clone(),
            "maximus.step": torch.tensor([self._backwards, self.stats.steps], dtype=torch.int64),
            "maximus.stats": torch.tensor(self.stats.as_list(), dtype=torch.int64),
        }

    def policy_metadata(self) -> dict:
        """The state file's ``policy`` (FORMAT.md section 9): geometry and ``self.policy``."""
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim,
                **self.policy.to_metadata(), "padding_idx": self.padding_idx}

    def load_state_tensors(self, t: dict, where: str = "maximus state") -> None:
        """Restore shard state from ``state_tensors()`` output, re-ordering the weights if the
        stored permutation differs from the current one. Validates everything first.

        Raises:
            MaximusStateError: a tensor is missing or malformed, or does not fit this module.
        """
        V, N = self.num_embeddings, self.num_shards
        need = {"maximus.id_to_row": (V,), "maximus.row_to_id": (V,),
                "maximus.shard_offsets": (N + 1,), "maximus.token_freq": (V,),
                "maximus.shard_score": (N,), "maximus.shard_last_access_step": (N,),
                "maximus.resident": (N,), "maximus.step": (2,),
                "maximus.stats": (len(STATS_FIELDS),)}
        for k, shape in need.items():
            if k not in t:
                raise MaximusStateError(f"{where}: missing {k}")
            if tuple(t[k].shape) != shape:
                raise MaximusStateError(f"{where}: {k} has shape {list(t[k].shape)}, this "
                                        f"embedding needs {list(shape)} (vocabulary {V}, "
                                        f"{N} shards)")
        validate_permutation(t, V, where)
        id_to_row, row_to_id = t["maximus.id_to_row"].long(), t["maximus.row_to_id"].long()
        if not torch.equal(t["maximus.shard_offsets"].long(), self.shard_offsets):
            raise MaximusStateError(f"{where}: shard_offsets "
                                    f"{t['maximus.shard_offsets'].tolist()[:4]}... do not match "
                                    f"this embedding's {self.shard_offsets.tolist()[:4]}...")
        self.flush_gradients()
        if not torch.equal(row_to_id, self.row_to_id):
            # New row r holds token row_to_id[r], which sits at old row id_to_row[that token]:
            # move the rows of the table, dense or NF4, with the order.
            moved = self.id_to_row[row_to_id]
            with torch.no_grad():
                if self.nf4 is None:
                    self.weight.copy_(self.weight.detach()[moved])
                else:
                    packed, absmax, bs = self.nf4
                    self.nf4 = (packed[moved], absmax[moved], bs)
        self.id_to_row.copy_(id_to_row)
        self.row_to_id.copy_(row_to_id)
        self.token_counts.copy_(t["maximus.token_freq"])
        self.shard_score.copy_(t["maximus.shard_score"])
        self.shard_last_access_step.copy_(t["maximus.shard_last_access_step"])
        if "maximus.pad_ids" in t:
            self.pad_ids = t["maximus.pad_ids"].long().clone()
        self._backwards, steps = (int(x) for x in t["maximus.step"])
        self.stats = MaximusStats(**dict(zip(STATS_FIELDS, (int(x) for x in t["maximus.stats"]))))
        self.stats.steps = steps
        self.resident.clear()
        resident = t["maximus.resident"].nonzero().flatten().tolist()
        if not resident and not self.stats.steps and int(self.token_counts.sum()):
            # A fresh plan from real frequencies: start with the hottest shards resident, their
            # rate at the load threshold, so that they stay until the stream shows otherwise.
            resident = list(range(self.budget_shards))
            self.shard_score[resident] = self.policy.load_rate
        for s in resident[: self.budget_shards]:
            self._load(s)
            self.stats.shard_loads -= 1

    def save_maximus_state(self, path, **kw):
        """Save this module's shard state (see ``lct.format.maximus.save_maximus_state``)."""
        return save_maximus_state(self, path, **kw)

    def load_maximus_state(self, path) -> None:
        """Restore shard state saved by ``save_maximus_state`` (validated first)."""
        load_maximus_state(self, path)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, shards={self.num_shards}, "
                f"budget={self.budget_shards}, bucket_size={self.policy.bucket_size}, "
                f"sparse={self.policy.sparse}")


# Saving and restoring the shard state of a model's MaximusEmbedding modules --------------
def _modules(model) -> dict:
    if isinstance(model, MaximusEmbedding):
        return {"": model}
    return {name: m for name, m in model.named_modules() if isinstance(m, MaximusEmbedding)}


def save_maximus_state(model, path, *, frequency_source: str | None = None) -> Path:
    """Write the shard state of every ``MaximusEmbedding`` in ``model`` (or of one module).

    Pending gradient buckets are flushed first. ``path`` is a file, or a folder that receives
    ``maximus.safetensors``. Atomic: written under a temporary name and renamed into place.

    Returns:
        The file written.
    """
    mods = _modules(model)
    if not mods:
        raise MaximusStateError("the model has no MaximusEmbedding; nothing to save")
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path.mkdir(parents=True, exist_ok=True)
        path = path / C.MAXIMUS_FILE
    return write_state_file(
        {mp: (m.state_tensors(), {"policy": m.policy_metadata(), "frequency_source":
                                  frequency_source or getattr(m, "frequency_source", None)})
         for mp, m in mods.items()}, path)


def load_maximus_state(model, path) -> None:
    """Restore the shard state saved by ``save_maximus_state`` into ``model`` (or one module).

    Raises:
        MaximusStateError: missing/corrupt file, or a state that does not fit the model
            (vocabulary, shard count, permutation); nothing is changed in that case.
    """
    tensors, modules, path = read_state_file(path)
    mods = _modules(model)
    if set(mods) != set(modules):
        raise MaximusStateError(f"{path}: state for modules {sorted(modules)}, the model has "
                                f"MaximusEmbedding at {sorted(mods)}")
    for mp, m in mods.items():
        pol, own_pol = modules[mp].get("policy", {}), m.policy_metadata()
        for k in ("num_embeddings", "embedding_dim", "num_shards"):
            if pol.get(k) != own_pol[k]:
                raise MaximusStateError(f"{path}: {mp or 'module'}: {k} is {pol.get(k)} in the "
                                        f"state, {own_pol[k]} in the model")
        own = module_tensors(tensors, state_key(mp, "maximus."))
        validate_state(own, modules, mp, m.num_embeddings, m.embedding_dim, m.num_shards,
                       where=f"{path}: {mp or 'module'}")
        try:
            m.load_state_tensors(own, where=f"{path}: {mp or 'module'}")
        except ValueError as e:
            raise MaximusStateError(str(e)) from e
        m.frequency_source = modules[mp].get("frequency_source")
