"""Reading a mixture-of-experts block's routed experts by the router's choice: only the chunks
that hold the experts the tokens are routed to (docs/FORMAT.md section 4 keeps whole experts in
chunks of their own), for the layer-wise model and for modules a device map leaves on "disk".

transformers 5 hands a block's experts module the router's choice: its ``forward`` takes
``top_k_index`` (the experts of each token) and reads, of its fused weights (``[experts, ...]``,
made from the checkpoint's experts stored one by one by transformers' converters), only those
experts' rows. A forward pre-hook on that module sees ``top_k_index`` before the module runs:
``RoutedExperts.read`` reads and checks (the chunks' checksums, as every read) the chunks of
those experts, converts their tensors with the same converter ``from_pretrained`` uses, and puts
each expert's rows at its index in parameters of the full shape, a batch of experts at a time
(``RoutedExperts.batches``: the experts of one chunk together). The other rows are never
written: they are memory the system hands out untouched (no resident pages), and the module
never reads them, because the hook read every expert ``top_k_index`` names.

Where LCT cannot know that (``plan`` says why): the module's ``forward`` takes no
``top_k_index``, the model's experts implementation is not one of transformers' own that reads
only the routed rows (``ROUTED_IMPLEMENTATIONS``), the experts are expert-parallel, a converter
that does not convert a subset of the experts row for row (checked once on tiny stand-ins), or
an index outside ``[0, experts)`` at run time: the whole group is read, as before.

The routed experts are read when the router has chosen, in the experts module's pre-hook, not
prefetched: no reader can know earlier which experts a token needs. The layer-wise model's
window keeps prefetching the next layers' other groups meanwhile.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from lct.format import constants as C
from lct.format.layout import EXPERT_INDEX

# The experts implementations (``config._experts_implementation``) whose forward reads the
# fused weights only at the rows of the experts in ``top_k_index`` (transformers'
# integrations/moe.py; None and "eager" are the module's own loop over the experts hit).
ROUTED_IMPLEMENTATIONS = (None, "eager", "batched_mm", "grouped_mm")


@dataclass
class ExpertBytes:
    """The expert bytes a model read, in stored (compressed) bytes of the artifact's expert
    chunks, mapped from the decoded cache or read from the artifact: ``read`` against ``all``,
    what reading every experts group whole would have read over the same forwards."""

    read: int = 0
    all: int = 0
    reads: int = 0                  # experts-group reads (one per experts module run)
    whole: int = 0                  # of those, whole groups (no routing known)
    whole_groups: dict = field(default_factory=dict)     # {group: why it is read whole}

    def add(self, read: int, all_: int, whole: bool) -> None:
        self.read += read
        self.all += all_
        self.reads += 1
        self.whole += int(whole)

    def to_dict(self) -> dict:
        return {"read": self.read, "all": self.all, "reads": self.reads,
                "whole_reads": self.whole, "whole_groups": dict(self.whole_groups)}


def _routing_arg(module):
    """The position of ``top_k_index`` in ``module``'s forward (after self), or None when its
    forward takes no such argument."""
    try:
        params = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("top_k_index") - 1 if "top_k_index" in params else None


def stored_bytes(manifest, group: str) -> int:
    """The stored (compressed) bytes of ``group``'s chunks: what reading it whole reads."""
    return sum(c.stored_size for c in manifest.group_chunks(group))


def routing_of(position: int, args: tuple, kwargs: dict):
    """The ``top_k_index`` a call of an experts module passes (keyword, or positional at
    ``position``), or None."""
    if "top_k_index" in kwargs:
        return kwargs["top_k_index"]
    return args[position] if position < len(args) else None


