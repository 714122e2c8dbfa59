"""Reading an artifact: ``lct.open(path)`` -> ``Artifact``.

The manifest is validated before use and checked against the data files on disk (sizes, magic,
artifact id). Chunks are read by byte range, their checksum verified, and decoded into one
buffer; tensors are zero-copy views of that buffer.
"""

from __future__ import annotations

import hashlib
import os
import re
import reprlib
import struct
from concurrent.futures import CancelledError, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from lct.format import codecs
from lct.format.codecs import checksum
from lct.format import constants as C
from lct.errors import (ArtifactClosedError, ArtifactNotFoundError, ChecksumError,
                        CorruptChunkError, EntryNotFoundError, ManifestError, OptionError)
from lct.format.encodings import (BlocksWeight, Int8Weight, NF4Weight, Q6_KWeight,  # noqa: F401
                                  Q8_0Weight, get_encoding, torch_dtype)
from lct.format.manifest import ChunkInfo, Manifest, TensorInfo
from lct.io.store import LocalStore, confined


def _check_data_header(head: bytes, index: int, artifact_id: str, where) -> None:
    """Raise ``ManifestError`` unless ``head`` (the first ``DATA_HEADER_SIZE`` bytes of data file
    ``index``) is the header FORMAT.md section 3 describes: magic, this major version, the file's
    index, the manifest's artifact id, and every reserved byte after them zero."""
    used = C.DATA_HEADER_FIELDS_SIZE
    if len(head) < used or head[:len(C.DATA_MAGIC)] != C.DATA_MAGIC:
        raise ManifestError(f"{where}: not an LCT data file (bad magic)")
    _magic, major, _minor, found, ident = struct.unpack_from(C.DATA_HEADER_STRUCT, head, 0)
    if major != C.FORMAT_VERSION[0] or found != index or ident.hex() != artifact_id:
        raise ManifestError(f"{where}: header (version {major}, index {found}, id "
                            f"{ident.hex()}) does not match the manifest "
                            f"(index {index}, id {artifact_id})")
    if len(head) < C.DATA_HEADER_SIZE:
        raise ManifestError(f"{where}: the file is {len(head)} bytes, shorter than its "
                            f"{C.DATA_HEADER_SIZE}-byte header")
    reserved = head[used:C.DATA_HEADER_SIZE]
    if reserved.count(0) != len(reserved):
        at = used + next(k for k, b in enumerate(reserved) if b)
        raise ManifestError(f"{where}: header byte at offset {at} is {head[at]:#04x}; bytes "
                            f"{used}..{C.DATA_HEADER_SIZE - 1} of the header are reserved and "
                            f"must be zero")


QUANTIZED = (NF4Weight, Int8Weight, BlocksWeight)


