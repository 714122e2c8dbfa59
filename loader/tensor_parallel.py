"""Tensor-parallel loading: an artifact into a ``torch.distributed`` job, as the sharded model
``AutoModelForCausalLM.from_pretrained(src, tp_plan="auto")`` builds.

Every rank builds the model on the meta device, lets transformers apply the model's own
tensor-parallel plan (DTensor placements, forward hooks, the device mesh), then streams the
artifact's groups (the same prefetch window and checksums as ``lct.load``) and keeps of each
tensor only its own slice. A rank never holds more than one group's decoded tensors besides its
shards. Whatever goes wrong on one rank ends every rank with that error: the ranks agree on
success before anyone runs a collective of the model. A rank that failed raises its own error;
the others raise one naming that rank (``failed_rank``), so that each failure can be said once.
torch's DTensor UserWarnings are not shown while the model is built and filled.

``launch`` starts the ranks of a job on this machine itself (``lct load ART --tp N``), as
``torchrun --nproc_per_node N`` would, without torchrun's own report of a failed rank (a
traceback of the launcher under the ranks' errors).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

from lct import errors
from lct.errors import LCTError, OptionError
from lct.format.encodings import is_lossy

# Bytes of an error message the ranks exchange (UTF-8, cut to fit); no pickle crosses ranks.
_MESSAGE_BYTES = 2048
# How long ``launch`` lets the other ranks run on after one has failed: they end at once when
# they agree on the failure; one left in a collective by a rank that died waits for ever.
LAUNCH_GRACE_S = 30.0


def load_tp(path, options=None, *, tp_plan="auto", stats=None):
    """Load ``path`` tensor-parallel over the initialised default process group.

    Args:
        path: the artifact folder or ``hf://org/name[@rev]`` (every rank pulls or streams it).
        options: a ``LoadOptions``; ``prefetch``, ``workers``, ``verify``, ``stream`` and
            ``expect`` as for ``lct.load``, and:
            ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (each rank's local device, NCCL);
            ``dtype``: the parameters' dtype (default: the one the artifact stores its layers
            in); ``nf4``: ``"keep"``: the lossy embedding and head stay in their encoding,
            each rank holding its rows (``lct.kernels.sharded``; an encoding no kernels are
            registered for is dequantized); ``"dequantize"``: plain DTensors.
        tp_plan: ``"auto"``: the model's own plan (``base_model_tp_plan``), as
            ``from_pretrained(tp_plan="auto")`` uses it.
        stats: a ``LoadStats`` filled with this rank's bytes read and decoded and timings.

    Returns:
        The model in eval mode; its DTensor parameters hold this rank's shards.

    Raises:
        LCTError: no process group, a plan or model this cannot shard, or any rank's failure
            (on every rank: a rank that failed raises its own error, the others one of its
            class naming that rank and the chunk, with ``failed_rank`` set to it).
    """
    import torch.distributed as dist

    from lct.loader.source import LoadOptions, LoadStats
    options = options or LoadOptions()
    if not dist.is_available() or not dist.is_initialized():
        raise LCTError("tensor-parallel loading needs an initialised torch.distributed process "
                       "group (launch with torchrun)", option="tp_plan")
    if tp_plan != "auto":
        raise LCTError(f"tp_plan {tp_plan!r}: only 'auto' (the model's own plan) is supported",
                       option="tp_plan")
    from lct.loader.build import check_device
    check_device(options.device)
    stats = stats if stats is not None else LoadStats()
    with dtensor_warnings_ignored():
        return _load_checked(path, options, stats)


def _load_checked(path, options, stats):
    """``load_tp`` once the group and the options are checked."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from lct.loader.build import DECODE_NICE
    device, dtype, nf4 = options.device, options.dtype, options.nf4
    t0 = time.perf_counter()
    if str(device).startswith("cuda"):   # the current device is per thread: set it where we install
        import torch
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank()))
                              % torch.cuda.device_count())
    art = failure = None
    try:
        art = options.open(path)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, whatever it is
        failure = e
    # Agree before the skeleton: building it runs collectives (the device mesh), which a rank
    # that could not open the artifact would never join.
    try:
        _agree(failure)
    except BaseException:
        if art is not None:
            art.close()
        raise
    stats.manifest_s = time.perf_counter() - t0
    # As the single-process load: decode threads (all cores; splitting them between the ranks
    # measured slower) yield the core to the skeleton's import.
    art.thread_nice = DECODE_NICE
    lossy = [t.name for t in art.manifest.tensors.values() if is_lossy(t.encoding)]
    if lossy:
        stats.notes.append(
            "the lossy embedding and head stay in their encoding, split by rows over the "
            "ranks" if nf4 == "keep" else f"{len(lossy)} lossy tensor(s) dequantized")

    def skeleton():
        t1 = time.perf_counter()
        built = _skeleton(art, dtype, device)
        stats.skeleton_s = time.perf_counter() - t1
        return built
    model = None
    builder = ThreadPoolExecutor(1, thread_name_prefix="lct-skeleton")
    try:
        # The skeleton (transformers' import, the plan, the device mesh) is built beside the
        # stream, which starts at once on the chunks of this rank's pieces.
        future = builder.submit(skeleton)
        chunks = _rank_chunks(art.manifest, dist.get_rank(), dist.get_world_size())
        from lct.loader.build import cache_hit
        hit = cache_hit(art, options.cache, stats)  # an entry: this rank maps its share
        with art.stream(prefetch=options.prefetch, chunks=chunks, cached=hit) as groups:
            model = _fill(future, art, groups, stats, keep=nf4 == "keep", cached=hit)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, whatever it is
        failure = e
    finally:
        builder.shutdown(wait=True)     # its collectives end on every rank before the agreement
        art.close()
    _agree(failure)
    if os.environ.get("LOCAL_RANK", str(dist.get_rank())) == "0":  # one fill a machine
        from lct.loader.build import fill_later
        fill_later(art, options.cache, hit, stats)  # no entry: kept for the next start
    stats.total_s = time.perf_counter() - t0
    return model


