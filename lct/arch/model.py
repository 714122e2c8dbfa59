"""An architecture as LCT needs it, read from the model transformers builds (never from a table
kept by hand): its layer stacks, the input and output embeddings, the ties, the final norm (and
whether it stores ``w - 1``), the routed experts, and how each checkpoint tensor becomes a
parameter of the built model.

Example:
    >>> arch = Architecture.from_folder("path/to/model")
    >>> arch.place("model.layers.3.block_sparse_moe.experts.0.w1.weight")
    ('layers.3.experts', 'layer')
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lct.arch import hf
from lct.errors import ArchitectureError
from lct.format import constants as C

EXPERTS_MODULE = C.EXPERTS_MODULE


@dataclass(frozen=True)
class Stack:
    """One list of transformer blocks (a decoder, an encoder, a vision tower)."""

    path: str           # the ModuleList's path in the built model
    prefix: str         # its groups' name prefix: "layers." for the text decoder, else path + "."
    count: int
    block: str          # the class name of its blocks

    def group(self, index: int, experts: bool = False) -> str:
        """The group of block ``index`` (its routed experts have a group of their own)."""
        return f"{self.prefix}{index}{C.GROUP_EXPERTS_SUFFIX if experts else ''}"


@dataclass
class Experts:
    """The routed experts of a mixture-of-experts model."""

    count: int           # experts per layer
    active: int | None   # experts a token is routed to (None when the model does not say)
    layers: int          # layers that have them

    def to_dict(self) -> dict:
        return {"count": self.count, "active": self.active, "layers": self.layers}


@dataclass
class Architecture:
    """What LCT needs to know of a model, taken from the model built on the meta device."""

    model: object                   # the built model (parameters on meta)
    stacks: list
    embed: str | None               # parameter name of the input embedding's weight
    head: str | None                # of the output embedding (None: no head)
    ties: dict                      # {tied parameter: parameter}, as the model ties them
    final_norm: str | None          # module path of the norm before the head
    plus_one: bool                  # the final norm scales by (1 + weight)
    experts: Experts | None
    # transformers' transforms for this model, its state dict (names -> meta tensors), the
    # names of its embedding tables and norm modules; checkpoint names already looked up
    _renamings: list | None = field(default=None, repr=False)
    _converters: list | None = field(default=None, repr=False)
    _meta: dict = field(default_factory=dict, repr=False)
    _embeddings: set = field(default_factory=set, repr=False)
    _norms: set = field(default_factory=set, repr=False)
    _targets: dict = field(default_factory=dict, repr=False)

    @property
    def class_name(self) -> str:
        return type(self.model).__name__

    @property
    def text_config(self):
        """The config of the text model (the whole config for a text-only model)."""
        cfg = self.model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    @property
    def main(self) -> Stack | None:
        """The text decoder's stack (groups ``layers.N``)."""
        return next((s for s in self.stacks if s.prefix == C.GROUP_LAYER_PREFIX), None)

    @classmethod
    def from_config(cls, config, model_class=None, dtype=None, names=None,
                    tensor_parallel: int | None = None) -> "Architecture":
        """The architecture of ``config``: built with ``model_class`` (default: the first of
        ``hf.candidate_classes`` that takes every tensor in ``names``, the checkpoint's tensor
        names; without them, the first candidate), tensor-parallel over ``tensor_parallel``
        ranks when given (``hf.build_meta``)."""
        classes = [model_class] if model_class is not None else hf.candidate_classes(config)
        if not classes:
            raise ArchitectureError(
                f"transformers {hf.version()} has no model class for model type "
                f"{config.model_type!r} (architectures {getattr(config, 'architectures', None)}); "
                f"LCT builds models with transformers and runs no custom code")
        first = first_error = None
        for klass in classes:
            try:
                arch = cls.from_model(hf.build_meta(klass, config, dtype, tensor_parallel))
            except ArchitectureError as e:
                first_error = first_error or e
                continue
            if names is None or not arch.foreign(names):
                return arch
            first = first or arch
        if first is None:
            raise first_error
        return first        # no class takes every tensor: the likeliest, to say which not

    @classmethod
    def from_folder(cls, folder, model_class=None, dtype=None, names=None) -> "Architecture":
        """The architecture of the ``config.json`` in ``folder``."""
        return cls.from_config(hf.read_config(folder), model_class, dtype, names)

    @classmethod
    def from_model(cls, model) -> "Architecture":
        """The architecture of a built model."""
        import torch
        modules = dict(model.named_modules())
        names = {id(m): n for n, m in modules.items()}
        stacks = _stacks(model, modules)
        embed_mod = model.get_input_embeddings() if _has(model, "get_input_embeddings") else None
        head_mod = model.get_output_embeddings() if _has(model, "get_output_embeddings") else None
        embed = _weight(names, embed_mod)
        head = _weight(names, head_mod)
        main = next((s for s in stacks if s.prefix == C.GROUP_LAYER_PREFIX), None)
        norm = _final_norm(modules, main)
        plus_one = _plus_one(modules[norm]) if norm is not None else False
        experts = _experts(modules, stacks)
        return cls(model, stacks, embed, head, hf.tied_keys(model), norm, plus_one, experts,
                   None, None, dict(model.state_dict(keep_vars=True)),
                   {n + ".weight" for n, m in modules.items() if isinstance(m, torch.nn.Embedding)},
                   {n for n, m in modules.items() if _is_norm(m)})

    # Checkpoint names -----------------------------------------------------------------------
    def target(self, key: str) -> tuple:
        """``(model name or None, converter pattern or None)`` of checkpoint tensor ``key``:
        the parameter (or buffer) of the built model it fills, after transformers' renames and
        converters; None when the model has no place for it."""
        hit = self._targets.get(key)
        if hit is None:
            if key in self._meta:       # the model's own name (most checkpoints: no transform)
                hit = self._targets[key] = (key, None)
                return hit
            if self._renamings is None:     # looked up on first need: building them compiles
                self._renamings, self._converters = hf.conversions(self.model)  # many regexes
            name, pattern = hf.rename_key(key, self._renamings, self._converters,
                                          self.model.base_model_prefix, self._meta)
            hit = self._targets[key] = (name if name in self._meta else None, pattern)
        return hit

    def to_model(self, tensors: dict, where: str = "") -> dict:
        """``{model name: tensor}`` from checkpoint ``{name: tensor}`` (one group): renamed
        tensors pass as they are (zero-copy), the ones a converter takes (experts stored one
        by one, fused by the model) are converted as ``from_pretrained`` converts them; a
        converter's inputs must all be in ``tensors``. Tensors the model does not take are
        left out (``foreign`` says which of those matter)."""
        out: dict = {}
        pending: dict = {}
        for key in sorted(tensors, key=hf.natural_key):
            name, pattern = self.target(key)
            if name is None:
                continue
            t = tensors[key]
            if pattern is None:
                out[name] = t
                continue
            if not hasattr(t, "is_floating_point"):      # NF4/int8: converters need values
                t = t.dequantize()
            conv = pending.get(name)
            if conv is None:
                conv = pending[name] = hf.new_converter(self._pattern_converter(pattern))
            hf.add_source(conv, name, key, pattern, t)
        for name, conv in pending.items():
            try:
                out.update(hf.run_converter(conv, name, self.model))
            except Exception as e:  # noqa: BLE001 - a converter's failure, named once
                raise ArchitectureError(f"{where}: transformers could not convert the stored "
                                        f"tensors of {name!r} ({e})") from e
        return out

    def _pattern_converter(self, pattern: str):
        return next(c for c in self._converters or () if pattern in c.source_patterns)

    def foreign(self, keys) -> list:
        """The checkpoint tensors among ``keys`` the model neither takes nor may ignore."""
        ignore = hf.ignored_patterns(self.model)[1]
        return [k for k in keys if self.target(k)[0] is None
                and not any(re.search(p, k) for p in ignore)]

    def filled(self, keys) -> set:
        """The model names the checkpoint tensors ``keys`` fill: each renamed tensor's, and
        every parameter a converter makes of them (``q, k, v`` of a fused ``qkv`` too)."""
        out = set()
        for k in keys:
            name, pattern = self.target(k)
            if name is None:
                continue
            out.add(name)
            if pattern is not None:
                targets = hf.target_patterns(self._pattern_converter(pattern))
                out.update(name.replace(targets[0], t) for t in targets[1:])
        return out

    def unfilled(self, keys) -> list:
        """The parameters of the model that neither a checkpoint tensor among ``keys`` fills nor
        a tie does, and that the model does not allow a checkpoint to lack: a load of ``keys``
        would leave them empty."""
        have = self.filled(keys)
        may_lack = hf.ignored_patterns(self.model)[0]
        out = []
        for name, _ in self.model.named_parameters(remove_duplicate=False):
            if name in have or (name in self.ties and self.ties[name] in have):
                continue
            if any(re.search(p, name) for p in may_lack):
                continue
            out.append(name)
        return out

    def misfits(self, shapes: dict) -> list:
        """What keeps stored tensors ``{name: shape}`` from filling this model exactly, one
        line each (empty when they do): a tensor the model has no place for (and may not
        ignore), a tensor of another shape than its parameter, a parameter no tensor fills."""
        out = [f"stored tensor {k!r}: {self.class_name} has no parameter for it"
               for k in self.foreign(shapes)]
        for k, shape in shapes.items():
            name, pattern = self.target(k)
            if name is not None and pattern is None and \
                    tuple(self._meta[name].shape) != tuple(shape):
                out.append(f"stored tensor {k!r} is {list(shape)}, but config.json builds "
                           f"{list(self._meta[name].shape)} for {self.class_name}'s {name!r}")
        out += [f"parameter {n!r} of {self.class_name}: no stored tensor fills it"
                for n in self.unfilled(shapes)]
        return out

    def blocks_disagree(self, names) -> tuple | None:
        """``(stack path, blocks the config builds, blocks the checkpoint holds)`` of the first
        stack for which the checkpoint ``names`` hold another number of blocks than the config
        builds (a ``num_hidden_layers`` that is not the weights'); None when none does."""
        import re
        for s in self.stacks:
            pat = re.compile(re.escape(s.path) + r"\.(\d+)\.")
            held = [int(m.group(1)) for n in names
                    for m in [pat.search(self.target(n)[0] or n)] if m]
            if held and max(held) + 1 != s.count:
                return s.path, s.count, max(held) + 1
        return None

    def place(self, key: str) -> tuple:
        """``(group, role)`` of checkpoint tensor ``key`` (docs/FORMAT.md section 4)."""
        return self.place_param(self.target(key)[0])

    def place_param(self, name: str | None) -> tuple:
        """``(group, role)`` of the model's parameter (or buffer) ``name``."""
        if name is None:
            return C.GROUP_MISC, "misc"
        if name == self.embed:
            return C.GROUP_EMBED, "embed"
        if name == self.head:
            return C.GROUP_HEAD, "head"
        for s in self.stacks:
            if name.startswith(s.path + "."):
                index, _, rest = name[len(s.path) + 1:].partition(".")
                routed = f".{EXPERTS_MODULE}." in f".{rest}"
                return s.group(int(index), routed and self.experts is not None), "layer"
        if name in self._embeddings:
            return C.GROUP_EMBED, "pos_embed"
        if name.rpartition(".")[0] in self._norms:
            return C.GROUP_NORM, "norm"
        return C.GROUP_MISC, "misc"

    def group_order(self, groups) -> list:
        """``groups`` in load order: embed, the blocks of each stack (the text decoder's last,
        each block's experts after it), norm, head, misc."""
        rank = {C.GROUP_EMBED: (0, 0, 0, 0)}
        for k, s in enumerate(self.stacks):
            for i in range(s.count):
                rank[s.group(i)] = (1, k, i, 0)
                rank[s.group(i, True)] = (1, k, i, 1)
        rank.update({C.GROUP_NORM: (2, 0, 0, 0), C.GROUP_HEAD: (3, 0, 0, 0)})
        return sorted(set(groups), key=lambda g: rank.get(g, (4, 0, 0, 0)))

    def final_norm_keys(self, keys) -> dict:
        """``{"weight"/"bias": checkpoint name}`` of the final norm among ``keys``."""
        if self.final_norm is None:
            return {}
        out = {}
        for k in keys:
            name = self.target(k)[0]
            if name in (f"{self.final_norm}.weight", f"{self.final_norm}.bias"):
                out[name.rpartition(".")[2]] = k
        return out

    def checkpoint_ties(self, keys) -> dict:
        """``{tied model parameter: checkpoint name of the tensor it is tied to}`` for the ties
        whose target the checkpoint ``keys`` lack (or hold as a copy: see the converter)."""
        by_target = {}
        for k in keys:
            name = self.target(k)[0]
            if name is not None and self.target(k)[1] is None:
                by_target.setdefault(name, k)
        return {tied: by_target[src] for tied, src in self.ties.items() if src in by_target}

    def summary(self) -> dict:
        """The manifest's informative ``architecture`` facts (docs/FORMAT.md section 2)."""
        out = {"class": self.class_name,
               "stacks": [{"path": s.path, "group_prefix": s.prefix, "blocks": s.count}
                          for s in self.stacks]}
        if self.experts is not None:
            out["experts"] = self.experts.to_dict()
        return out


