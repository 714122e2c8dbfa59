"""Mapping the decoded copy or decoding the artifact, chosen per start (lct.io.cache.choose):
an entry whose pages are in memory is mapped, one on the disk is left there and the artifact
(fewer bytes) decoded instead, with the same weights, and the entry is read into memory after
the load for the next start; LCT_CACHE_MAP=always maps whatever; where mincore cannot be asked
the entry is mapped; the layer-wise model maps always. Pages are dropped from the page cache
with posix_fadvise(DONTNEED): where the kernel keeps them anyway (tmpfs), the tests that need
an entry on the disk skip, saying so."""

import os
import time

import pytest
import torch

import lct
from lct.errors import LCTError
from lct.io import cache
from tests.decoded_cache import entry_on_disk, resident_share, use_cache_root


@pytest.fixture
def root(tmp_path, monkeypatch):
    return use_cache_root(tmp_path, monkeypatch, "auto")    # conftest maps always


def _filled(art) -> cache.Entry:
    with lct.open(art) as a:
        f = cache.fill(a)
    assert f.done, f.reason
    (entry,) = cache.entries()
    return entry


def _in_memory(entry) -> None:
    (entry.path / cache.DATA).read_bytes()


def _load(art, **kw):
    stats = lct.LoadStats()
    model = lct.load(art, stats=stats, **kw)
    return model, stats


def _same(a, b) -> None:
    want, got = a.state_dict(), b.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def _warmed(art) -> None:
    """Wait (30 s at most) for the process that reads the entry into memory after a load
    (``cache.warm``); the kernel's reads end after its calls."""
    deadline = time.monotonic() + 30
    while resident_share(art) < cache.MAP_RESIDENT and time.monotonic() < deadline:
        time.sleep(0.1)


def test_residency_is_measured_from_a_sample_of_pages(root, llama_art):
    entry = _filled(llama_art)
    _in_memory(entry)
    assert resident_share(llama_art) == 1.0
    entry_on_disk(llama_art, entry)
    assert resident_share(llama_art) < cache.MAP_RESIDENT
    assert resident_share(llama_art) < cache.MAP_RESIDENT    # asking touched no page of it


def test_an_entry_in_memory_is_mapped_one_on_the_disk_is_not(root, llama_art):
    want = lct.load(llama_art, cache=False)
    entry = _filled(llama_art)
    _in_memory(entry)
    mapped, stats = _load(llama_art)
    assert stats.cache == "hit: mapped (100% of it in memory)" and stats.bytes_read == 0
    _same(want, mapped)
    del mapped
    entry_on_disk(llama_art, entry)
    decoded, stats = _load(llama_art)
    assert stats.cache.startswith("cold: ") and "in memory: decoded the artifact instead" in \
        stats.cache, stats.cache
    assert stats.bytes_read > 0                     # it read the artifact, not the entry
    _same(want, decoded)
    assert [e.digest for e in cache.entries()] == [entry.digest]     # left as it was
    # after the load, the entry is read into memory for the next start, which maps it
    _warmed(llama_art)
    again, stats = _load(llama_art)
    assert stats.cache.startswith("hit: mapped (") and stats.bytes_read == 0, stats.cache
    _same(want, again)


def test_lct_cache_map_always_maps_an_entry_on_the_disk(root, llama_art, monkeypatch):
    want = lct.load(llama_art, cache=False)
    entry = _filled(llama_art)
    entry_on_disk(llama_art, entry)
    monkeypatch.setenv(cache.ENV_MAP, "always")
    mapped, stats = _load(llama_art)
    assert stats.cache == "hit: mapped (LCT_CACHE_MAP=always)" and stats.bytes_read == 0
    _same(want, mapped)
    monkeypatch.setenv(cache.ENV_MAP, "sometimes")
    with pytest.raises(LCTError, match="LCT_CACHE_MAP='sometimes': use auto or always"):
        lct.load(llama_art)