def _skeleton(art, dtype, device):
    """The model's ``Architecture``, its model on the meta device with transformers'
    tensor-parallel plan applied."""
    import torch.distributed as dist

    from lct.arch import hf
    from lct.loader.build import build_skeleton
    config = hf.read_config(art.path)
    world = dist.get_world_size()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for what in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(text, what, None)
        if n is not None and n % world:
            raise LCTError(f"{art.path}: {what} = {n} does not divide over {world} ranks; "
                           f"tensor-parallel attention needs whole heads on every rank")
    arch = build_skeleton(art, dtype, tensor_parallel=world)
    return arch


def _rank_chunks(m, rank: int, world: int) -> set:
    """The chunks rank ``rank`` of ``world`` reads: of a tensor stored as plain pieces that the
    world divides, the pieces of its slice (the converter splits along the axis the plan
    shards, into equal pieces); of any other tensor, all of it."""
    out = set()
    for t in m.tensors.values():
        if t.pieces and t.row_order is None and len(t.pieces) % world == 0:
            k = len(t.pieces) // world
            out.update(p.chunk for p in t.pieces[rank * k:(rank + 1) * k])
        else:
            out.update(p.chunk for p in t.placements())
    return out


def _fill(future, art, groups, stats, keep: bool = False, cached=None):
    """Give every parameter of the skeleton ``future`` builds its shard (DTensor) or whole
    tensor from the stream ``groups``. A tensor stored as pieces along the axis the plan splits
    takes only the pieces inside this rank's slice; any other tensor is decoded whole and
    sliced; tensors a converter fuses (experts stored one by one) are converted whole, as the
    single-process load converts them, then sliced. A chunk outside the rank's guess is read
    then, or mapped from ``cached`` (the decoded cache's entry). Returns the model."""
    import torch

    from lct.arch import hf
    from lct.kernels import has_kernels
    arch = model = None
    t_install = 0.0
    m = art.manifest
    quantized = {}      # param name -> (tensor info, this rank's rows encoded, row range)
    filled = set()
    for group in groups:
        if model is None:
            arch, params, plans, target = _plans(future.result(), art, stats)
            model = arch.model
        t = time.perf_counter()
        fused = {}
        for info in m.group_tensors(group.name):
            if info.name not in plans:
                continue
            full, index, pieces = plans[info.name]
            for p in (pieces if pieces is not None else info.placements()):
                if p.chunk not in group.buffers:      # outside the rank's guess: read it now
                    group.buffers[p.chunk] = art.read_chunk(p.chunk) if cached is None \
                        else cached.chunk(p.chunk)
            if full is None:                          # an input of a converter
                fused[info.name] = art.assemble(info, group.buffers)
                continue
            module, leaf, ref = params[full]
            # kept encoded where kernels compute on its encoding, else dequantized (as in one
            # process)
            if keep and has_kernels(info.encoding) and _by_rows(index, info):
                quantized[full] = (info, _quantized_rows(art, info, group.buffers, pieces,
                                                         index[0]), index[0])
                filled.add(full)
                continue
            if pieces is not None:
                # One piece is a chunk of its own: its decoded bytes are the shard, kept as
                # they are (no copy); several are joined.
                parts = [art.tensor_from_buffer(p, group.buffers[p.chunk]) for p in pieces]
                local = parts[0] if len(parts) == 1 else torch.cat(parts, info.piece_axis)
                local = local.to(device=target, dtype=ref.dtype)
            elif index is None:     # whole, or a strided shard (fused gate/up)
                whole = art.assemble(info, group.buffers).to(dtype=ref.dtype)
                local = hf.local_shard(whole, ref).to(device=target)
            else:
                local = _slice(art.assemble(info, group.buffers), index, target, ref.dtype)
            _put(module, leaf, ref, local)
            filled.add(full)
        for full, whole in arch.to_model(fused, where=str(art.path)).items():
            if full in params:
                module, leaf, ref = params[full]
                local = hf.local_shard(whole.to(dtype=ref.dtype), ref)
                _put(module, leaf, ref, local.to(device=target))
                filled.add(full)
        t_install += time.perf_counter() - t
    if model is None:
        arch, params, plans, target = _plans(future.result(), art, stats)
        model = arch.model
    s = groups.stats
    stats.take_stream(s)
    stats.install_s = t_install
    names = set(params)
    filled |= {tied for tied, real in arch.ties.items() if real in quantized}
    missing = names - filled
    tied = set(arch.ties)
    if missing - tied:
        raise LCTError(f"{art.path}: the artifact lacks {len(missing - tied)} parameter(s) of "
                       f"{arch.class_name}, first {sorted(missing - tied)[0]!r}")
    hf.tie(model, missing)
    hf.materialize_buffers(model, target)     # rotary tables, on meta until now
    if quantized:
        _install_sharded(model, arch, quantized, params)
    return model.eval()


