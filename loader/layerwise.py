"""The layer-wise executor: run a model larger than memory with only the embedding, the final norm,
the head and the prefetch window of transformer layers resident.

Every forward pass streams the layer groups in order with ``prefetch`` of them decoding ahead
(compression stays on: AirLLM prefetches one layer and turns prefetch off when compressed). A
layer's weights are installed just before its forward and dropped right after, so at most
``prefetch + 1`` layers are resident at any time. The logits equal those of the fully loaded
model, because the weights are the same bytes. Where the decoded cache holds the artifact
(``lct cache fill``, or an earlier ``lct.load``; ``cache=`` / ``LCT_CACHE``), the layers are
mapped from it instead of read and decoded.

A mixture of experts' block reads only the experts its tokens are routed to, when the router has
chosen (``lct.loader.experts``; not prefetched), where LCT can know the routing, and its whole
experts group otherwise; ``expert_stats`` counts the expert bytes read against all of them.
"""

from __future__ import annotations

from lct.errors import LCTError
from lct.io.stream import DEFAULT_PREFETCH, GroupStream
from lct.loader.build import build_skeleton, cache_hit, check_device, fill_later
from lct.loader.experts import stored_bytes
from lct.loader.install import Installer
from lct.loader.source import LoadOptions


class LayerwiseModel:
    """A transformers model whose decoder layers stream from the artifact on every forward.

    Use ``model(...)``/``generate(...)`` as with the model itself (``.model`` is the wrapped
    ``PreTrainedModel``); close it (or use ``with``) to release the artifact.

    Example:
        >>> with LayerwiseModel("big.lct", prefetch=2) as lm:
        ...     out = lm.generate(ids, max_new_tokens=8)
    """

    def __init__(self, path, prefetch: int = DEFAULT_PREFETCH, device="cpu", dtype=None,
                 nf4: str = "keep", workers: int | None = None, *, verify: bool = True,
                 pad_ids=None, stream: bool = False, expect: str | None = None,
                 page_cache: str = "keep", cache: bool | None = None):
        import torch

        # page_cache "keep" by default: every forward reads the layers again.
        options = LoadOptions(prefetch=prefetch, device=device, dtype=dtype, nf4=nf4,
                              workers=workers, verify=verify, stream=stream, expect=expect,
                              pad_ids=pad_ids, page_cache=page_cache, cache=cache)
        device, dtype = options.device, options.dtype
        check_device(device)
        self.art = options.open(path)
        self.prefetch = prefetch
        try:
            # a decoded-cache entry: every forward maps the layers instead of decoding them
            self.cached = cache_hit(self.art, options.cache, choose=False)
            arch = build_skeleton(self.art, dtype)
            self.model = arch.model
            if len(arch.stacks) != 1:
                raise LCTError(f"{self.art.path}: layer-wise execution streams one stack of "
                               f"decoder layers; {arch.class_name} has {len(arch.stacks)} "
                               f"({', '.join(s.path for s in arch.stacks) or 'none'}): load it "
                               f"whole (lct.load) or with a device map")
            self.installer = Installer(arch, self.art, device=device, dtype=dtype, nf4=nf4,
                                       pad_ids=pad_ids)
            stack = arch.stacks[0]
            # A block's groups: its own and, for a mixture of experts, its experts' group.
            units: dict = {}
            for g in self.art.groups:
                for t in self.art.manifest.group_tensors(g):
                    name = arch.target(t.name)[0]
                    if name is not None and name.startswith(stack.path + "."):
                        index = int(name[len(stack.path) + 1:].partition(".")[0])
                        units.setdefault(index, [])
                        if g not in units[index]:
                            units[index].append(g)
            # A block's routed experts are read by the router's choice where LCT can know it
            # (lct.loader.experts): those groups leave the stream, each read in its experts
            # module's pre-hook; the others stream whole, as the block's own group does.
            from lct.loader.experts import ExpertBytes, plan
            self.routed, whole = plan(self.art, arch, self.model, self.installer.shapes,
                                      self.installer.dtypes,
                                      [g for gs in units.values() for g in gs])
            self.expert_bytes = ExpertBytes(whole_groups=whole)
            self.expert_forwards: list = []     # (read, all) expert bytes of each forward
            self._whole_bytes = {g: stored_bytes(self.art.manifest, g) for g in whole}
            self.layer_groups = [g for i in sorted(units) for g in units[i]
                                 if g not in self.routed]
            self._index_of = {g: i for i, gs in units.items() for g in gs}
            resident = [g for g in self.art.groups
                        if g not in self.layer_groups and g not in self.routed]
            with GroupStream(self.art, resident, prefetch=prefetch, cached=self.cached) as stream:
                for group in stream:
                    self.installer.install(group)
            self._modules = {}
            self._units = {}
            self._placeholders = {}
            streamed: set = set()
            layers = self.model.get_submodule(stack.path)
            for index, groups in sorted(units.items()):
                module = layers[index]
                self._modules[index] = module
                self._units[index] = [g for g in groups if g not in self.routed]
                # Zero-element stand-ins on the target device: they hold no memory, and
                # model.device (generate() uses it) stays the real device, not meta.
                self._placeholders[index] = {
                    n: torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=self.installer.device),
                                          requires_grad=False)
                    for n, p in module.named_parameters()}
                streamed.update(f"{stack.path}.{index}.{n}" for n in self._placeholders[index])
                self._release(index)
            self.installer.finish(streamed)
            if self.installer.device.type != "cpu":
                self.model.to(self.installer.device)  # buffers (rotary tables) follow
            self._stream = None
            self._expected = 0
            self.resident_layers = 0
            self.max_resident_layers = 0
            self.layers_streamed = 0
            self._hooks = [self.model.register_forward_pre_hook(self._start, with_kwargs=True),
                           self.model.register_forward_hook(self._end, with_kwargs=True)]
            for index, module in self._modules.items():
                self._hooks.append(module.register_forward_pre_hook(self._make_pre(index)))
                self._hooks.append(module.register_forward_hook(self._make_post(index)))
            for routed in self.routed.values():
                module = self.model.get_submodule(routed.module_path)
                self._hooks.append(module.register_forward_pre_hook(
                    self._make_experts(routed), with_kwargs=True))
            self.model.eval()
            # no entry: one is kept for the next start, in the background (a miss's fill)
            self.filling = fill_later(self.art, options.cache, self.cached)
        except BaseException:
            self.close()
            raise

    # Hooks ----------------------------------------------------------------------------------
    def _start(self, module, args, kwargs):
        self._close_stream()
        self._stream = GroupStream(self.art, self.layer_groups, prefetch=self.prefetch,
                                   cached=self.cached)
        self._expected = 0
        self._bytes_at = (self.expert_bytes.read, self.expert_bytes.all)

    def _end(self, module, args, kwargs, output):
        self._close_stream()
        read, all_ = self._bytes_at
        self.expert_forwards.append((self.expert_bytes.read - read,
                                     self.expert_bytes.all - all_))

    def _make_experts(self, routed):
        """The pre-hook of a routed experts module: read the experts its ``top_k_index``
        names (every expert when that is not a tensor of indices in range) and install them."""
        def pre(module, args, kwargs):
            self.installer.put(routed.read_call(args, kwargs, self.cached, self.expert_bytes))
        return pre

    def _close_stream(self):
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _make_pre(self, index: int):
        def pre(module, args):
            if self._stream is None:
                raise LCTError("layer-wise model: a layer ran outside a model forward")
            for g in self._units[index]:
                group = next(self._stream)
                if group.name != g:
                    raise LCTError(f"layer-wise model: expected group {g}, the stream gave "
                                   f"{group.name}; layers must run in order")
                self.installer.install(group)
                if g in self._whole_bytes:      # an experts group read whole
                    self.expert_bytes.add(self._whole_bytes[g], self._whole_bytes[g], True)
            self.resident_layers += 1
            st = self._stream
            ahead = {self._index_of[g] for g in st.names[st._next - len(st._pending):st._next]}
            self.max_resident_layers = max(self.max_resident_layers,
                                           self.resident_layers + len(ahead - {index}))
            self.layers_streamed += 1
        return pre

    def _release(self, index: int) -> None:
        module = self._modules[index]
        for name, placeholder in self._placeholders[index].items():
            mod_path, _, leaf = name.rpartition(".")
            (module.get_submodule(mod_path) if mod_path else module)._parameters[leaf] = placeholder

    def _make_post(self, index: int):
        def post(module, args, output):
            self._release(index)
            self.resident_layers -= 1
        return post

    @property
    def expert_stats(self) -> dict:
        """The expert bytes read (``ExpertBytes.to_dict``: stored bytes of the experts chunks
        read against those of every experts group whole, over every forward so far) and
        ``forwards``: ``[read, all]`` of each model forward (one per generated token after
        the prompt's); ``routed_groups``: the experts groups read by routing."""
        out = self.expert_bytes.to_dict()
        out["routed_groups"] = len(self.routed)
        out["forwards"] = [list(f) for f in self.expert_forwards]
        return out

    # Use ------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """``model.generate`` with layers streamed on every step."""
        return self.model.generate(*args, **kwargs)

    def close(self) -> None:
        """Stop any stream, remove the hooks and release the artifact."""
        self._close_stream() if hasattr(self, "_stream") else None
        for h in getattr(self, "_hooks", []):
            h.remove()
        self.art.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
