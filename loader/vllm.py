"""vLLM's ``--load-format lct``: serve an LCT artifact with vLLM.

``pip install 'lct[vllm]'`` registers ``register`` under vLLM's ``vllm.general_plugins`` entry
point, which vLLM calls in every one of its processes (the front end, the engine core, each
worker); it registers ``LCTModelLoader`` as load format ``lct``. The loader opens the artifact
and feeds LCT's prefetching group stream into the model's own ``load_weights``: pairs of
(checkpoint name, tensor), as vLLM's default loader feeds safetensors, so the model maps the
names (fused qkv, gate_up, experts) itself. Chunks are checked as they are read (``verify``);
lossless tensors are handed over bit-exact in their stored dtype (the parameter's loader casts
them, as it casts a safetensors tensor); the NF4/int8 tables are dequantized, in the dtype the
artifact names for them, and cast to the serving dtype: the values ``lct export`` writes.
Tied names are not yielded (the safetensors checkpoint held the tensor once; vLLM's models tie
themselves). A damaged chunk raises LCT's ``ChecksumError`` / ``CorruptChunkError``, which
stops the engine before anything serves.

Where LCT's decoded cache holds the artifact's copy (kept by an earlier start), its chunks are
mapped, each checked against the artifact's pins, and on one rank on the CPU the parameters
whose checkpoint tensors the copy holds as vLLM lays them out become those pages
(``mapped_parameters``): nothing is copied into fresh memory for them (4.82 of the Gemma-2B
shape's 5.01 GB), and each such mapping ends when vLLM replaces the parameter, as its CPU
linear layers do once they have packed their weights. The pages are the copy's, copy-on-write,
as ``lct.load``'s own weights on a hit are (docs/LOADING.md).

Example:
    >>> from vllm import LLM
    >>> llm = LLM(model="gemma-2b.lct", load_format="lct",
    ...           model_loader_extra_config={"prefetch": 4})

    or ``vllm serve gemma-2b.lct --load-format lct``, with
    ``--model-loader-extra-config '{"verify": false}'`` for options.

Options (``model_loader_extra_config``): ``prefetch`` (groups decoded ahead, default
``lct.io.stream.DEFAULT_PREFETCH``), ``workers`` (decode threads, default all cores),
``verify`` (check every chunk's checksum, default True), ``stream`` (a Hub repo's chunks are
range-requested from one pinned commit instead of pulled first, default False).

The model is an artifact folder, or the Hub repo id of an artifact (``org/name``, with vLLM's
``--revision``): vLLM reads config.json and the tokenizer from either before any loader runs,
then ``download_model`` pulls the repo into the Hugging Face cache, checked against the Hub's
hashes (or fetches its small files, with ``stream``). vLLM itself reads no config from an
``hf://`` address: give it the repo id.

Tensor parallel (``tensor_parallel_size`` > 1): each rank reads, of the weights the artifact
stores as pieces (``lct convert --tp-pieces N``), only the pieces that cover the rows or columns
its own layers keep (``rank_shares``); everything else is read whole by every rank, which
vLLM's weight loaders then narrow. MoE experts: with tensor parallel alone vLLM splits each
expert's rows over the ranks, so every rank reads them all; with expert parallel
(``enable_expert_parallel``) a rank holds whole experts and reads only the chunks of its own
(``other_ranks_experts``; an experts group's chunks hold whole experts).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from lct.errors import ArchitectureError, MissingDependencyError, OptionError
from lct.io.stream import DEFAULT_PREFETCH

try:
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
except ImportError as e:                                    # pragma: no cover
    raise MissingDependencyError(f"vLLM is required for --load-format lct ({e}): "
                                 f"pip install 'lct[vllm]'") from e

LOAD_FORMAT = "lct"
# model_loader_extra_config keys the loader takes, and their defaults.
DEFAULTS = {"prefetch": DEFAULT_PREFETCH, "workers": None, "verify": True, "stream": False,
            "cache": None}

# Under "vllm." so that vLLM's logging shows it, beside its own loaders' "Loading weights took".
logger = init_logger(f"vllm.{__name__}")


def register() -> None:
    """Register ``LCTModelLoader`` as vLLM load format ``lct`` (the ``vllm.general_plugins``
    entry point; vLLM calls it once in each of its processes), and tell vLLM that LCT's data
    files are weights."""
    register_model_loader(LOAD_FORMAT)(LCTModelLoader)
    _data_files_are_weights()


def _data_files_are_weights() -> None:
    """Add LCT's data files to the patterns vLLM leaves out when it snapshots a Hub repo's
    "non-weight" files for the tokenizer (``repo_utils._WEIGHT_FILE_PATTERNS``, vLLM 0.32):
    without it, serving ``org/name`` downloads every chunk before the loader runs, and the
    ``stream`` option streams nothing. A vLLM without that list needs nothing."""
    from lct.format import constants as C
    try:
        from vllm.transformers_utils import repo_utils
    except ImportError:                                     # pragma: no cover
        return
    patterns = getattr(repo_utils, "_WEIGHT_FILE_PATTERNS", None)
    if isinstance(patterns, list) and C.DATA_FILE_GLOB not in patterns:
        patterns.append(C.DATA_FILE_GLOB)


def loader_options(extra) -> dict:
    """The loader's options from ``model_loader_extra_config`` (None or a dict), defaults
    filled in and each one checked.

    Raises:
        OptionError: an unknown key, or a value out of its range.

    Example:
        >>> loader_options({"prefetch": 4})
        {'prefetch': 4, 'workers': None, 'verify': True, 'stream': False, 'cache': None}
    """
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise OptionError(f"model_loader_extra_config for load format {LOAD_FORMAT!r} must be a "
                          f"dict, got {type(extra).__name__}",
                          option="model_loader_extra_config")
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise OptionError(f"model_loader_extra_config: unknown option(s) "
                          f"{', '.join(map(repr, unknown))} for load format {LOAD_FORMAT!r}; "
                          f"it takes {', '.join(DEFAULTS)}", option="model_loader_extra_config")
    opts = {**DEFAULTS, **extra}
    for flag in ("verify", "stream"):
        if not isinstance(opts[flag], bool):
            raise OptionError(f"{flag} must be true or false, got {opts[flag]!r}",
                              option=flag)
    if opts["cache"] is not None and not isinstance(opts["cache"], bool):
        raise OptionError(f"cache must be true, false or null (LCT_CACHE decides), got "
                          f"{opts['cache']!r}", option="cache")
    from lct.loader.source import LoadOptions
    LoadOptions(prefetch=opts["prefetch"], workers=opts["workers"])    # LCT's one check of them
    return opts


class LCTModelLoader(BaseModelLoader):
    """vLLM model loader for LCT artifacts (load format ``lct``)."""

    def __init__(self, load_config):
        super().__init__(load_config)
        self.options = loader_options(load_config.model_loader_extra_config)
        self.stats = None            # the last load's StreamStats
        self.recycled = 0            # bytes the last load decoded into recycled buffers
        self.mapped = (0, 0)         # parameters (and their bytes) mapped from the decoded copy
        self._resolution = None      # (address, lct.loader.source.Resolved) once resolved

    def _resolved(self, model_config):
        """The artifact ``model_config.model`` names, resolved once per loader (a Hub repo is
        pulled, or its small files fetched for streaming, once)."""
        address = artifact_address(model_config.model, model_config.revision)
        if self._resolution is None or self._resolution[0] != address:
            from lct.loader.source import resolve
            self._resolution = address, resolve(address, stream=self.options["stream"],
                                                verify=self.options["verify"])
        return self._resolution[1]

    def download_model(self, model_config) -> None:
        """Make the artifact local: a folder is; a Hub repo is pulled and checked (or, with
        the ``stream`` option, only its small files are fetched)."""
        self._resolved(model_config)

    def load_weights(self, model, model_config) -> None:
        """Stream the artifact's tensors into ``model.load_weights`` and check that every
        parameter was loaded, as vLLM's default loader does.

        Raises:
            ChecksumError, CorruptChunkError: a damaged chunk (the engine stops).
            ArchitectureError: the artifact lacks weights the model has, or holds a head that
                the config ties to the embedding.
        """
        from lct.loader.source import open_source
        t0 = time.perf_counter()
        resolved = self._resolved(model_config)
        path = resolved.source
        with open_source(path, verify=self.options["verify"], workers=self.options["workers"],
                         stream=resolved.stream) as art:
            # vLLM's copies into its parameters run torch's threads on every core, and one of
            # them preempted stalls the whole copy: LCT's threads take what those leave
            from lct.loader.build import DECODE_NICE
            art.thread_nice = DECODE_NICE
            _check_ties(art, model_config)
            shares = rank_shares(model, art.manifest,
                                 quantized=model_config.quantization is not None)
            others = other_ranks_experts(model, art.manifest)
            quantized = model_config.quantization is not None
            into = {} if quantized else table_parameters(model, art)
            weights = self._weights(art, model_config.dtype, shares, others, into,
                                    model=None if quantized else model)
            try:
                loaded = model.load_weights(weights)
            finally:
                weights.close()
            if get_tensor_model_parallel_rank() == 0:  # no entry: kept for the next start
                from lct.loader.build import fill_later
                fill_later(art, self.options["cache"], self.hit)
            # vLLM copied the other tensors out: unmap the entry before the engine takes its
            # memory for the KV cache (a mapping kept to the end was the copy's pages beside
            # vLLM's); the parameters made of its pages keep mappings of their own
            hit, self.hit = self.hit, None
            if hit is not None and hit.damaged:     # LCT's own log is not vLLM's: say it here
                logger.warning("LCT's decoded copy of %s: %d chunk(s) differed from what the "
                               "artifact's manifest pins; decoded from the artifact instead, "
                               "and the copy removed (the next start keeps a new one)", path,
                               len(hit.damaged))
        from lct.units import human
        s = self.stats
        world = get_tensor_model_parallel_world_size()
        share = f"; rank {get_tensor_model_parallel_rank()} of {world}: {len(shares)} " \
                f"tensor(s) read by the pieces of its share, {len(others)} expert tensor(s) " \
                f"of other ranks not read" if world > 1 else ""
        # vLLM's own words first (its benchmarks and users grep them), then LCT's breakdown:
        # the decode threads' read and decode time, and what the model waited for them.
        logger.info("Loading weights took %.2f seconds (LCT: %d groups, %s (%d bytes) read, %s "
                    "decoded (%s into recycled buffers), %d table(s) dequantized into their "
                    "parameters, %d parameter(s) mapped from the decoded copy (%s), prefetch "
                    "%d; threads read %.2f s, decoded %.2f s, the model waited %.2f s%s)",
                    time.perf_counter() - t0, s.groups, human(s.bytes_read), s.bytes_read,
                    human(s.bytes_decoded), human(self.recycled), len(into), self.mapped[0],
                    human(self.mapped[1]), self.options["prefetch"], s.read_s, s.decode_s,
                    s.wait_s, share)
        if model_config.quantization is None and loaded is not None:
            try:    # vLLM's own check, with its exemptions (quantization scales)
                DefaultModelLoader.track_weights_loading(self, model, loaded, quantized=False)
            except ValueError as e:
                raise ArchitectureError(f"{path}: {e}") from e

    def _weights(self, art, dtype, shares=None, skip=frozenset(), into=None, model=None):
        """(checkpoint name, tensor) of every stored tensor, group by group, tied names
        skipped; lossy tables dequantized and cast to ``dtype``. ``shares``
        (``{name: (axis, start, stop)}``, from ``rank_shares``): of those tensors only the
        pieces that cover the range are read, into a tensor of the full shape whose other
        rows or columns are never written (vLLM's weight loader narrows to the range).
        ``skip``: names neither read nor yielded (``other_ranks_experts``). ``into``
        (``{name: parameter}``, from ``table_parameters``): lossy tables dequantized straight
        into the model's parameter, which is then what is yielded (its loader's copy is onto
        itself), instead of into a new tensor that it copies. ``model`` (the vLLM model, None
        for a quantized one): where the chunks are mapped from the decoded copy, its parameters
        that can be those very pages (``mapped_parameters``) become them, and what is yielded
        for them is the parameter's own range (again a copy onto itself)."""
        from lct.format.encodings import get_encoding
        m = art.manifest
        shares = shares or {}
        chunks = None
        if shares or skip:
            chunks = {p.chunk for t in m.tensors.values() if t.name not in skip
                      for p in t.placements()
                      if t.name not in shares or _overlaps(p, shares[t.name])}
        # vLLM copies every tensor into its parameter, so a group's buffers are decoded into
        # again once the model is done with them: a few tensors later (the model's loader
        # may hold the last one or two it was given), and only if no tensor views them still.
        done = deque()      # (group, tensors handed over when its last one was)
        handed = 0
        # A decoded-cache entry (lct cache fill, or an earlier lct.load): mapped, not decoded.
        from lct.loader.build import cache_hit
        self.hit = cache_hit(art, self.options["cache"])
        plan = mapped_parameters(model, art) if self.hit is not None and model is not None \
            else {}
        self.mapped = (0, 0)
        with art.stream(prefetch=self.options["prefetch"], dequantize=True, chunks=chunks,
                        recycle=True, cached=self.hit) as stream:
            self.stats = stream.stats
            for group in stream:
                views = self._map_group(group, plan.pop(group.name, ()))
                for info in m.group_tensors(group.name):
                    if info.name in m.ties or info.name in skip:
                        continue
                    if info.name in views:
                        t = views.pop(info.name)
                    elif info.name in shares:
                        t = _partial(art, info, shares[info.name], group.buffers)
                    elif into and info.name in into:
                        t = into[info.name]
                        art.assemble(info, group.buffers, dequantize=False).dequantize(
                            t.dtype, out=t.data)
                    else:
                        t = art.assemble(info, group.buffers, dequantize=True)
                    if get_encoding(info.encoding).lossy and t.dtype != dtype:
                        t = t.to(dtype)
                    yield info.name, t
                    del t
                    handed += 1
                    while done and handed - done[0][1] >= _RECYCLE_AFTER:
                        done.popleft()[0].recycle()
                done.append((group, handed))
            self.recycled = stream.pool.reused

    def _map_group(self, group, params) -> dict:
        """``{checkpoint name: tensor to yield}`` for the parameters ``params`` (the
        ``MappedParameter`` entries of ``group``) that become their verified bytes in the
        decoded copy: each parameter's data is a mapping of its own of those pages
        (``CachedChunks.mapped``, so that it ends when vLLM replaces the parameter, as its CPU
        linear layers do once their weights are packed), and each checkpoint tensor is the
        parameter's own range, which vLLM's loader then copies onto itself (torch skips a copy
        between views of the same data). A chunk that did not match its pin (decoded from the
        artifact instead) maps nothing: its tensors take the usual copy."""
        import torch
        out = {}
        count, size = self.mapped
        for mp in params:
            arr = self.hit.mapped(group.buffers.get(mp.chunk), mp.start, mp.nbytes)
            if arr is None:
                continue
            mp.param.data = torch.from_numpy(arr).view(mp.param.dtype).view(mp.param.shape)
            for name, (row, rows) in mp.parts.items():
                out[name] = mp.param.data.narrow(0, row, rows)
            count, size = count + 1, size + mp.nbytes
        self.mapped = count, size
        return out


