"""Export an artifact back to a Hugging Face folder that ``from_pretrained`` loads.

Shards, their names and the index are what ``save_pretrained`` writes (huggingface_hub's
``split_torch_state_dict_into_shards``; a test compares the bytes). Lossless tensors are written
bit-identical to the source; NF4 tensors are dequantized exactly as
bitsandbytes dequantizes them, to their source dtype. Tied tensors are written once (the config
keeps its ``tie_word_embeddings``). The folder appears atomically.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path

from lct.conversion.source import INDEX_NAME
from lct.errors import LCTError, OptionError
from lct.format import constants as C
from lct.io.reader import Artifact, check_address, open_artifact
from lct.io.store import confined
from lct.io.writer import (
    OutputLock,
    check_replaceable,
    check_output_path,
    foreign_entry,
    make_staging,
    recorded_side_files,
    swap_into_place,
    write_error,
)

DEFAULT_SHARD_SIZE = C.EXPORT_SHARD_SIZE


def _shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _is_export_file(name: str, side_files=C.SIDECAR_FILES) -> bool:
    """Whether ``name`` is a file ``export`` writes (shards as ``_shard_name`` names them, their
    index, and ``side_files``: the artifact's)."""
    return (name in (_shard_name(0, 1), INDEX_NAME, C.EXPORT_MARKER) or name in side_files
            or re.fullmatch(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors", name) is not None)


def _check_place(out: Path, art_path: Path) -> None:
    """Refuse an export target that is a file or link, the artifact itself, or a folder inside
    or around it."""
    check_output_path(out)
    src, dst = art_path.resolve(), out.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise LCTError(f"{out}: the export would write into, over or around the artifact "
                       f"{art_path}; give a folder outside it")


def _check_target(out: Path, overwrite: bool, side_files=C.SIDECAR_FILES) -> None:
    """Refuse to replace an existing folder that an export did not write (no
    ``EXPORT_MARKER``: a Hugging Face folder holds the same file names, the source model's
    perhaps), one holding files an export does not write, or, without ``overwrite``, any
    earlier export; an empty folder is filled (run with the output lock held)."""
    if not out.exists() or not any(out.iterdir()):
        return
    if not (out / C.EXPORT_MARKER).is_file():
        raise LCTError(f"{out} exists and was not written by an export (it has no "
                       f"{C.EXPORT_MARKER}); refusing to replace it: give a new folder")
    other = foreign_entry(out, lambda name: _is_export_file(name, side_files))
    if other is not None:
        raise LCTError(f"{out} holds {other!r}, which an export does not write; refusing to "
                       f"replace the folder (move it first)")
    if not overwrite:
        raise LCTError(f"{out} already exists", option="overwrite")
    check_replaceable(out)


def export(artifact, out_dir, *, max_shard_size=DEFAULT_SHARD_SIZE, overwrite: bool = False,
           progress=None) -> Path:
    """Write the artifact as a Hugging Face folder (safetensors, config, tokenizer).

    Args:
        artifact: an artifact path, an ``hf://org/name[@rev]`` address (pulled first), an
            ``s3://``/``gs://``/``az://bucket/prefix`` (streamed), or an open ``Artifact``.
        out_dir: the folder to create.
        max_shard_size: the largest safetensors shard, as save_pretrained takes it: bytes or
            ``"5GB"`` / ``"500MB"`` (``lct.units.parse_size``; an index is written when there are
            several shards). Default: save_pretrained's.
        overwrite: replace an existing ``out_dir``.
        progress: called as ``progress(group, done, total)`` after each group.

    Returns:
        The output folder.

    Example:
        >>> lct.export("gemma.lct", "gemma-hf")
        >>> AutoModelForCausalLM.from_pretrained("gemma-hf")
    """
    check_address(out_dir)
    out = Path(out_dir).absolute()
    from lct.units import parse_size
    max_shard_size = parse_size(max_shard_size, "max_shard_size", option="max_shard_size")
    if max_shard_size == 0:
        raise OptionError("max_shard_size 0 would write a shard per tensor; give a size such as "
                          "5GB (the default) or 500MB", option="max_shard_size")
    given = artifact if isinstance(artifact, Artifact) else None
    if given is None:
        from lct.cloud import local_or_open
        artifact = local_or_open(artifact)
        if isinstance(artifact, Artifact):      # an object store's, streamed: ours to close
            try:
                return export(artifact, out_dir, max_shard_size=max_shard_size,
                              overwrite=overwrite, progress=progress)
            finally:
                artifact.close()
    art_path = artifact.path if isinstance(artifact, Artifact) else Path(artifact)
    _check_place(out, art_path)
    # Held while writing: no other LCT process writes the same folder between the checks and
    # the rename; litter of dead runs is cleaned on the way in.
    with OutputLock(out):
        _check_target(out, overwrite, recorded_side_files(art_path))
        return _export(artifact, out, max_shard_size, progress)


def _config_dtype(config: Path, cast) -> None:
    """An artifact converted with a cast holds its weights in ``cast``: the exported config says
    so, as ``save_pretrained`` of that model would (``from_pretrained``'s default dtype is the
    config's, which would otherwise cast them back)."""
    if cast is None or not config.is_file():
        return
    from lct.format.jsontext import read_json
    try:
        data = read_json(config, LCTError)
    except LCTError:
        return          # a config the source had this way is exported as it is
    if not isinstance(data, dict):
        return
    data["dtype"] = cast
    if "torch_dtype" in data:
        data["torch_dtype"] = cast
    config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _planned_shards(art, max_shard_size: int):
    """huggingface_hub's shard plan (``split_torch_state_dict_into_shards``, what
    ``save_pretrained`` uses) for the tensors the export writes, from their shapes and dtypes
    alone (meta tensors: nothing is read), in load order; tied names are written once."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards

    from lct.io.reader import torch_dtype
    meta = {}
    for group in art.groups:
        for t in art.manifest.group_tensors(group):
            if t.name in art.manifest.ties:
                continue
            dtype = art.lossy_dtype(t) if t.encoding != C.ENCODING_PLAIN else t.stored_dtype
            meta[t.name] = torch.empty(t.shape, dtype=torch_dtype(dtype), device="meta")
    # save_pretrained (transformers 5) hands the splitter its state dict sorted by name
    meta = {n: meta[n] for n in sorted(meta)}
    split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)
    return split, sum(t.numel() for t in meta.values())


def _export(artifact, out: Path, max_shard_size: int, progress) -> Path:
    from lct.format.files import save_safetensors

    art = artifact if isinstance(artifact, Artifact) else open_artifact(artifact)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    make_staging(tmp, out)
    try:
        split, parameters = _planned_shards(art, max_shard_size)
        # A shard is written as soon as every tensor of it has been read (groups stream in load
        # order; shards hold names in sorted order, as save_pretrained's do, so several may be
        # filling at once: at most the model, which is what save_pretrained holds too).
        todo = {f: set(names) for f, names in split.filename_to_tensors.items()}
        pending: dict = {f: {} for f in todo}
        groups = art.groups
        for i, group in enumerate(groups):
            tensors = art.read_group(group, dequantize=True)
            for name, t in tensors.items():
                f = split.tensor_to_filename.get(name)
                if f is None or name in art.manifest.ties:
                    continue
                pending[f][name] = t.contiguous()
                todo[f].discard(name)
                if not todo[f]:
                    # save_pretrained's call: the same names, order and metadata
                    save_safetensors({n: pending[f][n] for n in split.filename_to_tensors[f]},
                                     tmp / f, {"format": "pt"})
                    pending[f] = {}
            del tensors
            if progress:
                progress(group, i + 1, len(groups))
        left = [f for f, names in todo.items() if names]
        if left:
            raise LCTError(f"{art.path}: the export found no tensor for {sorted(todo[left[0]])[:3]}")
        if split.is_sharded:
            index = {"metadata": {"total_parameters": parameters, **split.metadata},
                     "weight_map": split.tensor_to_filename}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for name in art.manifest.side_files():
            if (art.path / name).is_file() and confined(art.path / name, art.path):
                shutil.copyfile(art.path / name, tmp / name)
        _config_dtype(tmp / "config.json", art.cast_dtype)
        from lct._version import __version__
        (tmp / C.EXPORT_MARKER).write_text(json.dumps(
            {"exported_by": f"lct {__version__}", "artifact_id": art.manifest.artifact_id,
             "artifact": str(art.path)}, indent=1) + "\n")
        swap_into_place(tmp, out)  # an earlier export (checked) is replaced in one step
    except OSError as e:
        mapped = write_error(e, out, "the export")
        if mapped is not None:
            raise mapped from e
        raise
    finally:
        from lct.proc import interrupts_held
        with interrupts_held():         # a second Ctrl-C would leave the folder
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            if art is not artifact:
                art.close()
    return out
