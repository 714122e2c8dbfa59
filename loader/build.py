"""``lct.load``: an artifact to a ready transformers model, streamed group by group.

The skeleton is built from the stored config with its parameters on the meta device (buffers
such as rotary frequencies are real, as from_pretrained makes them); decoded tensors are then
installed as zero-copy views of the decoded chunk buffers, while the next ``prefetch`` groups
decode in the background.
"""

from __future__ import annotations

import logging
import time

from lct.errors import ArchitectureError, LCTError
from lct.format import constants as C

from lct.loader.source import LoadOptions, LoadStats

log = logging.getLogger("lct.loader")


# While the skeleton is built (the transformers import: one core of pure Python for seconds),
# decode threads run at this nice increment, so that the import, which is the critical path,
# is not slowed by them; they still get every cycle it leaves (docs/BENCHMARKS.md, checks by hand).
DECODE_NICE = 10


def build_skeleton(art, dtype=None, tensor_parallel: int | None = None):
    """The ``lct.arch.model.Architecture`` of ``art``'s config: its model (``.model``) built
    with the class the artifact was converted for (the manifest's ``architecture.class``; for
    an artifact that does not say, the first class that takes its tensors), parameters on the
    meta device and real buffers, in ``dtype`` (default: the dtype the artifact stores its
    layers in, which a ``--dtype`` cast at conversion makes differ from the config's), and
    with ``tensor_parallel`` (the world size) distributed as ``hf.build_meta`` says."""
    from lct.arch import hf
    from lct.arch.model import Architecture
    from lct.errors import ArchitectureError
    from lct.loader.source import stored_dtype
    dtype = dtype or stored_dtype(art)
    if not (art.path / "config.json").is_file():
        raise LCTError(f"{art.path}: no config.json in the artifact; cannot build a model "
                       f"(the source had none)")
    config = hf.read_config(art.path)
    name = art.manifest.architecture.get("class")
    cls = hf.class_by_name(name) if isinstance(name, str) else None
    if isinstance(name, str) and cls is None:
        raise ArchitectureError(f"{art.path}: the artifact was converted for {name}, which "
                                f"transformers {hf.version()} does not have")
    return Architecture.from_config(config, cls, dtype, names=list(art.manifest.tensors),
                                    tensor_parallel=tensor_parallel)


def import_model_class(path) -> None:
    """Import the transformers modeling module of the artifact's architecture (so that load
    breakdowns can count it as import time); silently does nothing if that is not possible."""
    from pathlib import Path
    try:
        from lct.arch import hf
        from lct.format.jsontext import read_json
        d = read_json(Path(path) / "config.json", LCTError)
        for name in d.get("architectures") or ():
            hf.class_by_name(name)
    except Exception:  # noqa: BLE001 - only a timing aid; build_skeleton reports real errors
        pass


def _set(model, full: str, tensor, as_buffer: bool = False) -> None:
    import torch
    mod_path, _, leaf = full.rpartition(".")
    module = model.get_submodule(mod_path) if mod_path else model
    if as_buffer or leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:
        # requires_grad as from_pretrained sets it: besides matching what users get there, torch's
        # CPU linear takes a path up to 100x slower for a strided 3-D input when the weight does
        # not require grad (generate's prefill slice); inside no_grad nothing is recorded.
        module._parameters[leaf] = torch.nn.Parameter(tensor,
                                                      requires_grad=tensor.is_floating_point())