@dataclass(frozen=True)
class MappedParameter:
    """A vLLM parameter that can be the decoded copy's pages as they are: its checkpoint
    tensors (``parts``: ``{checkpoint name: (first row, rows)}`` in the parameter) lie one
    after the other, in the parameter's order, in chunk ``chunk`` from byte ``start``, and
    fill it (``nbytes``), in its dtype."""
    param: object
    chunk: int
    start: int
    nbytes: int
    parts: dict


def mapped_parameters(model, art) -> dict:
    """``{group: [MappedParameter]}``: the parameters of this vLLM ``model`` (one rank, on the
    CPU) whose checkpoint tensors the artifact stores, losslessly and whole, in exactly the
    parameter's dtype and layout: an unfused one (an embedding, a head, a row-parallel linear,
    a norm) whose tensor has its shape, or a fused one (``qkv_proj``, ``gate_up_proj``: a
    column-parallel linear's ``output_sizes`` parts, found as ``rank_shares`` finds them) whose
    parts lie back to back in one chunk in the order vLLM stacks them (Gemma's and Llama's
    ``gate_proj`` and ``up_proj`` do; ``q``, ``k``, ``v`` are stored ``k``, ``o``, ``q``,
    ``v``). Tensors under a page are left to the copy (a mapping of their own is not worth
    it)."""
    import mmap
    if get_tensor_model_parallel_world_size() != 1:
        return {}
    from lct.format.encodings import get_encoding, torch_dtype
    m = art.manifest
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    fused = {part: (whole, i) for whole, parts in
             (getattr(model, "packed_modules_mapping", None) or {}).items()
             for i, part in enumerate(parts)}
    params = dict(model.named_parameters())
    found = {}          # vLLM parameter name: {part index: TensorInfo}, None where ambiguous
    for t in m.tensors.values():
        if t.pieces or t.name in m.ties or get_encoding(t.encoding).lossy or not t.shape:
            continue
        where = _parameter_part(model, mapper, fused, t.name)
        if where is None or where[0] not in params:
            continue
        name, module, part = where
        parts = found.setdefault(name, {})
        if parts is not None:
            found[name] = None if part in parts else {**parts, part: (t, module)}
    out = {}
    for name, parts in found.items():
        p = params[name]
        if not parts or p.device.type != "cpu" or not p.is_contiguous() or p.dim() == 0:
            continue
        module = next(iter(parts.values()))[1]
        sizes = list(getattr(module, "output_sizes", None) or [p.shape[0]])
        if len(sizes) > 1 and (getattr(p, "output_dim", None) != 0 or
                               getattr(module, "tp_size", 1) != 1):
            continue
        if sorted(parts) != list(range(len(sizes))) or sum(sizes) != p.shape[0]:
            continue
        tensors = [parts[i][0] for i in range(len(sizes))]
        first, row, layout = tensors[0], 0, {}
        at = first.offset
        for t, rows in zip(tensors, sizes):
            if t.chunk != first.chunk or t.offset != at or tuple(t.shape) != \
                    (rows, *p.shape[1:]) or torch_dtype(t.stored_dtype) != p.dtype:
                break
            layout[t.name] = (row, rows)
            row, at = row + rows, at + t.nbytes
        else:
            nbytes = at - first.offset
            if nbytes == p.numel() * p.element_size() and nbytes >= mmap.PAGESIZE:
                out.setdefault(first.group, []).append(
                    MappedParameter(p, first.chunk, first.offset, nbytes, layout))
    return out


