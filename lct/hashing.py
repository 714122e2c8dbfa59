"""File hashes LCT records and checks (the sha256 of source files, side files and the Maximus
state) and git's blob id (what the Hub lists for a file kept in git), by hashlib alone: opening
and verifying an artifact needs no huggingface_hub. A leaf: the reader, the converter and the
hub layer all need it."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import threading
from concurrent.futures import CancelledError
from contextvars import ContextVar

_BLOCK = 1 << 20    # bytes read at a time

# The event that stops sha256_file in this thread (set by ``stop_when``), so that a hash a caller
# no longer needs (a conversion that failed or was interrupted) ends within one block, not after
# gigabytes; sha256_file keeps its one argument (callers and tests substitute it).
_stop: ContextVar[threading.Event | None] = ContextVar("lct_hash_stop", default=None)


@contextlib.contextmanager
def stop_when(event: threading.Event):
    """Within this block, every ``sha256_file`` in the current thread raises ``CancelledError``
    at its next block once ``event`` is set.

    Example:
        >>> cancel = threading.Event()
        >>> with stop_when(cancel):       # doctest: +SKIP
        ...     sha256_file("model.safetensors")    # another thread may cancel.set()
    """
    token = _stop.set(event)
    try:
        yield
    finally:
        _stop.reset(token)


def sha256_file(path) -> str:
    """Hex sha256 of the file at ``path``, read in blocks.

    Raises:
        OSError: the file cannot be read, or is not a regular file (a FIFO, a device, a
            socket: its read would wait for a writer or never end; a link to a regular file is
            read).
        CancelledError: inside ``stop_when(event)``, the event was set (checked once a block).

    Example:
        >>> sha256_file("config.json")   # doctest: +SKIP
        '3f1c...'
    """
    stop = _stop.get()
    h = hashlib.sha256()
    # Opened without blocking (a FIFO's open waits for a writer), then refused unless regular;
    # the flag changes nothing for a regular file's reads.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    with open(fd, "rb") as f:
        while block := f.read(_BLOCK):
            if stop is not None and stop.is_set():
                raise CancelledError(f"{path}: hashing stopped (no longer needed)")
            h.update(block)
    return h.hexdigest()


def git_blob_id(data: bytes) -> str:
    """Git's object id of a file holding ``data`` (``git hash-object``): the sha1 of
    ``b"blob <size>\\0"`` followed by the bytes, as the Hub's ``blob_id`` gives it.

    Example:
        >>> git_blob_id(b"")
        'e69de29bb2d1d6434b8b29ae775ad8c2e48c5391'
    """
    h = hashlib.sha1(b"blob %d\0" % len(data), usedforsecurity=False)   # git's id
    h.update(data)
    return h.hexdigest()
