"""The layer-wise executor: run a model larger than memory with only the embedding, the final norm,
the head and the prefetch window of transformer layers resident.

Every forward pass streams the layer groups in order with ``prefetch`` of them decoding ahead
(compression stays on: AirLLM prefetches one layer and turns prefetch off when compressed). A
layer's weights are installed just before its forward and dropped right after, so at most
``prefetch + 1`` layers are resident at any time. The logits equal those of the fully loaded
model, because the weights are the same bytes.
"""

from __future__ import annotations

from lct.errors import LCTError
from lct.format import constants as C
from lct.io.stream import GroupStream
from lct.loader.build import Installer, _is_cuda, build_skeleton, check_device
from lct.loader.source import open_source, param_name


def _common_module(names: list) -> str:
    parts = [n.split(".")[:-1] for n in names]
    prefix = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        prefix.append(items[0])
    return ".".join(prefix)


class LayerwiseModel:
    """A transformers model whose decoder layers stream from the artifact on every forward.

    Use ``model(...)``/``generate(...)`` as with the model itself (``.model`` is the wrapped
    ``PreTrainedModel``); close it (or use ``with``) to release the artifact.

    Example:
        >>> with LayerwiseModel("big.lct", prefetch=2) as lm:
        ...     out = lm.generate(ids, max_new_tokens=8)
    """

    def __init__(self, path, prefetch: int = 2, device="cpu", dtype=None, nf4: str = "keep",
                 workers: int | None = None, *, verify: bool = True, pad_ids=None,
                 stream: bool = False):
        import torch

        check_device(device)
        self.art = open_source(path, verify=verify, workers=workers, stream=stream,
                               pin_memory=_is_cuda(device))
        self.prefetch = prefetch
        try:
            self.model = build_skeleton(self.art, dtype)
            self.installer = Installer(self.model, self.art, device=device, dtype=dtype, nf4=nf4,
                                       pad_ids=pad_ids)
            self.layer_groups = [g for g in self.art.groups if g.startswith(C.GROUP_LAYER_PREFIX)]
            resident = [g for g in self.art.groups if g not in self.layer_groups]
            with GroupStream(self.art, resident, prefetch=prefetch) as stream:
                for group in stream:
                    self.installer.install(group)
            self._modules = {}
            self._placeholders = {}
            streamed: set = set()
            for g in self.layer_groups:
                names = [param_name(self.model, t.name, self.installer.names)
                         for t in self.art.manifest.group_tensors(g)]
                if None in names:
                    raise LCTError(f"{self.art.path}: group {g} has tensors the model does not have")
                module = self.model.get_submodule(_common_module(names))
                self._modules[g] = module
                # Zero-element stand-ins on the target device: they hold no memory, and
                # model.device (generate() uses it) stays the real device, not meta.
                self._placeholders[g] = {
                    n: torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=self.installer.device),
                                          requires_grad=False)
                    for n, p in module.named_parameters()}
                streamed.update(names)
                self._release(g)
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
            for g, module in self._modules.items():
                self._hooks.append(module.register_forward_pre_hook(self._make_pre(g)))
                self._hooks.append(module.register_forward_hook(self._make_post(g)))
            self.model.eval()
        except BaseException:
            self.close()
            raise

    # Hooks ----------------------------------------------------------------------------------
    def _start(self, module, args, kwargs):
        self._close_stream()
        self._stream = GroupStream(self.art, self.layer_groups, prefetch=self.prefetch)
        self._expected = 0

    def _end(self, module, args, kwargs, output):
        self._close_stream()

    def _close_stream(self):
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _make_pre(self, g: str):
        def pre(module, args):
            if self._stream is None:
                raise LCTError("layer-wise model: a layer ran outside a model forward")
            group = next(self._stream)
            if group.name != g:
                raise LCTError(f"layer-wise model: expected group {g}, the stream gave "
                               f"{group.name}; layers must run in order")
            self.installer.install(group)
            self.resident_layers += 1
            self.max_resident_layers = max(self.max_resident_layers,
                                           self.resident_layers + len(self._stream._pending))
            self.layers_streamed += 1
        return pre

    def _release(self, g: str) -> None:
        module = self._modules[g]
        for name, placeholder in self._placeholders[g].items():
            mod_path, _, leaf = name.rpartition(".")
            (module.get_submodule(mod_path) if mod_path else module)._parameters[leaf] = placeholder

    def _make_post(self, g: str):
        def post(module, args, output):
            self._release(g)
            self.resident_layers -= 1
        return post

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