class RoutedExperts:
    """One block's experts group, read expert by expert (see the module docstring).

    Args:
        art: the open artifact.
        arch: the model's ``Architecture``.
        group: the experts group (``layers.N.experts``).
        module_path: the experts module's path in the model.
        count: its experts.
        position: where ``top_k_index`` is among its forward's arguments.
        params: ``{model name: (shape, dtype)}`` of the parameters the group fills.
    """

    def __init__(self, art, arch, group: str, module_path: str, count: int, position: int,
                 params: dict):
        self.art, self.arch, self.group = art, arch, group
        self.module_path, self.count, self.position, self.params = \
            module_path, count, position, params
        self.by_expert: dict = {}           # expert -> [checkpoint names]
        self.chunks_of: dict = {}           # expert -> {chunk ids}
        self.fused: list = []               # tensors of all experts at once
        self.shared: set = set()            # their chunks: read with any expert
        for t in art.manifest.group_tensors(group):
            ids = {p.chunk for p in t.placements()}
            m = EXPERT_INDEX.search(t.name)
            if m is None:
                self.fused.append(t.name)
                self.shared |= ids
            else:
                e = int(m.group(1))
                self.by_expert.setdefault(e, []).append(t.name)
                self.chunks_of.setdefault(e, set()).update(ids)
        self.stored = {c.id: c.stored_size for c in art.manifest.group_chunks(group)}
        self.all_bytes = stored_bytes(art.manifest, group)

    def experts_of(self, top_k_index) -> list | None:
        """The experts ``top_k_index`` names, ascending; None when it is not an integer tensor
        of indices in ``[0, count)`` (then only the whole group is safe)."""
        import torch
        if not isinstance(top_k_index, torch.Tensor) or top_k_index.is_floating_point() \
                or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
            return None
        hit = torch.unique(top_k_index.detach().to("cpu")).tolist()
        if any(e < 0 or e >= self.count for e in hit):
            return None
        return hit

    def chunks(self, experts) -> list:
        """The chunk ids holding ``experts`` (and the tensors of all experts), in file order."""
        ids = set(self.shared)
        for e in experts:
            ids |= self.chunks_of.get(e, set())
        return sorted(ids)

    def batches(self, experts) -> list:
        """``experts`` in batches that share no chunk (the experts of one chunk together, in
        expert order): each batch is read, converted and put in place before the next, so that
        a read holds one batch's bytes beside the parameters, not every routed expert's."""
        batches: list = []                  # [(experts, chunk ids)]
        for e in sorted(experts):
            ids = set(self.chunks_of.get(e, ()))
            joined = [b for b in batches if b[1] & ids]
            for b in joined:
                batches.remove(b)
                ids |= b[1]
            batches.append((sorted([e, *(x for b in joined for x in b[0])]), ids))
        return sorted(batches)

    def read_call(self, args: tuple, kwargs: dict, cached=None, bytes_=None) -> dict:
        """``read`` of the experts a call of the experts module (its ``args``, ``kwargs``)
        routes to: every expert where its ``top_k_index`` cannot be read (``experts_of``)."""
        return self.read(self.experts_of(routing_of(self.position, args, kwargs)), cached,
                         bytes_)

    def read(self, experts, cached=None, bytes_=None) -> dict:
        """``{model name: tensor}`` of the experts group with only ``experts``' rows read
        (None: every expert, the whole group): parameters of their full shape and dtype.
        ``cached``: a decoded-cache entry the chunks are mapped from. ``bytes_``: an
        ``ExpertBytes`` told what was read."""
        import torch
        whole = experts is None
        experts = sorted(self.by_expert) if whole else list(experts)
        ids = self.chunks(experts)
        if bytes_ is not None:
            bytes_.add(sum(self.stored[i] for i in ids), self.all_bytes, whole)
        out: dict = {}
        if self.fused:                      # tensors of all experts: converted with them
            self._place(experts, self._convert(ids, experts, cached), out)
        else:
            for batch, chunk_ids in self.batches(experts):
                self._place(batch, self._convert(sorted(chunk_ids), batch, cached), out)
        for name, (shape, dtype) in self.params.items():
            if name not in out:             # no routed expert: nothing of it is read
                out[name] = torch.empty(shape, dtype=dtype)
        return out

    def _convert(self, ids: list, experts: list, cached) -> dict:
        """Chunks ``ids`` read and checked, ``experts``' tensors (and the fused ones) converted
        by the checkpoint's converter; the chunks' buffers let go on return."""
        from lct.io.stream import GroupStream
        with GroupStream(self.art, [self.group], prefetch=0, chunks=ids, cached=cached) as s:
            group = next(s)
        names = [n for e in experts for n in self.by_expert.get(e, ())] + self.fused
        tensors = {n: self.art.assemble(self.art.manifest.tensors[n], group.buffers)
                   for n in names}
        return self.arch.to_model(tensors, where=str(self.art.path))

    def _place(self, experts: list, converted: dict, out: dict) -> dict:
        """``converted``'s rows (``experts``, in order) put at their experts' rows of ``out``'s
        full-shape parameters (made as needed, untouched elsewhere)."""
        import torch
        for name, (shape, dtype) in self.params.items():
            t = converted.get(name)
            if t is None:
                continue
            if name not in out and tuple(t.shape) == tuple(shape):
                out[name] = t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
                continue
            if name not in out:
                out[name] = torch.empty(shape, dtype=dtype)
            out[name][torch.tensor(experts)] = t.to(dtype)
        return out