def _slice(whole, index, target, dtype):
    """This rank's ``index`` (a tuple of slices) of a decoded tensor on ``target`` in
    ``dtype`` (a slice is copied: a view would keep the whole decoded tensor alive)."""
    import torch
    return whole[index].to(device=target, dtype=dtype, copy=True,
                           memory_format=torch.contiguous_format)


def _put(module, leaf: str, ref, local) -> None:
    """Install ``local`` as parameter ``leaf`` of ``module``: a DTensor of ``ref``'s placements
    when ``ref`` is one."""
    import torch
    from torch.distributed.tensor import DTensor
    value = DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False,
                               shape=ref.shape, stride=ref.stride()) \
        if isinstance(ref, DTensor) else local
    param = torch.nn.Parameter(value, requires_grad=value.is_floating_point())
    param._is_hf_initialized = True
    module._parameters[leaf] = param


def _by_rows(index, info) -> bool:
    """Whether this rank's slice of ``info`` is a range of whole rows (a 2-D table split along
    the vocabulary, as the plan splits the embedding and the head)."""
    return index is not None and len(info.shape) == 2 and index[1].start == 0 and \
        index[1].stop == info.shape[1]


def _quantized_rows(art, info, bufs, pieces, rows: slice):
    """This rank's ``rows`` of the lossy table ``info``, still encoded (its encoding's weight,
    shaped ``[rows, cols]``) and in memory of its own: its pieces when they are exactly those
    rows, else those rows of the whole. The encoding's ``join`` takes them, so that any
    registered encoding loads here as it does in one process."""
    import dataclasses

    import torch

    from lct.format.encodings import get_encoding
    if pieces is not None:
        parts = [art.tensor_from_buffer(p, bufs[p.chunk], dequantize=False) for p in pieces]
        first = 0
    else:
        parts, first = [art.assemble(info, bufs, dequantize=False)], rows.start
    n = rows.stop - rows.start
    # One copy of the rows: cat makes it of several pieces; of one tensor (a view of a decoded
    # chunk, or of the whole table) the rows are taken out by index.
    take = torch.arange(first, first + n) if len(parts) == 1 else None
    w = get_encoding(info.encoding).join(info, parts, take, art.lossy_dtype(info))
    return dataclasses.replace(w, shape=(n, info.shape[1]))