class Artifact:
    """An opened LCT artifact. Use as a context manager, or call ``close()``.

    Example:
        >>> with lct.open("gemma.lct") as art:
        ...     w = art.read_tensor("model.layers.0.mlp.up_proj.weight")
    """

    def __init__(self, path, *, verify: bool = True, workers: int | None = None,
                 pin_memory: bool = False, store=None):
        check_address(path)
        self.path = Path(path)
        self.pin_memory = pin_memory
        if not self.path.is_dir():
            raise ArtifactNotFoundError(f"{self.path}: no such artifact directory")
        mpath = self.path / C.MANIFEST_NAME
        if not mpath.is_file():
            if (self.path / "config.json").is_file() and any(self.path.glob("*.safetensors")):
                raise ArtifactNotFoundError(
                    f"{self.path}: a Hugging Face checkpoint (config.json and safetensors), not "
                    f"an LCT artifact (no {C.MANIFEST_NAME}): convert it to one first",
                    option="convert")
            raise ArtifactNotFoundError(f"{self.path}: not an LCT artifact (no {C.MANIFEST_NAME})")
        size = mpath.stat().st_size
        if size > C.MAX_MANIFEST_BYTES:
            raise ManifestError(f"{mpath}: manifest is {size} bytes, cap is {C.MAX_MANIFEST_BYTES}")
        raw = mpath.read_bytes()
        self.manifest = Manifest.from_json(raw, str(mpath))
        # The pin a user can record (lct info prints it) and check (verify/load expect=):
        # the sha256 of the manifest's bytes, which holds every name, shape, type, place and
        # chunk checksum.
        self.digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        self.verify = verify
        self.workers = workers or os.cpu_count() or 1
        # Nice increment of the decode threads (lct.load raises it so that decoding runs on
        # what the transformers import beside it leaves). Set before the first decode.
        self.thread_nice = 0
        self._pool = None
        self._closed = False
        self._maximus = None
        self._maximus_policy: dict = {}
        self.store = store if store is not None else LocalStore(self.path)
        self._check_files()
        # read by us or by transformers
        for name in (*C.SIDECAR_FILES, *self.manifest.side_files(), C.MAXIMUS_FILE):
            if not confined(self.path / name, self.path):
                raise ManifestError(f"{self.path / name}: a symbolic link that leaves the "
                                    f"artifact folder; refusing to follow it")
        if verify:  # what builds the model: a changed config loads a different model silently
            problems = self.check_side_files(C.MODEL_SIDE_FILES)
            if problems:
                raise ChecksumError(problems[0])

    def check_digest(self, expect: str | None) -> None:
        """Raise ``ManifestError`` unless the manifest's digest is ``expect`` (``sha256:`` and
        64 hex digits, as ``lct info`` prints it; None checks nothing), and ``OptionError``
        (``option="expect"``) unless it is such a string or None (the caller's mistake, which
        ``lct verify`` reports before checking anything, not as the artifact's failure)."""
        if expect is None:
            return
        if not isinstance(expect, str):     # bytes, a number, a list: an AttributeError before
            raise OptionError(f"expect must be a string, sha256:<64 hex digits> as lct info "
                              f"prints it, not {type(expect).__name__} {reprlib.repr(expect)}",
                              option="expect")
        want = expect if expect.startswith("sha256:") else f"sha256:{expect}"
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", want):
            raise OptionError(f"expected digest {expect!r}: give sha256:<64 hex digits>, as "
                              f"lct info prints it", option="expect")
        if self.digest != want:
            raise ManifestError(f"{self.path / C.MANIFEST_NAME}: digest {self.digest} is not "
                                f"the expected {want}: this is not the artifact you pinned")

    def check_gaps(self) -> list:
        """Problems with the bytes of the data files that no chunk holds (FORMAT.md section
        3): after each file's header, between its chunks and after the last one, every byte
        MUST be zero; a reader need not read them, a verifying one does, so that every byte of
        a data file is covered by a check (the header's, the chunks' checksums, these).
        ``[(file name, message)]``, one per file with a non-zero byte, naming its offset;
        empty for a remote store (a request per gap: left to the Hub's file hashes)."""
        if not getattr(self.store, "local", False):
            return []
        problems = []
        by_file: dict = {}
        for c in self.manifest.chunks:
            by_file.setdefault(c.file, []).append(c)
        for index, f in enumerate(self.manifest.files):
            spans = sorted((c.offset, c.offset + c.stored_size) for c in by_file.get(index, ()))
            pos = C.DATA_HEADER_SIZE
            for start, end in spans + [(f["size"], f["size"])]:
                if start > pos:
                    gap = self.store.read_range(f["name"], pos, start - pos, f["size"])
                    data = bytes(gap)
                    gap.release()
                    if data.count(0) != len(data):
                        at = pos + next(k for k, b in enumerate(data) if b)
                        problems.append((f["name"], f"{self.store.describe(f['name'])}: byte "
                                        f"{at} is not zero, but it lies between chunks, where "
                                        f"a data file holds only zeros (the file was changed)"))
                        break
                pos = max(pos, end)
        return problems

    def check_side_files(self, names=None) -> list:
        """Problems with the side files ``names`` (config, tokenizer, ...): each one copied from
        the source must still equal the source's size and sha256 recorded in the manifest
        (``source.files``). Returns one message per problem (empty: all match)."""
        from lct.hashing import sha256_file
        recorded = self.manifest.source.get("files")  # untrusted: a dict only if well formed
        recorded = recorded if isinstance(recorded, dict) else {}
        problems = []
        for name in self.manifest.side_files() if names is None else names:
            want = recorded.get(name)
            if not isinstance(want, dict):
                continue  # not copied from the source (or an artifact that predates the rule)
            path = self.path / name
            if not path.is_file():
                problems.append(f"{path}: missing (the manifest records it from the source)")
                continue
            size = path.stat().st_size  # (links leaving the folder were refused at open)
            if size != want.get("size"):
                problems.append(f"{path}: differs from the source file the manifest records "
                                f"(size {size}, expected {want.get('size')}); it was changed "
                                f"after conversion")
            elif (got := sha256_file(path)) != want.get("sha256"):
                problems.append(f"{path}: differs from the source file the manifest records "
                                f"(sha256 {got[:12]}..., expected "
                                f"{str(want.get('sha256'))[:12]}..., same size); it was "
                                f"changed after conversion")
        return problems

    # Lifecycle ---------------------------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        """Release the worker threads and the mapped data files. Reads still running in other
        threads, and any read after this, end in ``ArtifactClosedError``."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.store.close()

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._closed:
            raise ArtifactClosedError(f"{self.path}: the artifact is closed")
        if self._pool is None:
            from lct.proc import lower_thread_priority
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="lct-decode",
                                            initializer=lower_thread_priority,
                                            initargs=(self.thread_nice,))
        return self._pool

    def _check_files(self) -> None:
        for i, f in enumerate(self.manifest.files):
            p = self.store.describe(f["name"])
            actual = self.store.size(f["name"])
            if actual != f["size"]:
                raise ManifestError(f"{p}: file is {actual} bytes, manifest says {f['size']} "
                                    f"(truncated or replaced?)")
            view = self.store.read_range(f["name"], 0, min(C.DATA_HEADER_SIZE, actual), actual)
            head = bytes(view)
            view.release()
            _check_data_header(head, i, self.manifest.artifact_id, p)

    # Views ----------------------------------------------------------------------------------
    @property
    def groups(self) -> list:
        """Group names in load order."""
        return list(self.manifest.groups)

    @property
    def tensor_names(self) -> list:
        """Names of all tensors, including tied names."""
        return list(self.manifest.tensors) + list(self.manifest.ties)

    def tensor_info(self, name: str) -> TensorInfo:
        """The manifest entry of ``name`` (a tied name resolves to the stored tensor)."""
        real = self.manifest.ties.get(name, name)
        try:
            return self.manifest.tensors[real]
        except KeyError:
            raise EntryNotFoundError(f"{self.path}: no tensor named {name!r}") from None

    # Chunks ----------------------------------------------------------------------------------
    def read_stored(self, chunk: ChunkInfo, check: bool = True) -> memoryview:
        """The stored bytes of ``chunk`` (zero-copy from a local file, or fetched by one range
        request from a remote store), checksum-verified unless verification is off or
        ``check`` is False (``decode_verified`` checks them beside the decode). Call
        ``release`` once they are decoded."""
        f = self.manifest.files[chunk.file]
        view = self.store.read_range(f["name"], chunk.offset, chunk.stored_size, f["size"])
        if len(view) != chunk.stored_size:
            raise CorruptChunkError(f"{self.store.describe(f['name'])}: chunk {chunk.id} "
                                    f"({chunk.group}) is truncated: got {len(view)} of "
                                    f"{chunk.stored_size} bytes")
        if self.verify and check:
            self.check(chunk, view)
        return view

    def will_need(self, chunks) -> None:
        """Hint that ``chunks`` will be read soon: a local store starts reading them into the
        page cache in the background; other stores ignore the hint."""
        hint = getattr(self.store, "will_need", None)
        if hint is None:
            return
        for chunk in chunks:
            f = self.manifest.files[chunk.file]
            hint(f["name"], chunk.offset, chunk.stored_size, f["size"])

    def release(self, chunk: ChunkInfo) -> None:
        """Let go of a decoded chunk's stored bytes (drops mapped pages from this process)."""
        self.store.release(self.manifest.files[chunk.file]["name"], chunk.offset,
                           chunk.stored_size)

    def check(self, chunk: ChunkInfo, stored) -> None:
        """Raise ``ChecksumError`` unless ``stored`` matches the chunk's checksum."""
        found = checksum(stored)
        if found != chunk.checksum:
            fname = self.manifest.files[chunk.file]["name"]
            raise ChecksumError(f"{self.store.describe(fname)}: chunk {chunk.id} (group {chunk.group!r}, "
                                f"offset {chunk.offset}) checksum mismatch: expected "
                                f"{chunk.checksum}, found {found}")

    def decode(self, chunk: ChunkInfo, stored, out: np.ndarray | None = None) -> np.ndarray:
        """Decode a chunk's stored bytes into ``out`` (a uint8 buffer of its decoded size, as
        a stream recycles them) or a fresh one."""
        codec = codecs.get_codec(chunk.codec)
        where = f"{self.path / self.manifest.files[chunk.file]['name']}: chunk {chunk.id} ({chunk.group})"
        codec.check_stored(stored, chunk.decoded_size, chunk.params, where)  # before allocating
        if out is not None and (out.dtype != np.uint8 or out.size != chunk.decoded_size):
            raise OptionError(f"{where}: out must be a uint8 buffer of {chunk.decoded_size} "
                              f"bytes, got {out.dtype} of {out.size}", option="out")
        try:
            out = self._alloc(chunk.decoded_size) if out is None else out
        except MemoryError:
            raise CorruptChunkError(f"{where}: declares {chunk.decoded_size:,} decoded bytes, "
                                    f"more than this machine can allocate") from None
        map_fn = self.pool.map if chunk.decoded_size > chunk.params.get("frame_size", 1 << 62) else map
        codec.decode(stored, out, chunk.params, map_fn, where)
        return out

    def decode_verified(self, chunk: ChunkInfo, stored, out: np.ndarray | None = None) \
            -> np.ndarray:
        """``decode`` of stored bytes read with ``read_stored(check=False)``, their checksum
        computed on the decode pool beside the decode's frames instead of before them (on 16
        cores the hash before the decode was a fifth of a chunk's time). Unless verification
        is off, the decoded buffer is returned only once the checksum matched: a mismatch is
        the ``ChecksumError``, whatever the codec made of the bytes."""
        if not self.verify:
            return self.decode(chunk, stored, out)
        checking = self.pool.submit(self.check, chunk, stored)
        try:
            out = self.decode(chunk, stored, out)
        except Exception:
            checking.result()       # damaged bytes are a ChecksumError, not the codec's error
            raise
        except BaseException:       # an interrupt is the caller's, whatever the checksum says
            checking.cancel()
            raise
        checking.result()
        return out

    def _alloc(self, size: int) -> np.ndarray:
        """A decoded-chunk buffer; page-locked (pinned) when the artifact feeds a GPU, so that
        host-to-device copies can be asynchronous without a staging copy."""
        if self.pin_memory:
            import torch
            return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(size, dtype=np.uint8)

    def read_chunk(self, chunk_id: int) -> np.ndarray:
        """Read, verify and decode chunk ``chunk_id``."""
        chunk = self.manifest.chunks[chunk_id]
        if self._closed:
            raise ArtifactClosedError(f"{self.path}: the artifact is closed (chunk {chunk_id})")
        stored = self.read_stored(chunk, check=False)
        try:
            return self.decode_verified(chunk, stored)
        except (CancelledError, RuntimeError) as e:
            if self._closed:  # close() cancelled the frames this decode was waiting for
                raise ArtifactClosedError(f"{self.path}: closed while chunk {chunk_id} "
                                          f"({chunk.group}) was being decoded") from e
            raise
        finally:
            self.release_stored(chunk, stored)

    def release_stored(self, chunk: ChunkInfo, stored: memoryview) -> None:
        """Let go of a chunk's stored bytes once it is decoded. When a decode was interrupted
        (Ctrl-C) while decode threads still hold slices of them, they stay until those threads
        finish, so that the interrupt, not a BufferError, reaches the caller."""
        try:
            stored.release()
        except BufferError:
            return
        self.release(chunk)

    # Tensors ---------------------------------------------------------------------------------
    @property
    def cast_dtype(self) -> str | None:
        """The dtype the conversion cast every float tensor to (``policy.dtype``), or None."""
        cast = self.manifest.policy.get("dtype")
        return cast if cast in C.FLOAT_DTYPES else None

    @property
    def closed(self) -> bool:
        return self._closed

    def lossy_dtype(self, info: TensorInfo) -> str:
        """The dtype an NF4/int8 tensor dequantizes to: its source dtype, or ``cast_dtype``, so
        that it matches the lossless tensors it runs with."""
        return self.cast_dtype or info.dtype

    def tensor_from_buffer(self, info: TensorInfo, buf: np.ndarray, dequantize: bool = True):
        """Build tensor (or piece) ``info`` as a zero-copy view of its decoded chunk ``buf``."""
        import torch
        raw = torch.from_numpy(buf[info.offset: info.offset + info.nbytes])
        enc = get_encoding(info.encoding)
        if not enc.lossy:
            return raw.view(torch_dtype(info.stored_dtype)).view(info.shape)
        a, n = info.scales_span() or (0, 0)     # Q8_0 keeps its scales in its blocks
        w = enc.weight(info, raw, torch.from_numpy(buf[a: a + n]).view(torch.float32),
                       self.lossy_dtype(info))
        return w.dequantize() if dequantize else w

    def assemble(self, info: TensorInfo, bufs: dict, dequantize: bool = True,
                 id_order: bool = True):
        """Tensor ``info`` from its decoded chunk buffers ``{chunk_id: buffer}``.

        A single-chunk tensor is a zero-copy view. A sharded tensor is concatenated from its
        pieces and, when stored in frequency order, put back in token-id order using the
        artifact's Maximus permutation (unless ``id_order`` is False).
        """
        if not info.pieces:
            return self.tensor_from_buffer(info, bufs[info.chunk], dequantize)
        import torch
        parts = [self.tensor_from_buffer(p, bufs[p.chunk], dequantize=False)
                 for p in info.pieces]
        perm = self.maximus_state()["maximus.id_to_row"] \
            if id_order and info.row_order == C.ROW_ORDER_MAXIMUS else None
        enc = get_encoding(info.encoding)
        if enc.lossy:
            w = enc.join(info, parts, perm, self.lossy_dtype(info))
            return w.dequantize() if dequantize else w
        table = torch.cat(parts, dim=info.piece_axis)
        return table[perm] if perm is not None else table

    def maximus_state(self) -> dict:
        """The artifact's Maximus state tensors (``maximus.*``), checksum-verified and validated.

        Raises:
            ManifestError: the artifact has no Maximus state, or the file is corrupt or invalid.
        """
        if self._maximus is None:
            m = self.manifest.maximus
            if m is None:
                raise ManifestError(f"{self.path}: the artifact has no Maximus shard state")
            from lct.errors import MaximusStateError
            from lct.format.maximus import module_tensors, read_state_file, validate_state
            from lct.hashing import sha256_file
            path = self.path / m["file"]
            if not path.is_file():
                raise ArtifactNotFoundError(f"{path}: Maximus state file missing")
            if self.verify and sha256_file(path) != m["sha256"]:
                raise ChecksumError(f"{path}: sha256 does not match the manifest")
            prefix = m.get("prefix", "maximus.")
            module_path = prefix[len("maximus."):-1]
            # The manifest checked that every listed tensor is [V, H] in N pieces (section 2.4).
            rows, dim = self.manifest.tensors[m["tensors"][0]].shape
            try:
                tensors, modules, _ = read_state_file(path)
                own = module_tensors(tensors, prefix)
                validate_state(own, modules, module_path, rows, dim, m["num_shards"], str(path))
            except MaximusStateError as e:
                raise ManifestError(str(e)) from e
            self._maximus = own
            self._maximus_policy = dict(modules[module_path]["policy"])
        return self._maximus

    def maximus_policy(self) -> dict:
        """The stored Maximus policy (shards, budget, rates) of the state file, read with the
        tensors by ``maximus_state``."""
        self.maximus_state()
        return self._maximus_policy

    def decode_group(self, group: str) -> dict:
        """Read and decode every chunk of ``group``: ``{chunk_id: buffer}``."""
        return {c.id: self.read_chunk(c.id) for c in self.manifest.group_chunks(group)}

    def read_group(self, group: str, dequantize: bool = True) -> dict:
        """All tensors of ``group`` as ``{name: tensor}`` (NF4 and int8 ones as ``NF4Weight`` and
        ``Int8Weight`` unless dequantized).

        Tied names whose stored tensor is in this group are included under both names.
        """
        if not self.manifest.has_group(group):
            raise EntryNotFoundError(f"{self.path}: no group named {group!r}; groups: "
                                     f"{self.groups}")
        return self.assemble_group(group, self.decode_group(group), dequantize)

    def assemble_group(self, group: str, bufs: dict, dequantize: bool = True) -> dict:
        """Every tensor of ``group`` from its decoded chunk buffers ``{chunk_id: buffer}``,
        tied names included (zero-copy views where a tensor is one chunk's bytes)."""
        out = {t.name: self.assemble(t, bufs, dequantize)
               for t in self.manifest.group_tensors(group)}
        for tied, real in self.manifest.ties.items():
            if real in out:
                out[tied] = out[real]
        return out

    def stream(self, groups=None, prefetch: int | None = None, dequantize: bool = False,
               chunks=None, recycle: bool = False, cached=None):
        """Decoded groups in order, ``prefetch`` of them decoding ahead (default
        ``DEFAULT_PREFETCH``, 2); with ``recycle``, buffers the consumer hands back
        (``Group.recycle``) are decoded into again; with ``cached`` (a decoded-cache entry,
        ``lct.io.cache.lookup``), the chunks are mapped from it; see ``GroupStream``.

        Example:
            >>> with lct.open("m.lct") as art:
            ...     for group in art.stream(prefetch=2):
            ...         print(group.name, len(group.tensors))
        """
        from lct.io.stream import DEFAULT_PREFETCH, GroupStream
        return GroupStream(self, groups, dequantize=dequantize, chunks=chunks, recycle=recycle,
                           prefetch=DEFAULT_PREFETCH if prefetch is None else prefetch,
                           cached=cached)

    def read_tensor(self, name: str, dequantize: bool = True):
        """One tensor by name (decodes its chunk(s); use ``read_group`` for many)."""
        info = self.tensor_info(name)
        bufs = {p.chunk: self.read_chunk(p.chunk) for p in info.placements()}
        return self.assemble(info, bufs, dequantize)


