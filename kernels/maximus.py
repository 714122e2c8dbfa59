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
batch is never evicted.

Forward equals ``nn.Embedding`` exactly. Gradients are coalesced per unique id within a batch with
the same kernel ``nn.Embedding`` uses, optionally accumulated over ``bucket_size`` steps before
they reach ``weight.grad`` (sparse or dense), so the result equals ``nn.Embedding``'s gradient
summed over the same steps. Pad ids are never gathered, yield zeros and get zero gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import nn

STATS_FIELDS = ("lookups", "hits", "misses", "shard_loads", "shard_evictions", "bytes_moved",
                "steps", "pad_lookups")


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


def shard_offsets(num_embeddings: int, num_shards: int) -> torch.Tensor:
    """Row boundaries of ``num_shards`` equal shards (the last may be shorter): int64 [N+1]."""
    if not 1 <= num_shards <= num_embeddings:
        raise ValueError(f"num_shards must be in 1..{num_embeddings}, got {num_shards}")
    size = math.ceil(num_embeddings / num_shards)
    bounds = [min(i * size, num_embeddings) for i in range(num_shards + 1)]
    return torch.tensor(bounds, dtype=torch.int64)


def frequency_order(counts: torch.Tensor) -> torch.Tensor:
    """``row_to_id``: ids by descending count, ties by ascending id (a stable, reproducible order)."""
    counts = torch.as_tensor(counts, dtype=torch.int64)
    return torch.sort(-counts, stable=True).indices


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