class Installer:
    """Installs decoded groups into a meta-initialised model; NF4 parts kept or dequantized."""

    def __init__(self, arch, art, *, device="cpu", dtype=None, nf4: str = "keep",
                 pad_ids=None):
        import torch
        self.arch, self.model, self.art, self.nf4 = arch, arch.model, art, nf4
        model = arch.model
        self.device = torch.device(device)
        self.dtype = dtype
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        # Each parameter's dtype as the skeleton has it: the load's dtype, or float32 where the
        # model keeps a parameter so (from_pretrained's dtype plan, applied by the skeleton).
        self.dtypes = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
        self.dtypes.update({n: b.dtype for n, b in model.named_buffers(remove_duplicate=False)
                            if b.is_floating_point()})
        self.names = set(self.shapes) | {n for n, _ in model.named_buffers(remove_duplicate=False)}
        foreign = arch.foreign(art.manifest.tensors)
        if foreign:
            raise ArchitectureError(
                f"{art.path}: {arch.class_name} has no parameter for {len(foreign)} stored "
                f"tensor(s), first {foreign[0]!r}; the artifact does not belong to the model its "
                f"config.json builds")
        # What is tied and not stored (model names): the model's own ties, and the artifact's
        # (a head stored once with its embedding). finish() ties them; a quantized table's
        # tied head shares its codes.
        stored = {arch.target(n)[0] for n in art.manifest.tensors}
        ties = dict(arch.ties)
        ties.update({arch.target(t)[0] or t: arch.target(r)[0]
                     for t, r in art.manifest.ties.items() if arch.target(r)[0]})
        self.ties = {t: r for t, r in ties.items() if t not in stored}
        from lct.loader.source import StoredDtypes
        check = StoredDtypes(art, arch)
        for name in art.manifest.tensors:      # all of them, before anything is installed
            check(name, arch.target(name)[0])
        # Given ids are skipped as asked; the config's pad id only while its stored row is zero.
        self.pad_ids, self.pad_given = _pad_ids(model, pad_ids), pad_ids is not None
        self.installed: set = set()
        self.nf4_modules: list = []
        self._stream = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)

    def _to_device(self, t):
        """Move a host tensor to the target device: pinned buffer + non-blocking copy on a side
        stream on CUDA; nothing on CPU (the decoded view is used as it is)."""
        import torch
        if self.device.type == "cpu":
            return t
        pinned = t if t.is_pinned() else t.pin_memory()
        with torch.cuda.stream(self._stream):
            out = pinned.to(self.device, non_blocking=True)
        out.record_stream(torch.cuda.current_stream(self.device))
        return out

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def install(self, group) -> None:
        """Install every tensor of a decoded group, under the model's names (transformers'
        renames and converters applied, ``lct.arch``)."""
        from lct.io.reader import QUANTIZED
        from lct.kernels import has_kernels
        self._done: set = set()
        ties = self.art.manifest.ties
        group_tensors = {n: t for n, t in group.tensors.items() if n not in ties}
        for name, t in group_tensors.items():
            target, pattern = self.arch.target(name)
            if target is not None and pattern is None:
                self._check_shape(target, name, tuple(t.shape))
        tensors = self.arch.to_model(group_tensors, where=str(self.art.path))
        for full, t in tensors.items():
            if full in self._done:
                continue  # a tie already installed
            if full not in self.shapes and full not in self.names:
                continue
            self._check_converted(full, t)
            if isinstance(t, QUANTIZED):
                # kept encoded where kernels compute on its encoding, else dequantized
                if self.nf4 == "keep" and has_kernels(t.encoding) and self._replaceable(full):
                    self._install_quantized(full, t)
                    continue
                t = t.dequantize()
            want = self.dtypes.get(full, self.dtype)
            if want is not None and t.is_floating_point() and t.dtype != want:
                t = t.to(want)
            _set(self.model, full, self._to_device(t))
            self._mark(full)

    def _check_converted(self, full: str, t) -> None:
        """A converted tensor must come out with the shape the model gives its parameter."""
        want = self.shapes.get(full)
        if want is not None and tuple(t.shape) != tuple(want):
            raise ArchitectureError(f"{self.art.path}: the stored tensors of {full!r} make "
                                    f"{list(t.shape)}, but the model built from config.json "
                                    f"expects {list(want)}")

    def _check_shape(self, full: str, name: str, shape: tuple) -> None:
        """The stored shape must be the one the config gives the parameter (a manifest edited or
        mutated otherwise would build a different model, or fail deep in a kernel)."""
        want = self.shapes.get(full)
        if want is not None and tuple(want) != shape:
            raise LCTError(f"{self.art.path}: tensor {name!r} is stored as {list(shape)}, but the "
                           f"model built from config.json expects {list(want)}")

    def _replaceable(self, full: str) -> bool:
        """Whether the module owning ``full`` can become an NF4/int8 module: a plain embedding
        or linear layer (Gemma's scaled embedding too), not one with modules or parameters of
        its own beside its weight and bias (Inkling's embedding holds a norm): such a table is
        dequantized into it instead."""
        import torch
        module = self.model.get_submodule(full.rpartition(".")[0])
        own = {n for n, p in module._parameters.items() if p is not None}
        return isinstance(module, (torch.nn.Embedding, torch.nn.Linear)) and \
            not any(True for _ in module.children()) and own <= {"weight", "bias"}

    def _mark(self, full: str) -> None:
        self.installed.add(full)
        self._done.add(full)

    def _install_quantized(self, full: str, w) -> None:
        from lct.format.encodings import map_tensors
        dtype = self.dtype or _dtype(w.dtype)
        w = map_tensors(w, self._to_device)
        self._swap(full, w, dtype)
        # A tied head shares the embedding's quantized storage.
        for tied, real in self.ties.items():
            if real == full and tied not in self._done and \
                    tied.rpartition(".")[0] != full.rpartition(".")[0]:
                self._swap(tied, w, dtype)

    def _swap(self, full: str, w, dtype) -> None:
        """Replace the module owning parameter ``full`` by its counterpart over the stored
        weight ``w`` (an ``NF4Weight``, ``Int8Weight`` or ``BlocksWeight``, on the device),
        as the weight's encoding builds it."""
        import torch

        from lct.format.encodings import get_encoding
        from lct.kernels import embedding_for, linear_for
        enc = get_encoding(w.encoding)
        mod_path = full.rpartition(".")[0]
        parent_path, _, leaf = mod_path.rpartition(".")
        parent = self.model.get_submodule(parent_path) if parent_path else self.model
        old = getattr(parent, leaf)
        if isinstance(old, torch.nn.Embedding):
            scale = getattr(old, "embed_scale", None)
            if isinstance(scale, (int, float)) and not isinstance(scale, bool):
                scale = torch.tensor(float(scale))      # BioGPT's and XGLM's: a float
            scale = scale.to(self.device) if scale is not None else None
            pad = self.pad_ids if self.pad_given else _padding_only(self.pad_ids,
                                                                    enc.zero_marker(w),
                                                                    w.shape[0])
            new = embedding_for(w, dtype, pad_ids=pad, scale=scale)
        elif isinstance(old, torch.nn.Linear):
            bias = old.bias if old.bias is not None and not old.bias.is_meta else None
            new = linear_for(w, dtype, bias=bias)
        else:
            raise LCTError(f"{self.art.path}: tensor {full!r} is {enc.label} but its module is "
                           f"a {type(old).__name__}; load with nf4='dequantize'")
        setattr(parent, leaf, new)
        self.nf4_modules.append(mod_path)
        self._mark(full)

    def finish(self, streamed=()) -> None:
        """Tie what the model ties (a tied parameter the artifact does not store becomes the one
        it is tied to, as ``from_pretrained`` ties), and fail if any parameter is still on the
        meta device (except the ``streamed`` names, which a layer-wise executor or a device
        map installs on demand): never a partial model."""
        self.synchronize()
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for tied, real in self.ties.items():
            t, r = params.get(tied), params.get(real)
            if t is None or r is None or (t.is_meta == r.is_meta):
                continue
            target, source = (tied, real) if t.is_meta else (real, tied)
            mod_path, _, leaf = target.rpartition(".")
            module = self.model.get_submodule(mod_path) if mod_path else self.model
            module._parameters[leaf] = self.model.get_parameter(source)
            self.installed.add(target)
        streamed = set(streamed)
        missing = [n for n, p in self.model.named_parameters(remove_duplicate=False)
                   if p.is_meta and n not in streamed]
        if missing:
            raise ArchitectureError(f"{self.art.path}: the artifact has no tensor for "
                                    f"{len(missing)} parameter(s) of {self.arch.class_name}: "
                                    f"{', '.join(missing[:5])}")
        from lct.kernels import flatten_head
        flatten_head(self.model)


