"""The manifest (``lct.json``): parse, validate against docs/FORMAT.md, serialize. No torch here.

Everything in a manifest is untrusted: ``Manifest.from_json`` checks types, caps, sizes, offsets,
overlaps and names before any of it is used, and raises ``ManifestError`` naming what is wrong.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace

from lct.format import codecs
from lct.format import constants as C
from lct.format.encodings import get_encoding, lossy_encodings
from lct.format.rules import fail as _fail
from lct.format.rules import integer as _int
from lct.errors import ManifestChecksumError, ManifestError, UnsupportedVersionError
from lct.format.jsontext import parse_json


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk: where its stored bytes are, how big it decodes, how to decode it."""

    id: int
    group: str
    file: int
    offset: int
    stored_size: int
    decoded_size: int
    codec: str
    params: dict
    checksum: str
    binding: str | None = None   # xxh3_64 of what the chunk is (FORMAT.md 6), from 1.1 on
    decoded_checksum: str | None = None  # xxh3_64 of the decoded bytes (FORMAT.md 6), from 1.6 on


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its shape and dtype, and the place of its bytes in a decoded chunk."""

    name: str
    shape: tuple
    dtype: str
    stored_dtype: str
    encoding: str
    role: str
    group: str
    chunk: int
    offset: int
    nbytes: int
    nf4: dict | None = None
    pieces: tuple | None = None     # row- or column-range pieces (TensorInfo each), in order
    row_order: str | None = None    # "maximus": stored rows are in frequency order
    rows: tuple | None = None       # (r0, r1) of a piece within its tensor
    int8: dict | None = None        # {"scale_offset", "scale_nbytes"} of an int8 tensor
    cols: tuple | None = None       # (c0, c1) of a column piece within its tensor (since 1.2)

    @classmethod
    def from_pieces(cls, name: str, shape: tuple, dtype: str, pieces: tuple,
                    row_order: str | None) -> "TensorInfo":
        """The whole tensor stored as ``pieces`` (in row or column order): placed at the first
        piece, ``nbytes`` their sum (FORMAT.md 2.3)."""
        first = pieces[0]
        return cls(name, tuple(shape), dtype, first.stored_dtype, first.encoding, first.role,
                   first.group, first.chunk, first.offset, sum(p.nbytes for p in pieces),
                   first.nf4 and {"blocksize": first.nf4["blocksize"]}, tuple(pieces), row_order)

    def scales_span(self) -> tuple | None:
        """``(offset, nbytes)`` of the float32 scales after a lossy tensor's codes (NF4's absmax
        per block, int8's scale per row); None for a plain tensor."""
        if self.nf4 and "absmax_offset" in self.nf4:
            return self.nf4["absmax_offset"], self.nf4["absmax_nbytes"]
        if self.int8:
            return self.int8["scale_offset"], self.int8["scale_nbytes"]
        return None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def placements(self) -> tuple:
        """Where the bytes are: the tensor itself, or its pieces in order."""
        return self.pieces if self.pieces else (self,)

    @property
    def piece_axis(self) -> int | None:
        """0 for a tensor stored as row pieces, 1 for column pieces, None for one placement."""
        if not self.pieces:
            return None
        return 1 if self.pieces[0].cols is not None else 0

    def span(self) -> tuple | None:
        """``(start, end)`` of a piece along its tensor's piece axis."""
        return self.cols if self.cols is not None else self.rows