def test_without_mincore_the_entry_is_mapped(root, llama_art, monkeypatch):
    import lct.io.store as store
    entry = _filled(llama_art)
    entry_on_disk(llama_art, entry)
    monkeypatch.setattr(store, "_LIBC", False)      # what _libc() keeps when libc has none
    with lct.open(llama_art) as a:
        assert cache.lookup(a).resident() is None
    _, stats = _load(llama_art)
    assert stats.cache == "hit: mapped (how much of it is in memory is unknown: no mincore)"
    assert stats.bytes_read == 0


def test_the_loaders_that_map_choose_too_and_the_layerwise_model_maps_always(root, llama_art):
    """A device-mapped load decodes the artifact where the entry is on the disk, and reads the
    entry into memory afterwards instead of filling another; the layer-wise model, which reads
    its layers at every forward, maps the entry wherever its pages are."""
    from lct.loader.layerwise import LayerwiseModel
    whole = lct.load(llama_art, cache=False)
    entry = _filled(llama_art)
    entry_on_disk(llama_art, entry)
    before = cache.wait_fills()
    stats = lct.LoadStats()
    got = lct.load(llama_art, device_map={"": "cpu"}, stats=stats)
    assert stats.cache.startswith("cold: ") and stats.bytes_read > 0, stats.cache
    _same(whole, got)
    assert [f for f in cache.wait_fills() if not any(f is b for b in before)] == []
    assert [e.digest for e in cache.entries()] == [entry.digest]
    _warmed(llama_art)
    entry_on_disk(llama_art, entry)
    with LayerwiseModel(llama_art) as lm:
        assert lm.cached is not None and lm.filling is None


def test_an_artifact_no_smaller_than_its_copy_is_never_decoded_for_it(root, llama_src,
                                                                         tmp_path):
    """Stored raw, the artifact's bytes are the decoded ones: decoding it reads no fewer, so
    its entry is mapped, wherever its pages are."""
    art = tmp_path / "raw.lct"
    lct.convert(str(llama_src), art, policy=lct.Policy(codec="raw"))
    with lct.open(art) as a:
        assert a.manifest.stored_bytes >= a.manifest.decoded_bytes
    entry = _filled(art)
    entry_on_disk(art, entry)
    _, stats = _load(art)
    assert stats.cache == "hit: mapped (the artifact is no smaller than its decoded copy)"
    assert stats.bytes_read == 0


def test_a_load_without_checksums_leaves_an_entry_on_the_disk_and_warms_it(root, llama_art):
    """An entry is checked as it is mapped whatever the load checks, so a device-mapped load
    with verify=False that decoded the artifact instead still reads it into memory for the
    next start, and says it decoded, not that nothing is kept."""
    entry = _filled(llama_art)
    entry_on_disk(llama_art, entry)
    stats = lct.LoadStats()
    lct.load(llama_art, device_map={"": "cpu"}, verify=False, stats=stats)
    assert stats.cache.startswith("cold: "), stats.cache
    _warmed(llama_art)
    assert resident_share(llama_art) >= cache.MAP_RESIDENT


def test_a_mapped_copy_is_read_ahead_a_group_at_a_time(root, llama_art, monkeypatch):
    """Mapping a copy partly on the disk reads it in large requests ahead of the load, as the
    artifact is (posix_fadvise WILLNEED on each group's spans of the entry's file), not a page
    at a time as its views are first touched; the weights are the entry's either way."""
    asked = []
    real = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED and os.readlink(f"/proc/self/fd/{fd}").endswith(
                cache.DATA):
            asked.append((offset, length))
        return real(fd, offset, length, advice)
    entry = _filled(llama_art)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setenv(cache.ENV_MAP, "always")
    stats = lct.LoadStats()
    model = lct.load(llama_art, stats=stats)
    assert stats.cache.startswith("hit: mapped") and stats.bytes_read == 0
    with lct.open(llama_art) as a:
        spans, _ = cache.layout(a.manifest)
    assert sorted(asked) == sorted(spans.values()), (asked, spans)
    assert model is not None and entry.size >= max(at + n for at, n in spans.values())
