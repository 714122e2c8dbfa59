"""Prefetching group stream: decode groups in order, at most ``prefetch`` ahead of the consumer.

While the consumer holds group i, groups i+1 .. i+prefetch are being read and decoded by
background threads; group i+prefetch+1 is not started until group i is released (the consumer
asks for the next one). ``prefetch=0`` is strictly sequential: each group is read and decoded in
the consumer's thread when asked for.

Errors raised by a worker (checksum mismatch, I/O error, corrupt chunk) reach the consumer as the
same typed exception when it reaches that group. Closing the stream (``close()``, leaving a
``with`` block, breaking out of a ``for`` loop, Ctrl-C) cancels what has not started and waits for
what has, so no thread outlives it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lct.errors import EntryNotFoundError, OptionError

# Groups decoded ahead of the one the consumer holds: every loader's and the CLI's default.
DEFAULT_PREFETCH = 2


def check_prefetch(prefetch) -> int:
    """``prefetch`` if it is a window LCT can run (an integer >= 0), else an ``OptionError``:
    the one check of it, whichever entry point it came through."""
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise OptionError(f"prefetch must be an integer >= 0, got {prefetch!r}",
                          option="prefetch")
    return prefetch


@dataclass
class StreamStats:
    """Instrumentation of one stream: timings and the prefetch window actually used."""

    groups: int = 0
    read_s: float = 0.0
    decode_s: float = 0.0
    wait_s: float = 0.0
    bytes_read: int = 0
    bytes_decoded: int = 0
    max_in_flight: int = 0           # groups submitted but not yet handed to the consumer
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, read_s: float, decode_s: float, stored: int, decoded: int) -> None:
        with self._lock:
            self.read_s += read_s
            self.decode_s += decode_s
            self.bytes_read += stored
            self.bytes_decoded += decoded


class Group:
    """One decoded group: its name, its decoded chunk ``buffers`` and its ``tensors``.

    The tensors (zero-copy torch views of the buffers) are built on first access, by the
    consumer: workers only read and decode, so a stream flows before torch is even imported
    (``lct.load`` imports it beside the decode).
    """

    __slots__ = ("name", "buffers", "_art", "_dequantize", "_tensors", "_pool")

    def __init__(self, name: str, buffers: dict, art, dequantize: bool = False, pool=None):
        self.name, self.buffers = name, buffers
        self._art, self._dequantize, self._tensors = art, dequantize, None
        self._pool = pool

    def recycle(self) -> int:
        """Hand this group's decoded buffers back to its stream (one made with ``recycle``),
        which decodes later groups into them instead of into fresh memory (a stream that maps a
        decoded-cache entry drops their pages from this process's memory instead,
        ``CachedChunks.put``); a buffer that a tensor still views is left alone (it is freed
        with its last view, never reused).
        The group is empty afterwards. Returns the bytes handed back."""
        self._tensors = None
        buffers, self.buffers = self.buffers, {}
        given = 0
        while buffers:
            _, buf = buffers.popitem()
            # references: ``buf`` and getrefcount's argument; any more is a live view
            if self._pool is not None and sys.getrefcount(buf) == 2:
                self._pool.put(buf)
                given += buf.size
        return given

    @property
    def tensors(self) -> dict:
        """``{name: tensor}`` for every tensor of the group (tied names included)."""
        if self._tensors is None:
            self._tensors = self._art.assemble_group(self.name, self.buffers, self._dequantize)
        return self._tensors

    def __repr__(self) -> str:
        return f"Group({self.name!r}, {len(self.buffers)} chunk(s))"


class BufferPool:
    """Decoded-chunk buffers handed back by the consumer (``Group.recycle``), reused for chunks
    of the same decoded size: memory already touched, where a fresh buffer's first touch costs
    a page fault per page (on some VMs 1-2 s per GB). Holds at most ``limit`` buffers."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free: dict = {}            # decoded size -> [buffers]
        self._count = 0
        self._lock = threading.Lock()
        self.reused = 0                  # bytes decoded into recycled buffers

    def put(self, buf) -> None:
        with self._lock:
            if self._count < self.limit:
                self._free.setdefault(buf.size, []).append(buf)
                self._count += 1

    def take(self, size: int):
        """A recycled buffer of ``size`` bytes, or None."""
        with self._lock:
            free = self._free.get(size)
            if not free:
                return None
            self._count -= 1
            self.reused += size
            return free.pop()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._count = 0