@dataclass
class Manifest:
    """A validated manifest. Build with ``from_json``/``from_dict``; write with ``to_json``."""

    format_version: tuple
    created_by: str
    artifact_id: str
    source: dict
    architecture: dict
    policy: dict
    files: list
    groups: list
    chunks: list
    tensors: dict
    ties: dict = field(default_factory=dict)
    unmapped: list = field(default_factory=list)
    maximus: dict | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {
            "format": C.FORMAT_NAME,
            "format_version": list(self.format_version),
            "created_by": self.created_by,
            "artifact_id": self.artifact_id,
            "source": self.source,
            "architecture": self.architecture,
            "policy": self.policy,
            "files": self.files,
            "groups": self.groups,
            "chunks": [{k: v for k, v in asdict(c).items()
                        if k not in _OPTIONAL_CHUNK_KEYS or v is not None} for c in self.chunks],
            "tensors": [_tensor_dict(t) for t in self.tensors.values()],
            "ties": self.ties,
            "unmapped": self.unmapped,
        }
        if self.maximus is not None:
            d["maximus"] = self.maximus
        d.update(self.extra)
        return d

    def to_json(self) -> str:
        """The manifest's text. From format 1.1 on it is sealed (FORMAT.md section 6): every
        chunk's ``binding`` is computed from the tensors placed in it, and ``manifest_checksum``
        covers the text."""
        d = self.to_dict()
        if tuple(self.format_version) >= SEALED_SINCE:
            binds = chunk_bindings(self.chunks, self.tensors, self.ties)
            for c in d["chunks"]:
                c["binding"] = binds[c["id"]]
            d.pop(CHECKSUM_KEY, None)
            d[CHECKSUM_KEY] = _ZERO_SUM
            return seal(json.dumps(d, indent=1, sort_keys=False, allow_nan=False) + "\n")
        return json.dumps(d, indent=1, sort_keys=False, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: bytes | str, where: str = "lct.json") -> "Manifest":
        """Parse and validate manifest text (``where`` names it in errors)."""
        if len(text) > C.MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: manifest is {len(text)} bytes, cap is {C.MAX_MANIFEST_BYTES}")
        raw = text.encode() if isinstance(text, str) else text
        d = parse_json(raw, where)
        manifest = cls.from_dict(d, where)
        if tuple(manifest.format_version) >= SEALED_SINCE:
            _check_sealed(raw, d, where)
        return manifest

    @classmethod
    def from_dict(cls, d, where: str = "lct.json") -> "Manifest":
        """Validate a parsed manifest dict; see docs/FORMAT.md."""
        return _parse(d, where)

    # Convenience views --------------------------------------------------------------------
    @functools.cached_property
    def _by_group(self) -> dict:
        """``{group: (chunks, tensors)}`` in manifest order, built once (a manifest is not
        changed after it is built; readers ask per group, the layer-wise executor per token)."""
        index: dict = {}
        for c in self.chunks:
            index.setdefault(c.group, ([], []))[0].append(c)
        for t in self.tensors.values():
            index.setdefault(t.group, ([], []))[1].append(t)
        return index

    @functools.cached_property
    def _group_set(self) -> frozenset:
        return frozenset(self.groups)

    def has_group(self, group: str) -> bool:
        """Whether ``group`` is one of the manifest's groups (constant time: a reader asks once
        per group, and a manifest may list very many)."""
        return group in self._group_set

    def side_files(self) -> list:
        """The side files the artifact carries: the names in ``source.files`` (copied from the
        source, with their sha256) that are side-file names, in manifest order."""
        recorded = self.source.get("files")
        return [n for n in recorded if is_side_file_name(n)] if isinstance(recorded, dict) \
            else []

    def group_chunks(self, group: str) -> list:
        """The chunks of ``group`` in order."""
        return list(self._by_group.get(group, ((), ()))[0])

    def group_tensors(self, group: str) -> list:
        """The tensors of ``group`` in manifest order."""
        return list(self._by_group.get(group, ((), ()))[1])

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_size for c in self.chunks)

    @property
    def decoded_bytes(self) -> int:
        return sum(c.decoded_size for c in self.chunks)

    @property
    def source_bytes(self) -> int:
        return sum(f.get("size", 0) for f in self.source.get("files", {}).values())


def _tensor_dict(t: TensorInfo) -> dict:
    d = {k: v for k, v in asdict(t).items() if k not in ("pieces", "rows", "cols")}
    d["shape"] = list(t.shape)
    for key in ("nf4", "row_order", "int8"):
        if d[key] is None:
            del d[key]
    if t.pieces:
        for key in ("chunk", "offset", "nbytes", "nf4", "int8"):
            d.pop(key, None)
        d["pieces"] = [{("cols" if p.cols is not None else "rows"): list(p.span()),
                        "chunk": p.chunk, "offset": p.offset,
                        "nbytes": p.nbytes, **({"nf4": p.nf4} if p.nf4 else {}),
                        **({"int8": p.int8} if p.int8 else {})}
                       for p in t.pieces]
    return d


def is_side_file_name(name) -> bool:
    """Whether ``name`` can be a side file of an artifact (FORMAT.md section 1): a plain name
    (``SIDE_FILE_PATTERN``), not weights or an index of weights, not the model card, not one of
    LCT's own files."""
    return (isinstance(name, str) and re.fullmatch(C.SIDE_FILE_PATTERN, name) is not None
            and not name.lower().endswith(C.WEIGHT_SUFFIXES) and ".index.json" not in name
            and name not in C.NOT_SIDE_FILES and re.fullmatch(C.DATA_FILE_PATTERN, name) is None)


# Sealing (FORMAT.md section 6): chunk bindings and the manifest's own checksum, from 1.1 on;
# each chunk's decoded bytes pinned by its entry (and so by the manifest's digest), from 1.6 on.
SEALED_SINCE = (1, 1)
DECODED_PINNED_SINCE = (1, 6)
_OPTIONAL_CHUNK_KEYS = ("binding", "decoded_checksum")
CHECKSUM_KEY = "manifest_checksum"
_ZERO_SUM = C.CHECKSUM_ALGO + ":" + "0" * C.CHECKSUM_HEX_DIGITS
_CHECKSUM_PATTERN = C.CHECKSUM_ALGO + ":[0-9a-f]{%d}" % C.CHECKSUM_HEX_DIGITS
_SUM_RE = re.compile(rb'"manifest_checksum": ?"(' + _CHECKSUM_PATTERN.encode() + rb')"')


