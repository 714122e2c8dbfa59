"""Loading with a device map, as ``from_pretrained(device_map=...)`` takes one: ``"auto"`` (or
``"balanced"``, ``"balanced_low_0"``, ``"sequential"``) with ``max_memory``, or an explicit
``{module: device}`` with ``"cpu"`` and ``"disk"`` among the devices.

Modules mapped to ``"disk"`` stay in the artifact: their chunks are not read at load, and
accelerate's offload hooks fetch their weights from the artifact (one group decoded at a time)
when they run. A pipeline stage is such a map: the layers of other stages on ``"disk"``, so the
process never reads their chunks unless it runs them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from lct.errors import LCTError

AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


class ArtifactWeights(Mapping):
    """The artifact's tensors by the model's parameter names, decoded on access (the group of
    the last one asked for is kept, so a layer's weights decode once per forward); what the
    load installed is served from ``installed`` instead."""

    def __init__(self, art, names: dict, dtype=None, installed: dict | None = None):
        self.art, self.names, self.dtype = art, names, dtype   # names: model name -> artifact
        self.installed = installed or {}
        self._group, self._tensors = None, {}
        self._lock = threading.Lock()

    def __getitem__(self, key: str):
        if key in self.installed:
            return self.installed[key]
        name = self.names[key]
        m = self.art.manifest
        group = m.tensors[m.ties.get(name, name)].group
        with self._lock:
            if group != self._group:
                self._tensors = self.art.read_group(group, dequantize=True)
                self._group = group
            tensor = self._tensors[name]
        return tensor.to(self.dtype) if self.dtype is not None and \
            tensor.is_floating_point() else tensor

    def __iter__(self):
        return iter(set(self.names) | set(self.installed))

    def __len__(self) -> int:
        return len(set(self.names) | set(self.installed))


def resolve(model, device_map, max_memory=None, dtype=None) -> dict:
    """``{module name: device}`` for ``model`` (on the meta device): accelerate computes the
    ``"auto"`` forms from ``max_memory``; an explicit map is checked to cover every parameter."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map
    no_split = getattr(model, "_no_split_modules", None) or []
    if isinstance(device_map, str):
        if device_map not in AUTO_MAPS:
            raise LCTError(f"device_map {device_map!r}: expected one of {AUTO_MAPS} or a "
                           f"{{module: device}} dict", option="device_map")
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory,
                                             no_split_module_classes=no_split, dtype=dtype,
                                             low_zero=device_map == "balanced_low_0")
        return dict(infer_auto_device_map(model, max_memory=max_memory,
                                          no_split_module_classes=no_split, dtype=dtype))
    if not isinstance(device_map, Mapping):
        raise LCTError(f"device_map must be a string or a dict, got {type(device_map).__name__}",
                       option="device_map")
    dmap = {str(k): (v if isinstance(v, (int, str)) else str(v)) for k, v in device_map.items()}
    for name, _ in model.named_parameters():
        if device_of(name, dmap) is None:
            raise LCTError(f"device_map places no module above parameter {name!r}",
                           option="device_map")
    return dmap


def device_of(name: str, dmap: dict):
    """The device of parameter ``name``: that of its nearest enclosing module in ``dmap``."""
    parts = name.split(".")
    for k in range(len(parts), -1, -1):
        key = ".".join(parts[:k])
        if key in dmap:
            return dmap[key]
    return None


def load_mapped(path, device_map, *, max_memory=None, prefetch: int = 2, dtype=None,
                nf4: str = "keep", workers: int | None = None, verify: bool = True,
                stats=None, stream: bool = False):
    """Load ``path`` placing its modules as ``device_map`` says (see the module docstring).

    Returns:
        The model in eval mode, dispatched with accelerate's hooks when it spans more than one
        device or has modules on ``"disk"`` (the artifact stays open for those).
    """
    import torch
    from accelerate import dispatch_model

    from lct.loader.build import Installer, _install_all, build_skeleton
    from lct.loader.source import LoadStats, open_source, param_name, stored_dtype
    stats = stats if stats is not None else LoadStats()
    t0 = time.perf_counter()
    art = open_source(path, verify=verify, workers=workers, stream=stream)
    closing = True
    try:
        model = build_skeleton(art, dtype)
        dmap = resolve(model, device_map, max_memory, dtype or stored_dtype(art))
        devices = set(dmap.values())
        offloading = len(devices) > 1 or "disk" in devices
        if offloading and nf4 == "keep":
            nf4 = "dequantize"   # accelerate's hooks move plain parameters only
            stats.notes.append("NF4/int8 parts dequantized: offloaded modules hold plain "
                               "weights")
        names = {p for p, _ in model.named_parameters(remove_duplicate=False)}
        wanted = {}
        for t in art.manifest.tensors.values():
            full = param_name(model, t.name, names)
            if full is not None:
                wanted[full] = t.name
        read = [g for g in art.groups
                if any(device_of(full, dmap) != "disk" for full, name in wanted.items()
                       if art.manifest.tensors[name].group == g)]
        stats.notes.append(f"{len(read)} of {len(art.groups)} groups read at load; the rest "
                           f"stay in the artifact until their modules run")
        inst = Installer(model, art, device="cpu", dtype=dtype, nf4=nf4)
        from lct.io.stream import GroupStream
        with GroupStream(art, read, prefetch=prefetch) as groups:
            for group in groups:
                _install_all(inst, [group], stats)
            s = groups.stats
        left = {full for full, name in wanted.items()
                if art.manifest.tensors[name].group not in read}
        inst.finish(streamed=left)
        stats.take_stream(s)
        if offloading:
            installed = {n: p for n, p in model.state_dict(keep_vars=True).items()
                         if p.device.type != "meta"}
            weights = ArtifactWeights(art, wanted, dtype, installed)
            model = dispatch_model(model, dmap, state_dict=weights, offload_index={})
            model._lct_artifact = art     # read on demand by the offloaded modules
            closing = "disk" not in devices
        else:
            (device,) = devices
            model.to(torch.device("cuda", device) if isinstance(device, int) else device)
        model.hf_device_map = dmap
    finally:
        if closing:
            art.close()
    stats.total_s = time.perf_counter() - t0
    return model.eval()
