"""``lct.load``: one entry over the three loaders: single-process streaming (``build``),
tensor-parallel (``tensor_parallel``) and device-mapped (``device_map``)."""

from __future__ import annotations

from lct.errors import OptionError
from lct.io.stream import DEFAULT_PREFETCH
from lct.loader.source import LoadOptions, LoadStats


def load(path, prefetch: int = DEFAULT_PREFETCH, device="cpu", dtype=None, nf4: str = "keep",
         workers: int | None = None, *, verify: bool = True, pad_ids=None, stats=None,
         maximus=False, stream: bool = False, tp_plan=None, device_map=None, max_memory=None,
         expect: str | None = None, cache: bool | None = None, page_cache: str = "auto"):
    """Load an LCT artifact into a transformers model ready for ``generate()``.

    Without ``tp_plan`` or ``device_map`` this is ``lct.loader.build.load``, the prefetching
    streaming loader (its docstring has the details).

    Args:
        path: the artifact folder, ``hf://org/name[@revision]`` (pulled and verified first,
            or with ``stream=True`` read by HTTP range requests), or ``s3://``, ``gs://`` or
            ``az://bucket/prefix`` (always read by range requests, ``lct.cloud``).
        prefetch: groups decoded ahead of the one being installed (0: sequential).
        device: ``"cpu"`` or ``"cuda[:N]"``.
        dtype: cast floating-point weights to this torch dtype (default: the stored ones).
        nf4: ``"keep"`` NF4/int8 parts in their encoding, or ``"dequantize"`` them.
        workers: decode threads (default: all cores).
        verify: check chunk checksums as they stream.
        pad_ids: ids the quantized embedding returns as zeros without gathering.
        stats: a ``LoadStats`` filled with the time and bytes breakdown.
        maximus: ``True`` (or a budget in shards) installs a ``MaximusEmbedding``.
        stream: for ``hf://``, fetch chunks by HTTP range requests instead of the files.
        cache: use the local decoded cache (``lct.io.cache``): a load finds what an earlier
            load of the same artifact decoded and maps it instead of decoding, and a load that
            decodes keeps it there afterwards, in the background. None: ``LCT_CACHE`` (1/0)
            decides, else off. With ``tp_plan`` or ``device_map`` a load maps an entry (each
            rank its share) but fills none: a whole load or ``lct cache fill`` does.
        page_cache: what happens to the page-cache pages of a local artifact's stored
            (compressed) bytes once their chunk is decoded: ``"auto"`` drops those this load
            read in from disk when the decoded cache keeps this load's decode (the next load
            maps that) and keeps them otherwise (the next load reads them from memory),
            ``"keep"`` keeps them all, ``"drop"`` drops them all (README, "The page cache").
        expect: the digest the artifact's manifest must have (``sha256:...``, as ``lct info``
            prints it): a pin on the names, shapes, types and places of every tensor and on
            every chunk's checksum (an ``hf://`` address at a commit is pinned already).
        tp_plan: ``"auto"`` under an initialised ``torch.distributed`` process group: the
            tensor-parallel model ``from_pretrained(tp_plan="auto")`` builds, each rank keeping
            its shards (``lct.loader.tensor_parallel.load_tp``).
        device_map, max_memory: place modules as ``from_pretrained(device_map=...)`` does
            (``"auto"`` with ``max_memory``, or ``{module: device}`` with ``"cpu"``/``"disk"``);
            ``"disk"`` modules stay in the artifact and are not read at load
            (``lct.loader.device_map.load_mapped``); with any module offloaded, NF4/int8
            tables are dequantized (accelerate's hooks move plain weights; ``stats.notes``
            says so). An entry inside another is taken (the nearest one decides).

    Example:
        >>> model = lct.load("gemma-2b.lct", prefetch=2)
    """
    options = LoadOptions(prefetch=prefetch, device=device, dtype=dtype, nf4=nf4,
                          workers=workers, verify=verify, stream=stream, expect=expect,
                          pad_ids=pad_ids, maximus=maximus, cache=cache,
                          page_cache=page_cache)
    _check_stats(stats)
    if max_memory is not None and device_map is None:
        raise OptionError("max_memory is the budget of device_map='auto'; pass device_map too",
                          option="max_memory")
    if device_map is not None:
        if tp_plan is not None or maximus:
            raise OptionError("device_map does not go with tp_plan or Maximus shards",
                              option="device_map")
        if str(device) != "cpu":
            raise OptionError(f"device {str(device)!r} and device_map both given: the map "
                              f"places every module; put the device in the map", option="device")
        from lct.loader.device_map import load_mapped
        return load_mapped(path, device_map, options, max_memory=max_memory, stats=stats)
    if tp_plan is not None:
        if maximus:
            raise OptionError("Maximus shards and tensor-parallel loading do not go together "
                              "yet", option="maximus")
        from lct.loader.tensor_parallel import load_tp
        return load_tp(path, options, tp_plan=tp_plan, stats=stats)
    from lct.loader.build import load as load_streamed
    return load_streamed(path, options, stats=stats)


def _check_stats(stats) -> None:
    """Refuse a ``stats`` that is not a ``LoadStats`` (the load fills it)."""
    if stats is not None and not isinstance(stats, LoadStats):
        raise OptionError(f"stats must be an lct.LoadStats (filled by the load), got "
                              f"{type(stats).__name__}", option="stats")