def _dtype(name: str):
    from lct.io.reader import torch_dtype
    return torch_dtype(name)


def _pad_ids(model, pad_ids):
    if pad_ids is not None:
        return tuple(pad_ids)
    pid = getattr(model.config, "pad_token_id", None)
    if isinstance(pid, int):
        return (pid,)
    return ()


def _padding_only(ids, absmax, rows: int) -> tuple:
    """The ids among ``ids`` whose quantized row is all zeros (every block's absmax, or the
    int8 row's scale, is 0): skipping
    those gives the very zeros a gather would, so the lookup stays identical to transformers'.
    A pad id that is also a trained token (chat models often pad with ``<|im_end|>``) has a
    non-zero row and is gathered like any other token."""
    table = absmax.reshape(rows, -1)
    return tuple(i for i in ids if 0 <= i < rows and not bool(table[i].any()))


def install_maximus(model, art, budget=None, device="cpu"):
    """Replace the input embedding with a ``MaximusEmbedding`` using the artifact's shard state.

    The hottest shards (by the stored frequencies, or the saved residency) are made resident
    first, up to ``budget`` shards (default: the stored policy's budget); the rest stay in host
    memory. Returns the new module.
    """
    from dataclasses import replace

    import torch

    from lct.format.maximus import MaximusPolicy
    from lct.kernels import MaximusEmbedding, NF4Embedding, QuantizedEmbedding
    m = art.manifest.maximus
    if m is None:
        raise LCTError(f"{art.path}: no Maximus shard state (converted without Maximus shards)",
                       option="maximus_shards")
    state = art.maximus_state()
    module_path = m["prefix"][len("maximus."):-1]
    policy = art.maximus_policy()
    parent_path, _, leaf = module_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, leaf)
    stored = MaximusPolicy.from_metadata(policy, where=str(art.path / m["file"]))
    if isinstance(budget, int) and not isinstance(budget, bool):
        stored = replace(stored, budget_shards=budget)
    kw = {"policy": stored, "device": device, "row_to_id": state["maximus.row_to_id"],
          "counts": state["maximus.token_freq"]}
    scale = getattr(old, "scale", None) if isinstance(old, NF4Embedding) else \
        getattr(old, "embed_scale", None)
    pads = state.get("maximus.pad_ids", torch.zeros(0, dtype=torch.int64)).tolist()
    # The table itself lives in host memory (pinned on a GPU): the model may already sit on
    # the accelerator, so its table is brought back first.
    if isinstance(old, NF4Embedding):
        new = MaximusEmbedding(old.num_embeddings, old.embedding_dim, pad_ids=pads,
                               nf4=(old.packed.cpu(), old.absmax.cpu(), old.blocksize),
                               dtype=old.dtype, scale=scale, **kw)
    elif isinstance(old, (torch.nn.Embedding, QuantizedEmbedding)):
        # Another lossy table (int8, Q8_0, Q6_K ...) is held dequantized: Maximus shards rows
        # of a dense or NF4 table.
        new = MaximusEmbedding(old.num_embeddings, old.embedding_dim, pad_ids=pads,
                               weight=old.weight.detach().cpu(), dtype=old.weight.dtype,
                               scale=scale, **kw)
        # Trainable, as from_pretrained's embedding (inference under no_grad is unaffected);
        # its gradients are sparse, the rows looked up.
        new.weight.requires_grad_(True)
    else:
        raise LCTError(f"{art.path}: {module_path} is a {type(old).__name__}, not an embedding")
    new.load_state_tensors(state, where=str(art.path / m["file"]))
    new.frequency_source = m.get("frequency_source")
    setattr(parent, leaf, new)
    return new


