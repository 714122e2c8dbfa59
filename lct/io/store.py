"""Where an artifact's data files are read from. ``LocalStore`` maps local files; a remote store
(``lct.hub.remote``) serves the same calls with HTTP range requests. The reader only ever asks for a
file's size and for byte ranges, which is what lets a chunk stream from a URL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
import threading
from pathlib import Path

from lct.errors import ArtifactNotFoundError, ManifestError
from lct.format.constants import DATA_HEADER_SIZE

log = logging.getLogger(__name__)

# Linux's posix_fadvise(WILLNEED) reads at most one readahead window (max of read_ahead_kb and
# the device's io size) per call and ignores the rest of the range: ask in 2 MiB pieces.
WILLNEED_STEP = 2 << 20

# What a local store does with the page-cache pages of the stored (compressed) bytes once a chunk
# is decoded (``release``): "auto" drops those it read in from disk and keeps those that were
# cached when it began, "keep" keeps all, "drop" drops all. lct.load's "auto" is the store's
# "auto" while the decoded cache keeps the decode, "keep" otherwise (README, "The page cache");
# a store keeps unless told (lct.open, verify and export read as they did).
PAGE_CACHE_MODES = ("auto", "keep", "drop")

# A remote store's read-ahead (ReadAhead): ranges fetched before they are asked for, at most
# this many bytes held or in flight, on this many threads of their own, each range as pieces of
# at most READAHEAD_PIECE bytes (one request each) so that the earliest range gets every
# connection.
READAHEAD_BYTES = 512 << 20
READAHEAD_THREADS = 4
READAHEAD_PIECE = 16 << 20
# A remote store's range reads (RemoteStore._read; the Hub's and the object stores'): the
# slowest average a transfer may have after its timeout's grace before it is dropped and
# retried, and the bytes that must arrive between failures for the retries to start afresh.
STREAM_MIN_RATE = 256 * 1024
STREAM_PROGRESS_RESET = 1024 * 1024

_LIBC = None


def _libc():
    """The C library (``mincore``, ``madvise``, ``mmap``), or None where it cannot be loaded."""
    global _LIBC
    if _LIBC is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            lib.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
            lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_long)
            _LIBC = lib
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC or None


def will_need(path, ranges, flags: int = 0) -> None:
    """Ask the kernel to read the ``(offset, size)`` ``ranges`` of the file ``path`` into the
    page cache (posix_fadvise WILLNEED: it issues the reads and returns), ``WILLNEED_STEP`` per
    call (Linux reads at most one readahead window per call); ``flags`` are added to the
    open's. Nothing where unsupported or the file cannot be opened."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY | flags)
    except OSError:
        return
    try:
        for offset, size in ranges:
            for start in range(offset, offset + size, WILLNEED_STEP):
                os.posix_fadvise(fd, start, min(WILLNEED_STEP, offset + size - start),
                                 os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


# madvise(MADV_POPULATE_READ) (Linux 5.14; Python's mmap module names it from 3.13)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)


def populate(mm: mmap.mmap, offset: int, size: int) -> bool:
    """Map the pages of ``[offset, offset + size)`` of the file mapping ``mm`` in one call
    (``MADV_POPULATE_READ``), reading them from the disk where they are not in the page
    cache: what touching them does a page (or a fault-around window) at a time, at a fraction
    of the cost of the faults (on this project's VM a mapped and hashed copy went from 4.8 to
    6.0 GB/s). False where the kernel or platform cannot; the pages then come as touched.

    The kernel holds the process's mmap lock for the whole call, and every ``mmap`` or
    ``munmap`` another thread makes meanwhile waits for it: a range already in the page cache
    (``in_page_cache``) is better left to the faults of its first touch, which take only the
    mapping's own lock (the Qwen2-7B shape's warm load: populating its 14 GB copy kept the
    skeleton's import 0.6-0.7 s off the CPU, in wall time 4.3 s against 3.4 s without).

    The call goes through the C library (``populate_range``), which lets the interpreter's lock
    go while the kernel reads: ``mmap.madvise`` holds it, and a cold copy's chunk read from the
    disk in that call (a tenth of a second and more) stalled the skeleton's import beside it
    (the Gemma-2B shape mapped cold, 8 pairs of fresh processes: 7.5 s against 7.8 s, medians)."""
    if MADV_POPULATE_READ is None or size <= 0:
        return False
    page = mmap.PAGESIZE
    start = offset - offset % page
    end = min(offset + size, len(mm))
    if _libc() is not None:
        address = _address(mm)
        return address is not None and populate_range(address + start, end - start)
    try:
        mm.madvise(MADV_POPULATE_READ, start, end - start)
    except (OSError, ValueError):
        return False
    return True


# madvise(MADV_POPULATE_WRITE) (Linux 5.14)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else None)


def populate_range(address: int, size: int, write: bool = False) -> bool:
    """``populate`` for a mapping known by its address, through the C library
    (``MADV_POPULATE_READ``, or ``MADV_POPULATE_WRITE`` with ``write``: the pages made
    writable, a shared file mapping's page-cache pages allocated, in one call instead of a fault
    per page; on this project's VM decoding 3.5 GB into a shared mapping of a file went from
    about 5 to 2.4 s). False where that cannot be done; the pages then come as touched."""
    lib = _libc()
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    if lib is None or advice is None or size <= 0:
        return False
    return lib.madvise(ctypes.c_void_p(address), size, advice) == 0


def map_private(address: int, size: int, fd: int, offset: int = 0) -> bool:
    """Map ``size`` bytes of file ``fd`` from ``offset`` (a multiple of the page size)
    copy-on-write (``MAP_PRIVATE``) over the mapping at ``address``, at the same addresses: one
    ``mmap`` with ``MAP_FIXED``, so the range is never unmapped meanwhile and every view of it
    stays valid; the pages are the file's, in the page cache. False where the call failed (the
    mapping is then as it was)."""
    lib = _libc()
    if lib is None or size <= 0:
        return False
    got = lib.mmap(ctypes.c_void_p(address), size, mmap.PROT_READ | mmap.PROT_WRITE,
                   mmap.MAP_PRIVATE | getattr(mmap, "MAP_FIXED", 0x10), fd, offset)
    return got == address


def residency(address: int, offset: int, size: int):
    """One uint8 per page of ``[offset, offset + size)`` of the mapping at ``address`` (from the
    page ``offset`` rounds down to), 1 where the page is in the page cache (``mincore``); None
    where that cannot be asked."""
    lib = _libc()
    if lib is None or size <= 0:
        return None
    import numpy as np
    page = mmap.PAGESIZE
    start = offset - offset % page
    pages = (offset + size - start + page - 1) // page
    vec = np.zeros(pages, dtype=np.uint8)
    if lib.mincore(ctypes.c_void_p(address + start), pages * page,
                   ctypes.c_void_p(vec.ctypes.data)) != 0:
        return None
    return vec & 1


def in_page_cache(mm: mmap.mmap, offset: int, size: int) -> bool:
    """Whether every page of ``[offset, offset + size)`` of the file mapping ``mm`` is in the
    page cache (``mincore``: one call, nothing touched); False where that cannot be asked."""
    address = _address(mm) if size > 0 and _libc() is not None else None
    if address is None:
        return False
    vec = residency(address, offset, min(size, len(mm) - offset))
    return vec is not None and bool(vec.all())


def _address(mm: mmap.mmap) -> int | None:
    """The address of the mapping ``mm``, or None where it is closed."""
    import numpy as np
    try:
        view = np.frombuffer(mm, dtype=np.uint8)
    except (TypeError, ValueError):
        return None
    address = view.ctypes.data
    del view                                           # no export left: mm can be closed
    return address


def confined(path: Path, root: Path) -> bool:
    """Whether ``path`` (inside the artifact folder ``root``) is a regular file, or a symbolic
    link that stays where the artifact's bytes legitimately live: inside ``root``, or, for an
    artifact in the Hugging Face cache (``.../snapshots/<commit>/``), that repo's ``blobs``."""
    if not path.is_symlink():
        return True
    target = path.resolve()
    base = root.resolve()
    allowed = [base]
    if root.parent.name == "snapshots":
        allowed.append((root.parent.parent / "blobs").resolve())
    return any(target == a or a in target.parents for a in allowed)


def uninitialized(n: int) -> memoryview:
    """A writable view of ``n`` fresh bytes, not zeroed: a range's buffer is written whole
    before it is read, and zeroing hundreds of megabytes first costs a core for a while (a
    ``bytearray`` of 475 MB took 0.3 s in the loader's thread)."""
    import numpy as np
    return memoryview(np.empty(n, np.uint8)).cast("B")


def receive_range(blocks, buf: bytearray, got: list, *, start: int, want: int, timeout: float,
                  min_rate: int, where: str, error, counted=None) -> None:
    """Copy the byte ``blocks`` of one answer to a range request (bytes ``start`` on, ``want``
    of them, the last ``want`` bytes of ``buf``) into ``buf`` from ``got[0]``, advancing
    ``got[0]`` as they arrive (so that a retry resumes there); ``counted(k)`` is told of each
    block. A remote store's one receiving loop (``lct.hub.remote``, ``lct.cloud``): it feeds
    ``range_receiver``, which a client that pushes blocks (writes them to a file object) calls
    itself.

    Raises:
        TimeoutError: the transfer averaged below ``min_rate`` bytes a second after ``timeout``
            seconds of grace (worth retrying).
        error: the server sent more than was asked for (``error`` is the store's error class).
    """
    take = range_receiver(buf, got, start=start, want=want, timeout=timeout,
                          min_rate=min_rate, where=where, error=error, counted=counted)
    for block in blocks:
        take(block)


def range_receiver(buf: bytearray, got: list, *, start: int, want: int, timeout: float,
                   min_rate: int, where: str, error, counted=None):
    """``take(block)``: what ``receive_range`` does with each block, for a client that hands
    the blocks over one call at a time; the deadline runs from this call."""
    import time
    grace = timeout + want / max(min_rate, 1)
    deadline = time.monotonic() + grace

    def take(block) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"too slow: {got[0] - (len(buf) - want)} of {want} bytes in "
                               f"{grace:.0f} s")
        k, at = len(block), got[0]
        if at + k > len(buf):
            raise error(f"{where}: the server sent more than the {want} bytes asked for at "
                        f"{start}")
        buf[at:at + k] = block
        got[0] = at + k
        if counted is not None:
            counted(k)
    return take


