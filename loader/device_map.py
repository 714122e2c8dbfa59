"""Loading with a device map, as ``from_pretrained(device_map=...)`` takes one: ``"auto"`` (or
``"balanced"``, ``"balanced_low_0"``, ``"sequential"``) with ``max_memory``, or an explicit
``{module: device}`` with ``"cpu"`` and ``"disk"`` among the devices.

Modules mapped to ``"disk"`` stay in the artifact: their chunks are not read at load, and
accelerate's offload hooks fetch their weights from the artifact (one group decoded at a time)
when they run. A pipeline stage is such a map: the layers of other stages on ``"disk"``, so the
process never reads their chunks unless it runs them. A mixture of experts' experts module on
``"disk"`` reads only the experts its tokens are routed to (``lct.loader.experts``), where LCT
can know the routing; ``model.lct_expert_bytes`` counts the expert bytes read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from lct.errors import LCTError
from lct.format import constants as C
from lct.loader.experts import stored_bytes

AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


class ArtifactWeights(Mapping):
    """The artifact's tensors by the model's parameter names, decoded on access (the group of
    the last one asked for is kept, so a layer's weights decode once per forward, and converted
    as the load converts them, ``lct.arch``); what the load installed is served from
    ``installed`` instead."""

    def __init__(self, art, arch, groups_of: dict, dtype=None, installed: dict | None = None,
                 routed: dict | None = None, expert_bytes=None):
        self.art, self.arch, self.dtype = art, arch, dtype
        self.groups_of = groups_of              # model name -> the groups that fill it
        self.installed = installed or {}
        # Experts groups read by routing (lct.loader.experts): their module's pre-hook puts
        # the routed experts' parameters in routed_now just before accelerate's hook asks.
        self.routed = routed or {}
        self.expert_bytes = expert_bytes
        self.routed_now: dict = {}
        self._groups, self._tensors = (), {}
        self._lock = threading.Lock()

    def __getitem__(self, key: str):
        if key in self.installed:
            return self.installed[key]
        if key in self.routed_now:
            return self.routed_now[key]
        source = self.arch.ties.get(key, key) if key not in self.groups_of else key
        groups = self.groups_of[source]
        with self._lock:
            if groups != self._groups:
                tensors = {}
                for g in groups:
                    tensors.update(self.art.read_group(g, dequantize=True))
                    if g.endswith(C.GROUP_EXPERTS_SUFFIX) and self.expert_bytes is not None:
                        n = stored_bytes(self.art.manifest, g)
                        self.expert_bytes.add(n, n, True)       # no routing known: whole
                self._tensors = self.arch.to_model(tensors, where=str(self.art.path))
                self._groups = groups
            tensor = self._tensors[source]
        return tensor.to(self.dtype) if self.dtype is not None and \
            tensor.is_floating_point() else tensor

    def __iter__(self):
        return iter(set(self.groups_of) | set(self.installed))

    def __len__(self) -> int:
        return len(set(self.groups_of) | set(self.installed))


def _routed_on_disk(art, arch, inst, groups_of: dict, dmap: dict) -> tuple:
    """``({group: RoutedExperts}, ExpertBytes)``: the experts groups whose parameters are all
    on "disk", those read by routing (``lct.loader.experts.plan``; the others' reasons in
    ``ExpertBytes.whole_groups``)."""
    from lct.loader.experts import ExpertBytes, plan
    on_disk: dict = {}
    for name, gs in groups_of.items():
        for g in gs:
            if g.endswith(C.GROUP_EXPERTS_SUFFIX):
                on_disk[g] = on_disk.get(g, True) and device_of(name, dmap) == "disk"
    routed, whole = plan(art, arch, arch.model, inst.shapes, inst.dtypes,
                         [g for g, disk in on_disk.items() if disk])
    return routed, ExpertBytes(whole_groups=whole)


def _hook_routed(model, weights: ArtifactWeights) -> None:
    """A pre-hook on each routed experts module left on "disk": it reads the experts the
    call's ``top_k_index`` names (``RoutedExperts.read``) into ``weights.routed_now`` before
    accelerate's hook (inside the module's forward, after torch's pre-hooks) asks for the
    module's parameters; a forward hook lets them go after it."""
    for routed in weights.routed.values():
        module = model.get_submodule(routed.module_path)

        def pre(module, args, kwargs, routed=routed):
            weights.routed_now = routed.read_call(args, kwargs, bytes_=weights.expert_bytes)

        def post(module, args, output):
            weights.routed_now = {}
        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post)