def plan(art, arch, model, shapes: dict, dtypes: dict, groups=None) -> tuple:
    """Which experts groups can be read by routing.

    Args:
        art, arch, model: the open artifact, its ``Architecture`` and the built model (its
            experts modules' parameters may be on meta).
        shapes, dtypes: ``{model name: shape}`` and ``{model name: dtype}`` of the parameters
            (the ``Installer``'s, taken before any is replaced).
        groups: the experts groups to consider (default: every one).

    Returns:
        ``({group: RoutedExperts}, {group: why it is read whole})``.
    """
    routed, whole = {}, {}
    for group in groups if groups is not None else art.groups:
        if not group.endswith(C.GROUP_EXPERTS_SUFFIX):
            continue
        why = None
        try:
            r = _routed(art, arch, model, group, shapes, dtypes)
        except _Whole as e:
            why = str(e)
        if why is None:
            routed[group] = r
        else:
            whole[group] = why
    return routed, whole


class _Whole(Exception):
    """Why an experts group is read whole."""


def _routed(art, arch, model, group: str, shapes: dict, dtypes: dict) -> RoutedExperts:
    names = [t.name for t in art.manifest.group_tensors(group)]
    targets = sorted(arch.filled(names))
    paths = {t.rpartition(".")[0] for t in targets}
    if len(paths) != 1 or next(iter(paths)).rpartition(".")[2] != C.EXPERTS_MODULE:
        raise _Whole("its tensors fill parameters outside one experts module")
    (path,) = paths
    module = model.get_submodule(path)
    position = _routing_arg(module)
    if position is None:
        raise _Whole(f"{type(module).__name__}.forward takes no top_k_index")
    config = getattr(module, "config", None)
    impl = getattr(config, "_experts_implementation", None)
    if impl not in ROUTED_IMPLEMENTATIONS:
        raise _Whole(f"experts implementation {impl!r} is not one known to read only the "
                     f"routed rows ({', '.join(str(i) for i in ROUTED_IMPLEMENTATIONS[1:])})")
    if getattr(module, "_is_expert_parallel", False):
        raise _Whole("the experts are expert-parallel")
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise _Whole(f"{type(module).__name__} says no num_experts")
    params = {t: (shapes[t], dtypes[t]) for t in targets if t in shapes}
    r = RoutedExperts(art, arch, group, path, count, position, params)
    if sorted(r.by_expert) != list(range(count)):
        raise _Whole(f"it stores {len(r.by_expert)} experts one by one, not the module's "
                     f"{count}")
    for t in targets:
        if t not in shapes or not shapes[t] or shapes[t][0] != count:
            raise _Whole(f"parameter {t} is not [{count}, ...]")
    _probe(arch, r)
    return r


def _probe(arch, r: RoutedExperts) -> None:
    """Check on tiny stand-ins (one element per dimension, each expert's tensors their own
    values) that converting a subset of the experts gives, row for row, the rows that
    converting all of them gives those experts: what ``read`` relies on."""
    import torch
    infos = {n: r.art.manifest.tensors[n] for ns in r.by_expert.values() for n in ns}

    def stand_ins(experts):
        out = {}
        for i, (name, info) in enumerate(sorted(infos.items())):
            e = int(EXPERT_INDEX.search(name).group(1))
            if e in experts:
                out[name] = torch.full((1,) * len(info.shape), float(e * 1000 + i + 1))
        return out
    subset = sorted({1 % r.count, r.count - 1})
    try:
        full = arch.to_model(stand_ins(range(r.count)))
        part = arch.to_model(stand_ins(subset))
    except Exception as e:  # noqa: BLE001 - a converter that needs the real shapes: whole
        raise _Whole(f"transformers' converter does not run on a subset of the experts "
                     f"({type(e).__name__})") from None
    for name, t in full.items():
        p = part.get(name)
        if p is None or t.shape[0] != r.count or p.shape[0] != len(subset) or \
                not torch.equal(p, t[torch.tensor(subset)]):
            raise _Whole(f"transformers' converter does not make {name} expert by expert")