def chunk_bindings(chunks: list, tensors: dict, ties: dict) -> dict:
    """``{chunk id: binding}``: xxh3_64 of a canonical JSON of the chunk's entry (its checksum
    included) and of every tensor or piece the manifest places in it (name, the piece's rows or
    columns, shape, dtype,
    stored dtype, encoding, role, group, offset, nbytes, scales, row order) and the ties to
    them. Any change to what a chunk is said to hold changes its binding."""
    import xxhash
    held: dict = {c.id: [] for c in chunks}
    for t in tensors.values():
        for p in t.placements():
            held.setdefault(p.chunk, []).append(
                [t.name, list(p.span()) if p.span() else None, list(t.shape), t.dtype,
                 t.stored_dtype, t.encoding, t.role, t.group, p.offset, p.nbytes, p.nf4, p.int8,
                 t.row_order])
    tied_to: dict = {}
    for k, v in ties.items():
        tied_to.setdefault(v, []).append(k)
    out = {}
    for c in chunks:
        entries = sorted(held.get(c.id, []), key=lambda e: (e[8], e[0]))
        desc = {"id": c.id, "group": c.group, "file": c.file, "offset": c.offset,
                "stored_size": c.stored_size, "decoded_size": c.decoded_size, "codec": c.codec,
                "params": c.params, "checksum": c.checksum, "tensors": entries,
                "ties": sorted([e[0], k] for e in entries for k in tied_to.get(e[0], []))}
        if c.decoded_checksum is not None:
            desc["decoded_checksum"] = c.decoded_checksum
        text = json.dumps(desc, sort_keys=True, separators=(",", ":"), allow_nan=False)
        out[c.id] = f"{C.CHECKSUM_ALGO}:{xxhash.xxh3_64_hexdigest(text.encode())}"
    return out


def seal(text: str) -> str:
    """Set the ``manifest_checksum`` of manifest ``text``: xxh3_64 of the exact bytes with that
    value written as 16 zeros. Tools that edit a manifest call this after the edit (the chunk
    bindings stay as they are, so an edit of what a chunk holds still fails)."""
    import xxhash
    raw = text.encode()
    found = list(_SUM_RE.finditer(raw))
    if len(found) != 1:
        raise ManifestError(f"a manifest to seal holds {len(found)} '{CHECKSUM_KEY}' entries; "
                            f"it needs exactly one")
    m = found[0]
    zeroed = raw[:m.start(1)] + _ZERO_SUM.encode() + raw[m.end(1):]
    digest = f"{C.CHECKSUM_ALGO}:{xxhash.xxh3_64_hexdigest(zeroed)}"
    return (raw[:m.start(1)] + digest.encode() + raw[m.end(1):]).decode()


def _check_sealed(raw: bytes, d: dict, where: str) -> None:
    """The manifest's own checksum must match its bytes (checked after the structure)."""
    import xxhash
    found = list(_SUM_RE.finditer(raw))
    value = d.get(CHECKSUM_KEY)
    if len(found) != 1 or value != found[0].group(1).decode():
        _fail(where, f"the manifest must carry exactly one top-level '{CHECKSUM_KEY}' "
                     f"('{C.CHECKSUM_ALGO}:<16 hex>'); found {len(found)}")
    m = found[0]
    zeroed = raw[:m.start(1)] + _ZERO_SUM.encode() + raw[m.end(1):]
    digest = f"{C.CHECKSUM_ALGO}:{xxhash.xxh3_64_hexdigest(zeroed)}"
    if digest != value:
        raise ManifestChecksumError(
            f"{where}: manifest checksum mismatch: it says {value}, its bytes give {digest}; "
            f"the file was changed after it was written, even re-indented; restore it or "
            f"convert the model again (a tool that edits a manifest reseals it: "
            f"docs/FORMAT.md section 6)")


def _str(v, where: str, what: str, maxlen: int = C.MAX_NAME_LEN) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= maxlen or "\x00" in v:
        _fail(where, f"{what} must be a non-empty string of at most {maxlen} characters "
                     f"without NUL, got {str(v)[:80]!r}")
    return v


def _obj(d: dict, key: str, kind, where: str):
    v = d.get(key)
    if not isinstance(v, kind):
        _fail(where, f"'{key}' must be a {kind.__name__}, got {type(v).__name__}")
    return v


# The informative objects (FORMAT.md section 2): each MUST be a JSON object when present (an
# absent one reads as empty); a key the spec defines MUST have the type given here, a key it does
# not define is ignored (section 8). Type tags: "str", "int" (not negative), "signed" (any int),
# "num" (int or float), "bool", "null", "obj", "strs" (list of strings), "files"
# (source.files), "costs" (``{part: {encoding: num}}``), "stacks" (architecture.stacks).
_SOURCE_KEYS = {"id": ("str",), "kind": ("str",), "revision": ("str", "null"),
                "files": ("files",)}
_ARCHITECTURE_KEYS = {"model_type": ("str", "null"), "tie_word_embeddings": ("bool",),
                      "mapping": ("str",), "class": ("str",), "stacks": ("stacks",),
                      "experts": ("obj",)}