def groups_filling(arch, manifest) -> dict:
    """``{model name: tuple of groups}``: the artifact groups whose tensors fill each parameter
    of the model (one for a renamed tensor, the experts' group for fused experts), and for a
    tied parameter the artifact does not store, those of the one it is tied to."""
    out: dict = {}
    for t in manifest.tensors.values():
        if arch.target(t.name)[0] is None:
            continue
        for name in arch.filled([t.name]):
            if t.group not in out.setdefault(name, ()):
                out[name] += (t.group,)
    for tied, real in arch.ties.items():
        if tied not in out and real in out:
            out[tied] = out[real]
    return out


def _device(value, what: str, option: str):
    """A device of a map or a ``max_memory`` key as accelerate takes it: ``"cpu"``,
    ``"disk"`` or a CUDA index (``0``, ``"cuda"``, ``"cuda:1"``); refused clearly otherwise,
    and a CUDA device where this torch has none."""
    import torch
    if isinstance(value, torch.device):
        value = str(value)
    if isinstance(value, str) and value in ("cpu", "disk"):
        return value
    index = value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(value, str) and value.partition(":")[0] == "cuda":
        rest = value.partition(":")[2]
        index = int(rest) if rest.isdigit() else 0 if not rest else None
    if index is None or index < 0:
        raise LCTError(f"{what}: device {value!r} is not 'cpu', 'disk' or a CUDA device "
                       f"('cuda:N' or N)", option=option)
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise LCTError(f"{what}: device {value!r}: this machine has "
                       f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} "
                       f"CUDA device(s); use 'cpu' or 'disk'", option=option)
    return index


def check_max_memory(max_memory) -> dict | None:
    """``max_memory`` as accelerate takes it, ``{device: bytes}``: sizes parsed ("8GiB",
    "500MB" or bytes), devices checked. A ``"disk"`` entry is dropped: disk here is the
    artifact itself, never written, so it has no budget."""
    from lct.units import parse_size
    if max_memory is None:
        return None
    if not isinstance(max_memory, Mapping):
        raise LCTError(f"max_memory must be a dict of device to size, such as "
                       f"{{'cpu': '8GiB'}}, got {type(max_memory).__name__} {max_memory!r}",
                       option="max_memory")
    out = {}
    for key, size in max_memory.items():
        device = _device(key, "max_memory", "max_memory")
        if isinstance(size, bool) or not isinstance(size, (int, str)):
            raise LCTError(f"max_memory[{key!r}] = {size!r}: expected a size such as '8GiB' or "
                           f"a number of bytes", option="max_memory")
        nbytes = parse_size(size, f"max_memory[{key!r}]", option="max_memory")
        if device != "disk":
            out[device] = nbytes
    if not out:
        raise LCTError("max_memory names no device to place modules on (only 'disk'); give "
                       "'cpu' or a CUDA device a size", option="max_memory")
    return out


def _one_device(device_map) -> bool:
    """Whether ``device_map`` names one device for the whole model (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``, a ``torch.device``), as ``from_pretrained`` takes it."""
    import re
    if type(device_map).__name__ == "device":
        return True
    return isinstance(device_map, str) and device_map not in AUTO_MAPS and \
        re.fullmatch(r"cpu|cuda(:[0-9]+)?", device_map) is not None