def load(path, options: LoadOptions | None = None, *, stats: LoadStats | None = None):
    """Load an LCT artifact into a transformers model ready for ``generate()``.

    Args:
        path: the artifact directory, or a Hub address ``hf://org/name[@revision]`` (pulled
            into the Hugging Face cache and verified first, unless ``stream``).
        options: a ``LoadOptions`` (default: its defaults), whose fields are:
        prefetch: groups decoded ahead of the one being installed (0: strictly sequential).
        device: ``"cpu"`` or a CUDA device (pinned host buffers, non-blocking copies).
        dtype: cast floating-point weights to this torch dtype (default: keep stored dtypes).
        nf4: ``"keep"`` keeps NF4 parts in NF4 (``NF4Embedding``/``NF4Linear``);
            ``"dequantize"`` expands them to the model dtype at load.
        workers: decode threads (default: all cores).
        verify: check chunk checksums as they stream.
        pad_ids: ids the NF4 embedding never gathers and returns as zeros (default: the
            config's pad_token_id, and only while its stored row is zero, so that the lookup
            equals transformers' for every input).
        maximus: ``True`` (or a budget in shards) installs a ``MaximusEmbedding`` from the
            artifact's shard state, hottest shards resident first.
        stream: for an ``hf://`` address, fetch the chunks by HTTP range requests straight
            from the Hub (same prefetch window and checksums) instead of downloading the files.
        expect: the manifest's digest, as ``lct info`` prints it (``lct.load``'s docstring).
        stats: a ``LoadStats`` to fill with the time breakdown.

    Returns:
        A ``PreTrainedModel`` in eval mode.

    While it runs, torch and transformers are imported (and the skeleton built) in a thread
    beside the decode, the decode threads run at a lower priority (nice +10) so that import keeps
    its core, and the cyclic garbage collector is paused (restored afterwards, also on errors).

    Raises:
        LCTError subclasses: bad artifact, checksum mismatch (naming the chunk), missing tensors.

    Example:
        >>> model = load("gemma-2b.lct", LoadOptions(prefetch=2))
        >>> model.generate(ids, max_new_tokens=20)
    """
    import gc

    # The import and the load create long-lived objects by the hundred thousand: the cyclic
    # collector would walk them again and again while holding the GIL the decoders need
    # (about 1.5 s of a 9 s load of the 2B artifact). It is restored as it was, whatever happens.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _load(path, options or LoadOptions(), stats)
    finally:
        if was_enabled:
            gc.enable()