_EXPERTS_KEYS = {"count": ("int",), "active": ("int", "null"), "layers": ("int",)}
_POLICY_KEYS = {"mode": ("str",), "blocksize": ("int",),     # and each lossy encoding's parts
                "dtype": ("str", "null"), "codec": ("str",), "level": ("signed",),
                "frame_size": ("int",), "maximus_shards": ("int", "null"),
                "tp_pieces": ("int",), "measured": ("obj",)}
_MEASURED_KEYS = {"method": ("str",), "mode": ("str",), "budget_kl": ("num",),
                  "cost_kl": ("num",), "tied": ("bool",), "tokens": ("int",),
                  "seconds": ("num",), "costs": ("costs",), "kept": ("obj",),
                  "sizes": ("costs",), "note": ("str",), "partial": ("obj",),
                  "margin": ("num",)}
_FREQUENCY_SOURCE_KEYS = {"kind": ("str",), "path": ("str", "null"), "tokens": ("int",),
                          "note": ("str",)}
_INFORMATIVE = {"source": _SOURCE_KEYS, "architecture": _ARCHITECTURE_KEYS,
                "policy": _POLICY_KEYS}
_NESTED = {"policy.measured": _MEASURED_KEYS, "architecture.experts": _EXPERTS_KEYS}
# What a tensor entry's single placement holds; a pieced entry has these per piece instead.
_PLACEMENT_KEYS = ("chunk", "offset", "nbytes", "nf4", "int8")
_SHA256_RE = re.compile("[0-9a-f]{64}")


def _is(v, tag: str) -> bool:
    """Whether JSON value ``v`` has the type ``tag`` (see ``_SOURCE_KEYS``)."""
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if tag == "str":
        return isinstance(v, str)
    if tag == "int":
        return is_int and 0 <= v <= C.MAX_MANIFEST_INT
    if tag == "signed":
        return is_int and abs(v) <= C.MAX_MANIFEST_INT
    if tag == "num":
        return is_int or isinstance(v, float)
    if tag == "bool":
        return isinstance(v, bool)
    if tag == "null":
        return v is None
    if tag == "obj":
        return isinstance(v, dict)
    if tag == "strs":
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    if tag == "stacks":
        return isinstance(v, list) and all(
            isinstance(x, dict) and isinstance(x.get("path"), str)
            and isinstance(x.get("group_prefix"), str) and _is(x.get("blocks"), "int")
            for x in v)
    if tag == "costs":
        return isinstance(v, dict) and all(
            isinstance(c, dict) and all(x is None or _is(x, "num") for x in c.values())
            for c in v.values())
    if tag == "files":
        return isinstance(v, dict) and all(
            isinstance(f, dict) and isinstance(f.get("sha256"), str)
            and _SHA256_RE.fullmatch(f["sha256"]) is not None and _is(f.get("size"), "int")
            for f in v.values())
    raise AssertionError(tag)  # pragma: no cover


_TAG_WORDS = {"str": "a string", "int": "a non-negative integer", "signed": "an integer",
              "num": "a number", "bool": "true or false", "null": "null", "obj": "an object",
              "strs": "a list of strings", "costs": "an object {part: {encoding: number or null}}",
              "files": 'an object {name: {"sha256": 64 hex digits, "size": integer}}',
              "stacks": 'a list of {"path": string, "group_prefix": string, "blocks": integer}'}


def _check_keys(obj: dict, keys: dict, what: str, where: str) -> None:
    for key, tags in keys.items():
        if key in obj and not any(_is(obj[key], tag) for tag in tags):
            _fail(where, f"'{what}.{key}' must be {' or '.join(_TAG_WORDS[t] for t in tags)}, "
                         f"got {json.dumps(obj[key])[:80]}")


def _informative(d: dict, key: str, where: str) -> dict:
    """Top-level object ``key`` (``source``, ``architecture``, ``policy``) with the types of
    the keys the spec defines checked; ``{}`` when absent."""
    if key not in d:
        return {}
    v = d[key]
    if not isinstance(v, dict):
        _fail(where, f"'{key}' must be an object, got {json.dumps(v)[:80]}")
    keys = _INFORMATIVE[key]
    if key == "policy":     # the parts of each lossy encoding registered now (a list of strings)
        keys = {**keys, **{e: ("strs",) for e in lossy_encodings()}}
    _check_keys(v, keys, key, where)
    for path, keys in _NESTED.items():
        top, _, sub = path.partition(".")
        if top == key and isinstance(v.get(sub), dict):
            _check_keys(v[sub], keys, path, where)
    return v