class GroupStream:
    """Iterator over decoded groups of an artifact with a bounded prefetch window.

    Example:
        >>> with lct.open("model.lct") as art, art.stream(prefetch=2) as stream:
        ...     for group in stream:
        ...         install(group.tensors)
    """

    def __init__(self, artifact, groups=None, *, prefetch: int = DEFAULT_PREFETCH,
                 dequantize: bool = False, chunks=None, recycle: bool = False, cached=None,
                 on_decoded=None, into=None):
        self._closed = True          # until the pool exists: close() (and __del__) do nothing
        check_prefetch(prefetch)
        self.art = artifact
        if isinstance(groups, str):
            groups = [groups]        # one group by name, not its letters
        self.names = list(groups if groups is not None else artifact.groups)
        unknown = [g for g in self.names if not artifact.manifest.has_group(g)]
        if unknown:
            raise EntryNotFoundError(f"{artifact.path}: no group named {unknown[0]!r}")
        self.prefetch = prefetch
        self.dequantize = dequantize
        # Only these chunk ids are read (a tensor-parallel rank's share); None: every chunk.
        self.chunks = None if chunks is None else frozenset(chunks)
        # With ``recycle``, groups the consumer is done with (``Group.recycle``) are decoded
        # into again: a consumer that copies the tensors out (a serving engine's weight
        # loader) then touches fresh memory only for the first window's groups.
        self.pool = BufferPool(limit=prefetch + 2) if recycle else None
        # ``cached`` (``lct.io.cache.CachedChunks``): the chunks are views of a decoded-cache
        # entry, nothing is read or decoded; ``on_decoded(chunk id, buffer)`` is told of each
        # chunk decoded otherwise (a cache fill keeps them); ``into(chunk)`` gives the buffer a
        # chunk is decoded into, or None for fresh memory (a fill's mapped data file,
        # ``lct.io.cache.StagedFill.out``).
        if recycle and (on_decoded is not None or into is not None):
            raise OptionError("recycle reuses the buffers on_decoded and into are given: "
                              "not both", option="recycle")
        self.cached, self.on_decoded, self.into = cached, on_decoded, into
        self.stats = StreamStats()
        self._next = 0               # next group index to submit
        self._given = 0              # groups handed to the consumer
        self._pending: deque = deque()
        self._advised = -1           # last group index whose chunks the store was told about
        from lct.proc import lower_thread_priority
        self._pool = ThreadPoolExecutor(prefetch, thread_name_prefix="lct-prefetch",
                                        initializer=lower_thread_priority,
                                        initargs=(artifact.thread_nice,)) \
            if prefetch else None
        self._closed = False

    # Lifecycle ---------------------------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        # A stream left unclosed (a loop broken out of) may be collected on one of its own
        # prefetch threads, which cannot wait for itself: a finalizer only cancels.
        self.close(wait=False)

    def close(self, wait: bool = True) -> None:
        """Cancel what has not started, wait for what has (unless ``wait`` is False), release
        the threads."""
        if self._closed:
            return
        self._closed = True
        for fut in self._pending:
            fut.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
        if self.pool is not None:
            self.pool.clear()

    # Work --------------------------------------------------------------------------------------
    def _chunks_of(self, name: str) -> list:
        chunks = self.art.manifest.group_chunks(name)
        return chunks if self.chunks is None else [c for c in chunks if c.id in self.chunks]

    def _load(self, name: str) -> Group:
        art = self.art
        buffers = {}
        for chunk in self._chunks_of(name):
            t0 = time.perf_counter()
            if self.cached is not None:
                buffers[chunk.id] = self.cached.chunk(chunk.id)
                self.stats.add(time.perf_counter() - t0, 0.0, 0, chunk.decoded_size)
                continue
            stored = art.read_stored(chunk, check=False)
            t1 = time.perf_counter()
            try:
                out = self.pool.take(chunk.decoded_size) if self.pool is not None else \
                    self.into(chunk) if self.into is not None else None
                buf = art.decode_verified(chunk, stored, out)
            finally:
                art.release_stored(chunk, stored)
            t2 = time.perf_counter()
            self.stats.add(t1 - t0, t2 - t1, chunk.stored_size, chunk.decoded_size)
            buffers[chunk.id] = buf
            if self.on_decoded is not None:
                self.on_decoded(chunk.id, buf)
        # a recycled group of a mapped entry gives its pages back instead (CachedChunks.put)
        pool = self.cached if self.cached is not None and self.pool is not None else self.pool
        return Group(name, buffers, art, self.dequantize, pool)

    def _advise(self, upto: int) -> None:
        """Ask the store to read groups up to index ``upto`` ahead (once each): a local store
        into the page cache, one group ahead of the decoders; a remote store's read-ahead
        (``lct.io.store.ReadAhead``) is told every group, and its byte budget decides how far
        its fetches run ahead. A mapped decoded-cache entry is read ahead the same way
        (``CachedChunks.will_need``): nothing of the artifact is read then."""
        upto = min(upto, len(self.names) - 1)
        while self._advised < upto:
            self._advised += 1
            chunks = self._chunks_of(self.names[self._advised])
            if self.cached is not None:
                self.cached.will_need([c.id for c in chunks])
            else:
                self.art.will_need(chunks)

    def _fill(self) -> None:
        ahead = getattr(getattr(self.art.store, "readahead", None), "hint_groups", 1)
        while self._next < len(self.names) and len(self._pending) < self.prefetch:
            self._advise(self._next + ahead)
            self._pending.append(self._pool.submit(self._load, self.names[self._next]))
            self._next += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, len(self._pending))

    def start(self) -> None:
        """Hint and submit the first window now, as the first ``next`` would: the reads begin
        before the caller turns to other work (the loader's skeleton import)."""
        if self._pool is not None and not self._closed:
            self._fill()

    def __iter__(self):
        return self

    def __next__(self) -> Group:
        if self._closed or self._given >= len(self.names):
            self.close()
            raise StopIteration
        try:
            if self._pool is None:
                self._advise(self._given)
                group = self._load(self.names[self._given])
            else:
                self._fill()
                fut = self._pending.popleft()
                t0 = time.perf_counter()
                group = fut.result()
                self.stats.wait_s += time.perf_counter() - t0
                self._fill()
        except BaseException:
            self.close()
            raise
        self._given += 1
        self.stats.groups += 1
        return group
