"""What a load reads from and what it reports: opening a local, pulled or streamed artifact,
the options every loader takes (``LoadOptions``), the time and bytes breakdown (``LoadStats``),
and the model's name for an artifact tensor.
Shared by the single-process loader (``build``) and the tensor-parallel one."""

from __future__ import annotations

from dataclasses import dataclass, field

from lct.errors import OptionError
from lct.io.stream import DEFAULT_PREFETCH, check_prefetch
from lct.proc import check_workers

NF4_MODES = ("keep", "dequantize")


@dataclass(frozen=True)
class LoadOptions:
    """How every loader reads and installs an artifact (``lct.load``'s arguments, checked
    once, here, and passed down whole).

    ``dtype`` is kept as a torch dtype (a name such as ``"float16"`` is taken, as the CLI's
    ``--dtype``); ``device`` is checked against the machine by the load itself."""

    prefetch: int = DEFAULT_PREFETCH
    device: object = "cpu"
    dtype: object = None
    nf4: str = "keep"
    workers: int | None = None
    verify: bool = True
    stream: bool = False
    expect: str | None = None
    pad_ids: object = None
    maximus: object = False
    cache: bool | None = None       # the decoded cache (lct.io.cache): None: LCT_CACHE decides
    page_cache: str = "auto"        # the stored bytes' page-cache pages (lct.io.store)

    def __post_init__(self):
        from lct.io.store import PAGE_CACHE_MODES
        if self.page_cache not in PAGE_CACHE_MODES:
            raise OptionError(f"page_cache {self.page_cache!r}: expected one of "
                              f"{', '.join(PAGE_CACHE_MODES)}", option="page_cache")
        check_prefetch(self.prefetch)
        if self.nf4 not in NF4_MODES:
            raise OptionError(f"nf4 must be one of {', '.join(NF4_MODES)}, got {self.nf4!r}",
                              option="nf4")
        check_workers(self.workers)
        m = self.maximus
        if isinstance(m, int) and not isinstance(m, bool) and m < 1:
            raise OptionError(f"maximus {m}: a budget is a number of resident shards, at "
                              f"least 1 (True: the stored policy's)", option="maximus")
        if isinstance(self.dtype, str):
            import torch

            from lct.format import constants as C
            name = self.dtype.removeprefix("torch.")
            if name not in C.FLOAT_DTYPES:
                raise OptionError(f"dtype {self.dtype!r}: expected one of "
                                  f"{', '.join(C.FLOAT_DTYPES)} or a torch dtype", option="dtype")
            object.__setattr__(self, "dtype", getattr(torch, name))

    @property
    def cuda(self) -> bool:
        """Whether the load's device is a CUDA one (pinned host buffers, non-blocking copies)."""
        return str(self.device).startswith("cuda")

    def open(self, path):
        """``open_source`` of ``path`` with these options."""
        art = open_source(path, verify=self.verify, workers=self.workers, stream=self.stream,
                          pin_memory=self.cuda, expect=self.expect)
        if hasattr(art.store, "page_cache"):        # a local store (lct.io.store.LocalStore)
            # "auto" keeps until the decoded cache is found to keep this load's decode
            # (build._cache_for): the next load then maps that, not these pages.
            art.store.page_cache = "keep" if self.page_cache == "auto" else self.page_cache
        return art


