"""What a local load leaves in the page cache (lct/io/store.py, ``page_cache``): the store's "auto"
drops the stored bytes it read in from disk once decoded and keeps what was cached before it,
"keep" keeps all, "drop" drops all. ``lct.load``'s "auto" (the default) drops while the decoded
cache keeps the decode and keeps otherwise; the model is the same whichever; layer-wise models
keep (every forward reads again); a bad value is refused by name."""

import mmap
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import lct
from lct.cli.main import cli
from lct.errors import OptionError
from lct.io.store import LocalStore, residency
from lct.loader import LayerwiseModel


def resident(address: int, offset: int, size: int):
    """Whether every page of the range of the mapping at ``address`` is in the page cache."""
    vec = residency(address, offset, size)
    return None if vec is None else bool(vec.all())


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _warm(path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass


def _fraction(path) -> float:
    """The share of ``path``'s pages in the page cache."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    a = np.frombuffer(m, dtype=np.uint8)
    page, n = mmap.PAGESIZE, len(m)
    hits = sum(bool(resident(a.ctypes.data, off, min(page, n - off)))
               for off in range(0, n, page))
    del a
    m.close()
    return hits / ((n + page - 1) // page)


@pytest.fixture
def big_file(tmp_path):
    """A 4 MiB file, evicted: skips where the file system keeps its pages (tmpfs)."""
    p = tmp_path / "data.bin"
    p.write_bytes(os.urandom(4 << 20))
    _evict(p)
    if _fraction(p) > 0.5:
        pytest.skip(f"{tmp_path}: this file system keeps its pages in memory (tmpfs?)")
    return p


def test_resident_tells_cached_pages_from_evicted_ones(big_file):
    assert _fraction(big_file) < 0.5
    _warm(big_file)
    assert _fraction(big_file) == 1.0


@pytest.mark.parametrize("mode, warm, dropped", [
    ("auto", False, True), ("auto", True, False), ("keep", False, False), ("drop", True, True)])
def test_a_range_is_dropped_when_the_mode_says(big_file, mode, warm, dropped):
    if warm:
        _warm(big_file)
    store = LocalStore(big_file.parent, page_cache=mode)
    size = big_file.stat().st_size
    start, length = 1 << 20, 2 << 20
    store.will_need(big_file.name, start, length, size)
    view = store.read_range(big_file.name, start, length, size)
    assert bytes(view[:16]) == big_file.read_bytes()[start:start + 16]
    view.release()
    store.release(big_file.name, start, length)
    assert store.dropped == (length if dropped else 0)
    m = store._maps[big_file.name]
    inside = resident(store._addresses[big_file.name], start, length)
    assert inside is (not dropped)
    store.close()
    assert isinstance(m, mmap.mmap) and m.closed


def _data_files(art):
    return sorted(art.glob("model-*.lct"))


@pytest.fixture
def wide_art(wide_srcs, tmp_path):
    out = tmp_path / "wide.lct"
    lct.convert(str(wide_srcs["llama"]), out)
    files = _data_files(out)
    assert files, list(out.iterdir())
    for f in files:
        _evict(f)
    if max(_fraction(f) for f in files) > 0.5:
        pytest.skip(f"{tmp_path}: this file system keeps its pages in memory (tmpfs?)")
    return out


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 2]])).logits


def test_a_cold_load_keeps_its_pages_unless_the_decoded_cache_keeps_the_decode(
        wide_art, tmp_path, monkeypatch):
    from lct.io import cache
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "cache"))
    files = _data_files(wide_art)
    kept = lct.load(wide_art)                          # the default: auto, no decoded cache
    assert min(_fraction(f) for f in files) > 0.9     # read in, and kept for the next load
    for f in files:
        _evict(f)
    filling = lct.load(wide_art, cache=True)           # the next load maps the decoded cache
    assert all(f.done for f in cache.wait_fills())
    assert max(_fraction(f) for f in files) < 0.5
    for f in files:
        _evict(f)
    dropped = lct.load(wide_art, page_cache="drop")
    assert max(_fraction(f) for f in files) < 0.5
    for model in (filling, dropped):
        torch.testing.assert_close(_logits(model), _logits(kept), rtol=0, atol=0)


def test_a_warm_load_keeps_what_was_cached(wide_art):
    files = _data_files(wide_art)
    for f in files:
        _warm(f)
    lct.load(wide_art)
    assert min(_fraction(f) for f in files) > 0.9


def test_layerwise_keeps_the_layers_it_reads_again(wide_art):
    files = _data_files(wide_art)
    with LayerwiseModel(wide_art) as lw:
        with torch.no_grad():
            lw(torch.tensor([[1, 5, 9, 2]]))
    assert min(_fraction(f) for f in files) > 0.9


def test_a_bad_mode_is_refused_by_name(wide_art):
    with pytest.raises(OptionError, match="page_cache 'sometimes': expected one of auto, keep, drop"):
        lct.load(wide_art, page_cache="sometimes")
    r = CliRunner().invoke(cli, ["load", str(wide_art), "--page-cache", "sometimes"])
    assert r.exit_code == 2 and "--page-cache" in r.output


def test_the_cli_takes_the_mode(wide_art):
    r = CliRunner().invoke(cli, ["load", str(wide_art), "--page-cache", "drop", "-q"])
    assert r.exit_code == 0, r.output
    assert max(_fraction(f) for f in _data_files(wide_art)) < 0.5