def _parse(d, where: str) -> Manifest:
    if not isinstance(d, dict):
        _fail(where, "manifest must be a JSON object")
    if d.get("format") != C.FORMAT_NAME:
        _fail(where, f"'format' must be {C.FORMAT_NAME!r}, got {d.get('format')!r}")
    ver = d.get("format_version")
    if not (isinstance(ver, list) and len(ver) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= C.MAX_VERSION_NUMBER
            for x in ver)):
        _fail(where, f"'format_version' must be [major, minor], got {ver!r}")
    if ver[0] != C.FORMAT_VERSION[0]:
        raise UnsupportedVersionError(
            f"{where}: format version {ver[0]}.{ver[1]} is not readable by this LCT, which reads "
            f"{C.FORMAT_VERSION[0]}.x (written version {C.FORMAT_VERSION[0]}.{C.FORMAT_VERSION[1]}); "
            f"upgrade lct")

    artifact_id = d.get("artifact_id")
    if not isinstance(artifact_id, str) or not re.fullmatch(
            "[0-9a-f]{%d}" % (2 * C.ARTIFACT_ID_BYTES), artifact_id):
        _fail(where, f"'artifact_id' must be {2 * C.ARTIFACT_ID_BYTES} lowercase hex digits "
                     f"(the id in every data file header), got {str(artifact_id)[:80]!r}")
    created_by = _str(d.get("created_by"), where, "'created_by'") if "created_by" in d else ""
    objects = {key: _informative(d, key, where) for key in _INFORMATIVE}

    files = _obj(d, "files", list, where)
    if len(files) > C.MAX_FILES:
        _fail(where, f"{len(files)} data files exceed the cap {C.MAX_FILES}")
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            _fail(where, f"files[{i}] must be an object")
        name = _str(f.get("name"), where, f"files[{i}].name")
        if not re.fullmatch(C.DATA_FILE_PATTERN, name):
            _fail(where, f"files[{i}].name {name!r} is not a data file name "
                         f"(expected {C.DATA_FILE_PATTERN})")
        _int(f.get("size"), where, f"files[{i}].size")
    if len({f["name"] for f in files}) != len(files):
        _fail(where, "data file names are not unique")

    groups = _obj(d, "groups", list, where)
    for g in groups:
        _str(g, where, "group name")
    if len(set(groups)) != len(groups):
        _fail(where, "group names are not unique")

    raw_chunks = _obj(d, "chunks", list, where)
    if len(raw_chunks) > C.MAX_CHUNKS:
        _fail(where, f"{len(raw_chunks)} chunks exceed the cap {C.MAX_CHUNKS}")
    group_set = set(groups)
    chunks = [_chunk(c, i, files, group_set, where) for i, c in enumerate(raw_chunks)]
    _check_no_overlap(
        [(c.file, c.offset, c.offset + c.stored_size, f"chunk {c.id}") for c in chunks],
        where, "chunk byte ranges")

    raw_tensors = _obj(d, "tensors", list, where)
    if len(raw_tensors) > C.MAX_TENSORS:
        _fail(where, f"{len(raw_tensors)} tensors exceed the cap {C.MAX_TENSORS}")
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for i, t in enumerate(raw_tensors):
        info = _tensor(t, i, chunks, where, tuple(ver))
        if info.name in tensors:
            _fail(where, f"tensor name {info.name!r} appears twice")
        tensors[info.name] = info
        for p in info.placements():
            spans.append((p.chunk, p.offset, p.offset + p.nbytes, p.name))
            aux = p.scales_span()
            if aux:
                spans.append((p.chunk, aux[0], aux[0] + aux[1], p.name + " scales"))
    _check_no_overlap(spans, where, "tensor byte ranges")
    ends: dict = {}
    for chunk_id, _, end, _ in spans:
        ends[chunk_id] = max(ends.get(chunk_id, 0), end)
    for c in chunks:
        if c.decoded_size != ends.get(c.id, 0):
            _fail(where, f"chunk {c.id} ({c.group}) decodes to {c.decoded_size} bytes, but what "
                         f"the manifest places in it ends at byte {ends.get(c.id, 0)}: a chunk "
                         f"holds its tensors and nothing after them")

    ties = d.get("ties", {})
    if not isinstance(ties, dict):
        _fail(where, "'ties' must be an object")
    for k, v in ties.items():
        _str(k, where, "tied name")
        _str(v, where, f"tie {k!r} target")
        if v not in tensors:
            _fail(where, f"tie {k!r} -> {v!r}: no stored tensor named {v!r}")
        if k in tensors:
            _fail(where, f"tie {k!r} is also a stored tensor")

    unmapped = d.get("unmapped", [])
    if not isinstance(unmapped, list):
        _fail(where, f"'unmapped' must be a list, got {type(unmapped).__name__}")
    for u in unmapped:
        _str(u, where, "an 'unmapped' name")

    maximus = d.get("maximus")
    if maximus is not None:
        _check_maximus(maximus, tensors, where)
    listed = set(maximus["tensors"]) if maximus is not None else set()
    for t in tensors.values():
        if t.row_order == C.ROW_ORDER_MAXIMUS and t.name not in listed:
            _fail(where, f"tensor {t.name!r} has row_order 'maximus' but is not in "
                         f"maximus.tensors (section 2.4): without that state its rows cannot be "
                         f"put back in token-id order")

    if tuple(ver) >= DECODED_PINNED_SINCE:
        for c in chunks:
            if c.decoded_checksum is None:
                _fail(where, f"chunk {c.id} ({c.group}) has no 'decoded_checksum', which format "
                             f"{ver[0]}.{ver[1]} requires (section 6)")
    if tuple(ver) >= SEALED_SINCE:
        binds = chunk_bindings(chunks, tensors, ties)
        for c in chunks:
            if c.binding is None:
                _fail(where, f"chunk {c.id} ({c.group}) has no 'binding', which format "
                             f"{ver[0]}.{ver[1]} requires (section 6)")
            if c.binding != binds[c.id]:
                _fail(where, f"chunk {c.id} ({c.group}): binding {c.binding} does not match what "
                             f"the manifest says the chunk holds ({binds[c.id]}): its tensors' "
                             f"names, shapes, types or places were changed after it was written")

    known = {"format", "format_version", "created_by", "artifact_id", "source", "architecture",
             "policy", "files", "groups", "chunks", "tensors", "ties", "unmapped", "maximus",
             CHECKSUM_KEY}
    return Manifest(
        format_version=tuple(ver),
        created_by=created_by,
        artifact_id=artifact_id,
        source=objects["source"],
        architecture=objects["architecture"],
        policy=objects["policy"],
        files=files,
        groups=groups,
        chunks=chunks,
        tensors=tensors,
        ties=ties,
        unmapped=unmapped,
        maximus=maximus,
        extra={k: v for k, v in d.items() if k not in known},
    )