def check_device(device) -> None:
    """Refuse a device that is neither ``cpu`` nor an available CUDA device, before any work."""
    name = device if isinstance(device, str) else str(device)
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise LCTError(f"device {name!r} is not 'cpu' or 'cuda[:N]'")
    if kind == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise LCTError(f"device {name!r}: CUDA is not available in this torch build or on "
                           f"this machine; load on 'cpu'")
        if index and int(index) >= torch.cuda.device_count():
            raise LCTError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA "
                           f"device(s)")


def _load(path, options: LoadOptions, stats: LoadStats | None):
    from concurrent.futures import ThreadPoolExecutor
    device, dtype, nf4, pad_ids = options.device, options.dtype, options.nf4, options.pad_ids
    check_device(device)

    from lct.io.stream import GroupStream
    stats = stats if stats is not None else LoadStats()
    t0 = time.perf_counter()
    # torch is not imported here: the skeleton thread imports it (with transformers) while
    # the stream already reads and decodes, which needs only numpy and zstd.
    art = options.open(path)
    stats.manifest_s = time.perf_counter() - t0
    art.thread_nice = DECODE_NICE
    fill = cold = None

    def skeleton():
        t1 = time.perf_counter()
        model = build_skeleton(art, dtype)
        stats.skeleton_s = time.perf_counter() - t1
        return model

    # The skeleton (importing transformers' modeling code, seconds of pure Python) is built in
    # a thread while this one takes the decoded groups off the stream: they are the model's
    # final weights, so holding them until the skeleton exists costs no memory beyond the
    # window, and the stream never runs more than `prefetch` groups ahead of this consumer.
    builder = ThreadPoolExecutor(1, thread_name_prefix="lct-skeleton")
    budget = held_budget(art)
    try:
        cached, fill, cold = _cache_for(art, options, stats)
        with GroupStream(art, prefetch=options.prefetch, dequantize=False, cached=cached,
                         on_decoded=None if fill in (None, LATER) else fill.add) as stream:
            # Reads first: importing torch holds the interpreter for a while (its libraries
            # load under the GIL), and the store's requests should already be on their way.
            stream.start()
            future = builder.submit(skeleton)
            inst, held, held_bytes = None, [], 0
            for group in stream:
                held.append(group)
                if inst is None:
                    held_bytes += sum(c.decoded_size
                                      for c in art.manifest.group_chunks(group.name))
                    stats.max_held_bytes = max(stats.max_held_bytes, held_bytes)
                # Past the budget, wait for the skeleton: its shape checks then run before
                # more is decoded, whatever sizes the manifest claims.
                if inst is None and (future.done() or held_bytes > budget):
                    inst = Installer(future.result(), art, device=device, dtype=dtype, nf4=nf4,
                                     pad_ids=pad_ids)
                if inst is not None:
                    _install_all(inst, held, stats)
            inst = inst or Installer(future.result(), art, device=device, dtype=dtype, nf4=nf4,
                                     pad_ids=pad_ids)
            _install_all(inst, held, stats)  # what arrived before the skeleton was ready
            s = stream.stats
        model = inst.model
        inst.finish()
        if device != "cpu":
            model.to(device)  # buffers (rotary tables) follow the weights
        if options.maximus:
            install_maximus(model, art, budget=options.maximus, device=device)
    finally:
        builder.shutdown(wait=True)  # an import cannot be interrupted: let it end, no thread left
        art.close()
    stats.take_stream(s)
    if cached is not None and cached.damaged:
        stats.cache = (f"hit, but {len(cached.damaged)} chunk(s) differed from what was written: "
                       f"decoded from the artifact instead, and the entry removed")
    stats.nf4_modules = list(inst.nf4_modules)
    stats.total_s = time.perf_counter() - t0
    log.info("loaded %s: %d groups, %d bytes decoded in %.2f s (skeleton %.2f s beside decode, "
             "waited %.2f s for decode)", path, stats.groups, stats.bytes_decoded, stats.total_s,
             stats.skeleton_s, stats.wait_s)
    _generation_config(model, art.path)
    if fill is LATER:             # the load succeeded: decode a copy to keep, in the background
        fill_later(art, options.cache, None, stats)
    elif fill is not None:        # the load succeeded: keep its buffers, in the background
        from lct.io.cache import start_fill
        start_fill(fill)
    elif cold is not None:        # an entry on the disk: in memory for the next start
        from lct.io.cache import warm
        warm(cold)
    return model.eval()


