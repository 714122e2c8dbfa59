"""``lct.load``: an artifact to a ready transformers model, streamed group by group.

The skeleton is built from the stored config with its parameters on the meta device (buffers
such as rotary frequencies are real, as from_pretrained makes them); decoded tensors are then
installed (``lct.loader.install``) as zero-copy views of the decoded chunk buffers, while the
next ``prefetch`` groups decode in the background.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError
from contextlib import contextmanager

from lct.errors import LCTError
from lct.format import constants as C
from lct.loader.install import Installer, install_all, install_maximus
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

    While it runs, torch and transformers are imported (and the skeleton built) beside the
    decode, on the caller's thread (a helper takes the decoded groups), the decode threads run
    at a lower priority (nice +10) so that the import keeps its core, and the cyclic garbage
    collector makes young collections only (``young_collections_only``).

    Raises:
        LCTError subclasses: bad artifact, checksum mismatch (naming the chunk), missing tensors.

    Example:
        >>> model = load("gemma-2b.lct", LoadOptions(prefetch=2))
        >>> model.generate(ids, max_new_tokens=20)
    """
    with young_collections_only():
        return _load(path, options or LoadOptions(), stats)


# gc.set_threshold takes C ints: this many young collections never come during one load.
_NO_FULL_COLLECTION = 1 << 30


@contextmanager
def young_collections_only():
    """Run the block with the cyclic collector's full collections held off (restored after,
    also on errors; a collector the caller disabled stays disabled).

    The import and the load create long-lived objects by the hundred thousand: a full collection
    walks them all while holding the GIL the decoders need (six of them took 0.7-0.9 s of a
    3.5 s warm load of the 2B artifact). Young collections stay on: they are what frees the
    import's cyclic garbage while it is made, where its next allocations reuse the memory.
    Paused outright (as LCT did before), the collector freed 5-7 MB of it after the model was
    built, holes in the heap that the first forward's buffers then filled: a peak RSS 3 MB
    higher, and 0.25 s for the one large collection that came after (docs/BENCHMARKS.md).
    """
    import gc
    if not gc.isenabled():
        yield
        return
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], _NO_FULL_COLLECTION)
    try:
        yield
    finally:
        gc.set_threshold(*before)


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
    # torch is not imported yet: the skeleton imports it (with transformers) once the stream
    # already reads and decodes, which needs only numpy and zstd.
    art = options.open(path)
    stats.manifest_s = time.perf_counter() - t0
    art.thread_nice = DECODE_NICE
    fill = cold = staged = None

    def skeleton():
        t1 = time.perf_counter()
        model = build_skeleton(art, dtype)
        stats.skeleton_s = time.perf_counter() - t1
        return model

    # The skeleton (importing transformers' modeling code, seconds of pure Python) is built on
    # this thread while a helper takes the decoded groups off the stream (``_hold``): they are
    # the model's final weights, so holding them until the skeleton exists costs no memory
    # beyond the window, and the stream never runs more than `prefetch` groups ahead of its
    # consumer. The import on the caller's thread, as ``from_pretrained``'s: its freed
    # temporaries stay in the arena this thread allocates from later (a helper's arena kept
    # 10-20 MB of them beside the first forward's allocations).
    holder = ThreadPoolExecutor(1, thread_name_prefix="lct-hold")
    budget = held_budget(art)
    try:
        cached, fill, cold = _cache_for(art, options, stats)
        staged = fill if fill not in (None, LATER) else None
        with GroupStream(art, prefetch=options.prefetch, dequantize=False, cached=cached,
                         on_decoded=staged and staged.add,
                         into=staged and staged.out) as stream:
            # Reads first: importing torch holds the interpreter for a while (its libraries
            # load under the GIL), and the store's requests should already be on their way.
            stream.start()
            built = threading.Event()
            holding = holder.submit(_hold, stream, art, built, budget, stats)
            try:
                model = skeleton()
            finally:
                built.set()
            held = holding.result()     # the stream's error, if it had one
            inst = Installer(model, art, device=device, dtype=dtype, nf4=nf4, pad_ids=pad_ids)
            install_all(inst, held, stats)  # what arrived before the skeleton was ready
            for group in stream:
                install_all(inst, [group], stats)
            s = stream.stats
        model = inst.model
        inst.finish()
        if device != "cpu":
            model.to(device)  # buffers (rotary tables) follow the weights
        if options.maximus:
            install_maximus(model, art, budget=options.maximus, device=device)
        _generation_config(model, art.path)
        if staged is not None:
            staged.seal()       # the weights copy-on-write from here: the entry never changes
    except BaseException:
        if staged is not None:
            staged.discard()
        raise
    finally:
        holder.shutdown(wait=True)   # the stream is closed: the helper has ended or ends now
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
    if fill is LATER:             # the load succeeded: decode a copy to keep, in the background
        fill_later(art, options.cache, None, stats)
    elif fill is not None:        # the load succeeded: check and publish the entry it decoded into
        from lct.io.cache import start_fill
        start_fill(fill)
    elif cold is not None:        # an entry on the disk: in memory for the next start
        from lct.io.cache import warm
        warm(cold)
    return model.eval()


def _hold(stream, art, built, budget: int, stats: LoadStats) -> list:
    """The groups taken off ``stream`` (in a helper thread) until the skeleton is ``built``,
    the stream ends, or more than ``budget`` decoded bytes are held: past it the skeleton's
    shape checks run before more is decoded, whatever sizes the manifest claims. A stream
    closed meanwhile (the skeleton failed) ends it too."""
    held, held_bytes = [], 0
    while not built.is_set() and held_bytes <= budget:
        try:
            group = next(stream)
        except StopIteration:
            break
        except CancelledError:
            if built.is_set():      # closed by the caller, whose own error is the one to see
                break
            raise
        held.append(group)
        held_bytes += sum(c.decoded_size for c in art.manifest.group_chunks(group.name))
        stats.max_held_bytes = max(stats.max_held_bytes, held_bytes)
    return held


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
    (``lct.io.cache.StagedFill``: written after the load, or with ``LCT_CACHE_IN_PLACE=1``
    decoded straight into the entry's pages), and any other (onto a GPU, cast, dequantized)
    has one decoded in the background after it (``LATER``: ``fill_later``). Either way but a
    hit, the compressed pages read in from disk are dropped: the next start maps the copy."""
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
        fill = cache.StagedFill(art)
        if not fill.open():
            stats.cache = f"miss: not kept, {fill.reason}" if fill.reason else "miss"
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


def _generation_config(model, path) -> None:
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig
        model.generation_config = GenerationConfig.from_pretrained(path)