def _parameter_part(model, mapper, fused: dict, name: str):
    """``(vLLM parameter name, module, part index)`` that checkpoint tensor ``name`` loads
    into (a ``.weight`` or ``.bias``), by vLLM's name for it (``_vllm_name``) or the fused
    module ``packed_modules_mapping`` makes its module a part of; None when not found."""
    mapped, part = _vllm_name(mapper, name)
    if mapped is None or part is None:
        return None
    path, _, attr = mapped.rpartition(".")
    if attr not in ("weight", "bias"):
        return None
    parent, _, leaf = path.rpartition(".")
    try:
        return mapped, model.get_submodule(path), part
    except AttributeError:
        if leaf not in fused:
            return None
    whole, part = fused[leaf]
    path = f"{parent}.{whole}" if parent else whole
    try:
        return f"{path}.{attr}", model.get_submodule(path), part
    except AttributeError:
        return None


def rank_shares(model, manifest, quantized: bool = False) -> dict:
    """``{checkpoint name: (axis, start, stop)}``: the tensors of which this tensor-parallel
    rank's vLLM ``model`` keeps one range (``start:stop`` along ``axis``) and that the artifact
    stores as pieces, so that only the pieces covering the range need to be read.

    The range is the one vLLM's own weight loader narrows to, read from the module the tensor
    loads into: a column-parallel linear (fused qkv and gate_up included) keeps rows
    ``rank * n : (rank + 1) * n`` of each part, a row-parallel one those columns, a
    vocabulary-parallel embedding or head its vocabulary shard's rows. A tensor whose module is
    not found under its checkpoint name (or the fused name ``packed_modules_mapping`` gives),
    whose sizes disagree, that a k/v head replicated over ranks loads into, or that is stored
    in frequency order, is read whole, as are all tensors of a quantized model (``quantized``)
    and of one rank.
    """
    world = get_tensor_model_parallel_world_size()
    if world == 1 or quantized:
        return {}
    rank = get_tensor_model_parallel_rank()
    fused = {part: (whole, i) for whole, parts in
             (getattr(model, "packed_modules_mapping", None) or {}).items()
             for i, part in enumerate(parts)}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    out = {}
    for t in manifest.tensors.values():
        if not t.pieces or t.row_order is not None or len(t.shape) != 2 \
                or not t.name.endswith(".weight"):
            continue
        name, part = _vllm_name(mapper, t.name)
        if name is None or part is None:
            continue
        share = _module_share(model, name[:-len(".weight")], part, fused, t.shape, rank, world)
        if share is not None and share[0] == t.piece_axis:
            out[t.name] = share
    return out


