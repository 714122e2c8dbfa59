"""What a memory plan is asked for (``PlanOptions``): the options of ``lct.plan.memory.plan``
and ``lct plan``, their allowed values and defaults, checked once, when the object is built."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from lct.errors import PlanError
from lct.format import constants as C
from lct.format.encodings import encoding_keywords, is_lossy, lossy_encodings
from lct.plan.modelspec import Dims

MODES = ("infer", "train")
PRECISIONS = ("bf16", "fp16", "fp32", "mixed")
OPTIMIZERS = ("adamw", "sgd", "adafactor", "adamw-8bit")
FORMATS = ("hf", "lct")
DEVICES = ("cuda", "cpu")
KV_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
PRECISION_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "mixed": "bfloat16"}
DTYPE_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
DEFAULT_SEQ = 2048
DEFAULT_LOSS_CHUNK = 1024          # tokens per chunk in the chunked-loss figure


def parse_resident(text) -> tuple:
    """``"K/N"`` (or ``(K, N)``) -> ``(K, N)``: K of N Maximus shards resident."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        k, n = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
        if not m:
            raise PlanError(f"maximus resident fraction {text!r} must be K/N, like 8/32",
                            option="maximus_resident")
        k, n = int(m.group(1)), int(m.group(2))
    if not (isinstance(k, int) and isinstance(n, int) and n >= 1 and 0 <= k <= n):
        raise PlanError(f"maximus resident fraction {k}/{n}: need 0 <= K <= N and N >= 1",
                        option="maximus_resident")
    return k, n


def parse_bytes(text) -> int:
    """``"16GiB"``, ``"24GB"``, ``"512MiB"``, ``"1.5TiB"`` or an integer -> bytes
    (``lct.units.parse_size``, the rule every size option follows)."""
    from lct.errors import LCTError
    from lct.units import parse_size
    try:
        return parse_size(text, "memory")
    except LCTError as e:
        raise PlanError(str(e), option="memory") from None