def _entry(art, asked: bool | None, stats: LoadStats | None, choose: bool = True) -> tuple:
    """``(entry to map or None, entry left on the disk or None, state)``: the decoded cache's
    entry of ``art`` (``lct.io.cache``) where the cache is on for this load (``asked``:
    ``cache=``, None for ``LCT_CACHE``), and whether this start maps it (``cache.choose``; with
    ``choose`` False, always). ``state`` is ``off``, ``miss``, ``hit`` or ``cold`` (an entry
    whose pages are on the disk: the artifact is decoded instead); ``stats.cache`` says it with
    the why."""
    from lct.io import cache
    if not cache.enabled(asked):
        return None, None, "off"
    why = cache.unpinned(art)
    if why:
        what, hit, state = f"off: {why}", None, "off"
    else:
        hit = cache.lookup(art)
        use, what = cache.choose(hit, art) if hit is not None and choose else (True, "mapped")
        state = "miss" if hit is None else "hit" if use else "cold"
        what = "miss" if hit is None else f"{state}: {what}"
    if stats is not None:
        stats.cache = what
    return (hit, None, state) if state == "hit" else (None, hit, state)


# _cache_for's fill for a load whose buffers cannot be kept: fill_later decodes a copy after it
LATER = object()


def _cache_for(art, options: LoadOptions, stats: LoadStats) -> tuple:
    """``(cached chunks or None, fill or None, entry to warm or None)`` for a whole load: a hit
    maps an earlier load's decode (``_entry``); an entry on the disk is left there and read
    into memory after the load (``lct.io.cache.warm``); otherwise a load whose decoded buffers
    become the model's weights as they are (on the CPU, no cast, lossy parts kept) keeps them
    afterwards, and any other (onto a GPU, cast, dequantized) has one decoded in the
    background after it (``LATER``: ``fill_later``). Either way but a hit, the compressed pages read in from disk are dropped: the
    next start maps the decoded copy."""
    from lct.io import cache
    hit, cold, state = _entry(art, options.cache, stats)
    if state in ("off", "hit"):
        return hit, None, None
    if state == "miss":
        if options.device != "cpu" or options.dtype is not None or options.nf4 != "keep" or \
                not options.verify:
            # its buffers are not the stored bytes (on a GPU, cast, dequantized): a background
            # fill keeps a copy after the load instead (fill_later)
            return None, LATER, None
        fill = cache.Fill(art)
        if fill.over_budget():
            stats.cache = f"miss: not kept, {fill.over_budget()}"
            return None, None, None
        stats.cache = "filling"
    else:
        fill = None
    if options.page_cache == "auto" and hasattr(art.store, "page_cache"):
        art.store.page_cache = "auto"       # drop what is read in from disk (lct.io.store)
    return None, fill, cold


