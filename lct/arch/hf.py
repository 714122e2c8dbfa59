"""What LCT asks of transformers about a model, in one module.

The class a checkpoint was saved from, the model built without memory, its tied weights, its
layer blocks and the checkpoint-to-model conversion (renames, expert fusing) that
``from_pretrained`` applies. Several of these are semi-public in transformers 5 and move between
versions (``conversion_mapping``, ``core_model_loading``, ``all_tied_weights_keys``): every call
LCT makes into them is here (tests/test_architectures.py runs each on every model type), so that
an upgrade breaks in one place. The private calls of other libraries (``get_init_context``'s private flags, torch's
DTensor ``_utils``, huggingface_hub's ``_http``) are wrapped in ``lct.compat``.
"""

from __future__ import annotations

import contextlib

from lct.errors import ArchitectureError

# The Auto mappings tried, in order, when a config names no class transformers has (its
# ``architectures`` are missing or custom code): the first whose model takes every stored
# tensor wins, so a Whisper or T5 checkpoint is not built as the decoder-only causal LM that the
# causal-LM mapping also lists for its model type.
TASK_MAPPINGS = (
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


def version() -> str:
    """The installed transformers version."""
    import transformers
    return transformers.__version__


def read_config(folder):
    """``AutoConfig.from_pretrained(folder)``; an ``ArchitectureError`` naming the file when
    transformers cannot read it."""
    from pathlib import Path

    from transformers import AutoConfig
    from lct.format.jsontext import read_json
    path = Path(folder) / "config.json"
    read_json(path, ArchitectureError)   # under the caps first: transformers' parser recurses
    try:
        return AutoConfig.from_pretrained(folder)
    # Any failure of transformers' parser is the config's (huggingface_hub's strict dataclass
    # errors are bare Exceptions: a "hidden_size": "128" raised one).
    except Exception as e:  # noqa: BLE001
        raise ArchitectureError(f"{path}: transformers cannot read this config "
                                f"({version()}: {_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    """The gist of a library's error in one line: its first line, and the next one too when
    the first only announces it ("Validation error for field 'hidden_size':")."""
    text = [t.strip() for t in str(e).strip().splitlines() if t.strip()]
    if not text:
        return type(e).__name__
    line = text[0] if not text[0].endswith(":") or len(text) < 2 else f"{text[0]} {text[1]}"
    return line[:300]


def class_by_name(name: str):
    """The transformers model class called ``name``, or None."""
    import transformers
    from transformers import PreTrainedModel
    try:
        cls = getattr(transformers, name, None)
    except (ImportError, AttributeError, RuntimeError):   # a lazy module that cannot import
        return None
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedModel) else None


def candidate_classes(config) -> list:
    """The model classes that may build ``config``'s checkpoint, most likely first: the ones its
    ``architectures`` name (what ``save_pretrained`` saved it from), then those of the task
    mappings for its model type (``TASK_MAPPINGS``)."""
    import transformers.models.auto.modeling_auto as auto
    names = list(getattr(config, "architectures", None) or [])
    for mapping in TASK_MAPPINGS:
        name = getattr(auto, mapping, {}).get(config.model_type)
        if isinstance(name, (list, tuple)):
            names += list(name)
        elif name:
            names.append(name)
    out = []
    for name in dict.fromkeys(names):
        cls = class_by_name(name)
        if cls is not None and cls not in out:
            out.append(cls)
    return out


def build_meta(cls, config, dtype=None, tensor_parallel: int | None = None):
    """``cls`` built from ``config`` with its parameters on the meta device (no memory) and real
    buffers (rotary tables), as ``from_pretrained`` builds its skeleton; ``dtype`` defaults to
    the config's. With ``tensor_parallel`` (the world size of the initialised process group)
    it is built as ``from_pretrained(tp_plan="auto")`` builds it: ties made after the weights
    are in, and the model's own tensor-parallel plan applied (DTensor placements, hooks)."""
    try:
        if tensor_parallel:
            return _build_distributed(cls, config, dtype, tensor_parallel)
        with _on_meta():
            model = cls._from_config(config, dtype=dtype) if dtype is not None else \
                cls._from_config(config)
        keep_fp32(model, dtype)
        materialize_buffers(model)
        return model
    except ArchitectureError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the model class raises, named once
        raise ArchitectureError(f"transformers cannot build {cls.__name__} from this config "
                                f"({version()}: {_first_line(e)})") from e


def _build_distributed(cls, config, dtype, world: int):
    from transformers.distributed import DistributedConfig
    from transformers.utils.generic import ContextManagers

    from lct.compat import init_context
    # As from_pretrained: meta device, the dtype, and ties made after the weights are in (a
    # tie made now would hide the head from the plan).
    with ContextManagers(init_context(cls, dtype)):
        model = cls(config)
    keep_fp32(model, dtype)
    dcfg = DistributedConfig(tp_size=world, tp_plan="auto")
    try:        # transformers >= 5.2x: one mesh over every parallel dimension
        from transformers.distributed.utils import initialize_distributed_mesh
    except ImportError:     # earlier 5.x (5.17 on the GPU host of issue 40): the class makes it
        dcfg, _, mesh = cls.prepare_distribute_model(dcfg)
    else:
        _, mesh = initialize_distributed_mesh(dcfg)
    return cls.maybe_distribute_model(model, dcfg, mesh)


@contextlib.contextmanager
def _on_meta():
    """The meta device as ``from_pretrained`` builds under it (``torch.device("meta")``, and
    transformers' ``meta_device_safe_creation_ops`` where it has them): no parameter is ever
    allocated. accelerate's ``init_empty_weights`` allocated each one on the host and moved it
    to meta (57 mmap/munmap pairs, 5 GB of address space, for the Gemma-2B shape), and glibc
    then raised its mmap threshold to the largest of those it freed (8 MB), so that the first
    forward's temporaries stayed in the heap: the load's peak RSS 4 MiB above
    ``from_pretrained``'s (docs/BENCHMARKS.md). Not the whole ``init_context``: ``_from_config``
    sets the dtype and transformers' patches itself, and a single-process skeleton ties at
    construction."""
    import torch
    try:
        from transformers.initialization import meta_device_safe_creation_ops
    except ImportError:     # transformers before it
        meta_device_safe_creation_ops = contextlib.nullcontext
    with torch.device("meta"), meta_device_safe_creation_ops():
        yield


def materialize_buffers(model, device="cpu") -> None:
    """Give every buffer of ``model`` still on the meta device a tensor on ``device`` (one per
    buffer object: a buffer two modules share stays shared) and compute them by the model's
    ``initialize_weights``, outside the dtype context of its construction, as
    ``from_pretrained`` does with the buffers a checkpoint does not hold
    (``_move_missing_keys_from_meta_to_device``, then ``_init_weights``): rotary and sinusoidal
    tables, and what a model computes for its layers in its own init (``FalconH1Model`` sets each
    mixer's ``mup_vector``). On the meta parameters that init costs nothing, and it skips what is
    marked initialised (``_is_hf_initialized``). A load then installs the persistent buffers the
    artifact stores over them; a tensor-parallel load, after its install, gives the rest here."""
    import torch
    made: dict = {}
    for name, buf in list(model.named_buffers(remove_duplicate=False)):
        if buf.is_meta:
            mod_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(mod_name) if mod_name else model
            if id(buf) not in made:
                made[id(buf)] = torch.empty_like(buf, device=device)
            module._buffers[leaf] = made[id(buf)]
    model.initialize_weights()


def keep_fp32(model, dtype) -> None:
    """Give the parameters the model keeps in float32 at this ``dtype`` (its
    ``_keep_in_fp32_modules_strict``, and ``_keep_in_fp32_modules`` under float16: the
    ``dtype_plan`` of ``from_pretrained``) float32 placeholders, so that a load casts what it
    installs there to float32 as ``from_pretrained`` does."""
    import re

    import torch
    if dtype is None:
        return
    plan = model._get_dtype_plan(dtype)
    if not plan:
        return
    rx = re.compile("|".join(p.replace("*", ".*") for p in plan))
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if p.is_floating_point() and p.dtype != torch.float32 and rx.search(name):
            mod_path, _, leaf = name.rpartition(".")
            module = model.get_submodule(mod_path) if mod_path else model
            module._parameters[leaf] = torch.nn.Parameter(p.to(torch.float32),
                                                          requires_grad=p.requires_grad)


def local_shard(whole, param):
    """This rank's part of ``whole`` (a full tensor every rank holds) for the DTensor
    ``param``: whatever its placement (a plain shard, or the strided shard of fused gate/up
    experts), as ``distribute_tensor`` cuts it, without communication; a copy."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    if not isinstance(param, DTensor):
        return whole
    local = distribute_tensor(whole, param.device_mesh, param.placements,
                              src_data_rank=None).to_local()
    return local.clone(memory_format=torch.contiguous_format)


def local_index(param):
    """This rank's slice of a DTensor parameter (a tuple of slices), None for a whole one or
    one whose part is not a slice (a strided shard: ``local_shard`` cuts those)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from lct.compat import dtensor_local_shape_and_offset
    if not isinstance(param, DTensor) or \
            any(type(p) not in (Shard, Replicate) for p in param.placements):
        return None
    shape, offset = dtensor_local_shape_and_offset(param.shape, param.device_mesh,
                                                   param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def no_split_classes(model) -> set:
    """The block classes ``_no_split_modules`` names (the model's transformer blocks)."""
    return set(getattr(model, "_no_split_modules", None) or ())


def tied_keys(model) -> dict:
    """``{tied parameter: parameter it is tied to}`` of a built model, under its config's tie
    flags (transformers' ``all_tied_weights_keys``)."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is None:
        keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    return dict(keys or {})


def tie(model, missing: set) -> None:
    """Tie what the model ties, as ``from_pretrained`` does after loading: a tied parameter the
    checkpoint lacks (``missing``) becomes the one it is tied to."""
    model.tie_weights(missing_keys=set(missing), recompute_mapping=False)


def ignored_patterns(model) -> tuple:
    """``(missing, unexpected)``: the regexes of parameters a checkpoint may lack and of
    checkpoint tensors the model may ignore (``_keys_to_ignore_on_load_missing/unexpected``)."""
    return (tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
            tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()))


def conversions(model) -> tuple:
    """``(renamings, converters)``: the ordered transforms ``from_pretrained`` applies to the
    checkpoint's tensors for ``model`` (transformers' ``get_model_conversion_mapping``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def rename_key(key: str, renamings, converters, prefix: str, meta: dict) -> tuple:
    """``(model name, converter pattern or None)`` of checkpoint tensor ``key``, as
    ``convert_and_load_state_dict_in_model`` renames it (renames, at most one converter, the
    base model prefix added or stripped)."""
    from transformers.core_model_loading import rename_source_key
    renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
    if renamed not in meta and key in meta:
        renamed, pattern = rename_source_key(key, [], [], prefix, meta)
    return renamed, pattern


def natural_key(key: str):
    """The sort key ``from_pretrained`` orders checkpoint names by (numbers as numbers:
    ``layers.2`` before ``layers.10``), transformers' ``dot_natural_key``."""
    from transformers.core_model_loading import dot_natural_key
    return dot_natural_key(key)


def new_converter(converter):
    """A fresh copy of ``converter`` for one target (each fused parameter gets its own)."""
    from copy import deepcopy
    return deepcopy(converter)


def add_source(converter, target: str, key: str, pattern: str, tensor) -> None:
    """Hand checkpoint tensor ``key`` (matched by ``pattern``) to ``converter`` for ``target``."""
    converter.add_tensor(target, key, pattern, tensor)


def run_converter(converter, target: str, model) -> dict:
    """``{model name: tensor}`` that ``converter`` makes of the tensors handed to it."""
    out = converter.convert(target, model=model, config=model.config)
    return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}


def target_patterns(converter) -> list:
    """The parameter names (relative patterns) a converter produces."""
    return list(converter.target_patterns)