def default_device() -> str:
    """The device a plan is for unless told: ``"cuda"`` when torch sees a CUDA device on this
    machine, else ``"cpu"`` (asked when a plan needs it, not at import)."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


@encoding_keywords("lossy")
@dataclass(frozen=True)
class PlanOptions:
    """What a plan is asked for, checked once, when the object is built.

    The fields are ``plan()``'s keyword arguments, with the same meanings and defaults.
    Construction checks each against its allowed values (``MODES``, ``FORMATS``, ``DEVICES``,
    ``OPTIMIZERS``, ``PRECISIONS``, ``KV_DTYPES``, ``C.LOSSY_ROLES``) and keeps them normalized:
    ``maximus_resident`` as ``(K, N)``, ``memory`` as bytes, ``lossy`` as ``{encoding: parts
    tuple}`` (each registered lossy encoding's name is a keyword too, ``nf4=("head",)``, read
    back as ``options.nf4``).
    ``None`` for ``precision``, ``kv_dtype``, ``format`` and ``device`` means the model's (or
    this machine's) default, which ``resolved`` fills in once the model is read. What needs
    the model (a vocabulary grown below one token, more Maximus shards than rows, a blocksize
    that does not divide a row) is checked when planning.

    Raises:
        PlanError: a bad option, in one line; ``option`` names it.

    Example:
        >>> opts = PlanOptions(mode="train", batch=4, precision="mixed", memory="80GiB")
        >>> opts.memory
        85899345920
        >>> plan("google/gemma-2b", options=opts).fits
        True
    """

    mode: str = "infer"
    batch: int = 1
    seq: int = DEFAULT_SEQ
    vocab_size: int | None = None
    add_tokens: int | None = None
    precision: str | None = None
    optimizer: str = "adamw"
    kv_dtype: str | None = None
    format: str | None = None
    maximus_resident: tuple | str | None = None
    memory: int | str | None = None
    device: str | None = None
    loss_chunk: int = DEFAULT_LOSS_CHUNK
    blocksize: int | None = None
    revision: str | None = None
    lossy: dict | None = None       # {lossy encoding: parts} as asked; keywords too

    def forced(self) -> dict:
        """``{lossy encoding: parts}`` for every registered lossy encoding, in registry order
        (None: not given)."""
        return {e: self.lossy.get(e) for e in lossy_encodings()}

    def __post_init__(self):
        def keep(name, value):
            object.__setattr__(self, name, value)
        keep("format", self.format or None)
        keep("device", self.device or None)
        for value, allowed, what in (
                (self.mode, MODES, "mode"), (self.format, FORMATS, "format"),
                (self.device, DEVICES, "device"), (self.optimizer, OPTIMIZERS, "optimizer"),
                (self.precision, PRECISIONS, "precision"), (self.kv_dtype, KV_DTYPES, "KV dtype")):
            if value not in allowed and (value is not None or what in ("mode", "optimizer")):
                raise PlanError(f"{what} {value!r} is not one of {', '.join(allowed)}",
                                option=what.lower().replace(" ", "_"))
        for value, what in ((self.batch, "batch"), (self.seq, "seq"),
                            (self.loss_chunk, "loss chunk")):
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"{what} must be a positive integer, got {value!r}",
                                option=what.replace(" ", "_"))
        if self.vocab_size is not None and self.add_tokens is not None:
            raise PlanError("give a new vocabulary size or a number of tokens to add, not both",
                            option="add_tokens")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise PlanError(f"the vocabulary size must be >= 1, got {self.vocab_size}",
                            option="vocab_size")
        if self.maximus_resident is not None:
            keep("maximus_resident", parse_resident(self.maximus_resident))
        if self.memory is not None:
            keep("memory", parse_bytes(self.memory))
        if not isinstance(self.lossy, dict) or not all(map(is_lossy, self.lossy)):
            raise PlanError(f"lossy {self.lossy!r} must map lossy encodings ("
                            f"{', '.join(lossy_encodings())}) to parts", option="lossy")
        seen: dict = {}
        for what, parts in self.forced().items():
            if parts is not None and any(r not in C.LOSSY_ROLES for r in parts):
                raise PlanError(f"{what} parts {tuple(parts)!r} must be among {C.LOSSY_ROLES}",
                                option=what)
            both = [r for r in parts or () if r in seen]
            if both:
                other = seen[both[0]]
                raise PlanError(f"{other} {tuple(self.lossy[other])!r} and {what} "
                                f"{tuple(parts)!r} name the same part", option=other)
            seen.update({r: what for r in parts or ()})
        b = self.blocksize
        if b is not None and (not isinstance(b, int) or b < 2 or b % 2):
            raise PlanError(f"NF4 blocksize {b!r} must be a positive even integer",
                            option="blocksize")

    def new_vocab(self, base_vocab: int) -> int | None:
        """The vocabulary to plan for instead of the config's ``base_vocab`` (None: keep it).

        Raises:
            PlanError: ``add_tokens`` takes the vocabulary below one token.
        """
        if self.vocab_size is not None or self.add_tokens is None:
            return self.vocab_size
        new = base_vocab + self.add_tokens
        if new < 1:
            raise PlanError(f"the vocabulary size must be >= 1, got {new}", option="add_tokens")
        return new

    def resolved(self, base: Dims, manifest) -> PlanOptions:
        """These options with the defaults that depend on the model filled in: the format
        ("lct" for an artifact, else "hf"), the precision (the artifact's or config's dtype,
        else bf16), the KV dtype (the activation dtype) and the device (``default_device()``)."""
        precision = self.precision
        if precision is None:
            stored = (manifest.policy.get("dtype") if manifest else None) or base.dtype
            precision = DTYPE_PRECISION.get(stored or "", "bf16")
        return replace(
            self, precision=precision, format=self.format or ("lct" if manifest else "hf"),
            kv_dtype=self.kv_dtype or (precision if precision in ("fp32", "fp16") else "bf16"),
            device=self.device or default_device())