@dataclass
class LoadStats:
    """Where the time of one load went (seconds) and the prefetch window used."""

    manifest_s: float = 0.0
    skeleton_s: float = 0.0         # importing transformers + meta model, beside the decode
    read_s: float = 0.0
    decode_s: float = 0.0
    wait_s: float = 0.0
    install_s: float = 0.0
    total_s: float = 0.0
    bytes_read: int = 0
    bytes_decoded: int = 0
    groups: int = 0
    max_in_flight: int = 0
    max_held_bytes: int = 0         # decoded bytes held while the skeleton was not ready
    nf4_modules: list = field(default_factory=list)
    notes: list = field(default_factory=list)     # what the load did differently, one line each
    # the decoded cache: "off[: why]", "hit: mapped (why)" (nothing decoded), "cold: why" (an
    # entry on the disk, left there: the artifact decoded instead, lct.io.cache.choose),
    # "filling" (decoded, being kept in the background), or "miss[: <why it is not kept>]"
    cache: str = "off"

    def take_stream(self, s) -> None:
        """Take a ``GroupStream``'s figures (``StreamStats``): times, bytes, groups, window."""
        self.read_s, self.decode_s, self.wait_s = s.read_s, s.decode_s, s.wait_s
        self.bytes_read, self.bytes_decoded = s.bytes_read, s.bytes_decoded
        self.groups, self.max_in_flight = s.groups, s.max_in_flight


def open_source(path, *, verify: bool = True, workers: int | None = None, stream: bool = False,
                pin_memory: bool = False, expect: str | None = None):
    """Open a local artifact, a Hub address ``hf://org/name[@revision]`` or an object store's
    ``s3://``, ``gs://`` or ``az://bucket/prefix`` (always streamed by range requests).

    A Hub address is pulled into the Hugging Face cache and its files checked against the Hub's
    hashes (chunk checksums are then verified as they are read), or with ``stream`` its chunks
    are fetched by HTTP range requests from one pinned commit. With ``expect`` (a digest as
    ``lct info`` prints it) the manifest must be that one (``Artifact.check_digest``).
    """
    from lct.io.reader import open_artifact
    if "://" not in str(path):  # a folder: the Hub's and the object stores' modules not imported
        return _pinned(open_artifact(path, verify=verify, workers=workers,
                                     pin_memory=pin_memory), expect)
    from lct.cloud import is_cloud_uri
    from lct.hub import is_hf_uri
    if is_cloud_uri(path):      # always streamed: `lct pull` downloads one
        from lct.cloud import open_cloud
        return _pinned(open_cloud(path, verify=verify, workers=workers, pin_memory=pin_memory),
                       expect)
    if is_hf_uri(path):
        if stream:
            from lct.hub.remote import open_remote
            art = open_remote(path, verify=verify, workers=workers, pin_memory=pin_memory)
            return _pinned(art, expect)
        from lct.hub import pull
        path = pull(path, chunks=not verify)
    return _pinned(open_artifact(path, verify=verify, workers=workers, pin_memory=pin_memory),
                   expect)


@dataclass(frozen=True)
class Resolved:
    """An artifact address made local: ``folder`` holds its config and tokenizer (what the
    tokenizer and the model class are read from), ``source`` is what the loaders open (the
    folder, or with ``stream`` the Hub address pinned to the commit ``folder`` came from)."""

    folder: str
    source: str
    stream: bool


def resolve(path, *, stream: bool = False, verify: bool = True) -> Resolved:
    """Resolve ``path`` (a folder or ``hf://org/name[@revision]``) once, before a load that
    also needs its small files: a Hub address is pulled (and checked) into the Hugging Face
    cache, or with ``stream`` only its small files are, and the chunks are then streamed from
    that same commit, whatever the branch does meanwhile. ``stream`` is dropped for a local
    folder (it has nothing to stream from)."""
    from lct.cloud import is_cloud_uri
    from lct.hub import HF_SCHEME, is_hf_uri, parse_hf_uri
    path = str(path)
    if is_cloud_uri(path):      # streamed from the object store, small files from the cache
        from lct.cloud import fetch_small
        local, _, _ = fetch_small(path)
        return Resolved(str(local), path, True)
    if not is_hf_uri(path):
        return Resolved(path, path, False)
    if stream:
        from lct.hub.remote import fetch_small
        local, sha, _ = fetch_small(path)
        return Resolved(str(local), f"{HF_SCHEME}{parse_hf_uri(path)[0]}@{sha}", True)
    from lct.hub import pull
    local = str(pull(path, chunks=not verify))
    return Resolved(local, local, False)