def _chunk(c, i: int, files: list, groups: set, where: str) -> ChunkInfo:
    if not isinstance(c, dict):
        _fail(where, f"chunks[{i}] must be an object")
    w = f"{where}: chunk {i}"
    if c.get("id") != i:
        _fail(where, f"chunks[{i}].id must be {i}, got {c.get('id')!r}")
    group = _str(c.get("group"), where, f"chunks[{i}].group")
    if group not in groups:
        _fail(where, f"chunk {i}: group {group!r} is not in 'groups'")
    fidx = _int(c.get("file"), where, f"chunk {i} file", 0, max(len(files) - 1, 0))
    if not files:
        _fail(where, f"chunk {i} refers to a data file but 'files' is empty")
    fsize = files[fidx]["size"]
    offset = _int(c.get("offset"), where, f"chunk {i} offset", C.DATA_HEADER_SIZE)
    if offset % C.CHUNK_ALIGNMENT:
        _fail(where, f"chunk {i} offset {offset} is not a multiple of {C.CHUNK_ALIGNMENT}")
    stored = _int(c.get("stored_size"), where, f"chunk {i} stored_size")
    if offset + stored > fsize:
        _fail(where, f"chunk {i} ends at {offset + stored}, past the end of "
                     f"{files[fidx]['name']} ({fsize} bytes)")
    decoded = _int(c.get("decoded_size"), where, f"chunk {i} decoded_size", 0, C.MAX_CHUNK_DECODED)
    codec_name = _str(c.get("codec"), where, f"chunk {i} codec", 64)
    params = c.get("params")
    if not isinstance(params, dict):
        _fail(where, f"chunk {i} params must be an object")
    try:
        codecs.get_codec(codec_name).check_params(params, decoded, stored)
    except ManifestError as e:  # UnsupportedVersionError (unknown codec) keeps its type
        raise type(e)(f"{w}: {e}") from None
    checksum = _str(c.get("checksum"), where, f"chunk {i} checksum", 128)
    if not re.fullmatch(_CHECKSUM_PATTERN, checksum):
        _fail(where, f"chunk {i} checksum {checksum!r} is not '{C.CHECKSUM_ALGO}:<16 hex>'")
    binding = c.get("binding")
    if binding is not None and (not isinstance(binding, str) or not re.fullmatch(
            _CHECKSUM_PATTERN, binding)):
        _fail(where, f"chunk {i} binding {binding!r} is not '{C.CHECKSUM_ALGO}:<16 hex>'")
    decoded_sum = c.get("decoded_checksum")
    if decoded_sum is not None and (not isinstance(decoded_sum, str) or not re.fullmatch(
            _CHECKSUM_PATTERN, decoded_sum)):
        _fail(where, f"chunk {i} decoded_checksum {decoded_sum!r} is not "
                     f"'{C.CHECKSUM_ALGO}:<16 hex>'")
    return ChunkInfo(i, group, fidx, offset, stored, decoded, codec_name, params, checksum,
                     binding, decoded_sum)


