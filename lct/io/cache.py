"""The local decoded cache: what a load decoded, kept on disk so that a later load of the same
artifact maps it lazily instead of reading and decoding it again, as ``from_pretrained`` maps a
page-cached safetensors file.

One entry per artifact, named by its manifest's digest (``lct info``'s ``sha256:``, which pins
every tensor and every chunk's checksum): ``<root>/<64 hex digits>/`` holding ``decoded.bin``
(every chunk's decoded bytes, each at the next multiple of 4096 in chunk-id order, so that the
offsets follow from the manifest alone) and ``entry.json`` (the digest, the artifact it was
filled from, its size). Nothing in an entry is trusted: the manifest gives the layout, the data
file must have exactly that size, and every chunk's bytes must give the ``decoded_checksum``
that the artifact's own manifest pins (FORMAT.md section 6, since format 1.6), checked as a load
first maps the chunk (about 0.05 s per GB of a core, beside the first forward's own page-ins),
whatever the load's ``verify``. A chunk that differs (the disk's change, an entry swapped in
from another artifact, an edit) is decoded from the artifact instead, and the entry removed, so
that the next load fills it again: a damaged entry costs time, never a wrong weight. An artifact
written before format 1.6 pins no decoded bytes, so no copy of it is kept or used. Its last use
is ``entry.json``'s mtime.

An entry is filled by ``fill`` (``lct cache fill``: the groups decoded and written a few at a
time, in the caller's thread), or after a load that checked its chunks' checksums, from the
buffers the load decoded (the model's weights, so nothing is copied; each one's xxh3 taken as
it was decoded and checked again as it is written, so that weights changed in place meanwhile
are never kept), by a background thread at the lowest CPU and I/O priority; or, with
``LCT_CACHE_IN_PLACE=1``, decoded into directly by the load (``StagedFill``: the weights are
the entry's pages). Either way it is
written into a staging folder ``.fill-<random>`` that is renamed into place once whole: a
half-written entry never looks like one. The filling process holds a lock on the staging
folder's marker; a staging folder nobody holds is what a process that ended first left, and
``prune`` removes it. Before filling, least-recently-used entries are evicted to keep the cache
within its size budget (``LCT_CACHE_MAX``, default ``DEFAULT_MAX_BYTES``), and nothing is
written that would leave less of the disk free than ``min_free_bytes`` says (``LCT_CACHE_MIN_FREE``,
default the larger of ``MIN_FREE_BYTES`` and 5 % of the disk).

A load maps an entry wherever its pages are (``LCT_CACHE_MAP=always``, the default). With
``LCT_CACHE_MAP=auto`` it maps one only where that is the faster start (``choose``): where at
least ``MAP_RESIDENT`` of its data file is in the page cache (``CachedChunks.resident``,
``mincore`` on a sample of pages); where less is, it decodes the artifact's fewer bytes, leaves
the entry as it is, and reads it into memory afterwards (``warm``) for the next start. ``keep`` is what a loader that maps an entry, or
``lct pull``, does to keep one for the next start.

Where: ``LCT_CACHE_DIR``, else ``$XDG_CACHE_HOME/lct/decoded``, else ``~/.cache/lct/decoded``.
``LCT_CACHE=1``/``0`` turns it on or off whatever the default (``DEFAULT_ON``); ``lct.load(...,
cache=True/False)`` decides for one load. Only folders LCT made (an ``entry.json`` that says so,
or a staging folder holding ``FILL_MARKER``) are ever removed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lct.errors import LCTError, WriteError
from lct.format.jsontext import read_json
from lct.units import human

log = logging.getLogger(__name__)

ENV_SWITCH = "LCT_CACHE"
ENV_DIR = "LCT_CACHE_DIR"
ENV_MAX = "LCT_CACHE_MAX"
ENV_MIN_FREE = "LCT_CACHE_MIN_FREE"
ENV_MAP = "LCT_CACHE_MAP"
ENV_IN_PLACE = "LCT_CACHE_IN_PLACE"   # 1: a first start decodes into the entry (StagedFill)
MAP_MODES = ("auto", "always")      # LCT_CACHE_MAP: choose per start (choose), or always map
# Measured (docs/LOADING.md): a start that decodes the artifact because the copy is on the disk
# leaves the copy on the disk for the next start, which was then 2.1x from_pretrained's first
# token instead of 0.75x; a restart soon after a cold start is common (a server redeployed), so
# the default maps the copy wherever its pages are, and reading it in warms it for the next.
DEFAULT_MAP_MODE = "always"
MAP_RESIDENT = 0.5                  # map an entry where at least this share of it is in memory
RESIDENCY_SAMPLES = 64              # windows of an entry's data file asked about (mincore)...
RESIDENCY_WINDOW = 8                # ...of this many pages each, spread evenly over the file
DEFAULT_ON = True
DEFAULT_MAX_BYTES = 64 << 30
MIN_FREE_BYTES = 2 << 30
CANCEL_WAIT_S = 10.0                # a Ctrl-C gives cancelled fills this long to clean up
ALIGN = 4096
DATA = "decoded.bin"
ENTRY = "entry.json"
FILL_PREFIX = ".fill-"
FILL_MARKER = ".lct-cache-fill"
ENTRY_MAX_BYTES = 1 << 20            # entry.json: a few keys
KIND = "lct-decoded-cache"
_DIGEST_DIR = re.compile(r"[0-9a-f]{64}")


def cache_dir() -> Path:
    """The cache's folder: ``LCT_CACHE_DIR``, else the XDG cache home's ``lct/decoded``."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "lct" / "decoded"


def enabled(asked: bool | None = None) -> bool:
    """Whether a load uses the cache: ``asked`` when given, else ``LCT_CACHE`` (1/0, true/false,
    on/off), else ``DEFAULT_ON``."""
    if asked is not None:
        return bool(asked)
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    if value:
        raise LCTError(f"{ENV_SWITCH}={value!r}: use 1 or 0")
    return DEFAULT_ON


def max_bytes() -> int:
    """The cache's size budget: ``LCT_CACHE_MAX`` (``64GiB``, ``500GB``...), else
    ``DEFAULT_MAX_BYTES``."""
    from lct.units import parse_size
    value = os.environ.get(ENV_MAX)
    return parse_size(value, ENV_MAX) if value else DEFAULT_MAX_BYTES