def _pinned(art, expect):
    try:
        art.check_digest(expect)
    except BaseException:
        art.close()
        raise
    return art


class StoredDtypes:
    """Checks that a stored tensor's type is the one its manifest entry says the writer stored
    (the source's, or the conversion's cast), and one the model can hold there: a float
    parameter as floats of the artifact's dtype (config.json's, or that of most of its layers:
    MiniMax's float32 buffers outweigh its bfloat16 weights) or float32/float64 (a checkpoint
    may keep some wider), an integer or bool one as the same type. A tensor edited to another
    type of the same width (bfloat16 to float16, or to int16) would otherwise load as other
    values, or fail deep in a kernel. Called as ``check(name, model name)``; raises
    ``LCTError`` naming the tensor."""

    def __init__(self, art, arch):
        self.art, self.arch = art, arch
        self.floats = {str(d).removeprefix("torch.")
                       for d in (stored_dtype(art), majority_dtype(art)) if d is not None}

    def __call__(self, name: str, target: str | None) -> None:
        from lct.errors import LCTError
        from lct.format import constants as C
        info = self.art.manifest.tensors.get(name)
        if info is None or target is None:
            return
        plain = info.encoding == C.ENCODING_PLAIN
        stored = info.stored_dtype if plain else self.art.lossy_dtype(info)
        cast = self.art.cast_dtype
        where = f"{self.art.path}: tensor {name!r} is stored as {stored}, but"
        if plain and stored != info.dtype and not (cast and stored == cast and
                                                   info.dtype in C.FLOAT_DTYPES):
            raise LCTError(f"{where} its source dtype is {info.dtype} and the conversion cast "
                           f"nothing to {stored}; the manifest does not describe these weights")
        ref = self.arch._meta.get(target)
        allowed = self.floats | {"float32", "float64"} \
            if ref is None or ref.is_floating_point() else {str(ref.dtype).removeprefix("torch.")}
        if stored not in allowed:
            raise LCTError(f"{where} {self.arch.class_name} holds {target!r} as "
                           f"{' or '.join(sorted(allowed))} in this "
                           f"{'/'.join(sorted(self.floats))} artifact; the manifest does not "
                           f"describe these weights")


def stored_dtype(art):
    """The torch dtype a load builds the model in by default, as ``from_pretrained`` does
    (its ``dtype="auto"``): the dtype the conversion cast to, else the one config.json names
    (the text config's for a multimodal model), else the float dtype of most of the layers'
    stored elements (a model that keeps a few parameters or buffers in float32 is still a
    bfloat16 model), float32 without floats."""

    import torch

    from lct.format import constants as C
    from lct.io.reader import torch_dtype
    if art.cast_dtype:
        return torch_dtype(art.cast_dtype)
    from lct.errors import LCTError
    from lct.format.jsontext import read_json
    try:
        cfg = read_json(art.path / "config.json", LCTError)
    except LCTError:
        cfg = {}
    cfg = cfg if isinstance(cfg, dict) else {}
    for d in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        name = d.get("dtype") or d.get("torch_dtype")
        if isinstance(name, str) and name.removeprefix("torch.") in C.FLOAT_DTYPES:
            return torch_dtype(name.removeprefix("torch."))
    return majority_dtype(art) or torch.float32


def majority_dtype(art):
    """The float torch dtype of most of the layers' stored elements, or None without floats."""
    import math

    from lct.format import constants as C
    from lct.io.reader import torch_dtype
    count: dict = {}
    for t in art.manifest.tensors.values():
        if t.role != "layer":
            continue
        name = t.stored_dtype if t.encoding == C.ENCODING_PLAIN else t.dtype
        if name in C.FLOAT_DTYPES:
            count[name] = count.get(name, 0) + math.prod(t.shape)
    return torch_dtype(max(count, key=count.get)) if count else None