def _tensor(t, i: int, chunks: list, where: str, version: tuple) -> TensorInfo:
    """Validate tensor entry ``i`` (FORMAT.md 2.2, 2.3) of a manifest of format ``version``."""
    if not isinstance(t, dict):
        _fail(where, f"tensors[{i}] must be an object")
    name = _str(t.get("name"), where, f"tensors[{i}].name")
    w = f"tensor {name!r}"
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) > C.MAX_RANK:
        _fail(where, f"{w}: shape must be a list of at most {C.MAX_RANK} dims, got {shape!r}")
    for s in shape:
        _int(s, where, f"{w} dimension", 0, C.MAX_DIM)
    dtype = t.get("dtype")
    if not isinstance(dtype, str) or dtype not in C.DTYPE_SIZES:
        raise UnsupportedVersionError(f"{where}: {w}: unknown dtype {dtype!r}")
    role = t.get("role")
    if role not in C.ROLES:
        _fail(where, f"{w}: role {role!r} is not one of {C.ROLES}")
    if "pieces" in t:
        own = [k for k in _PLACEMENT_KEYS if k in t]
        if own:
            _fail(where, f"{w}: a tensor stored as pieces has no '{own[0]}' of its own; each "
                         f"piece carries its place (section 2.3)")
        return _since(_pieced(t, name, tuple(shape), dtype, chunks, where), version, where)
    if "row_order" in t:
        row_order = t["row_order"]
        if row_order is not None and row_order != C.ROW_ORDER_MAXIMUS:
            raise UnsupportedVersionError(f"{where}: {w}: unknown row_order {row_order!r}")
        _fail(where, f"{w}: row_order {row_order!r} applies only to a tensor stored as pieces "
                     f"(section 2.2); this one has a single placement")
    return _since(_placement(t, name, tuple(shape), dtype, chunks, where), version, where)


def _since(info: TensorInfo, version: tuple, where: str) -> TensorInfo:
    """``info``, once its encoding is one that format ``version`` has (FORMAT.md 2.2: each
    encoding needs the version that introduced it)."""
    get_encoding(info.encoding).check_version(version, f"tensor {info.name!r}", where)
    return info


def _pieced(t: dict, name: str, shape: tuple, dtype: str, chunks: list, where: str) -> TensorInfo:
    """A tensor stored as row-range (or, since 1.2, column-range) pieces, each placed in its own
    chunk (FORMAT.md 2.3)."""
    w = f"tensor {name!r}"
    pieces = t.get("pieces")
    if not isinstance(pieces, list) or not pieces or len(shape) != 2:
        _fail(where, f"{w}: 'pieces' must be a non-empty list, for a 2-D tensor")
    if len(pieces) > C.MAX_CHUNKS:
        _fail(where, f"{w}: {len(pieces)} pieces exceed the cap {C.MAX_CHUNKS}")
    row_order = t.get("row_order")
    if row_order not in (None, C.ROW_ORDER_MAXIMUS):
        raise UnsupportedVersionError(f"{where}: {w}: unknown row_order {row_order!r}")
    axis = 1 if isinstance(pieces[0], dict) and "cols" in pieces[0] else 0
    key = ("rows", "cols")[axis]
    if axis == 1 and (row_order is not None or t.get("encoding") != C.ENCODING_PLAIN):
        _fail(where, f"{w}: column pieces are for plain tensors in id order (section 2.3)")
    out, nxt = [], 0
    for k, p in enumerate(pieces):
        if not isinstance(p, dict):
            _fail(where, f"{w}: pieces[{k}] must be an object")
        span = p.get(key)
        if ("rows" if axis else "cols") in p or not (
                isinstance(span, list) and len(span) == 2 and span[0] == nxt
                and isinstance(span[1], int) and not isinstance(span[1], bool)
                and nxt < span[1] <= shape[axis]):
            _fail(where, f"{w}: pieces[{k}].{key} {span!r} must continue at {nxt} and end by "
                         f"{shape[axis]} (all pieces of a tensor split one axis)")
        sub = {k: v for k, v in t.items() if k != "pieces"}
        sub.update((kk, p[kk]) for kk in _PLACEMENT_KEYS if kk in p)
        sub_shape = (span[1] - span[0], shape[1]) if axis == 0 else (shape[0], span[1] - span[0])
        label = f"{name}[{span[0]}:{span[1]}]" if axis == 0 else f"{name}[:, {span[0]}:{span[1]}]"
        piece = _placement(sub, label, sub_shape, dtype, chunks, where)
        out.append(replace(piece, **{key: (span[0], span[1])}))
        nxt = span[1]
    if nxt != shape[axis]:
        _fail(where, f"{w}: pieces cover {key} 0..{nxt}, the tensor has {shape[axis]}")
    return TensorInfo.from_pieces(name, shape, dtype, tuple(out), row_order)


