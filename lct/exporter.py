"""Export an artifact back to a Hugging Face folder that ``from_pretrained`` loads.

Lossless tensors are written bit-identical to the source; NF4 tensors are dequantized exactly as
bitsandbytes dequantizes them, to their source dtype. Tied tensors are written once (the config
keeps its ``tie_word_embeddings``). The folder appears atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from . import constants as C
from .errors import LCTError
from .reader import Artifact, open_artifact
from .writer import check_output_path

DEFAULT_SHARD_SIZE = C.EXPORT_SHARD_SIZE


def _shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def export(artifact, out_dir, *, max_shard_size: int = DEFAULT_SHARD_SIZE, overwrite: bool = False,
           progress=None) -> Path:
    """Write the artifact as a Hugging Face folder (safetensors, config, tokenizer).

    Args:
        artifact: an artifact path or an open ``Artifact``.
        out_dir: the folder to create.
        max_shard_size: bytes per safetensors shard (an index is written when there are several).
        overwrite: replace an existing ``out_dir``.
        progress: called as ``progress(group, done, total)`` after each group.

    Returns:
        The output folder.

    Example:
        >>> lct.export("gemma.lct", "gemma-hf")
        >>> AutoModelForCausalLM.from_pretrained("gemma-hf")
    """
    from safetensors.torch import save_file

    art = artifact if isinstance(artifact, Artifact) else open_artifact(artifact)
    out = Path(out_dir).absolute()
    check_output_path(out)
    if out.exists() and not overwrite:
        raise LCTError(f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        shards: list[list[str]] = []
        weight_map: dict = {}
        pending: dict = {}
        pending_bytes = 0
        total_size = 0

        def flush():
            nonlocal pending, pending_bytes
            if pending:
                name = f"shard-{len(shards):05d}.tmp"
                save_file(pending, str(tmp / name), metadata={"format": "pt"})
                shards.append([name, *pending])
                pending, pending_bytes = {}, 0

        groups = art.groups
        for i, group in enumerate(groups):
            tensors = art.read_group(group, dequantize=True)
            for name, t in tensors.items():
                if name in art.manifest.ties:
                    continue
                nbytes = t.numel() * t.element_size()
                if pending and pending_bytes + nbytes > max_shard_size:
                    flush()
                pending[name] = t.contiguous()
                pending_bytes += nbytes
                total_size += nbytes
            del tensors
            if progress:
                progress(group, i + 1, len(groups))
        flush()
        for i, (tmpname, *names) in enumerate(shards):
            final = _shard_name(i, len(shards))
            os.replace(tmp / tmpname, tmp / final)
            weight_map.update({n: final for n in names})
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))
        for name in C.SIDECAR_FILES:
            if (art.path / name).is_file():
                shutil.copyfile(art.path / name, tmp / name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if art is not artifact:
            art.close()
    return out