def table_parameters(model, art) -> dict:
    """``{checkpoint name: parameter}``: the lossy (NF4/int8) tables that can be dequantized
    straight into this vLLM ``model``'s own parameter: on one rank, a CPU parameter under the
    tensor's vLLM name with its exact shape, contiguous, in the dtype the table dequantizes to
    (so the values are those ``lct export`` writes). The others take the usual path: a new
    tensor, which the parameter's loader copies (on these machines a fresh 1 GB costs 0.5-1 s
    to touch, and the copy more)."""
    if get_tensor_model_parallel_world_size() != 1:
        return {}
    from lct.format.encodings import get_encoding, torch_dtype
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    params = dict(model.named_parameters())
    out = {}
    for t in art.manifest.tensors.values():
        if not get_encoding(t.encoding).lossy or t.name in art.manifest.ties:
            continue
        name, part = _vllm_name(mapper, t.name)
        p = params.get(name) if part == 0 else None
        if p is not None and tuple(p.shape) == tuple(t.shape) and p.is_contiguous() and \
                p.device.type == "cpu" and p.dtype == torch_dtype(art.lossy_dtype(t)):
            out[t.name] = p
    return out


def other_ranks_experts(model, manifest) -> set:
    """Checkpoint names of the routed-expert tensors, stored one expert at a time
    (``….experts.{E}.…``), that this rank's vLLM ``model`` does not hold: with expert parallel
    (``enable_expert_parallel``) each rank holds its own experts, and vLLM's expert weight
    loader would drop the others. The experts' chunks hold whole experts (FORMAT.md section 4),
    so a rank reads only the chunks of its own. The module is found by vLLM's name for the
    tensor (``hf_to_vllm_mapper``); whether it holds expert E, by its own expert map."""
    holders = {path: m.expert_map_manager for path, m in model.named_modules()
               if hasattr(getattr(m, "expert_map_manager", None), "is_local_expert")}
    if not holders:
        return set()
    from lct.format.layout import EXPERT_INDEX
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    out = set()
    for t in manifest.tensors.values():
        if EXPERT_INDEX.search(t.name) is None:
            continue
        name = _vllm_name(mapper, t.name)[0]
        found = EXPERT_INDEX.search(name or "")
        manager = holders.get(name[:found.start(1) - 1]) if found else None
        if manager is not None and not bool(manager.is_local_expert(int(found.group(1)))):
            out.add(t.name)
    return out