def _placement(t: dict, name: str, shape: tuple, dtype: str, chunks: list,
               where: str) -> TensorInfo:
    """Validate where one tensor (or piece) lies in its chunk."""
    w = f"tensor {name!r}"
    encoding, stored_dtype, role = t.get("encoding"), t.get("stored_dtype"), t.get("role")
    cidx = _int(t.get("chunk"), where, f"{w} chunk", 0, max(len(chunks) - 1, 0))
    if not chunks:
        _fail(where, f"{w} refers to a chunk but 'chunks' is empty")
    chunk = chunks[cidx]
    group = t.get("group")
    if group != chunk.group:
        _fail(where, f"{w}: group {group!r} differs from its chunk's group {chunk.group!r}")
    offset = _int(t.get("offset"), where, f"{w} offset")
    nbytes = _int(t.get("nbytes"), where, f"{w} nbytes")
    enc = get_encoding(encoding, f"{where}: {w}")
    obj, scales = enc.check(t.get(enc.key) if enc.key else None, w, tuple(shape), dtype,
                            stored_dtype, nbytes, where)
    _span_in_chunk(offset, nbytes, chunk, where, w)
    if scales is not None:
        _span_in_chunk(scales[0], scales[1], chunk, where,
                       w + (" absmax" if enc.key == "nf4" else " scales"))
    for key in ("nf4", "int8"):
        if key in t and key != enc.key:
            _fail(where, f"{w}: has an '{key}' object but its encoding is {encoding!r}")
    placed = {enc.key: obj} if enc.key else {}
    return TensorInfo(name, tuple(shape), dtype, stored_dtype, encoding, role, group, cidx,
                      offset, nbytes, row_order=t.get("row_order"), **placed)


def _check_maximus(m, tensors: dict, where: str) -> None:
    if not isinstance(m, dict):
        _fail(where, "'maximus' must be an object")
    if m.get("file") != C.MAXIMUS_FILE:
        _fail(where, f"maximus.file must be {C.MAXIMUS_FILE!r}, got {m.get('file')!r}")
    if not isinstance(m.get("sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", m["sha256"]):
        _fail(where, "maximus.sha256 must be 64 hex digits")
    num_shards = _int(m.get("num_shards"), where, "maximus.num_shards", 1, C.MAX_CHUNKS)
    names = m.get("tensors")
    if not isinstance(names, list) or not names:
        _fail(where, "maximus.tensors must be a non-empty list")
    for n in names:
        info = tensors.get(n) if isinstance(n, str) else None
        if info is None or info.row_order != C.ROW_ORDER_MAXIMUS or not info.pieces:
            _fail(where, f"maximus.tensors names {n!r}, which is not a frequency-ordered "
                         f"sharded tensor")
    if len(set(names)) != len(names):
        _fail(where, "maximus.tensors names a tensor twice")
    shapes = {tensors[n].shape for n in names}
    if len(shapes) != 1:
        _fail(where, f"maximus.tensors must all have one shape [V, H] (the vocabulary table "
                     f"and its head), got {sorted(shapes)}")
    rows = next(iter(shapes))[0]
    size = -(-rows // num_shards)
    if num_shards > rows or (num_shards - 1) * size >= rows:
        _fail(where, f"maximus.num_shards {num_shards} does not split {rows} rows into "
                     f"non-empty shards of ceil({rows}/{num_shards}) = {size} rows (section 9)")
    from lct.format.maximus import shard_bounds
    bounds = shard_bounds(rows, num_shards)
    want = [(a, b) for a, b in zip(bounds, bounds[1:])]
    for n in names:
        got = [p.rows for p in tensors[n].pieces]
        if got != want:
            _fail(where, f"maximus tensor {n!r}: pieces cover rows {got[:4]}"
                         f"{'...' if len(got) > 4 else ''}, but its {num_shards} shards of "
                         f"ceil({rows}/{num_shards}) = {size} rows are {want[:4]}"
                         f"{'...' if len(want) > 4 else ''}: each piece is one shard (section 2.4)")
    prefix = m.get("prefix", "maximus.")
    if not isinstance(prefix, str) or not re.fullmatch(r"maximus\.([\w-]+\.)*", prefix):
        _fail(where, f"maximus.prefix {prefix!r} must be 'maximus.' and a module path ending "
                     f"in '.'")
    fs = m.get("frequency_source")
    if fs is not None:
        if not (isinstance(fs, dict) and isinstance(fs.get("kind", ""), str)
                and isinstance(fs.get("tokens", 0), int) and not isinstance(fs.get("tokens"), bool)):
            _fail(where, "maximus.frequency_source must be an object with a string 'kind' and "
                         "an integer 'tokens'")
        _check_keys(fs, _FREQUENCY_SOURCE_KEYS, "maximus.frequency_source", where)


def _span_in_chunk(offset: int, nbytes: int, chunk: ChunkInfo, where: str, w: str) -> None:
    if offset % C.TENSOR_ALIGNMENT:
        _fail(where, f"{w}: offset {offset} is not a multiple of {C.TENSOR_ALIGNMENT}")
    if offset + nbytes > chunk.decoded_size:
        _fail(where, f"{w}: bytes [{offset}, {offset + nbytes}) run past chunk {chunk.id} "
                     f"({chunk.decoded_size} decoded bytes)")


def _check_no_overlap(spans: list, where: str, what: str) -> None:
    spans = sorted(s for s in spans if s[2] > s[1])
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            _fail(where, f"{what} overlap: {a[3]} [{a[1]}, {a[2]}) and {b[3]} [{b[1]}, {b[2]})")