def _install_sharded(model, arch, quantized: dict, params: dict) -> None:
    """Put the lossy tables in: the embedding as a ``ShardedEmbedding`` over this rank's
    rows, the head (or the tied head, on the same rows) as a ``GatheredHead``."""
    import torch
    import torch.distributed as dist

    from lct.kernels import embedding_for, linear_for
    from lct.kernels.sharded import GatheredHead, ShardedEmbedding
    world = dist.get_world_size()
    targets = [(full, full) for full in quantized] + \
        [(head, real) for head, real in arch.ties.items() if real in quantized]
    for full, source in targets:
        info, w, rows = quantized[source]
        dtype = params[source][2].dtype
        vocab, cols = info.shape
        chunk = -(-vocab // world)
        sizes = [max(0, min(vocab, (r + 1) * chunk) - min(vocab, r * chunk))
                 for r in range(world)]
        mod_path = full.rpartition(".")[0]
        parent_path, _, leaf = mod_path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, leaf)
        if isinstance(old, torch.nn.Embedding):
            local = embedding_for(w, dtype)
            scale = getattr(old, "embed_scale", None)
            new = ShardedEmbedding(local, rows.start, rows.stop, vocab, cols,
                                   scale=None if scale is None or scale.is_meta else scale)
        else:
            if getattr(old, "bias", None) is not None:
                raise LCTError(f"{mod_path} has a bias; a split quantized head "
                               f"has none (load with nf4='dequantize')", option="nf4")
            local = linear_for(w, dtype)
            new = GatheredHead(local, sizes)
        setattr(parent, leaf, new)