def _has(model, attr: str) -> bool:
    try:
        getattr(model, attr)
        return True
    except (AttributeError, NotImplementedError):
        return False


def _weight(names: dict, module) -> str | None:
    """The parameter name of ``module.weight`` in the model, or None."""
    if module is None or getattr(module, "weight", None) is None or id(module) not in names:
        return None
    path = names[id(module)]
    return f"{path}.weight" if path else "weight"


def _stacks(model, modules: dict) -> list:
    """The layer stacks: the ModuleLists of the block classes ``_no_split_modules`` names (not
    one inside another's blocks); without such classes, ModuleLists of repeated modules. The
    text decoder is the last stack whose parent holds an embedding table (else the last)."""
    import torch
    blocks = hf.no_split_classes(model)

    def lists(accept):
        found = []
        for name, m in modules.items():
            if not isinstance(m, torch.nn.ModuleList) or not len(m) or not name:
                continue
            if any(name.startswith(p + ".") for p, _ in found) or not accept(m):
                continue
            found.append((name, m))
        return found
    found = lists(lambda m: any(type(c).__name__ in blocks for c in m))
    if not found:
        found = lists(lambda m: len({type(c) for c in m}) == 1 and
                      any(True for _ in m[0].parameters()) and
                      not m[0].__class__.__name__.endswith(("Expert", "Experts", "MLP")))
    if not found:
        return []

    def has_table(path):
        parent = modules[path.rpartition(".")[0]] if "." in path else model
        return any(isinstance(c, torch.nn.Embedding) for c in parent.children())
    main = next((n for n, _ in reversed(found) if has_table(n)), found[-1][0])
    return [Stack(n, C.GROUP_LAYER_PREFIX if n == main else f"{n}.", len(m),
                  type(m[0]).__name__) for n, m in found]