# Tensors handed to the model after a group's last one before its buffers are decoded into again.
_RECYCLE_AFTER = 4
# vLLM's shard ids of a fused qkv projection's parts, in the order of its output_sizes.
_QKV_SHARDS = ("q", "k", "v")


def _vllm_name(mapper, name: str) -> tuple:
    """The name vLLM's model gives checkpoint tensor ``name`` (its ``hf_to_vllm_mapper``, where
    it has one) and the index of the fused module's part it loads into: 0 when it is not
    fused; ``(None, None)`` when the model drops it or loads it into several parts."""
    if mapper is None:
        return name, 0
    if hasattr(mapper, "_map_name_with_shard"):     # vLLM >= 0.32: renames and fused parts
        mapped = mapper._map_name_with_shard(name)
        if mapped is None:
            return None, None
        name, shard = mapped
    else:
        name, shard = mapper.map_name(name), None
    if shard is None:
        return name, 0
    if isinstance(shard, int):
        return name, shard
    return (name, _QKV_SHARDS.index(shard)) if shard in _QKV_SHARDS else (None, None)


def _module_share(model, path: str, part: int, fused: dict, shape, rank: int, world: int):
    """``(axis, start, stop)`` that the vLLM module at ``path`` (part ``part`` of it, or the
    fused module ``fused`` names it a part of) keeps of a checkpoint tensor of ``shape`` on
    ``rank``; None when not known."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )
    parent, _, leaf = path.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        if leaf not in fused:
            return None
        whole, part = fused[leaf]
        try:
            module = model.get_submodule(f"{parent}.{whole}" if parent else whole)
        except AttributeError:
            return None
    rows, cols = shape
    if isinstance(module, VocabParallelEmbedding):
        si = module.shard_indices
        if getattr(module, "tp_size", 1) != world or rows != module.org_vocab_size:
            return None
        return 0, si.org_vocab_start_index, si.org_vocab_end_index
    if getattr(module, "tp_size", None) != world or getattr(module, "tp_rank", None) != rank:
        return None
    if isinstance(module, RowParallelLinear):
        if part or cols != module.input_size or cols % world:
            return None
        n = cols // world
        return 1, rank * n, (rank + 1) * n
    if isinstance(module, ColumnParallelLinear):
        sizes = getattr(module, "output_sizes", None) or [module.output_size]
        if part >= len(sizes) or rows != sizes[part] or rows % world:
            return None
        if part and getattr(module, "num_kv_head_replicas", 1) != 1:
            return None         # a k/v head shared by ranks: vLLM picks rank // replicas
        n = rows // world
        return 0, rank * n, (rank + 1) * n
    return None


def _overlaps(piece, share) -> bool:
    lo, hi = piece.span()
    return lo < share[2] and share[1] < hi


def _partial(art, info, share, bufs):
    """Tensor ``info`` in its full shape, holding (at least) range ``share`` from the pieces
    that overlap it; the rest is left unwritten (never touched, so never resident)."""
    import torch
    _, start, stop = share
    out = None
    for p in info.pieces:
        if not _overlaps(p, share):
            continue
        piece = art.tensor_from_buffer(p, bufs[p.chunk], dequantize=True)
        if out is None:
            out = torch.empty(info.shape, dtype=piece.dtype)
        lo, hi = p.span()
        (out[lo:hi] if info.piece_axis == 0 else out[:, lo:hi]).copy_(piece)
    return out


def artifact_address(model: str, revision: str | None = None) -> str:
    """What LCT opens for vLLM's ``model``: a local folder as it is; a Hub repo id
    (``org/name``, which vLLM has already read config.json and the tokenizer from) as
    ``hf://org/name@revision``, with vLLM's ``revision``.

    Example:
        >>> artifact_address("org/gemma-2b-lct", "v1")
        'hf://org/gemma-2b-lct@v1'
    """
    import os

    from lct.hub import HF_SCHEME, is_hf_uri, is_repo_id
    if is_hf_uri(model) or os.path.isdir(model) or not is_repo_id(model):
        return model
    return f"{HF_SCHEME}{model}@{revision}" if revision else f"{HF_SCHEME}{model}"


def _check_ties(art, model_config) -> None:
    """Refuse an artifact that stores a head of its own where the config ties the head to the
    embedding: vLLM's model, built tied, would drop it. (For a safetensors folder vLLM finds
    the ``lm_head`` and unties; an artifact holds no safetensors for it to look at.)"""
    cfg = model_config.hf_config.get_text_config()
    if not getattr(cfg, "tie_word_embeddings", False):
        return
    heads = [t.name for t in art.manifest.tensors.values()
             if t.role == "head" and t.name not in art.manifest.ties]
    if heads:
        raise ArchitectureError(f"{art.path}: config.json ties the word embeddings, but the "
                                f"artifact stores {heads[0]!r} of its own (it differs from the "
                                f"embedding); serve it with "
                                f"hf_overrides={{'tie_word_embeddings': False}}",
                                option="hf_overrides")


__all__ = ["LOAD_FORMAT", "LCTModelLoader", "MappedParameter", "artifact_address",
           "loader_options", "mapped_parameters", "other_ranks_experts", "rank_shares",
           "register", "table_parameters"]