def _plans(arch, art, stats) -> tuple:
    """``(arch, params, plans, target device)``: the skeleton's parameters by name, and for
    each artifact tensor the parameter it fills (None for a converter's input), this rank's
    slice and the pieces to read."""
    import torch
    from torch.distributed.tensor import DTensor

    from lct.arch import hf
    from lct.errors import ArchitectureError
    model = arch.model
    params = {}
    for mod_name, module in model.named_modules():
        for leaf, ref in module._parameters.items():
            if ref is not None:
                params[f"{mod_name}.{leaf}" if mod_name else leaf] = (module, leaf, ref)
    foreign = arch.foreign(art.manifest.tensors)
    if foreign:
        raise ArchitectureError(f"{art.path}: {arch.class_name} has no parameter for "
                                f"{len(foreign)} stored tensor(s), first {foreign[0]!r}")
    device = next((r.device_mesh.device_type for _, _, r in params.values()
                   if isinstance(r, DTensor)), "cpu")
    target = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else \
        torch.device("cpu")
    from lct.loader.source import StoredDtypes
    check = StoredDtypes(art, arch)
    plans = {}          # artifact name -> (param name or None, local index, pieces or None)
    for info in art.manifest.tensors.values():
        full, pattern = arch.target(info.name)
        if full is None:
            continue
        check(info.name, full)
        if pattern is not None:
            plans[info.name] = (None, None, None)
            continue
        if full not in params:
            continue            # a buffer the model makes itself
        ref = params[full][2]
        if tuple(info.shape) != tuple(ref.shape):
            raise LCTError(f"{art.path}: tensor {info.name!r} has shape {tuple(info.shape)}, "
                           f"the model expects {tuple(ref.shape)}")
        index = hf.local_index(ref)
        plans[info.name] = (full, index, _pieces_inside(info, index))
    if not any(isinstance(r, DTensor) for _, _, r in params.values()):
        stats.notes.append("the plan shards nothing at this world size: every rank holds whole "
                           "tensors")
    elif any(pieces is not None for _, _, pieces in plans.values()):
        stats.notes.append("each rank reads only the tensor-parallel pieces of its slice, and "
                           "the tensors it needs whole")
    else:
        import torch.distributed as dist
        pieces, world = art.manifest.policy.get("tp_pieces"), dist.get_world_size()
        why = f"its {pieces} tensor-parallel pieces do not divide over {world} ranks" \
            if pieces else "the artifact has no tensor-parallel pieces"
        stats.notes.append(f"each rank decodes whole tensors and keeps its slice ({why}: "
                           f"convert with tp_pieces a multiple of {world} to read only a "
                           f"rank's share)")
    return arch, params, plans, target


def _pieces_inside(info, index):
    """The pieces of ``info`` that make up exactly this rank's slice ``index`` along the piece
    axis (and the whole of the other axis), or None when the slice does not fall on piece
    boundaries (or the tensor is not stored as plain id-ordered pieces)."""
    if index is None or not info.pieces or info.row_order is not None:
        return None
    axis = info.piece_axis
    want = index[axis]
    other = index[1 - axis]
    if other.start != 0 or other.stop != info.shape[1 - axis]:
        return None
    inside = [p for p in info.pieces if want.start <= p.span()[0] and p.span()[1] <= want.stop]
    if not inside or inside[0].span()[0] != want.start or inside[-1].span()[1] != want.stop:
        return None
    return inside


@contextmanager
def rank_group(device="cpu"):
    """This process's place in a torchrun-launched job: the default process group, initialised
    from torchrun's environment when none is (gloo on CPU, NCCL on CUDA, after ``device`` is
    checked, so that a machine without CUDA gets one line rather than NCCL's traceback), and
    left together (a barrier, then its destruction) when the block ends, also on an error.
    Yields ``(rank, world size)``."""
    import torch.distributed as dist
    if "RANK" not in os.environ and not dist.is_initialized():
        raise OptionError("tensor-parallel loading runs as one of the ranks of a job (RANK is "
                          "not set)", option="tp")
    if not dist.is_initialized():
        from lct.loader.build import check_device
        check_device(device)
        dist.init_process_group("nccl" if str(device).startswith("cuda") else "gloo")
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def in_turn(fn) -> None:
    """Call ``fn()`` on one rank at a time, in rank order (what the ranks print never
    interleaves)."""
    import torch.distributed as dist
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            fn()
        dist.barrier()