class ReadAhead:
    """Range reads of a remote store started before they are asked for: ``want`` (the
    stream's ``will_need`` hints, in the order the ranges will be read) queues a range, and
    ranges are fetched in that order on threads of their own while at most ``max_bytes`` are
    held or in flight; ``take`` hands a fetched range over (or None: read it now) and frees its
    budget for the next. The link then keeps working while the decoders decode and while the
    consumer is busy. A failed fetch raises its error in ``take``, as the read would.

    A range is fetched as pieces of at most ``piece`` bytes (one request each, straight into
    the range's buffer), queued in order: the threads' connections all work on the earliest
    range first, so that it is whole as soon as the link allows, not after the ranges behind
    it that shared the link with it.

    Args:
        fetch: ``fetch(name, offset, size, out)`` fills the writable view ``out`` (``size``
            bytes) with the file's bytes from ``offset`` (the store's own read).
        size_of: ``size_of(name)``, the file's size (a range is clipped to it, as a read is).
    """

    # Groups a stream hints ahead of the one it submits (GroupStream reads it from its store):
    # all of them; the byte budget decides how far the fetches run ahead.
    hint_groups = 1 << 30

    def __init__(self, fetch, size_of, *, max_bytes: int | None = None,
                 threads: int | None = None, piece: int | None = None):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self._fetch, self._size_of = fetch, size_of
        self.max_bytes = READAHEAD_BYTES if max_bytes is None else max_bytes
        self.piece = READAHEAD_PIECE if piece is None else piece
        self._pool = ThreadPoolExecutor(threads or READAHEAD_THREADS,
                                        thread_name_prefix="lct-readahead")
        self._queue: deque = deque()    # (name, offset, size) not started yet, in order
        self._queued: set = set()
        self._pending: dict = {}        # (name, offset, size) -> (view, piece futures), started
        self._bytes = 0                 # of the started ones
        self._lock = threading.Lock()
        self.hits = 0

    def want(self, name: str, offset: int, size: int) -> None:
        """Queue ``[offset, offset + size)`` of ``name`` to be fetched (once)."""
        key = (name, offset, size)
        with self._lock:
            if self._pool is None or key in self._pending or key in self._queued:
                return
            self._queue.append(key)
            self._queued.add(key)
            self._pump()

    def _pump(self) -> None:
        """Start queued fetches, in order, while the budget allows (the first always, so
        that a range larger than the budget is fetched ahead alone). Lock held."""
        while self._queue and (not self._pending or
                               self._bytes + self._queue[0][2] <= self.max_bytes):
            key = self._queue.popleft()
            self._queued.discard(key)
            self._bytes += key[2]
            self._pending[key] = self._begin(*key)

    def _begin(self, name: str, offset: int, size: int) -> tuple:
        """The range's buffer and its pieces' futures (submitted in order). Lock held."""
        from concurrent.futures import Future
        try:
            n = max(0, min(offset + size, self._size_of(name)) - offset) if offset >= 0 else 0
        except Exception as e:      # noqa: BLE001 - handed to take, as the read would raise it
            failed = Future()
            failed.set_exception(e)
            return memoryview(b""), [failed]
        view = uninitialized(n)
        futs = [self._pool.submit(self._fetch, name, offset + at, min(self.piece, n - at),
                                  view[at:at + self.piece]) for at in range(0, n, self.piece)]
        return view, futs

    def take(self, name: str, offset: int, size: int):
        """The range's bytes if it was fetched ahead (waiting for fetches still running), else
        None (a range still queued is dropped from the queue: the caller reads it now)."""
        key = (name, offset, size)
        with self._lock:
            started = self._pending.pop(key, None)
            if started is not None:
                self._bytes -= size
                self.hits += 1
            elif key in self._queued:
                self._queued.discard(key)
                self._queue.remove(key)
            if self._pool is not None:
                self._pump()
        if started is None:
            return None
        view, futs = started
        try:
            for fut in futs:
                fut.result()
        except BaseException:
            for fut in futs:
                fut.cancel()
            raise
        return view

    def close(self) -> None:
        """Cancel what has not started and let go of what was fetched."""
        with self._lock:
            pool, self._pool = self._pool, None
            for _, futs in self._pending.values():
                for fut in futs:
                    fut.cancel()
            self._pending.clear()
            self._queue.clear()
            self._queued.clear()
            self._bytes = 0
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class RemoteStore:
    """What the remote stores share (``lct.hub.remote.HttpRangeStore``, ``lct.cloud.ObjectStore``):
    the read-ahead behind ``will_need`` and ``read_range``, the byte count, ``release`` and
    ``close``, and the retried, resumed range reads (``_read``). A subclass calls ``_start``
    (the lock, the counts, the read-ahead) and implements ``_fetch`` (one range request),
    ``_transient(e, name)`` (why a failure is worth retrying, or raise the error to give),
    ``_gave_up(message)`` (the error once the retries are spent), ``size`` and ``describe``."""

    local = False       # reading a range costs a request
    retries: int = 5    # attempts after transient failures with no real progress between
    backoff: float = 0.5    # first retry delay in seconds (doubles each time)

    def _read(self, name: str, offset: int, size: int, file_size: int,
              out=None) -> memoryview:
        """Bytes ``[offset, offset + size)`` of ``name`` (clipped to ``file_size``) by one range
        request, into ``out`` when given. A transient failure (``_transient`` says which, and
        why) is retried with backoff, resuming from the bytes already received, and
        ``STREAM_PROGRESS_RESET`` bytes of progress earn a fresh set of ``retries``; past
        them, ``_gave_up`` is raised. The subclass's ``_fetch(name, offset, end, buf, got)``
        fills ``buf[got[0]:]`` with bytes from ``offset + got[0]``."""
        import time

        end = min(offset + size, file_size)
        n = end - offset
        if n <= 0 or offset < 0:
            return memoryview(b"")
        buf = uninitialized(n) if out is None else out
        got = [0]                   # bytes of buf filled so far (updated while receiving)
        failures, since = 0, 0      # since: bytes received since the last fresh set of retries
        while got[0] < n:
            start, before = offset + got[0], got[0]
            try:
                self._fetch(name, offset, end, buf, got)
            except Exception as e:
                why = self._transient(e, name)      # raises what retrying cannot help
                since += got[0] - before
                if since >= STREAM_PROGRESS_RESET:
                    failures, since = 0, 0          # real progress: a fresh set of retries
                failures += 1
                if failures > self.retries:
                    raise self._gave_up(f"{self.describe(name)}: bytes {start}-{end - 1}: "
                                        f"giving up after {self.retries} retries ({why})") from e
                delay = self.backoff * 2 ** (failures - 1)
                log.warning("%s: bytes %d-%d: %s; retry %d of %d in %.1f s",
                            self.describe(name), start, end - 1, why, failures, self.retries,
                            delay)     # a stalled server is otherwise minutes of silence
                time.sleep(delay)
        self._fetched(name, offset, n)
        return memoryview(buf)

    def _fetched(self, name: str, offset: int, n: int) -> None:
        """Told of each range read whole (a subclass may keep a log)."""

    def _start(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_fetched = 0
        self.readahead = ReadAhead(lambda name, offset, size, out: self._read(
            name, offset, size, offset + size, out), self.size)

    def will_need(self, name: str, offset: int, size: int, file_size: int) -> None:
        """Queue the range for the read-ahead (``ReadAhead``): the stream says it comes."""
        self.readahead.want(name, offset, size)

    def read_range(self, name: str, offset: int, size: int, file_size: int) -> memoryview:
        """Bytes ``[offset, offset + size)`` of ``name`` (clipped to ``file_size``): fetched
        ahead, or now."""
        got = self.readahead.take(name, offset, size)
        return got if got is not None else self._read(name, offset, size, file_size)

    def _count(self, k: int) -> None:
        with self._lock:
            self.bytes_fetched += k

    def release(self, name: str, offset: int, size: int) -> None:
        """Nothing to drop: fetched bytes are owned by the caller's buffer."""

    def close(self) -> None:
        """Stop the read-ahead."""
        self.readahead.close()


class LocalStore:
    """Data files in a local directory, read through read-only memory maps (zero-copy)."""

    local = True        # reading a range costs no request (a remote store's is False)

    def __init__(self, root, page_cache: str = "keep"):
        self.root = Path(root)
        self._maps: dict = {}
        self._addresses: dict = {}      # name -> the address of its mapping
        self._before: dict = {}         # name -> its pages' residency when first mapped
        self._lock = threading.Lock()
        self.page_cache = page_cache    # one of PAGE_CACHE_MODES
        self.dropped = 0                # bytes dropped from the page cache by ``release``

    def describe(self, name: str) -> str:
        """How to name the file in messages."""
        return str(self.root / name)

    def size(self, name: str) -> int:
        """The file's size in bytes.

        Raises:
            ArtifactNotFoundError: the file is missing.
        """
        p = self.root / name
        if not p.is_file():
            raise ArtifactNotFoundError(f"{p}: data file missing")
        return p.stat().st_size

    def _open(self, name: str, expected: int):
        """The data file ``name`` opened for reading, checked first: inside the artifact's
        folder and ``expected`` bytes long."""
        path = self.root / name
        if not confined(path, self.root):  # it could read anything on the machine
            raise ManifestError(f"{path}: a symbolic link that leaves the artifact "
                                f"folder; refusing to follow it")
        fh = open(path, "rb")
        size = os.fstat(fh.fileno()).st_size
        if size != expected:
            fh.close()
            raise ManifestError(f"{path}: file is {size} bytes, manifest says "
                                f"{expected} (changed since the artifact was opened?)")
        return fh

    def _map(self, name: str, expected: int) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(name)
            if m is None:
                with self._open(name, expected) as fh:
                    m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if expected else b""
                if expected:
                    import numpy as np
                    view = np.frombuffer(m, dtype=np.uint8)
                    self._addresses[name] = view.ctypes.data
                    del view
                    # before this store reads a byte of it: what "auto" keeps
                    self._before[name] = residency(self._addresses[name], 0, expected)
                self._maps[name] = m
            return m

    def read_range(self, name: str, offset: int, size: int, file_size: int) -> memoryview:
        """Bytes ``[offset, offset + size)`` of ``name`` as a zero-copy view; a file's header
        (its first ``DATA_HEADER_SIZE`` bytes, checked when the artifact is opened) read into
        memory while the file is not mapped yet: a load that maps a decoded copy never maps
        the artifact's data files, and the residency snapshot that "auto" keeps by (taken
        when a file is first mapped: 30 ms for a 3.3 GB file here) is taken only by a load
        that reads them."""
        if offset == 0 and size <= DATA_HEADER_SIZE and name not in self._maps:
            with self._open(name, file_size) as fh:
                if hasattr(os, "posix_fadvise"):     # the header's page, not a read-ahead
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                return memoryview(os.pread(fh.fileno(), size, 0))
        return memoryview(self._map(name, file_size))[offset: offset + size]

    def will_need(self, name: str, offset: int, size: int, file_size: int) -> None:
        """Start reading a range into the page cache in the background (``will_need``), so
        that the disk works ahead of the decoder instead of one page fault at a time. The file
        is mapped first: its residency snapshot is what was in memory before this load."""
        try:
            self._map(name, file_size)
        except OSError:
            return                  # a missing file: the read reports it, not the hint
        if size:
            will_need(self.root / name, [(offset, size)])  # reading reports a missing file

    def release(self, name: str, offset: int, size: int) -> None:
        """Drop the mapped pages of a decoded range from this process, and, as ``page_cache``
        says, from the page cache: the decoded chunk is what the model keeps, and a second,
        compressed copy of it that this load read in would only hold memory that the next
        allocation has to get back. Pages shared with a neighbouring range stay."""
        m = self._maps.get(name)
        if isinstance(m, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED") and size:
            m.madvise(mmap.MADV_DONTNEED, offset, size)
        if self.page_cache == "keep" or not size or not hasattr(os, "posix_fadvise"):
            return
        runs = self._droppable(name, offset, size)
        if not runs:
            return
        try:
            fd = os.open(self.root / name, os.O_RDONLY)
        except OSError:
            return
        try:
            for start, length in runs:
                os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
                with self._lock:
                    self.dropped += length
        except OSError:
            pass
        finally:
            os.close(fd)

    def _droppable(self, name: str, offset: int, size: int) -> list:
        """``(start, length)`` runs of the whole pages inside a range that ``release`` drops:
        all with "drop"; with "auto" those not in the page cache when the file was mapped."""
        page = mmap.PAGESIZE
        first, last = -(-offset // page), (offset + size) // page
        if last <= first:
            return []
        if self.page_cache == "drop":
            return [(first * page, (last - first) * page)]
        before = self._before.get(name)
        if before is None:
            return []                               # unknown: kept
        import numpy as np
        cold = np.concatenate(([0], before[first:last] == 0, [0])).astype(np.int8)
        edges = np.flatnonzero(np.diff(cold))
        return [(int(first + a) * page, int(b - a) * page)
                for a, b in zip(edges[::2], edges[1::2])]

    def close(self) -> None:
        """Unmap every file (a view still held by a caller is unmapped by the GC later)."""
        with self._lock:
            for m in self._maps.values():
                try:
                    if isinstance(m, mmap.mmap):
                        m.close()
                except BufferError:
                    pass
            self._maps.clear()
            self._addresses.clear()
            self._before.clear()