def _is_norm(m) -> bool:
    import torch
    return isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)) or \
        "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None),
                                                          torch.nn.Parameter)


def _final_norm(modules: dict, main: Stack | None) -> str | None:
    """The norm applied before the head: a norm module beside the text decoder's stack."""
    if main is None:
        return None
    parent = main.path.rpartition(".")[0]
    for name, m in modules.items():
        if name.rpartition(".")[0] == parent and name != main.path and _is_norm(m) and \
                not isinstance(getattr(m, "weight", None), type(None)):
            return name
    return None


def _plus_one(module) -> bool:
    """Whether ``module`` (a norm) scales by ``1 + weight`` (Gemma's RMSNorm): run on a real
    copy with a zero weight, such a norm still passes its input through."""
    import copy

    import torch
    try:
        probe = copy.deepcopy(module).to_empty(device="cpu").float()
        with torch.no_grad():
            for p in probe.parameters():
                p.zero_()
            dim = probe.weight.shape[-1]
            x = torch.linspace(-1, 1, 2 * dim).reshape(1, 2, dim)
            out = probe(x)
        out = out[0] if isinstance(out, tuple) else out
        return bool(out.abs().max() > 1e-3)
    except Exception:  # noqa: BLE001 - a norm that cannot run alone is taken as plain
        return False


