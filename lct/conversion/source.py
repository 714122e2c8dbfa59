"""Conversion sources: a local Hugging Face folder or a Hub repo id, resolved to safetensors files.

Pickle checkpoints (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) are refused: LCT never unpickles.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from lct.errors import PolicyError, SourceError, SourceNotFoundError
from lct.format import constants as C
from lct.format.jsontext import read_json
from lct.units import human

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_NAME = "model.safetensors.index.json"

# safetensors dtype strings -> LCT dtype names.
ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


@dataclass
class Source:
    """A resolved source: where its files are and what it is."""

    root: Path
    id: str
    kind: str                      # "local" or "hub"
    revision: str | None
    files: list                    # safetensors file names, relative to root
    config: dict = field(default_factory=dict)

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    def sidecars(self) -> list:
        """The side files the conversion carries: every top-level regular file of the source
        that is not weights, an index, the card or git metadata, has a plain name
        (``lct.format.manifest.is_side_file_name``), stays inside the source folder, and is within the
        size caps (see ``skipped_sidecars``)."""
        return self._side_files()[0]

    def skipped_sidecars(self) -> list:
        """``[(name, why)]`` of the files ``sidecars`` leaves out although they are not
        weights: a name that is not plain, a link leaving the folder, over a size cap."""
        return self._side_files()[1]

    def _side_files(self) -> tuple:
        from lct.format.manifest import is_side_file_name
        from lct.io.store import confined
        kept, skipped, total = [], [], 0
        weights = set(self.files) | {INDEX_NAME}
        for p in sorted(self.root.iterdir(), key=lambda p: p.name):
            name = p.name
            if name in weights or name.startswith(".") or name in C.NOT_SIDE_FILES \
                    or name.lower().endswith(C.WEIGHT_SUFFIXES) or p.is_dir():
                continue
            kind = _not_regular(p)
            if kind:    # opening a FIFO would wait for a writer forever; reading a device, too
                skipped.append((name, f"{kind}, not a regular file"))
            elif not is_side_file_name(name):
                skipped.append((name, "not a plain file name"))
            elif not confined(p, self.root):
                skipped.append((name, "a link that leaves the model folder"))
            elif p.stat().st_size > C.MAX_SIDE_FILE_BYTES:
                skipped.append((name, f"over {human(C.MAX_SIDE_FILE_BYTES)}"))
            elif total + p.stat().st_size > C.MAX_SIDE_FILES_BYTES:
                skipped.append((name, f"side files over {human(C.MAX_SIDE_FILES_BYTES)} in all"))
            else:
                total += p.stat().st_size
                kept.append(p)
        return kept, skipped


def _not_regular(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file, links followed ("a FIFO", "a directory",
    "a link to nothing", ...); None for a regular file (or a link to one, as a Hugging Face
    cache snapshot's files are links to its blobs). Only the file's status is read: a FIFO is
    never opened (that would wait for a writer)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a link to nothing" if os.path.islink(path) else "missing"
    if stat.S_ISREG(mode):
        return None
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "another kind of file"


def _need_regular(path: Path, what: str) -> None:
    """Raise ``SourceError`` naming ``path`` unless it is a regular file (or a link to one)."""
    kind = _not_regular(path)
    if kind:
        raise SourceError(f"{path}: is not a regular file ({kind}); expected {what}")


def resolve(source: str, revision: str | None = None) -> Source:
    """Resolve ``source`` (local folder, Hub repo id, or ``hf://org/name[@revision]``) to its
    safetensors files.

    Raises:
        SourceNotFoundError: no such folder, and not a Hub id (or no such repo).
        SourceError: the folder holds no safetensors, only pickle checkpoints, or a broken index.
    """
    from lct.hub import is_hf_uri
    hub_only = is_hf_uri(source)
    if hub_only:
        from lct.hub import HubURIError, parse_hf_uri
        try:
            source, rev = parse_hf_uri(source)
        except HubURIError as e:
            raise SourceNotFoundError(str(e)) from e
        if rev and revision and rev != revision:
            raise SourceError(f"hf://{source}: revision {rev!r} in the address and "
                              f"{revision!r} given; pass one")
        revision = revision or rev
    path = Path(source).expanduser()
    if not hub_only and path.exists():
        if not path.is_dir():
            raise SourceError(f"{path}: is a file; pass the model folder that contains it")
        if revision is not None:
            raise SourceError(f"{path}: a local folder has no revision {revision!r} (a revision "
                              f"picks a Hub repo's branch, tag or commit; for the repo, write "
                              f"hf://{source})", option="revision")
        return _local(path, str(path.absolute()), "local", revision)
    from lct.hub.address import is_repo_id
    if not is_repo_id(source):
        raise SourceNotFoundError(f"{source}: no such folder (and not a Hub repo id like org/name)")
    return _local(_download(source, revision, maybe_folder=not hub_only), source, "hub",
                  revision)


def _download(repo_id: str, revision: str | None, maybe_folder: bool = True) -> Path:
    def fetch():
        import huggingface_hub as hub
        return Path(hub.snapshot_download(
            repo_id, revision=revision,
            ignore_patterns=[f"*{s}" for s in C.WEIGHT_SUFFIXES if s != ".safetensors"]
            + ["*/*", ".gitattributes"]))
    from lct.hub.client import hub_fetch
    return hub_fetch(fetch, repo_id, revision, not_found=SourceNotFoundError, error=SourceError,
                     offline=SourceError, maybe_folder=maybe_folder)


def _local(root: Path, sid: str, kind: str, revision: str | None) -> Source:
    config = {}
    cfg = root / "config.json"
    if os.path.lexists(cfg):
        _need_regular(cfg, "the model's JSON config")
        config = read_json(cfg, SourceError)
        if not isinstance(config, dict):
            raise SourceError(f"{cfg}: must hold a JSON object")
    index = root / INDEX_NAME
    if os.path.lexists(index):
        _need_regular(index, "a safetensors index (JSON)")
        index_data = read_json(index, SourceError)
        try:
            weight_map = index_data["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SourceError(f"{index}: not a safetensors index (needs a 'weight_map')") from e
        for f in files:
            if not isinstance(f, str) or Path(f).name != f or not os.path.lexists(root / f):
                raise SourceError(f"{index}: refers to {f!r}, which is not a file in {root}")
    else:
        # maximus.safetensors is a saved Maximus state (kernels.save_maximus_state), not weights
        files = sorted(p.name for p in root.glob("*.safetensors") if p.name != C.MAXIMUS_FILE)
    if not files:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise SourceError(
                f"{root}: only pickle checkpoints ({', '.join(pickles[:3])}); LCT never unpickles. "
                f"Re-save the model as safetensors first (model.save_pretrained(dir) in transformers)")
        if (root / C.MANIFEST_NAME).is_file():
            raise SourceError(f"{root}: an LCT artifact, not a model folder; it is converted "
                              f"already (lct export {root} DIR writes it back as safetensors)")
        raise SourceError(f"{root}: not a model folder (no *.safetensors files)")
    for f in files:     # before anything opens one: a FIFO would hang the open, a device the read
        _need_regular(root / f, "a safetensors weights file")
    return Source(root=root, id=sid, kind=kind, revision=revision, files=files, config=config)


@dataclass
class SourceTensor:
    """One tensor of a source checkpoint, from its safetensors header."""

    name: str
    file: str
    dtype: str
    shape: tuple


def scan(src: Source) -> dict:
    """Read the safetensors headers of ``src``: ``{name: SourceTensor}``; no tensor data is read.
    Every later reader of the files relies on this check: a truncated or damaged file is a
    ``SourceError`` naming it here."""
    from safetensors import SafetensorError, safe_open
    found: dict = {}
    for fname in src.files:
        path = src.root / fname
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    st = sl.get_dtype()
                    if st not in ST_DTYPES:
                        raise PolicyError(f"{path}: tensor {name!r} has dtype {st}, which LCT does "
                                          f"not store; supported: {sorted(ST_DTYPES)}")
                    if name in found:
                        raise SourceError(f"{path}: tensor {name!r} also appears in "
                                          f"{found[name].file}")
                    found[name] = SourceTensor(name, fname, ST_DTYPES[st], tuple(sl.get_shape()))
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:
            # (SafetensorError, a damaged header, is a plain Exception in safetensors 0.8)
            if isinstance(e, (PolicyError, SourceError)):
                raise
            raise SourceError(f"{path}: not a readable safetensors file ({e})") from e
    if not found:
        raise SourceError(f"{src.root}: the safetensors files hold no tensors")
    return found