@contextmanager
def dtensor_warnings_ignored():
    """Within the block, the UserWarnings of torch's DTensor (``torch.distributed.tensor``, such
    as "DTensor random operators may not have complete support on cpu device mesh" as
    transformers initialises a sharded model) are not shown; every other warning is, and the
    filters are as they were after the block."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning,
                                module=r"torch\.distributed\.tensor(\.|$)")
        yield


@dataclass
class RankExit:
    """How one rank that ``launch`` started ended."""

    rank: int
    code: int           # its exit status; negative: the signal that ended it
    stopped: bool       # ended by ``launch``: still running ``LAUNCH_GRACE_S`` after a failure


def launch(world: int, argv: list, *, env: dict | None = None,
           grace_s: float = LAUNCH_GRACE_S) -> list:
    """Run ``argv`` as the ``world`` ranks of one job on this machine, as ``torchrun
    --nproc_per_node world`` does on one node: each with its ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (a free loopback
    port), and ``OMP_NUM_THREADS=1`` for several ranks unless it is set; and wait for them.
    The ranks write to this process's stdout and stderr; the launcher itself writes nothing.
    Once a rank has failed the others have ``grace_s`` seconds to end, then are stopped.

    Args:
        world: the number of ranks, at least 1.
        argv: the command each rank runs (``[sys.executable, "-m", "lct", "load", ...]``).
        env: the ranks' environment besides those variables (default: this process's).
        grace_s: how long the other ranks may run on after one has failed.

    Returns:
        A ``RankExit`` per rank, in rank order.

    Raises:
        OptionError: ``world`` below 1.
        KeyboardInterrupt: a Ctrl-C; the ranks (which had it too) are ended first.

    Example:
        >>> [x.code for x in launch(2, [sys.executable, "-m", "lct", "load", "m.lct", "--tp"])]
        [0, 0]
    """
    import socket
    import subprocess
    if world < 1:
        raise OptionError(f"{world} ranks: a job has at least one", option="tp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ if env is None else env)
    if world > 1:
        base.setdefault("OMP_NUM_THREADS", "1")
    procs, stopped = [], set()
    try:
        for rank in range(world):
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=dict(
                base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))))
        deadline = None
        while any(p.poll() is None for p in procs):
            if deadline is None and any(p.returncode for p in procs):
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                stopped = {r for r, p in enumerate(procs) if p.poll() is None}
                break
            time.sleep(0.05)
    finally:
        _end(procs, 0.0 if stopped else 5.0)
    return [RankExit(r, p.returncode, r in stopped) for r, p in enumerate(procs)]


def _end(procs: list, wait_s: float) -> None:
    """Give the ``procs`` still running ``wait_s`` seconds to end, then SIGTERM, then SIGKILL."""
    import subprocess
    deadline = time.monotonic() + wait_s
    for step in (None, "terminate", "kill"):
        for p in procs:
            if p.poll() is None and step is not None:
                getattr(p, step)()
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            return
        deadline = time.monotonic() + 5.0


def _agree(failure: BaseException | None) -> None:
    """Every rank learns whether any rank failed: no rank is left waiting in a collective. A rank
    that failed raises its own ``failure``; any other raises the first failure (by rank) as its
    error class, naming that rank, with ``failed_rank`` set to it."""
    import torch
    import torch.distributed as dist
    payload = torch.zeros(_MESSAGE_BYTES + 1, dtype=torch.uint8)
    if failure is not None:
        text = f"{type(failure).__name__}\n{failure}".encode()[:_MESSAGE_BYTES]
        payload[0] = 1
        payload[1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    backend = dist.get_backend()
    if backend == "nccl":
        payload = payload.cuda()
    gathered = [torch.zeros_like(payload) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, payload)
    for rank, got in enumerate(gathered):
        if int(got[0]):
            raw = bytes(got[1:].cpu().numpy().tobytes()).rstrip(b"\0").decode(errors="replace")
            kind, _, message = raw.partition("\n")
            cls = getattr(errors, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, LCTError)):
                cls = LCTError
            if failure is not None:
                raise failure
            err = cls(f"rank {rank}: {message}")
            err.failed_rank = rank
            raise err