def min_free_bytes(total: int) -> int:
    """What the cache leaves free of a disk of ``total`` bytes: ``LCT_CACHE_MIN_FREE``
    (``10GiB``, ``0GB``...), else the larger of ``MIN_FREE_BYTES`` and 5 % of the disk."""
    from lct.units import parse_size
    value = os.environ.get(ENV_MIN_FREE)
    return parse_size(value, ENV_MIN_FREE) if value else max(MIN_FREE_BYTES, total // 20)


def map_mode() -> str:
    """``LCT_CACHE_MAP``: ``always`` (the default, ``DEFAULT_MAP_MODE``: map every entry) or
    ``auto`` (a load maps an entry or decodes the artifact, whichever reads fewer bytes from
    the disk, ``choose``)."""
    value = os.environ.get(ENV_MAP, "").strip().lower() or DEFAULT_MAP_MODE
    if value not in MAP_MODES:
        raise LCTError(f"{ENV_MAP}={value!r}: use {' or '.join(MAP_MODES)}")
    return value


def layout(manifest) -> tuple:
    """``({chunk id: (offset, size)}, total bytes)`` of an entry's data file for ``manifest``:
    each chunk's decoded bytes at the next multiple of ``ALIGN``, in chunk-id order."""
    at, spans = 0, {}
    for chunk in sorted(manifest.chunks, key=lambda c: c.id):
        spans[chunk.id] = (at, chunk.decoded_size)
        at += -(-chunk.decoded_size // ALIGN) * ALIGN
    return spans, at


def _hex(digest: str) -> str:
    return digest.removeprefix("sha256:")


def pins(manifest) -> dict | None:
    """``{chunk id: its pinned decoded xxh3_64}`` (FORMAT.md section 6, as integers); None for
    an artifact written before format 1.6, whose manifest pins no decoded bytes (no copy of it
    is kept or used)."""
    if any(c.decoded_checksum is None for c in manifest.chunks):
        return None
    return {c.id: int(c.decoded_checksum.partition(":")[2], 16) for c in manifest.chunks}


def unpinned(art) -> str:
    """Why the cache neither keeps nor uses a copy of ``art``, else ``""``."""
    if pins(art.manifest) is not None:
        return ""
    major, minor = art.manifest.format_version
    return (f"{art.path} is format {major}.{minor}: its manifest pins no decoded bytes "
            f"(decoded_checksum, format 1.6), so no decoded copy of it is kept; convert it "
            f"again to use the cache")


@dataclass
class Entry:
    """One cached artifact: its digest, the artifact it was filled from, its bytes, last use."""

    digest: str
    path: Path
    artifact: str
    size: int
    last_used: float


def _regular(path: Path) -> bool:
    """Whether ``path`` is a regular file, not a link (nothing else in the cache is opened)."""
    return path.is_file() and not path.is_symlink()


def _read_entry(folder: Path) -> Entry | None:
    """The entry in ``folder``, or None where it is not one of LCT's (or is damaged)."""
    try:
        if folder.is_symlink() or not _regular(folder / ENTRY) or \
                (folder / ENTRY).stat().st_size > ENTRY_MAX_BYTES:
            return None
        meta = read_json(folder / ENTRY, LCTError, ENTRY_MAX_BYTES)
        if not isinstance(meta, dict) or meta.get("kind") != KIND or \
                _hex(str(meta.get("digest"))) != folder.name or \
                not isinstance(meta.get("size"), int) or isinstance(meta.get("size"), bool):
            return None
        return Entry(str(meta["digest"]), folder, str(meta.get("artifact", "")), meta["size"],
                     (folder / ENTRY).stat().st_mtime)
    except (OSError, LCTError):     # LCTError: not JSON, or past the caps (deep nesting)
        return None


def entries(root: Path | None = None) -> list:
    """Every entry of the cache, least recently used first."""
    root = Path(root) if root is not None else cache_dir()
    if not root.is_dir():
        return []
    found = [e for d in root.iterdir() if _DIGEST_DIR.fullmatch(d.name) and d.is_dir()
             for e in [_read_entry(d)] if e is not None]
    return sorted(found, key=lambda e: e.last_used)


def _stale_fills(root: Path) -> list:
    """Staging folders no running fill holds (its process ended before publishing)."""
    out = []
    for d in root.iterdir() if root.is_dir() else ():
        if d.name.startswith(FILL_PREFIX) and not d.is_symlink() and _regular(d / FILL_MARKER):
            try:
                fd = os.open(d / FILL_MARKER, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                out.append(d)         # nobody holds it (the lock goes with this fd)
            except OSError:
                pass                  # a running fill
            finally:
                os.close(fd)
    return out


def orphaned(entry: Entry) -> bool:
    """Whether the artifact folder ``entry`` was filled from (``Entry.artifact``) is gone or now
    holds another artifact (its manifest's digest is not the entry's, or it cannot be read):
    the entry of a re-converted model or of a removed folder. An entry serves its artifact
    wherever it is (a copy elsewhere, the same artifact streamed again from a store), which
    this cannot see."""
    from lct.io.reader import open_artifact
    folder = Path(entry.artifact)
    if not entry.artifact or not folder.is_absolute() or not folder.is_dir():
        return True
    try:
        with open_artifact(folder, verify=False) as art:
            return art.digest != entry.digest
    except LCTError:
        return True


def prune(root: Path | None = None, *, keep_bytes: int | None = None, digest: str | None = None,
          everything: bool = False, orphans: bool = False) -> list:
    """Remove entries: ``digest``'s (the whole digest, or a prefix of it only one entry has,
    as ``lct cache list`` prints it), ``everything``, those whose artifact folder is gone or
    holds another artifact now (``orphans``: ``orphaned``), or the least recently used until
    the rest hold at most ``keep_bytes``; and always the staging folders of fills that ended
    without finishing. Returns the removed entries. Only LCT's own folders are touched.

    Raises:
        LCTError: ``digest`` names no entry, or more than one."""
    root = Path(root) if root is not None else cache_dir()
    removed = []
    current = entries(root)
    total = sum(e.size for e in current)
    if digest is not None:
        want = _hex(digest.strip().lower())
        named = [e for e in current if want and _hex(e.digest).startswith(want)]
        if len(named) != 1:
            raise LCTError(f"{root}: {'no entry' if not named else f'{len(named)} entries'} "
                           f"of the decoded cache {'has' if not named else 'have'} digest "
                           f"{digest!r}; lct cache list shows them", option="digest")
        digest = named[0].digest
    for e in current:
        if everything or (digest is not None and digest == e.digest) or \
                (keep_bytes is not None and total > keep_bytes) or (orphans and orphaned(e)):
            shutil.rmtree(e.path, ignore_errors=True)
            if not e.path.exists():
                total -= e.size
                removed.append(e)
    for d in _stale_fills(root):
        shutil.rmtree(d, ignore_errors=True)
    return removed


class CachedChunks:
    """A hit: the entry's data file mapped copy-on-write (pages are read from the page cache as
    they are first touched, writes stay private), each chunk a view of it, its xxh3 checked
    against the one ``art``'s manifest pins on its first use."""

    def __init__(self, entry: Entry, spans: dict, size: int, art, pinned: dict):
        self.entry, self.spans, self.art, self.pinned = entry, spans, art, pinned
        # the one open file every mapping of this hit is made from (``mapped`` too): a file
        # put in the entry's place later is never mapped beside the one checked
        fd = os.open(entry.path / DATA, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        self._file = os.fdopen(fd, "rb")
        self._map = np.memmap(self._file, dtype=np.uint8, mode="c", shape=(size,))
        self._checked: set = set()
        self._at = {at: cid for cid, (at, _) in spans.items()}
        self.damaged: list = []         # chunk ids whose bytes differed (decoded instead)

    def chunk(self, cid: int) -> np.ndarray:
        """Chunk ``cid``'s decoded bytes: a view of the mapping, or, where its checksum is not
        the one the manifest pins, its decode from the artifact (and the entry is removed)."""
        if self._matches(cid):
            return self._view(cid)
        return self.art.read_chunk(cid)

    def check(self) -> bool:
        """Check every chunk's hash now; False (and the entry removed) where one differs."""
        return all(self._matches(cid) for cid in sorted(self.spans))

    def resident(self) -> float | None:
        """The share of the entry's data file in the page cache (0 to 1), from ``mincore`` on
        ``RESIDENCY_SAMPLES`` windows of ``RESIDENCY_WINDOW`` pages spread evenly over it: a few
        hundred pages whatever the size (under a millisecond for 5 GB), which touches none of
        them. None where ``mincore`` cannot be asked."""
        import mmap

        from lct.io.store import residency
        page, size = mmap.PAGESIZE, self._map.size
        pages = -(-size // page)
        if pages == 0:
            return 1.0
        windows = min(RESIDENCY_SAMPLES, pages)
        address, seen, asked = self._map.ctypes.data, 0, 0
        for i in range(windows):
            first = i * pages // windows
            n = min(RESIDENCY_WINDOW, pages - first)
            vec = residency(address, first * page, min(n * page, size - first * page))
            if vec is None:
                return None
            seen, asked = seen + int(vec.sum()), asked + len(vec)
        return seen / asked

    def will_need(self, cids) -> None:
        """Ask the kernel to read chunks ``cids`` of the entry ahead (``lct.io.store.will_need``),
        as the stream does for an artifact's chunks: where part of the copy is on the disk, it
        comes in large requests a group ahead of the load, not a page at a time as the views
        are first touched."""
        from lct.io.store import will_need
        will_need(self.entry.path / DATA, [self.spans[cid] for cid in cids], os.O_NOFOLLOW)

    def put(self, buf) -> None:
        """The consumer is done with ``buf``, a chunk's view from ``chunk`` (``Group.recycle``
        of a stream that maps this entry): its pages leave this process's memory
        (``MADV_DONTNEED`` on the whole pages it spans), so that a loader which copies every
        tensor out (vLLM's) holds a window of the copy at a time, not all of it beside the
        copies; they stay in the page cache for the next start. The chunk is checked again if
        it is used again. A buffer that is not such a view (a damaged chunk's decode) is left
        to the garbage collector."""
        import mmap
        base = self._map.ctypes.data
        at = buf.ctypes.data - base if isinstance(buf, np.ndarray) else -1
        cid = self._at.get(at)
        if cid is None or buf.size != self.spans[cid][1]:
            return
        self._checked.discard(cid)
        page = mmap.PAGESIZE
        start, end = -(-at // page) * page, (at + buf.size) // page * page
        if end > start:
            self._map._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def mapped(self, buf, start: int, size: int) -> np.ndarray | None:
        """Bytes ``start:start + size`` of ``buf``, a checked chunk's view from ``chunk``, as a
        copy-on-write mapping of their own (the same file's pages, nothing copied), or None
        where ``buf`` is not such a view (a damaged chunk's decode) or its check was given
        back (``put``). A loader that hands a runtime these bytes as a parameter (vLLM's)
        lets the runtime free them: the mapping ends with the last tensor viewing it, which
        the hit's one mapping of the whole entry would not."""
        base = self._map.ctypes.data
        at = buf.ctypes.data - base if isinstance(buf, np.ndarray) else -1
        cid = self._at.get(at)
        if cid is None or cid not in self._checked or buf.size != self.spans[cid][1] or \
                start < 0 or size <= 0 or start + size > buf.size:
            return None
        return np.memmap(self._file, dtype=np.uint8, mode="c", offset=at + start, shape=(size,))

    def _view(self, cid: int) -> np.ndarray:
        at, size = self.spans[cid]
        return self._map[at: at + size]

    def _matches(self, cid: int) -> bool:
        if cid in self._checked:
            return True
        from lct.io.store import in_page_cache, populate
        if not in_page_cache(self._map._mmap, *self.spans[cid]):
            # some of it on the disk: read and mapped in one call; one in memory is mapped by
            # the hash's own faults, which leave the caller's threads their mmap lock
            populate(self._map._mmap, *self.spans[cid])
        if _xxh3(self._view(cid)) == self.pinned[cid]:
            self._checked.add(cid)
            return True
        if not self.damaged:
            log.warning("decoded cache %s: chunk %d's bytes are not those %s's manifest pins "
                        "(decoded_checksum); the entry is removed (the next load fills it "
                        "again); decoding from the artifact instead",
                        self.entry.path, cid, self.art.path)
            shutil.rmtree(self.entry.path, ignore_errors=True)   # the mapping stays valid
        self.damaged.append(cid)
        return False


def lookup(art, root: Path | None = None) -> CachedChunks | None:
    """The cached decode of artifact ``art`` (an open ``Artifact``), or None: an artifact
    whose manifest pins no decoded bytes (``unpinned``), no entry under its digest, or one whose
    data file is not exactly the size its manifest lays out (then it is removed, so that this
    load's fill replaces it). Each chunk of a hit is checked against the manifest's pin as it is
    first used (``CachedChunks``). A hit counts as a use (least-recently-used eviction)."""
    pinned = pins(art.manifest)
    if pinned is None:
        return None
    root = Path(root) if root is not None else cache_dir()
    folder = root / _hex(art.digest)
    entry = _read_entry(folder) if folder.is_dir() else None
    if entry is None:
        return None
    spans, size = layout(art.manifest)
    try:
        actual = (folder / DATA).stat().st_size if _regular(folder / DATA) else None
    except OSError:
        actual = None
    if entry.size != size or actual != size:
        log.warning("decoded cache %s: %s is not the %d bytes %s lays out; removed", folder,
                    DATA, size, art.digest)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    try:
        os.utime(folder / ENTRY)
        return CachedChunks(entry, spans, size, art, pinned)
    except (OSError, ValueError) as e:   # ValueError: numpy's, for a file changed meanwhile
        log.warning("decoded cache %s: cannot map it (%s); ignored", folder, e)
        return None


def choose(hit: CachedChunks, art) -> tuple:
    """``(map it, why)``: whether a load maps the entry ``hit`` of ``art`` or decodes the
    artifact instead, and why, in words for the load's ``cache`` stat.

    Mapping an entry whose pages are in memory is the fastest start there is (the Gemma-2B
    shape: 6.99 s to the first token, against 8.98 s decoding the page-cached artifact); with
    its pages on the disk, mapping reads every decoded byte (12.86 s), where decoding reads the
    artifact's fewer ones (0.66 of them: 11.09 s) (docs/LOADING.md). So the entry is mapped
    where at least ``MAP_RESIDENT`` of it is in memory (``CachedChunks.resident``), and the
    artifact decoded where less is, if it is local (a remote one's bytes come over the network)
    and smaller than the entry. ``LCT_CACHE_MAP=always`` maps every entry; where ``mincore``
    cannot be asked, the entry is mapped.

    Raises:
        LCTError: ``LCT_CACHE_MAP`` is neither ``auto`` nor ``always``.
    """
    from lct.io.store import LocalStore
    if map_mode() == "always":
        return True, f"mapped ({ENV_MAP}=always)"
    if not isinstance(art.store, LocalStore):
        return True, "mapped (the artifact is remote)"
    ratio = art.manifest.stored_bytes / max(art.manifest.decoded_bytes, 1)
    if ratio >= 1:
        return True, "mapped (the artifact is no smaller than its decoded copy)"
    share = hit.resident()
    if share is None:
        return True, "mapped (how much of it is in memory is unknown: no mincore)"
    if share >= MAP_RESIDENT:
        return True, f"mapped ({share:.0%} of it in memory)"
    return False, (f"{share:.0%} of the decoded copy in memory: decoded the artifact instead "
                   f"({ratio:.2f} of the bytes to read); the copy is read into memory after "
                   f"the load, where memory allows, for the next start")


def warm(hit: CachedChunks):
    """Read the data file of the entry ``hit`` into the page cache in the background, so that
    the next start maps it from memory: after a load that ``choose`` had decode the artifact
    because the entry was on the disk (else every later start would decode the then cached
    artifact, never mapping the entry). A process of its own (``read_ahead``: the lowest CPU
    and I/O priority, ``posix_fadvise`` WILLNEED window by window), started in a session of
    its own, so that it goes on after this process ends (a command that answers and exits
    would otherwise leave the copy half on the disk); nothing waits for it. Not where the
    memory available is less than the entry (it would only push other pages out). Returns the
    process, or None."""
    import subprocess
    import sys
    path, size = hit.entry.path / DATA, hit.entry.size
    from lct.proc import available_memory
    if not hasattr(os, "posix_fadvise") or not sys.executable or (available_memory() or 0) < size:
        return None
    try:
        return subprocess.Popen(
            [sys.executable, "-c", "import sys; from lct.io.cache import read_ahead; "
             "read_ahead(sys.argv[1], int(sys.argv[2]))", str(path), str(size)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True)
    except OSError:
        return None


def read_ahead(path, size: int) -> None:
    """Ask the kernel to read ``size`` bytes of the file ``path`` into the page cache
    (``lct.io.store.will_need``) at the lowest CPU and I/O priority (``warm``'s process)."""
    from lct.io.store import will_need
    _lower_io_priority()
    will_need(path, [(0, size)], os.O_NOFOLLOW)


def _xxh3(buf) -> int:
    import xxhash
    return xxhash.xxh3_64_intdigest(memoryview(buf).cast("B"))


def _write_all(fd: int, buf, at: int, stop: threading.Event | None = None) -> None:
    """Write all of ``buf`` at offset ``at`` of ``fd``, in pieces (a short write is resumed);
    raises ``_Cancelled`` between pieces once ``stop`` is set, so that a cancelled fill ends
    within one piece, not one chunk."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        if stop is not None and stop.is_set():
            raise _Cancelled()
        n = os.pwrite(fd, view[done: done + (16 << 20)], at + done)
        if n <= 0:
            raise WriteError(f"wrote nothing at offset {at + done}")
        done += n


def _lower_io_priority() -> None:
    """The calling thread's I/O to the idle class (Linux ioprio_set), CPU nice +19; nothing
    where unsupported."""
    from lct.proc import lower_thread_priority
    lower_thread_priority(19)
    try:
        import ctypes
        import platform
        nr = {"x86_64": 251, "aarch64": 30}.get(platform.machine())
        if nr is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall(nr, 1, threading.get_native_id(), 3 << 13)   # WHO_PROCESS, CLASS_IDLE
    except (OSError, AttributeError):
        pass


class _Background:
    """What ``start_fill`` and ``wait_fills`` need of a fill: a thread (``_spawn`` starts
    ``_run`` in it), a stop event, and an event its thread sets when ``_run`` returned."""

    _thread: threading.Thread | None = None
    _stop: threading.Event
    _ended: threading.Event | None = None

    def cancel(self) -> None:
        """Stop the fill (its staging folder is removed, nothing is kept)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the fill's thread; True once its work ended (or never started). An event,
        not ``Thread.join``: a join that a Ctrl-C interrupted can report the thread ended while
        it still runs (CPython before 3.13), and ``wait_fills`` waits again just then."""
        return self._ended is None or self._ended.wait(timeout)

    def _spawn(self) -> None:
        self._ended = threading.Event()

        def main():
            try:
                self._run()
            finally:
                self._ended.set()
        self._thread = threading.Thread(target=main, name="lct-cache-fill", daemon=True)
        self._thread.start()


class Fill(_Background):
    """Fills the entry of one artifact from the chunks a load decoded.

    ``add(cid, buf)`` during the load (in the decode workers) keeps a reference (no copy: they
    are the model's weights); ``start()`` after it writes them in a background thread, each
    checked against the decoded_checksum the manifest pins (so weights changed in place
    meanwhile are never kept), and publishes the entry, or drops everything where the cache has
    no room or a buffer changed. ``art`` must be pinned (``unpinned(art)`` empty). ``wait()`` blocks until that thread ended (tests,
    ``lct cache``); ``done`` says whether the entry was published."""

    def __init__(self, art, root: Path | None = None):
        self.root = Path(root) if root is not None else cache_dir()
        self.digest, self.artifact = art.digest, str(Path(art.path).absolute())
        self.spans, self.size = layout(art.manifest)
        self.pinned = pins(art.manifest) or {}
        self.budget = max_bytes()       # read here: a bad LCT_CACHE_MAX fails the load, at once
        min_free_bytes(0)               # and so does a bad LCT_CACHE_MIN_FREE
        self._bufs: dict = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.done = False
        self.reason = ""            # why nothing was published, when it was not

    @property
    def folder(self) -> Path:
        """Where the entry is (or will be) published."""
        return self.root / _hex(self.digest)

    def over_budget(self) -> str:
        """Why the entry can never be kept (over the cache's whole budget), else ``""``: known
        before a load decodes anything."""
        if self.size > self.budget:
            return (f"{human(self.size)} is over the cache's budget of {human(self.budget)} "
                    f"({ENV_MAX} sets it)")
        return ""

    def add(self, cid: int, buf) -> None:
        """Keep chunk ``cid``'s decoded buffer for the fill."""
        if cid in self.spans and buf.nbytes == self.spans[cid][1]:
            self._bufs[cid] = buf

    def start(self) -> None:
        """Write in the background if every chunk was added, else drop them."""
        if len(self._bufs) != len(self.spans):
            self._bufs.clear()
            self.reason = "the load did not decode every chunk"
            return
        self._spawn()

    def _room(self) -> bool:
        """Evict least-recently-used entries to fit the budget; False where the entry cannot fit
        (over the budget alone, or the disk would be left too full)."""
        budget = self.budget
        if self.over_budget():
            self.reason = self.over_budget()
            return False
        prune(self.root, keep_bytes=budget - self.size)
        usage = shutil.disk_usage(self.root)
        keep_free = min_free_bytes(usage.total)
        if usage.free - self.size < keep_free:
            self.reason = (f"{self.root}: {human(usage.free)} free, {human(self.size)} needed "
                           f"and {human(keep_free)} kept free ({ENV_MIN_FREE} sets how much)")
            return False
        return True

    def _run(self) -> None:
        _lower_io_priority()

        self.write((cid, self._bufs.pop(cid)) for cid in sorted(self._bufs))

    def write(self, chunks) -> None:
        """Write the entry from ``chunks`` (``(chunk id, decoded buffer)`` pairs, in any order,
        every chunk once) into a staging folder and publish it by rename; where it cannot be
        (no room, a chunk missing or changed, an error), ``reason`` says why and nothing is
        left."""
        stage = lock = None
        try:
            staged = self._stage()
            if staged is None:
                return
            stage, lock, fd = staged
            try:
                written = set()
                for cid, buf in chunks:
                    if self._stop.is_set():
                        self.reason = "cancelled"
                        return
                    if cid not in self.spans or buf.nbytes != self.spans[cid][1]:
                        raise _Changed(f"chunk {cid} is not the {self.spans.get(cid, (0, 0))[1]} "
                                       f"bytes the manifest lays out: nothing kept")
                    if _xxh3(buf) != self.pinned[cid]:
                        raise _Changed(f"chunk {cid} is not the bytes the manifest pins "
                                       f"(weights changed in place after the load): nothing "
                                       f"kept")
                    _write_all(fd, buf, self.spans[cid][0], self._stop)
                    written.add(cid)
                if written != set(self.spans):
                    self.reason = (f"{len(self.spans) - len(written)} chunk(s) were not "
                                   f"decoded: nothing kept")
                    return
                os.fsync(fd)
            finally:
                os.close(fd)
            if self._publish(stage):
                stage = None
        except _Changed as e:
            self.reason = str(e)
        except _Cancelled:
            self.reason = "cancelled"
        except Exception as e:      # noqa: BLE001  a background thread: say it, never raise
            self._failed(e)
        finally:
            self._bufs.clear()
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)
            if lock is not None:
                os.close(lock)

    def _failed(self, e: Exception) -> None:
        """Say why the fill failed (``reason``, and the log): the writer's background thread
        never raises."""
        self.reason = f"{self.root}: {e.strerror or e}" if isinstance(e, OSError) else \
            f"{type(e).__name__}: {e}"
        log.warning("decoded cache: not filled (%s)", self.reason)

    def _stage(self) -> tuple | None:
        """``(staging folder, its held lock's fd, the data file's fd open for writing, sized)``
        where the entry can be filled; else None, with ``reason`` saying why where it is not
        that the entry exists already. Raises OSError (the staging folder then removed)."""
        if len(self.pinned) != len(self.spans):
            self.reason = "the artifact's manifest pins no decoded bytes (before format 1.6)"
            return None
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        final = self.folder
        if _read_entry(final) is not None:
            return None
        if final.exists() or final.is_symlink():
            self.reason = f"{final} exists and is not an entry of this cache; left alone"
            log.warning("decoded cache: not filled (%s)", self.reason)
            return None
        if not self._room():
            return None
        stage = self.root / f"{FILL_PREFIX}{uuid.uuid4().hex}"
        stage.mkdir()
        lock = fd = None
        try:
            lock = os.open(stage / FILL_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)      # held until the end: prune leaves it alone
            fd = os.open(stage / DATA, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, self.size)
            return stage, lock, fd
        except BaseException:
            for f in (fd, lock):
                if f is not None:
                    os.close(f)
            shutil.rmtree(stage, ignore_errors=True)
            raise

    def _publish(self, stage: Path) -> bool:
        """Write ``entry.json`` into the staging folder ``stage`` (its data file written and
        synced) and rename it into place; False (``reason`` says why) where another process
        published the entry first."""
        with open(stage / ENTRY, "w") as f:
            json.dump({"kind": KIND, "digest": self.digest, "artifact": self.artifact,
                       "size": self.size, "created": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        (stage / FILL_MARKER).unlink()
        try:
            os.rename(stage, self.folder)
        except OSError:         # another process published it first
            self.reason = f"{self.folder} was published by another process meanwhile"
            return False
        self.done = True
        log.info("decoded cache: %s filled (%d bytes) at %s", self.artifact, self.size,
                 self.folder)
        return True


class StagedFill(Fill):
    """A fill that a whole load decodes into: chunks are decoded straight into their place in
    the staging folder's data file, mapped shared (``out``), so that the model's weights are the
    very pages the entry keeps: those bytes touch memory once, as page-cache pages, never as the
    model's fresh memory and then again as the copy's (issue 36, item 3).

    Only with ``LCT_CACHE_IN_PLACE=1`` (``in_place`` says why it is off by default); otherwise
    the data file is not mapped at all: every chunk is decoded into fresh memory and written
    after the load, as ``Fill`` does, into blocks reserved before the load. In place,
    as many chunks go in place as the kernel lets a process dirty before it throttles its
    writes to the disk's speed (``dirty_room``, measured at ``open``): past it, a decoder would
    wait for the disk (on this project's VM, 0.39 GB/s of writes: the Gemma-2B shape's first
    start went from 5.3 to 10.5 s when all 5 GB went in place; docs/LOADING.md). The others are
    decoded into fresh memory, as without the cache, and written after the load by the
    background thread, each checked against its pin first (weights changed in place meanwhile
    are never kept), as ``Fill`` writes them.

    ``open()`` before the load makes the staging folder (evicting least-recently-used entries
    first) and reserves the file's blocks on the disk (``posix_fallocate``: a full disk is a
    refusal here, never a fault in a decoder writing to a page it cannot back). ``seal()`` after
    the load (in place) maps the same addresses copy-on-write (``MAP_PRIVATE``), so that whatever the
    model's user writes into its weights stays in this process and never reaches the entry,
    which other processes map. ``start()`` then checks each chunk of the file against the
    decoded_checksum the manifest pins, writes the others, syncs the file and publishes the
    entry, in a background thread at the lowest priority. ``discard()`` (a failed load) removes
    the staging folder; the mapping stays valid, on a file nobody else can open."""

    def __init__(self, art, root: Path | None = None):
        super().__init__(art, root)
        self._stage_dir: Path | None = None
        self._lock = self._fd = None
        self._view: np.ndarray | None = None
        self._decoded: set = set()            # chunk ids decoded into their place
        self._sealed = self._not_private = False
        self._room_left = 0                   # bytes still to be decoded in place
        self._given = threading.Lock()
        self.in_place = 0                     # bytes decoded into the entry's pages

    def open(self) -> bool:
        """Make the staging folder and map its data file for the decoders; False (``reason``
        says why, empty where the entry exists already) where nothing is kept."""
        import mmap
        if self.over_budget() or self.size == 0:
            self.reason = self.over_budget() or "nothing to keep"
            return False
        try:
            staged = self._stage()
            if staged is None:
                return False
            self._stage_dir, self._lock, self._fd = staged
            os.posix_fallocate(self._fd, 0, self.size)
            if in_place():      # else nothing maps the file: every chunk is written after
                mapped = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
                self._view = np.frombuffer(mapped, np.uint8)
                self._room_left = dirty_room()
            return True
        except (OSError, ValueError) as e:
            self.reason = f"{self.root}: {getattr(e, 'strerror', None) or e}"
            self.discard()
            return False

    def out(self, chunk) -> np.ndarray | None:
        """Where chunk ``chunk`` (a manifest ``ChunkInfo``) is decoded: its place in the mapped
        data file while the room to dirty pages lasts, else None (fresh memory, written after
        the load)."""
        span = self.spans.get(chunk.id)
        if self._view is None or span is None or span[1] != chunk.decoded_size:
            return None
        with self._given:
            if span[1] > self._room_left:
                return None
            self._room_left -= span[1]
        from lct.io.store import populate_range
        view = self._view[span[0]: span[0] + span[1]]
        populate_range(view.ctypes.data, span[1], write=True)   # one call, not a fault a page
        return view

    def add(self, cid: int, buf) -> None:
        """Chunk ``cid`` was decoded into ``buf``: its place (``out``), or memory of its own,
        kept to be written after the load."""
        span = self.spans.get(cid)
        if self._fd is None or span is None or buf.nbytes != span[1]:
            return
        if self._view is not None and buf.ctypes.data == self._view.ctypes.data + span[0]:
            # decoded and checked: copy-on-write from now on, in the decoder's thread beside
            # the load rather than all at its end
            private = self._private(cid, populate=True)
            with self._given:
                if private:
                    self._decoded.add(cid)
                    self.in_place += span[1]
                else:
                    self._not_private = True
        else:
            self._bufs[cid] = buf

    def _private(self, cid: int, populate: bool = False) -> bool:
        """Chunk ``cid``'s pages of the mapping made copy-on-write (``map_private``), and, with
        ``populate``, mapped in at once."""
        from lct.io.store import map_private, populate_range
        at, size = self.spans[cid]
        address = self._view.ctypes.data + at
        size = -(-size // ALIGN) * ALIGN      # its last page is its own (the layout's padding)
        if not map_private(address, size, self._fd, at):
            return False
        if populate:
            populate_range(address, self.spans[cid][1])
        return True

    def seal(self) -> bool:
        """After the load, where the data file is mapped (in place): every page of the mapping
        copy-on-write (the chunks decoded in place are already, each as it was decoded:
        ``add``), so that nothing this process writes can
        reach the entry. False (the entry is then not kept: ``reason``) where that cannot be
        done."""
        if self._fd is None:
            return False
        if self._view is not None and (self._not_private or \
                not all(self._private(cid) for cid in self.spans if cid not in self._decoded)):
            self.reason = "the decoded pages could not be made copy-on-write: nothing kept"
            self.discard()
            return False
        self._sealed = True
        return True

    def start(self) -> None:
        """Check, write, sync and publish the entry in the background (after ``seal``); where
        not every chunk was decoded, drop it."""
        if not self._sealed or self._decoded | set(self._bufs) != set(self.spans):
            self.reason = self.reason or "the load did not decode every chunk"
            self._bufs.clear()
            self.discard()
            return
        self._spawn()

    def _run(self) -> None:
        _lower_io_priority()
        try:
            for cid in sorted(self.spans):
                if self._stop.is_set():
                    self.reason = "cancelled"
                    return
                buf = self._bufs.pop(cid, None)
                if buf is None and _file_xxh3(self._fd, *self.spans[cid]) == self.pinned[cid]:
                    continue
                if buf is not None and _xxh3(buf) == self.pinned[cid]:
                    _write_all(self._fd, buf, self.spans[cid][0], self._stop)
                    continue
                self.reason = (f"chunk {cid} is not the bytes the manifest pins"
                               f"{' (weights changed in place after the load)' if buf is not None else ''}"
                               f": nothing kept")
                log.warning("decoded cache: not filled (%s)", self.reason)
                return
            os.fsync(self._fd)
            if self._publish(self._stage_dir):
                self._stage_dir = None
        except _Cancelled:
            self.reason = "cancelled"
        except Exception as e:      # noqa: BLE001  a background thread: say it, never raise
            self._failed(e)
        finally:
            self._bufs.clear()
            self.discard()

    def discard(self) -> None:
        """Remove the staging folder, unless published, and close the files (the mapping, and
        every weight viewing it, stays valid)."""
        if self._stage_dir is not None:
            shutil.rmtree(self._stage_dir, ignore_errors=True)
            self._stage_dir = None
        for fd in (self._fd, self._lock):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock = None


def in_place() -> bool:
    """Whether a first start decodes into the entry's pages (``StagedFill``):
    ``LCT_CACHE_IN_PLACE=1``; off by default, by measurement (Gemma-2B shape, this project's
    2-core VM, 2026-12-06, bench_load.py, 5 interleaved runs): it halves what the machine holds
    after the first start (5.0 GB instead of 5.0 GB of weights plus the 5.0 GB copy in the page
    cache) and keeps the copy 1.5 s after the load instead of 12 s, but its first token came
    1.17x a load without the cache warm (7.46 s against 6.39 s), where decoding into memory and
    writing after the load came 1.04x (5.57 s against 5.37 s): page-cache pages and their
    writeback cost two cores more than fresh memory does."""
    value = os.environ.get(ENV_IN_PLACE, "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    raise LCTError(f"{ENV_IN_PLACE}={value!r}: use 1 or 0")


def dirty_room() -> int:
    """Bytes this process may write into the page cache before the kernel throttles its writes
    to the disk's pace: Linux's free-run ceiling, halfway between the background and the hard
    dirty thresholds (``/proc/sys/vm/dirty_*``: bytes where set, else ratios of the memory
    available), less what is dirty or under writeback now. 0 where it cannot be read."""
    try:
        def vm(name):
            with open(f"/proc/sys/vm/{name}") as f:
                return int(f.read())
        mem = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                mem[key] = int(value.split()[0]) * 1024
        available = mem["MemAvailable"]
        limit = vm("dirty_bytes") or vm("dirty_ratio") * available // 100
        background = vm("dirty_background_bytes") or vm("dirty_background_ratio") * available // 100
        return max(0, (limit + background) // 2 - mem["Dirty"] - mem["Writeback"])
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def _file_xxh3(fd: int, at: int, size: int) -> int:
    """xxh3_64 of ``size`` bytes of file ``fd`` from offset ``at`` (a multiple of ``ALIGN``),
    mapped read-only a window at a time: the file's own bytes, whatever a private mapping of
    it holds, and never more than a window of them counted in this process's memory."""
    import mmap

    import xxhash
    h, step = xxhash.xxh3_64(), 64 << 20
    for off in range(at, at + size, step):
        with mmap.mmap(fd, min(step, at + size - off), mmap.MAP_SHARED, mmap.PROT_READ,
                       offset=off) as window:
            h.update(window)
    return h.intdigest()


class _Cancelled(Exception):
    """A fill's writer saw its stop event set (``_write_all``)."""


class _Changed(Exception):
    """A chunk to be written is not what the load decoded or the manifest lays out."""


def fill(art, root: Path | None = None, progress=None,
         stop: threading.Event | None = None) -> Fill:
    """Fill the entry of ``art`` in this thread, without building a model.

    Its groups are decoded (checksums checked) ``DEFAULT_PREFETCH`` ahead and written as they
    come, so memory holds a few groups, not the model: the way to fill the cache for a model
    that the layer-wise, device-map or tensor-parallel loaders map but that no whole load
    decodes (``lct cache fill``).

    Args:
        art: an open ``Artifact`` that checks its chunks' checksums (``verify=True``).
        root: the cache's folder (default ``cache_dir()``).
        progress: called as ``progress(group, done, total)`` after each group.
        stop: set it to stop the fill (nothing is kept; ``BackgroundFill.cancel``).

    Returns:
        The ``Fill``: ``done`` once published, else ``reason`` says why nothing was kept (no
        room, a disk too full); an entry that exists already, every chunk's hash checked, is
        left as it is (``done`` False, no reason).

    Raises:
        LCTError: the artifact does not check its checksums, predates format 1.6 (its manifest
            pins no decoded bytes), or a chunk is damaged (the typed error of the read, nothing
            kept).

    Example:
        >>> with lct.open("gemma-2b.lct") as art:
        ...     print(fill(art).folder)
    """
    from lct.io.stream import GroupStream
    if not art.verify:
        raise LCTError(f"{art.path}: opened without checking checksums; a cache entry is "
                       f"trusted as the checked decode, so it is filled only from a checked one")
    why = unpinned(art)
    if why:
        raise LCTError(why)
    f = Fill(art, root)
    if stop is not None:
        f._stop = stop
    hit = lookup(art, f.root)           # a damaged entry is removed, then filled again
    if hit is not None and hit.check():
        return f
    failed: list = []

    def decoded():
        try:
            with GroupStream(art) as stream:
                for i, group in enumerate(stream, 1):
                    yield from group.buffers.items()
                    if progress is not None:
                        progress(group.name, i, len(stream.names))
        except Exception as e:      # noqa: BLE001  raised again below, after the cleanup
            failed.append(e)
    chunks = decoded()
    try:
        f.write(chunks)
    finally:
        chunks.close()          # a write that stopped early ends the stream too
    if failed:
        raise failed[0]
    return f


class BackgroundFill(_Background):
    """``fill`` of the local artifact at ``path`` in a thread of its own, its decoders at the
    lowest CPU and I/O priority: how the loaders that map an entry but decode only parts, or
    nothing they keep (the layer-wise model, device maps, tensor-parallel ranks, vLLM's load
    format), keep one for the next start after a load that found none. It reads and decodes the
    artifact once more, a few groups in memory at a time. ``wait``, ``cancel``, ``done`` and
    ``reason`` as ``Fill``'s, so that ``start_fill`` and ``wait_fills`` take it."""

    def __init__(self, path, root: Path | None = None):
        self.path, self.root = Path(path), root
        self.folder = None
        self.done, self.reason = False, ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the fill in its thread."""
        self._spawn()

    def _run(self) -> None:
        from lct.io.reader import open_artifact
        _lower_io_priority()
        try:
            with open_artifact(self.path) as art:
                art.thread_nice = 19
                f = fill(art, self.root, stop=self._stop)
            self.folder, self.done, self.reason = f.folder, f.done, f.reason
        except Exception as e:      # noqa: BLE001  a background thread: say it, never raise
            self.reason = f"{type(e).__name__}: {e}"
            log.warning("decoded cache: %s not filled (%s)", self.path, self.reason)


def keep(art, asked: bool | None = None) -> tuple:
    """Keep a decoded copy of the artifact ``art`` (open) for its next start, after a load that
    mapped none of it or after ``lct pull``: where an entry exists (a load left it on the disk,
    ``choose``), read it into memory (``warm``); where none does, fill one by a
    ``BackgroundFill`` started now (``start_fill``: the process waits for it at exit, saying
    so). Only where the cache is on (``asked``, else ``LCT_CACHE``), the artifact pins its
    decoded bytes, its checksums are checked and it is a local folder (a streamed one would be
    read again over the network: ``lct cache fill`` does that on request).

    Returns:
        ``(the fill, "")``; ``(None, why nothing is kept)``; or ``(None, "")`` where the cache
        is off, the artifact predates format 1.6 (``unpinned`` says it) or an entry exists.

    Example:
        >>> with lct.open("gemma-2b.lct") as art:
        ...     fill, why = keep(art)
    """
    from lct.io.store import LocalStore
    if not enabled(asked) or unpinned(art):
        return None, ""
    entry = lookup(art)
    if entry is not None:           # checked as it is mapped: whatever this load checked
        warm(entry)
        return None, ""
    if not art.verify:
        return None, "the artifact is read without checking checksums"
    if not isinstance(art.store, LocalStore):
        return None, "the artifact is streamed (lct cache fill ARTIFACT makes an entry)"
    f = BackgroundFill(art.path)
    start_fill(f)
    return f, ""


_FILLS: list = []


def start_fill(fill: Fill) -> None:
    """Start ``fill`` in the background; the interpreter waits for it at exit, so that a
    short-lived process still leaves its entry (``wait_fills`` waits sooner)."""
    import atexit
    if not _FILLS:
        atexit.register(_wait_at_exit)
    _FILLS[:] = [f for f in _FILLS if not f.wait(0)] + [fill]
    fill.start()


def say_running(stream=None) -> None:
    """Say on ``stream`` (standard error) that fills are still running, where some are: what a
    process waiting for them at exit tells its user."""
    import sys
    running = [f for f in _FILLS if not f.wait(0)]
    if running:
        (stream or sys.stderr).write(
            f"lct: keeping the decoded copy of {len(running)} artifact(s) for the next start "
            f"(Ctrl-C skips it; LCT_CACHE=0 turns the cache off)\n")


def _wait_at_exit() -> None:
    say_running()
    try:
        wait_fills()
    except KeyboardInterrupt:       # cancelled: the interpreter ends as it was going to
        pass


def wait_fills(timeout: float | None = None) -> list:
    """Wait for the fills this process started; returns them (``done``, ``reason``). A Ctrl-C
    meanwhile cancels them and is raised again once they removed their staging folders (each
    ends within one write of ``_write_all``'s pieces; at most ``CANCEL_WAIT_S`` is given to
    them, and a folder left past it is an unfinished fill that ``prune`` removes)."""
    try:
        for f in _FILLS:
            f.wait(timeout)
    except KeyboardInterrupt:
        cancel_fills()
        raise
    return list(_FILLS)


def cancel_fills() -> None:
    """Cancel the fills this process started and wait (at most ``CANCEL_WAIT_S``) for them to
    remove their staging folders: what a Ctrl-C means, whether it came while the process
    waited for them or while it did something else (``lct load`` generating), after which
    nothing is kept and the exit does not wait."""
    from lct.proc import interrupts_held
    with interrupts_held():     # a second Ctrl-C would leave the staging folders
        for f in _FILLS:
            f.cancel()
        deadline = time.monotonic() + CANCEL_WAIT_S
        for f in _FILLS:
            f.wait(max(0.0, deadline - time.monotonic()))