# The schemes of the addresses LCT reads and writes besides a local folder: the Hub's and the
# object stores' (lct.cloud's registry; tests/test_cloud.py holds the two equal).
ADDRESS_SCHEMES = ("hf", "s3", "gs", "az")


def check_address(path) -> None:
    """Refuse an address whose scheme LCT does not speak (``https://``, ``ftp://``), which a
    path would take for a local folder named ``https:``: LCT's are a local folder, ``hf://``
    and the object stores' (``ADDRESS_SCHEMES``).

    Raises:
        ArtifactNotFoundError: naming the address and what LCT reads.
    """
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", str(path))
    if scheme and scheme[1].lower() not in ADDRESS_SCHEMES:
        raise ArtifactNotFoundError(f"{path}: {scheme[1]}:// is not an address LCT reads or "
                                    f"writes: a local folder, hf://org/name[@rev], "
                                    f"s3://bucket/prefix (any S3-compatible store), "
                                    f"gs://bucket/prefix or az://container/prefix")


def open_artifact(path, *, verify: bool = True, workers: int | None = None,
                  pin_memory: bool = False, store=None) -> Artifact:
    """Open the LCT artifact at ``path`` (a directory).

    Args:
        path: the artifact directory.
        verify: check every chunk's checksum as it is read.
        workers: decode threads (default: all cores).
        pin_memory: decode into page-locked host memory (for asynchronous copies to a GPU).
        store: where the data files are read from (default: ``LocalStore(path)``; a remote
            store streams them by HTTP range requests while ``path`` holds the small files);
            the artifact owns it: it is closed with it, or at once if the open fails.

    Returns:
        An ``Artifact``; close it (or use ``with``) to release its threads.

    Raises:
        ArtifactNotFoundError: no such directory, manifest or data file.
        ManifestError: the manifest is invalid or disagrees with the data files.
        UnsupportedVersionError: a newer major version, or an unknown codec/dtype.
    """
    try:
        return Artifact(path, verify=verify, workers=workers, pin_memory=pin_memory, store=store)
    except BaseException:
        if store is not None:
            store.close()
        raise
