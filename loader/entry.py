"""``lct.load``: one entry over the three loaders: single-process streaming (``build``),
tensor-parallel (``tensor_parallel``) and device-mapped (``device_map``)."""

from __future__ import annotations

from lct.errors import LCTError


def load(path, prefetch: int = 2, device="cpu", dtype=None, nf4: str = "keep",
         workers: int | None = None, *, verify: bool = True, pad_ids=None, stats=None,
         maximus=False, stream: bool = False, tp_plan=None, device_map=None, max_memory=None,
         expect: str | None = None):
    """Load an LCT artifact into a transformers model ready for ``generate()``.

    Without ``tp_plan`` or ``device_map`` this is ``lct.loader.build.load``, the prefetching
    streaming loader (its docstring has the details).

    Args:
        path: the artifact folder, or ``hf://org/name[@revision]`` (pulled and verified first,
            or with ``stream=True`` read by HTTP range requests).
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
    dtype = _check_args(prefetch, dtype, stats, maximus)
    if max_memory is not None and device_map is None:
        raise LCTError("max_memory is the budget of device_map='auto'; pass device_map too",
                       option="max_memory")
    if device_map is not None:
        if tp_plan is not None or maximus:
            raise LCTError("device_map does not go with tp_plan or Maximus shards",
                           option="device_map")
        if str(device) != "cpu":
            raise LCTError(f"device {str(device)!r} and device_map both given: the map places "
                           f"every module; put the device in the map", option="device")
        from lct.loader.device_map import load_mapped
        return load_mapped(path, device_map, max_memory=max_memory, prefetch=prefetch,
                           dtype=dtype, nf4=nf4, workers=workers, verify=verify, stats=stats,
                           stream=stream, expect=expect)
    if tp_plan is not None:
        if maximus:
            raise LCTError("Maximus shards and tensor-parallel loading do not go together yet",
                           option="maximus")
        from lct.loader.tensor_parallel import load_tp
        return load_tp(path, tp_plan=tp_plan, prefetch=prefetch, device=device, dtype=dtype,
                       nf4=nf4, workers=workers, verify=verify, stats=stats, stream=stream,
                       expect=expect)
    from lct.loader.build import load as load_streamed
    return load_streamed(path, prefetch=prefetch, device=device, dtype=dtype, nf4=nf4,
                         workers=workers, verify=verify, pad_ids=pad_ids, stats=stats,
                         maximus=maximus, stream=stream, expect=expect)


def _check_args(prefetch, dtype, stats, maximus):
    """Refuse arguments of the wrong kind with an ``LCTError`` naming them; returns ``dtype`` as
    a torch dtype (a name such as ``"float16"`` is taken, as the CLI's ``--dtype``)."""
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise LCTError(f"prefetch must be an integer >= 0, got {prefetch!r}", option="prefetch")
    if stats is not None:
        from lct.loader.source import LoadStats
        if not isinstance(stats, LoadStats):
            raise LCTError(f"stats must be an lct.LoadStats (filled by the load), got "
                           f"{type(stats).__name__}", option="stats")
    if isinstance(maximus, int) and not isinstance(maximus, bool) and maximus < 1:
        raise LCTError(f"maximus {maximus}: a budget is a number of resident shards, at least 1 "
                       f"(True: the stored policy's)", option="maximus")
    if isinstance(dtype, str):
        import torch
        from lct.format import constants as C
        name = dtype.removeprefix("torch.")
        if name not in C.FLOAT_DTYPES:
            raise LCTError(f"dtype {dtype!r}: expected one of {', '.join(C.FLOAT_DTYPES)} or a "
                           f"torch dtype", option="dtype")
        return getattr(torch, name)
    return dtype