class MaximusEmbedding(nn.Module):
    """Frequency-sharded embedding; see the module docstring.

    Args:
        num_embeddings, embedding_dim, padding_idx: as ``nn.Embedding``.
        max_shards: number of shards N (the last may be shorter).
        bucket_size: backward passes whose coalesced gradients are summed before they are
            written to ``weight.grad`` (1: every step).
        budget_shards / budget_bytes: hard cap on resident shards (default: a quarter of them).
        pad_ids: extra ids treated like ``padding_idx`` (zeros, never gathered, no gradient).
        sparse: ``weight.grad`` as a sparse COO tensor (for SGD/SparseAdam) or dense.
        device: the compute device for resident shards (default: the host, i.e. CPU).
        load_rate / evict_rate / decay: residency policy (accesses per step, decay per step).
        weight: initial weights in id order [V, H] (default: ``nn.Embedding``'s init).
        counts: token counts [V] that define the frequency order (default: id order).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_shards: int = 32, bucket_size: int = 1, *, budget_shards: int | None = None,
                 budget_bytes: int | None = None, pad_ids=(), sparse: bool = True, device=None,
                 load_rate: float = 0.3, evict_rate: float = 0.05, decay: float = 0.9,
                 weight: torch.Tensor | None = None, counts=None, dtype=None):
        super().__init__()
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.num_shards = min(max_shards, num_embeddings)
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        self.bucket_size, self.sparse = bucket_size, sparse
        self.load_rate, self.evict_rate, self.decay = load_rate, evict_rate, decay
        if evict_rate > load_rate:
            raise ValueError("evict_rate must not exceed load_rate (hysteresis)")
        self.compute_device = torch.device(device) if device is not None else torch.device("cpu")

        counts = torch.zeros(num_embeddings, dtype=torch.int64) if counts is None else \
            torch.as_tensor(counts, dtype=torch.int64).clone()
        if counts.shape != (num_embeddings,):
            raise ValueError(f"counts must have shape [{num_embeddings}], got {list(counts.shape)}")
        row_to_id = frequency_order(counts)
        id_to_row = torch.empty_like(row_to_id)
        id_to_row[row_to_id] = torch.arange(num_embeddings)
        self.register_buffer("row_to_id", row_to_id)
        self.register_buffer("id_to_row", id_to_row)
        self.register_buffer("token_counts", counts)
        self.register_buffer("shard_offsets", shard_offsets(num_embeddings, self.num_shards))
        self.register_buffer("shard_score", torch.zeros(self.num_shards, dtype=torch.float32))
        self.register_buffer("shard_last_access_step",
                             torch.full((self.num_shards,), -1, dtype=torch.int64))
        pads = set(int(p) for p in pad_ids)
        if padding_idx is not None:
            pads.add(padding_idx)
        self.register_buffer("pad_ids", torch.tensor(sorted(pads), dtype=torch.int64))

        if weight is None:
            weight = torch.empty(num_embeddings, embedding_dim, dtype=dtype)
            nn.init.normal_(weight)
            if padding_idx is not None:
                with torch.no_grad():
                    weight[padding_idx].zero_()
        elif weight.shape != (num_embeddings, embedding_dim):
            raise ValueError(f"weight must be [{num_embeddings}, {embedding_dim}], "
                             f"got {list(weight.shape)}")
        self.weight = nn.Parameter(weight.detach()[row_to_id].clone())

        shard_bytes = self.rows_per_shard * embedding_dim * self.weight.element_size()
        if budget_shards is None and budget_bytes is None:
            budget_shards = max(1, self.num_shards // 4)
        if budget_bytes is not None:
            budget_shards = min(budget_shards or self.num_shards, budget_bytes // shard_bytes)
        self.budget_shards = max(0, min(int(budget_shards), self.num_shards))
        self.stats = MaximusStats()
        self.resident: dict = {}          # shard -> device copy of its rows
        self._dirty: set = set()          # shards whose host rows changed since their copy
        self._pending = None              # (rows, grads) accumulated within a bucket
        self._backwards = 0

    # Geometry -------------------------------------------------------------------------------
    @property
    def rows_per_shard(self) -> int:
        return int(self.shard_offsets[1] - self.shard_offsets[0])

    def shard_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Shard index of each row."""
        return torch.div(rows, self.rows_per_shard, rounding_mode="floor")

    @property
    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.resident.values())

    # Residency ------------------------------------------------------------------------------
    def _load(self, s: int) -> None:
        lo, hi = int(self.shard_offsets[s]), int(self.shard_offsets[s + 1])
        host = self.weight.detach()[lo:hi]
        if self.compute_device == host.device:
            self.resident[s] = host  # a view: nothing to copy or refresh
        else:
            src = host.pin_memory() if self.compute_device.type == "cuda" else host
            self.resident[s] = src.to(self.compute_device, non_blocking=True)
            self.stats.bytes_moved += host.numel() * host.element_size()
        self._dirty.discard(s)
        self.stats.shard_loads += 1

    def _evict(self, s: int) -> None:
        del self.resident[s]
        self.stats.shard_evictions += 1

    def _update_residency(self, needed: torch.Tensor) -> None:
        """Hysteresis under the budget; shards in ``needed`` are never evicted."""
        need = set(needed.tolist())
        score = self.shard_score
        for s in [s for s in self.resident if s not in need and score[s] < self.evict_rate]:
            self._evict(s)
        candidates = [s for s in torch.argsort(score, descending=True, stable=True).tolist()
                      if s not in self.resident and score[s] > self.load_rate]
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
            if s in self.resident and self.resident[s].data_ptr() != \
                    self.weight.detach()[int(self.shard_offsets[s])].data_ptr():
                self._load(s)
                self.stats.shard_loads -= 1  # a refresh, not a residency change
        self._dirty.clear()

    # Lookup ---------------------------------------------------------------------------------
    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.numel(), self.embedding_dim, dtype=self.weight.dtype,
                          device=self.compute_device)
        shards = self.shard_of_rows(rows)
        hit = torch.zeros(rows.numel(), dtype=torch.bool)
        for s, copy in self.resident.items():
            m = shards == s
            if m.any():
                out[m.to(out.device)] = copy[(rows[m] - self.shard_offsets[s]).to(copy.device)]
                hit |= m
        miss = ~hit
        if miss.any():
            out[miss.to(out.device)] = self.weight.detach()[rows[miss]].to(self.compute_device)
        self.stats.hits += int(hit.sum())
        self.stats.misses += int(miss.sum())
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(self.id_to_row.device)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"ids must be in [0, {self.num_embeddings}), got "
                             f"[{int(flat.min())}, {int(flat.max())}]")
        keep = ~torch.isin(flat, self.pad_ids) if self.pad_ids.numel() else \
            torch.ones_like(flat, dtype=torch.bool)
        rows = self.id_to_row[flat[keep]]
        self.stats.lookups += flat.numel()
        self.stats.pad_lookups += int((~keep).sum())
        self._observe(rows)
        self._refresh_dirty()
        gathered = _Lookup.apply(self.weight, rows, self) if torch.is_grad_enabled() and \
            self.weight.requires_grad else self._gather(rows)
        if bool(keep.all()):
            out = gathered
        else:
            out = gathered.new_zeros(flat.numel(), self.embedding_dim)
            out = out.index_put((keep.nonzero().squeeze(1).to(out.device),), gathered)
        return out.view(*ids.shape, self.embedding_dim)

    def _observe(self, rows: torch.Tensor) -> None:
        """Count this step's accesses, decay the rates, decide residency."""
        step = self.stats.steps
        shards = self.shard_of_rows(rows)
        per_shard = torch.bincount(shards, minlength=self.num_shards).to(torch.float32)
        self.shard_score.mul_(self.decay).add_(per_shard * (1 - self.decay))
        touched = per_shard > 0
        self.shard_last_access_step[touched] = step
        self.stats.steps += 1
        self._update_residency(torch.unique(shards))

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
        if self._backwards % self.bucket_size == 0:
            self.flush_gradients()

    def flush_gradients(self) -> None:
        """Write the pending bucket into ``weight.grad`` (added to what is there)."""
        if self._pending is None:
            return
        rows, grad = self._pending
        self._pending = None
        if self.sparse:
            g = torch.sparse_coo_tensor(rows.unsqueeze(0), grad, self.weight.shape,
                                        is_coalesced=True)
        else:
            g = torch.zeros_like(self.weight)
            g[rows] = grad
        self.weight.grad = g if self.weight.grad is None else self.weight.grad + g
        self._dirty.update(self.shard_of_rows(rows).unique().tolist()
                           if self.sparse else range(self.num_shards))

    # Views ----------------------------------------------------------------------------------
    def id_ordered_weight(self) -> torch.Tensor:
        """The table in token-id order (what ``nn.Embedding.weight`` would hold)."""
        return self.weight.detach()[self.id_to_row]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, shards={self.num_shards}, "
                f"budget={self.budget_shards}, bucket_size={self.bucket_size}, "
                f"sparse={self.sparse}")