def _experts(modules: dict, stacks: list) -> Experts | None:
    """The routed experts: modules named ``experts`` inside the blocks, their count (the
    module's ``num_experts``, the leading dimension of its fused weights, or its length) and
    the experts per token (a ``top_k`` or ``num_experts_per_tok`` of the block)."""
    count = active = None
    layers = 0
    for s in stacks:
        for i in range(s.count):
            block = f"{s.path}.{i}"
            found = [(n, m) for n, m in modules.items()
                     if n.startswith(block + ".") and n.rpartition(".")[2] == EXPERTS_MODULE]
            if not found:
                continue
            layers += 1
            if count is None:
                _, m = found[0]
                count = getattr(m, "num_experts", None)
                if not isinstance(count, int):
                    count = len(m) if hasattr(m, "__len__") else next(
                        (p.shape[0] for p in m.parameters(recurse=False) if p.dim() == 3), None)
                for n, sub in modules.items():
                    if n.startswith(block + "."):
                        k = getattr(sub, "top_k", None) or getattr(sub, "num_experts_per_tok",
                                                                   None)
                        if isinstance(k, int) and not isinstance(k, bool):
                            active = k
                            break
    if count and active and active > count:
        raise ArchitectureError(f"the config routes each token to {active} experts "
                                f"(num_experts_per_tok or top_k) of the {count} each layer "
                                f"has: no model can run so (generate fails in its router)")
    return Experts(count, active, layers) if count else None
