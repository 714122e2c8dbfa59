"""What the decoded cache's tests share: a cache folder of the test's own, and an entry's pages
put back on the disk (imported as ``tests.decoded_cache``)."""

import gc
import os

import pytest

import lct
from lct.io import cache


def use_cache_root(tmp_path, monkeypatch, map_mode: str | None = None):
    """Point the decoded cache at a folder under ``tmp_path``, with the cache switch and the
    budget from their defaults (conftest turns it off), and ``LCT_CACHE_MAP`` at ``map_mode``
    where given (conftest maps always); returns the folder."""
    d = tmp_path / "cache"
    monkeypatch.setenv(cache.ENV_DIR, str(d))
    monkeypatch.delenv(cache.ENV_SWITCH, raising=False)
    monkeypatch.delenv(cache.ENV_MAX, raising=False)
    if map_mode is not None:
        monkeypatch.setenv(cache.ENV_MAP, map_mode)
    return d


def resident_share(art) -> float:
    """The share of ``art``'s entry whose pages are in memory (``CachedChunks.resident``)."""
    with lct.open(art) as a:
        share = cache.lookup(a).resident()
    assert share is not None, "mincore could not be asked on this machine"
    return share


def entry_on_disk(art, entry) -> None:
    """Drop the pages of ``art``'s ``entry`` from the page cache; skip the test where the
    kernel keeps them."""
    gc.collect()            # a model that mapped the entry, gone: its pages are unmapped
    fd = os.open(entry.path / cache.DATA, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    share = resident_share(art)
    if share >= cache.MAP_RESIDENT:
        pytest.skip(f"the kernel kept {share:.0%} of the entry's pages after "
                    f"posix_fadvise(DONTNEED) (a file system in memory?)")
