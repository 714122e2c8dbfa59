"""Artifact writer: lays out groups into chunks, encodes them, writes data files, and publishes the
artifact directory atomically (temporary name beside the target, then ``os.replace``).

The writer is a small state machine: ``open`` -> ``finished`` or ``aborted``; any call in the
wrong state raises ``RuntimeError`` naming the state.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import struct
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from lct.errors import ArtifactClosedError, LCTError, OptionError, WriteError
from lct.format import codecs
from lct.format import constants as C
from lct.format.codecs import checksum
from lct.format.encodings import get_encoding
from lct.format.layout import ChunkLayout, TensorSpec, align
from lct.format.manifest import ChunkInfo, Manifest, TensorInfo

SYNC_EVERY = 256 * 1024 * 1024

log = logging.getLogger(__name__)


def check_output_path(target: Path) -> None:
    """Refuse an output path LCT cannot create or replace as a folder: a symbolic link, a file,
    a path below a file, or one whose nearest existing folder LCT may not write in (a
    read-only file system, no permission): checked before any work, so that a convert does not
    read and calibrate a model only to fail at its first write.

    Raises:
        LCTError: naming the path and what is in the way.
    """
    if target.is_symlink():
        raise LCTError(f"{target} is a symbolic link; give the path of a folder to create")
    if target.exists() and not target.is_dir():
        raise LCTError(f"{target} is a file, not a folder; give another output path")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise LCTError(f"{target}: cannot create it, {parent} is a file, not a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                read_only = os.statvfs(parent).f_flag & getattr(os, "ST_RDONLY", 1)
                why = os.strerror(errno.EROFS if read_only else errno.EACCES)
                raise LCTError(f"{target}: cannot write in {parent} ({why})")
            return


class OutputLock:
    """An exclusive lock on an output path, held while LCT writes it. On Linux it is a name in
    the abstract socket namespace (``\\0lct-output-`` and a hash of the path): it exists only
    while its process holds it, so a writer killed with SIGKILL leaves nothing behind, not even
    a lock file. Elsewhere it is ``flock`` on a file beside the output (``.NAME.lock``),
    deleted on release. While it is held, temporary folders of earlier runs for the same
    output (``.NAME.tmp-*``, ``.NAME.old-*``) can only be litter of runs that died, and are
    removed.

    Raises:
        LCTError: another process holds the lock.
    """

    def __init__(self, target: Path):
        self.target = target
        self.path = target.parent / f".{target.name}.lock"
        self._fd = None
        self._sock = None

    def acquire(self) -> "OutputLock":
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LCTError(f"{self.target}: cannot create {self.target.parent} "
                           f"({e.strerror or e}); choose a writable folder") from e
        if not self._bind():
            self._flock()
        parent, name = self.target.parent, self.target.name
        old = sorted((p for p in parent.glob(f".{name}.old-*") if p.is_dir() and not p.is_symlink()),
                     key=lambda p: p.stat().st_mtime)
        litter = [p for p in parent.glob(f".{name}.tmp-*") if p.is_dir() and not p.is_symlink()]
        litter += old
        if old and not self.target.exists() and not self.target.is_symlink():
            # A run died between moving the old output aside and putting the new one in place:
            # the old one goes back (the new one may be incomplete).
            os.replace(old[-1], self.target)
            litter.remove(old[-1])
        for p in litter:
            remove_tree(p)
        self._sweep_others()
        return self

    def _sweep_others(self) -> None:
        """Remove the staging folders (``.X.tmp-*``) beside this output that belong to other
        outputs no process is writing (their lock is free: a writer takes it before it makes
        its staging folder), so that a run killed with SIGKILL does not leave a partial
        artifact hidden in the folder until someone writes that same output again."""
        if self._sock is None:
            return      # without the abstract namespace, taking another lock makes a file
        own = self.target.name
        for p in self.target.parent.iterdir():
            m = _STAGING_RE.fullmatch(p.name)
            if m is None or m.group(1) == own or not p.is_dir() or p.is_symlink():
                continue
            other = OutputLock(self.target.parent / m.group(1))
            try:
                if not other._bind():
                    return
            except LCTError:
                continue    # being written right now
            try:
                remove_tree(p)
            finally:
                other.release()

    def _busy(self) -> LCTError:
        return LCTError(f"{self.target}: another LCT process is writing it right now; wait for "
                        f"it to finish")

    def _bind(self) -> bool:
        """Take the abstract socket name; False where the platform has no such namespace."""
        import hashlib
        import socket
        if not hasattr(socket, "AF_UNIX") or not sys.platform.startswith("linux"):
            return False
        key = hashlib.sha256(str(self.target.resolve()).encode()).hexdigest()[:40]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"\0lct-output-{key}")
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise self._busy() from None
            return False
        self._sock = sock
        return True

    def _flock(self) -> None:
        import fcntl
        for _ in range(8):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise LCTError(f"{self.target}: cannot write in {self.target.parent} "
                               f"({e.strerror or e}); choose a writable folder") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._busy() from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a file its previous holder deleted while we waited to open it
                self._fd = fd
                return
            os.close(fd)
        raise LCTError(f"{self.target}: could not take the lock {self.path}")

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # before unlocking: a waiter then sees another inode
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


_STAGING_RE = re.compile(r"\.(.+)\.tmp-[0-9a-f]+")


def remove_tree(p: Path) -> None:
    """Remove a folder LCT wrote (a staging folder, an old output); what cannot be removed is
    said, naming the folder, instead of staying behind unseen."""
    failed = []
    shutil.rmtree(p, onerror=lambda fn, path, info: failed.append((path, info[1])))
    if failed:
        path, exc = failed[0]
        log.warning("could not remove %s (%s: %s); remove it by hand", p, path,
                    getattr(exc, "strerror", None) or exc)


def check_replaceable(target: Path) -> None:
    """Refuse, before any work, to replace an existing non-empty ``target`` whose files this
    process cannot delete (a read-only or immutable folder): the new output would be put in
    place and the old one left behind in a staging folder.

    Raises:
        WriteError: naming ``target``.
    """
    if target.is_dir() and any(target.iterdir()) and not os.access(target, os.W_OK | os.X_OK):
        raise WriteError(f"{target}: cannot replace it: its files cannot be removed "
                         f"(permission denied, or the folder is read-only); nothing was written")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    kernel, the C library or the filesystem cannot."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def swap_into_place(new: Path, target: Path) -> None:
    """Put the complete folder ``new`` at ``target``. An existing target is exchanged with it
    atomically where the system allows (a crash at any instant leaves the old or the new one at
    ``target``), else moved aside first (a crash in between leaves it as ``.NAME.old-*``, which
    the next run holding ``OutputLock`` puts back); the old one is then deleted."""
    if not target.exists():
        os.replace(new, target)
        return
    if _exchange(new, target):
        remove_tree(new)    # now holds the old one
        return
    trash = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
    os.replace(target, trash)
    os.replace(new, target)
    remove_tree(trash)


def foreign_entry(folder: Path, owned) -> str | None:
    """The first entry of ``folder`` that is not a regular file for which ``owned(name)`` holds
    (what LCT would be deleting without having written it), or None."""
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() or not entry.is_file() or not owned(entry.name):
            return entry.name
    return None


# The errors of a write that the user can act on (and the ones a write to a file system LCT
# does not control may give): a full disk, a quota, a read-only file system, a file too large,
# no permission, an I/O error.
WRITE_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EROFS", "EFBIG",
                                                      "EACCES", "EPERM", "EIO")
                         if hasattr(errno, n))


def write_error(e: BaseException, target, what: str = "the artifact"):
    """The ``WriteError`` for ``e`` when it is an ``OSError`` of writing ``target`` (an errno
    of ``WRITE_ERRNOS``, and no file named, or one of ``target`` or of its staging folder
    beside it): one line naming the output and the reason; None for any other error."""
    if not isinstance(e, OSError) or isinstance(e, LCTError) or e.errno not in WRITE_ERRNOS:
        return None
    target = Path(target).absolute()
    names = [n for n in (getattr(e, "filename", None), getattr(e, "filename2", None))
             if n is not None]     # a copy's error names its source, then its destination
    if names and not any(_inside(Path(n).absolute(), target) for n in names):
        return None         # another file's error (a source read): not the output's
    reason = os.strerror(e.errno)
    return WriteError(f"{target}: cannot write {what} ({reason}); nothing was left "
                      f"half-written" + (": free some space and run it again"
                                         if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""))


def _close_quietly(fh) -> None:
    """Close a file being given up: a second error of its flush (a full disk again) would hide
    the first."""
    try:
        fh.close()
    except OSError:
        pass


def _inside(path: Path, target: Path) -> bool:
    """Whether ``path`` is ``target``, in it, or in its staging folder beside it."""
    return path == target or target in path.parents or \
        str(path).startswith(str(target.parent / f".{target.name}."))


def make_staging(tmp: Path, target: Path) -> None:
    """Create the temporary folder beside ``target``; a folder LCT cannot write names the
    user's path, not the temporary one.

    Raises:
        LCTError: the folder is not writable (or another OS error), naming ``target``.
    """
    try:
        tmp.mkdir()
    except OSError as e:
        raise LCTError(f"{target}: cannot write in {target.parent} ({e.strerror or e}); "
                       f"choose a writable folder") from e


def is_artifact_file(name: str, side_files=C.SIDECAR_FILES) -> bool:
    """Whether ``name`` is a file an LCT artifact consists of (FORMAT.md section 1): its
    manifest, Maximus state, data files, or one of ``side_files`` (the ones its manifest
    records; default: the well-known names)."""
    return (name in (C.MANIFEST_NAME, C.MAXIMUS_FILE) or name in side_files
            or re.fullmatch(C.DATA_FILE_PATTERN, name) is not None)


def recorded_side_files(folder: Path) -> tuple:
    """The side files an existing artifact's manifest records (its own words, untrusted: only
    names that are side-file names), plus the well-known names; what LCT wrote there."""
    from lct.format.jsontext import read_json
    from lct.format.manifest import is_side_file_name
    try:
        recorded = read_json(folder / C.MANIFEST_NAME)["source"]["files"]
        names = [n for n in recorded if is_side_file_name(n)]
    except (LCTError, KeyError, TypeError):
        names = []
    return tuple(C.SIDECAR_FILES) + tuple(names)


class ArtifactWriter:
    """Write an artifact directory atomically.

    Example:
        >>> with ArtifactWriter("out.lct") as w:
        ...     w.write_chunk(layout, buffer, "planes", {"level": 1, "frame_size": 1 << 20})
        ...     w.finish(manifest_fields)
    """

    def __init__(self, out_dir, *, max_file_size: int = C.DEFAULT_MAX_FILE_SIZE,
                 overwrite: bool = False, map_fn=map):
        from lct.io.reader import check_address
        check_address(out_dir)
        self.target = Path(out_dir).absolute()
        check_output_path(self.target)
        self.overwrite = overwrite
        # Held until finish/abort: no other LCT process creates or replaces the target between
        # the checks here and the rename in finish.
        self._lock = OutputLock(self.target).acquire()
        try:
            self._check_target()
            self.tmp = self.target.parent / f".{self.target.name}.tmp-{uuid.uuid4().hex[:12]}"
            make_staging(self.tmp, self.target)
        except BaseException:
            self._lock.release()
            raise
        self.artifact_id = uuid.uuid4().hex
        self.max_file_size = max_file_size
        self.map_fn = map_fn
        self.files: list = []
        self.chunks: list = []
        self.tensors: list = []
        self.pieced: dict = {}      # name -> (full TensorSpec, row_order, [piece TensorInfo])
        self.copied: list = []      # side files copied in (each needs a recorded hash)
        self._fh = None
        self._pos = 0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="lct-write")
        self._unsynced = 0
        self._pending = None
        self.state = "open"

    # State machine ----------------------------------------------------------------------------
    def _require_open(self):
        if self.state != "open":
            raise ArtifactClosedError(f"ArtifactWriter is {self.state}; no more writes allowed")

    def _check_target(self) -> None:
        """Refuse to replace anything but an LCT artifact made only of its own files."""
        if not self.target.exists() or (self.target.is_dir() and
                                         not any(self.target.iterdir())):
            return      # an empty folder holds nothing to lose
        if not (self.target.is_dir() and (self.target / C.MANIFEST_NAME).exists()):
            raise LCTError(f"{self.target} exists and is not an LCT artifact; refusing to "
                           f"replace it: give a new folder")
        own = recorded_side_files(self.target)
        other = foreign_entry(self.target, lambda name: is_artifact_file(name, own))
        if other is not None:
            raise LCTError(f"{self.target} holds {other!r}, which is not part of an LCT "
                           f"artifact; refusing to replace the folder (move it first)")
        if not self.overwrite:
            raise LCTError(f"{self.target} already exists", option="overwrite")
        check_replaceable(self.target)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.state == "open":
            self.abort()
        mapped = write_error(exc, self.target)
        if mapped is not None:
            raise mapped from exc
        return False

    # Data files -------------------------------------------------------------------------------
    def _new_file(self):
        self._close_file()
        index = len(self.files)
        name = C.DATA_FILE_TEMPLATE.format(index=index)
        self._fh = open(self.tmp / name, "wb")
        header = struct.pack(C.DATA_HEADER_STRUCT, C.DATA_MAGIC, *C.FORMAT_VERSION, index,
                             bytes.fromhex(self.artifact_id))
        self._fh.write(header.ljust(C.DATA_HEADER_SIZE, b"\0"))
        self._pos = C.DATA_HEADER_SIZE
        self.files.append({"name": name, "size": self._pos})

    def _close_file(self):
        if self._fh is not None:
            fh, self._fh = self._fh, None
            try:
                fh.flush()
                os.fsync(fh.fileno())
            finally:
                _close_quietly(fh)      # a failed flush is the error to report, not the close's

    def _place(self, stored_size: int) -> tuple:
        start = align(self._pos, C.CHUNK_ALIGNMENT)
        if self._fh is None or (start + stored_size > self.max_file_size
                                and self._pos > C.DATA_HEADER_SIZE):
            self._new_file()
            start = self._pos
        if start > self._pos:
            self._fh.write(b"\0" * (start - self._pos))
        return len(self.files) - 1, start

    # Chunks -----------------------------------------------------------------------------------
    def write_chunk(self, layout: ChunkLayout, buffer: np.ndarray, codec: str, params: dict) -> None:
        """Encode ``buffer`` (the decoded bytes laid out as ``layout`` says) and append it.

        The encoded bytes are written (and checksummed) by a background thread while the caller
        prepares the next chunk; at most one write is pending, and its error surfaces on the
        next call or in ``finish``.
        """
        self._require_open()
        if buffer.nbytes != layout.decoded_size:
            raise OptionError(f"buffer has {buffer.nbytes} bytes, the layout says "
                              f"{layout.decoded_size}", option="buffer")
        decoded_sum = checksum(buffer)     # what a decode must give (a decoded copy is held to it)
        stored = codecs.get_codec(codec).encode(buffer, params, self.map_fn)
        if codec != C.CODEC_RAW and len(stored) >= buffer.nbytes:
            codec, params, stored = C.CODEC_RAW, {}, buffer.tobytes()
        self._drain()
        self._pending = self._io.submit(self.write_stored, layout, stored, codec, params,
                                        decoded_sum)

    def _drain(self) -> None:
        """Wait for the pending background write (re-raising its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def write_stored(self, layout: ChunkLayout, stored: bytes, codec: str, params: dict,
                     decoded_checksum: str) -> ChunkInfo:
        """Append already-encoded chunk bytes for ``layout``; ``decoded_checksum`` is the
        ``checksum`` of the bytes they decode to (FORMAT.md section 6)."""
        self._require_open()
        fidx, offset = self._place(len(stored))
        self._fh.write(stored)
        self._pos = offset + len(stored)
        self.files[fidx]["size"] = self._pos
        self._unsynced += len(stored)
        if self._unsynced >= SYNC_EVERY:
            # Flush as we go (on the writer thread, overlapping the next chunk's encoding), so
            # that the final fsync in finish() has little left to wait for.
            self._fh.flush()
            os.fdatasync(self._fh.fileno())
            self._unsynced = 0
        info = ChunkInfo(len(self.chunks), layout.group, fidx, offset, len(stored),
                         layout.decoded_size, codec, dict(params), checksum(stored),
                         decoded_checksum=decoded_checksum)
        self.chunks.append(info)
        for spec in layout.specs:
            enc = get_encoding(spec.encoding)
            placed = {enc.key: enc.placement(spec.blocksize, layout.absmax_offsets.get(
                spec.name, 0), spec.absmax_nbytes)} if enc.key else {}
            entry = TensorInfo(spec.name, tuple(spec.shape), spec.dtype, spec.stored_dtype,
                               spec.encoding, spec.role, spec.group, info.id,
                               layout.offsets[spec.name], spec.nbytes, rows=spec.rows,
                               cols=spec.cols, **placed)
            if spec.piece_of is not None:
                self.pieced[spec.piece_of][2].append(entry)
            else:
                self.tensors.append(entry)
        return info

    def add_pieced(self, spec: TensorSpec, row_order: str | None) -> None:
        """Announce a tensor that will be written as row- or column-range pieces (``piece_of``
        specs)."""
        self._require_open()
        self.pieced[spec.name] = (spec, row_order, [])

    def copy_file(self, src, name: str | None = None) -> None:
        """Copy a side file (config, tokenizer) into the artifact."""
        self._require_open()
        src = Path(src)
        dest = self.tmp / (name or src.name)
        if dest.name != Path(dest.name).name or dest.name in ("", ".", ".."):
            raise LCTError(f"refusing side file name {dest.name!r}")
        shutil.copyfile(src, dest)
        self.copied.append(dest.name)

    @property
    def staging(self) -> Path:
        """The temporary directory being filled (side files may be written here)."""
        return self.tmp

    # Finish -----------------------------------------------------------------------------------
    def finish(self, *, groups: list, source: dict, architecture: dict, policy: dict,
               ties: dict, unmapped: list, created_by: str, maximus: dict | None = None) -> Manifest:
        """Write the manifest, validate it, and move the artifact into place. Every side file
        copied in must have its size and sha256 in ``source["files"]``: a reader checks side
        files against that record, and skips what it does not list."""
        self._require_open()
        recorded = (source or {}).get("files") or {}
        unrecorded = [n for n in self.copied if n not in recorded]
        if unrecorded:
            raise LCTError(f"{self.target}: side file {unrecorded[0]!r} was copied but its "
                           f"hash is not recorded; refusing to write an artifact whose side "
                           f"files cannot be verified")
        self._drain()
        self._io.shutdown(wait=True)
        self._close_file()
        for spec, row_order, pieces in self.pieced.values():
            pieces.sort(key=lambda p: p.span())
            self.tensors.append(TensorInfo.from_pieces(spec.name, spec.shape, spec.dtype,
                                                       tuple(pieces), row_order))
        manifest = Manifest(
            format_version=C.FORMAT_VERSION, created_by=created_by, artifact_id=self.artifact_id,
            source=source, architecture=architecture, policy=policy, files=self.files,
            groups=groups, chunks=self.chunks, tensors={t.name: t for t in self.tensors},
            ties=ties, unmapped=unmapped, maximus=maximus)
        text = manifest.to_json()
        manifest = Manifest.from_json(text, str(self.target / C.MANIFEST_NAME))
        with open(self.tmp / C.MANIFEST_NAME, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        self._check_target()  # something other than LCT may have put it there meanwhile
        swap_into_place(self.tmp, self.target)
        self.state = "finished"
        self._lock.release()
        return manifest

    def abort(self) -> None:
        """Drop everything written so far; nothing that looks like an artifact remains."""
        if self.state != "open":
            return
        from lct.proc import interrupts_held
        with interrupts_held():         # a second Ctrl-C would leave the folder
            try:
                self._io.shutdown(wait=True, cancel_futures=True)
                if self._fh is not None:
                    _close_quietly(self._fh)     # its buffered bytes go with the folder
                    self._fh = None
            finally:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.state = "aborted"
                self._lock.release()