def resolve(model, device_map, max_memory=None, dtype=None) -> dict:
    """``{module name: device}`` for ``model`` (on the meta device): accelerate computes the
    ``"auto"`` forms from ``max_memory``; an explicit map is checked to name modules of the
    model, devices that exist, and to cover every parameter."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map
    no_split = getattr(model, "_no_split_modules", None) or []
    max_memory = check_max_memory(max_memory)
    if _one_device(device_map):     # from_pretrained's "cpu", "cuda:0": the whole model there
        device_map = {"": str(device_map)}
    if isinstance(device_map, str):
        # Tied as the model ties (the loader ties again once the weights are in): accelerate
        # keeps a table and its tied head together, and says nothing about untied weights.
        model.tie_weights()
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
    if max_memory is not None:
        raise LCTError("max_memory goes with device_map='auto' (or another automatic map); an "
                       "explicit map places every module itself", option="max_memory")
    modules = dict(model.named_modules())
    dmap = {}
    for key, value in device_map.items():
        if not isinstance(key, str) or key not in modules:
            top = ", ".join(repr(n) for n in list(modules)[1:4])
            raise LCTError(f"device_map names {key!r}, which is not a module of the model "
                           f"(its modules start {top}; '' is the whole model)",
                           option="device_map")
        dmap[key] = _device(value, f"device_map[{key!r}]", "device_map")
    for name, _ in model.named_parameters():
        if device_of(name, dmap) is None:
            raise LCTError(f"device_map places no module above parameter {name!r}",
                           option="device_map")
    return disjoint(model, dmap)


def disjoint(model, dmap: dict) -> dict:
    """``dmap`` with no entry inside another (accelerate's dispatch needs that: a module on
    the CPU with a child on "disk" failed in it, for from_pretrained too): an entry with
    entries below it gives way to its children and its own parameters and buffers, each on
    its device unless an entry below names another. Every parameter keeps the device of its
    nearest entry, as ``device_of`` reads the map given."""
    out = dict(dmap)
    while True:
        split = next((k for k in out if any(o != k and (k == "" or o.startswith(k + "."))
                                            for o in out)), None)
        if split is None:
            return out
        device = out.pop(split)
        module = model.get_submodule(split) if split else model
        at = f"{split}." if split else ""
        for name, _ in module.named_children():
            out.setdefault(at + name, device)
        for name, _ in list(module.named_parameters(recurse=False)) + \
                list(module.named_buffers(recurse=False)):
            out.setdefault(at + name, device)


def device_of(name: str, dmap: dict):
    """The device of parameter ``name``: that of its nearest enclosing module in ``dmap``."""
    parts = name.split(".")
    for k in range(len(parts), -1, -1):
        key = ".".join(parts[:k])
        if key in dmap:
            return dmap[key]
    return None


def load_mapped(path, device_map, options=None, *, max_memory=None, stats=None):
    """Load ``path`` placing its modules as ``device_map`` says (see the module docstring),
    with ``options`` (a ``LoadOptions``; its ``device`` is the map's to give).

    Returns:
        The model in eval mode, dispatched with accelerate's hooks when it spans more than one
        device or has modules on ``"disk"`` (the artifact stays open for those).
    """
    import torch
    from accelerate import dispatch_model

    from lct.loader.build import build_skeleton
    from lct.loader.install import Installer, install_all
    from lct.loader.source import LoadOptions, LoadStats, stored_dtype
    options = options or LoadOptions()
    dtype, nf4 = options.dtype, options.nf4
    stats = stats if stats is not None else LoadStats()
    t0 = time.perf_counter()
    art = options.open(path)
    closing = True
    try:
        # The skeleton in the dtype the weights have (build_skeleton's default): accelerate
        # casts what it fetches for a "disk" module to the placeholder's dtype.
        arch = build_skeleton(art, dtype)
        model = arch.model
        dmap = resolve(model, device_map, max_memory, dtype or stored_dtype(art))
        devices = set(dmap.values())
        offloading = len(devices) > 1 or "disk" in devices
        from lct.format.encodings import is_lossy
        lossy = [t.name for t in art.manifest.tensors.values() if is_lossy(t.encoding)]
        if offloading and nf4 == "keep" and lossy:
            nf4 = "dequantize"   # accelerate's hooks move plain parameters only
            stats.notes.append(f"{len(lossy)} lossy table(s) dequantized: with modules "
                               f"offloaded, every module holds plain weights")
        groups_of = groups_filling(arch, art.manifest)
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        # A group is read at load when a parameter it fills (or a parameter tied to one it
        # fills) is on a device other than "disk".
        needed = {g for name, gs in groups_of.items() if name in params
                  and device_of(name, dmap) != "disk" for g in gs}
        read = [g for g in art.groups if g in needed]
        if len(read) < len(art.groups):
            stats.notes.append(f"{len(read)} of {len(art.groups)} groups read at load; the rest "
                               f"stay in the artifact until their modules run")
        if not read:
            stats.notes.append("every module is on 'disk': each forward reads the whole model "
                               "from the artifact")
        inst = Installer(arch, art, device="cpu", dtype=dtype, nf4=nf4)
        from lct.io.stream import GroupStream
        from lct.loader.build import cache_hit, fill_later
        hit = cache_hit(art, options.cache, stats)
        with GroupStream(art, read, prefetch=options.prefetch, cached=hit) as groups:
            for group in groups:
                install_all(inst, [group], stats)
            s = groups.stats
        left = {name for name, gs in groups_of.items() if not set(gs) & needed}
        inst.finish(streamed=left)
        stats.take_stream(s)
        fill_later(art, options.cache, hit, stats)      # no entry: kept for the next start
        if offloading:
            installed = {n: p for n, p in model.state_dict(keep_vars=True).items()
                         if p.device.type != "meta"}
            routed, expert_bytes = _routed_on_disk(art, arch, inst, groups_of, dmap)
            weights = ArtifactWeights(art, arch, groups_of, dtype, installed, routed,
                                      expert_bytes)
            model = dispatch_model(model, dmap, state_dict=weights, offload_index={})
            _hook_routed(model, weights)
            model.lct_expert_bytes = expert_bytes
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
