"""Installing decoded tensors into a model built on the meta device: ``Installer`` puts each
decoded group's tensors in under the model's names (transformers' renames and converters
applied, ``lct.arch``), as zero-copy views of the decoded chunks on the CPU or copied to a CUDA
device, keeps a lossy table in the modules of its encoding's kernels (or dequantizes it), ties
what the model ties and refuses a partial model; ``install_maximus`` swaps the input embedding
for a ``MaximusEmbedding`` over the artifact's shard state. Used by the streaming loader
(``build``), the layer-wise model and device maps."""

from __future__ import annotations

import time

from lct.errors import ArchitectureError, LCTError


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
    """Installs decoded groups into a meta-initialised model; lossy tables kept in their
    encoding's modules (``nf4="keep"``, where kernels are registered for it) or dequantized."""

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

    def put(self, tensors: dict) -> None:
        """Install ``{model name: tensor}`` already converted to the model's names, shapes and
        dtypes (the routed experts' parameters, ``lct.loader.experts``) on the target device."""
        for full, t in tensors.items():
            _set(self.model, full, self._to_device(t))
        self.synchronize()

    def install(self, group) -> None:
        """Install every tensor of a decoded group, under the model's names (transformers'
        renames and converters applied, ``lct.arch``)."""
        from lct.io.reader import QUANTIZED
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
                # kept encoded where kernels compute on its encoding, else dequantized (the
                # kernels are imported only here: a load of plain weights never needs them)
                from lct.kernels import has_kernels
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
        """Whether the module owning ``full`` can become a lossy encoding's module: a plain
        embedding or linear layer (Gemma's scaled embedding too), not one with modules or
        parameters of its own beside its weight and bias (Inkling's embedding holds a norm):
        such a table is dequantized into it instead."""
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


def install_all(inst: Installer, held: list, stats) -> None:
    """Install and let go of the ``held`` groups, oldest first, adding the time to
    ``stats.install_s`` (a ``LoadStats``)."""
    t = time.perf_counter()
    while held:
        inst.install(held.pop(0))
    stats.install_s += time.perf_counter() - t