def cache_hit(art, asked: bool | None, stats: LoadStats | None = None, *, choose: bool = True):
    """The decoded cache's entry of ``art`` mapped (``lct.io.cache.CachedChunks``) where the
    cache is on for this load (``asked``: ``cache=``, None for ``LCT_CACHE``), holds one, and
    this start maps it (``lct.io.cache.choose``: its pages are in memory, or decoding would
    read no fewer bytes; ``choose=False`` maps it whatever), else None: for the loaders that
    only map an entry (the layer-wise model, device maps, tensor-parallel ranks, vLLM's load
    format); an entry is filled by a whole ``lct.load`` or by ``lct cache fill``, or by
    ``fill_later`` after this load. ``stats.cache`` says which and why."""
    return _entry(art, asked, stats, choose)[0]


def fill_later(art, asked: bool | None, hit, stats: LoadStats | None = None):
    """After a load by a loader that only maps an entry (``cache_hit``) mapped none (``hit``
    None): keep one for the next start (``lct.io.cache.keep``: a background fill of a local
    artifact that the interpreter waits for at exit, saying so, or, where the entry exists but
    was left on the disk, reading it into memory). Returns the fill, or None; ``stats.cache``
    says which."""
    from lct.io import cache
    if hit is not None:
        return None
    f, why = cache.keep(art, asked)
    if stats is not None and (f is not None or why):
        stats.cache = f"miss: not kept, {why}" if why else \
            "miss: being kept for the next start (a background fill)"
    return f


def held_budget(art) -> int:
    """How many decoded bytes ``load`` may hold before the model's skeleton exists (it checks
    every stored shape against the model): about 1.5x the weights that config.json describes,
    estimated without transformers (vocabulary, hidden size, layers, MLP width, experts), plus
    64 MiB. An estimate that falls short only makes the load wait for the skeleton sooner; a
    config without these numbers gives the prefetch window's worth (64 MiB)."""
    from lct.format.jsontext import read_json
    try:
        cfg = read_json(art.path / "config.json", LCTError)
        cfg = {**cfg.get("text_config", {}), **cfg} if isinstance(cfg, dict) else {}
    except (LCTError, TypeError):
        cfg = {}

    def get(*keys):
        return next((cfg[k] for k in keys if isinstance(cfg.get(k), int)
                     and not isinstance(cfg.get(k), bool) and cfg[k] > 0), None)
    v, h = get("vocab_size"), get("hidden_size", "n_embd", "d_model")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    slack = 64 << 20
    if None in (v, h, layers):
        return slack
    inter = get("intermediate_size", "n_inner", "ffn_dim") or 4 * h
    experts = get("num_local_experts", "num_experts", "n_routed_experts") or 1
    heads, head_dim = get("num_attention_heads", "n_head") or 1, get("head_dim")
    attn = h * max(h, heads * head_dim if head_dim else h)
    params = 2 * v * h + layers * (4 * attn + 3 * h * inter * experts + 8 * h) + \
        (get("max_position_embeddings", "n_positions") or 0) * h
    width = 2 if str(cfg.get("torch_dtype", cfg.get("dtype"))) in ("bfloat16", "float16") else 4
    return min(params * width * 3 // 2 + slack, C.MAX_CHUNK_DECODED * 16)


def _install_all(inst: Installer, held: list, stats: LoadStats) -> None:
    """Install and let go of the held groups, oldest first."""
    t = time.perf_counter()
    while held:
        inst.install(held.pop(0))
    stats.install_s += time.perf_counter() - t


def _generation_config(model, path) -> None:
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig
        model.generation_config = GenerationConfig.from_pretrained(path)
