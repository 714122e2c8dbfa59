"""The local decoded cache (lct/io/cache.py): a load fills it in the background, a later load
maps it and reads nothing of the artifact, with the same model; LCT_CACHE and cache= switch it;
a damaged entry is replaced, never used; weights changed in place before they are written, a
load without checksums, a failed load, a full disk or an over-budget entry keep nothing; the
size budget evicts the least recently used; only the cache's own folders, and no running
fill's, are ever removed; and `lct cache` lists and prunes it."""

import fcntl
import gc
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import lct
from lct.cli.main import cli
from lct.errors import LCTError
from lct.io import cache
from lct.kernels import paths
from tests.decoded_cache import use_cache_root


@pytest.fixture
def root(tmp_path, monkeypatch):
    return use_cache_root(tmp_path, monkeypatch)


def _load(art, **kw):
    stats = lct.LoadStats()
    model = lct.load(art, stats=stats, **kw)
    fills = cache.wait_fills()
    return model, stats, fills


def _mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (/proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return rest[4] if len(rest) > 4 else None
    return None


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 2, 7, 3]])).logits


def test_a_load_fills_and_the_next_maps_it(root, llama_art):
    model, stats, fills = _load(llama_art, cache=True)
    assert stats.cache == "filling" and stats.bytes_read > 0
    assert fills[-1].done, fills[-1].reason
    (entry,) = cache.entries()
    with lct.open(llama_art) as a:
        assert entry.digest == a.digest and entry.artifact == str(a.path)
        _, size = cache.layout(a.manifest)
    assert entry.size == size == (entry.path / cache.DATA).stat().st_size
    again, stats2, _ = _load(llama_art, cache=True)
    assert stats2.cache.startswith("hit: mapped") and stats2.bytes_read == 0
    assert stats2.bytes_decoded == stats.bytes_decoded
    assert torch.equal(_logits(model), _logits(again))
    # the weights are views of the entry's file, mapped (nothing copied into fresh memory),
    # privately: writing to them changes neither the entry nor a later load
    layer = again.model.layers[0].mlp.down_proj.weight
    assert _mapped_file(layer.data_ptr()) == str(entry.path / cache.DATA)
    before = (entry.path / cache.DATA).read_bytes()
    with torch.no_grad():
        layer.mul_(2)
    assert (entry.path / cache.DATA).read_bytes() == before
    assert not list(root.glob(f"{cache.FILL_PREFIX}*"))       # no staging folder left


def test_by_default_a_first_load_decodes_into_memory_and_writes_the_copy_after(root, llama_art):
    """LCT_CACHE_IN_PLACE off (the default, by measurement): the weights are memory of their
    own, written into the entry after the load, each checked against its pin."""
    assert not cache.in_place()
    model, stats, fills = _load(llama_art, cache=True)
    assert stats.cache == "filling" and fills[-1].done, fills[-1].reason
    assert fills[-1].in_place == 0
    (entry,) = cache.entries()
    layer = model.model.layers[0].mlp.down_proj.weight
    assert _mapped_file(layer.data_ptr()) != str(entry.path / cache.DATA)
    # nothing of this process maps the file the copy was written into (renamed into the entry)
    assert str(entry.path / cache.DATA) not in Path("/proc/self/maps").read_text()
    again, stats2, _ = _load(llama_art, cache=True)
    assert stats2.cache.startswith("hit: mapped") and torch.equal(_logits(again), _logits(model))


def test_lct_cache_in_place(monkeypatch):
    for value, on in (("1", True), ("on", True), ("0", False), ("", False)):
        monkeypatch.setenv(cache.ENV_IN_PLACE, value)
        assert cache.in_place() is on
    monkeypatch.setenv(cache.ENV_IN_PLACE, "maybe")
    with pytest.raises(LCTError, match="LCT_CACHE_IN_PLACE='maybe': use 1 or 0"):
        cache.in_place()


def test_a_first_load_decodes_into_the_copy_it_keeps(root, llama_art, monkeypatch):
    """Issue 36 item 3, no double touch (LCT_CACHE_IN_PLACE=1): a load that fills decodes each
    chunk straight into the entry's data file, so that its weights are the entry's very pages
    (no fresh memory of their own beside the copy's); once loaded they are copy-on-write:
    writing to them changes neither the entry being published nor a later load."""
    monkeypatch.setenv(cache.ENV_IN_PLACE, "1")
    model, stats, fills = _load(llama_art, cache=True)
    assert fills[-1].in_place > 0
    assert stats.cache == "filling" and fills[-1].done, fills[-1].reason
    (entry,) = cache.entries()
    layer = model.model.layers[0].mlp.down_proj.weight
    norm = model.model.layers[-1].post_attention_layernorm.weight
    for weight in (layer, norm):          # the published file (it was renamed under the map)
        assert _mapped_file(weight.data_ptr()) == str(entry.path / cache.DATA)
    before = (entry.path / cache.DATA).read_bytes()
    expected = _logits(model)
    with torch.no_grad():
        layer.mul_(2)
    assert (entry.path / cache.DATA).read_bytes() == before
    again, stats2, _ = _load(llama_art, cache=True)
    assert stats2.cache.startswith("hit: mapped"), stats2.cache
    assert torch.equal(_logits(again), expected)
    assert torch.equal(_logits(lct.load(llama_art, cache=False)), expected)


def test_weights_written_before_the_entry_is_published_are_not_in_it(root, llama_art,
                                                                    monkeypatch):
    """The copy-on-write mapping comes before the load returns: a write into the weights at
    once, while the background thread still checks and syncs the file, stays in the model."""
    monkeypatch.setenv(cache.ENV_IN_PLACE, "1")
    held = []
    monkeypatch.setattr(cache, "start_fill", held.append)     # started below, by hand
    model = lct.load(llama_art, cache=True)
    (fill,) = held
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fill.start()
    fill.wait()
    assert fill.done, fill.reason
    again, stats, _ = _load(llama_art, cache=True)
    assert stats.cache.startswith("hit: mapped") and not stats.cache.startswith("hit, but")
    assert torch.equal(_logits(again), _logits(lct.load(llama_art, cache=False)))


def test_a_fill_whose_pages_cannot_be_made_private_keeps_nothing(root, llama_art, monkeypatch):
    """Where the copy-on-write mapping fails, the entry is not kept (other processes would map
    pages the model writes to); the load is whole and its staging folder removed."""
    import lct.io.store as store
    monkeypatch.setenv(cache.ENV_IN_PLACE, "1")
    monkeypatch.setattr(store, "map_private", lambda *args: False)
    model, stats, _ = _load(llama_art, cache=True)
    assert cache.entries() == [] and list(root.iterdir()) == []
    assert torch.equal(_logits(model), _logits(lct.load(llama_art, cache=False)))


def test_the_switch(root, llama_art, monkeypatch):
    assert cache.DEFAULT_ON
    _, stats, fills = _load(llama_art)
    assert stats.cache == "filling" and fills[-1].done        # on by default (issue 36)
    _, stats, _ = _load(llama_art)
    assert stats.cache.startswith("hit: mapped")
    cache.prune(everything=True)
    monkeypatch.setenv(cache.ENV_SWITCH, "1")
    _, stats, _ = _load(llama_art)
    assert stats.cache == "filling"
    _, stats, _ = _load(llama_art, cache=False)               # the argument wins
    assert stats.cache == "off"
    monkeypatch.setenv(cache.ENV_SWITCH, "0")
    _, stats, _ = _load(llama_art)
    assert stats.cache == "off"
    monkeypatch.setenv(cache.ENV_SWITCH, "maybe")
    with pytest.raises(LCTError, match="LCT_CACHE='maybe': use 1 or 0"):
        lct.load(llama_art)


def test_a_load_whose_weights_are_not_the_stored_bytes_has_a_copy_decoded_after_it(root,
                                                                                 llama_art):
    """A load that casts (or dequantizes, or goes onto a GPU) cannot keep its own buffers: a
    background fill decodes the artifact's stored bytes into the entry after it (issue 36:
    every start keeps a copy), which the next load maps; a load that checks no checksums
    keeps nothing."""
    _, stats, _ = _load(llama_art, cache=True, verify=False)
    assert stats.cache == "miss: not kept, the artifact is read without checking checksums"
    assert cache.entries() == []
    _, stats, _ = _load(llama_art, cache=True, dtype=torch.float32)
    assert stats.cache == "miss: being kept for the next start (a background fill)"
    cache.wait_fills(timeout=120)
    assert len(cache.entries()) == 1
    _, stats, _ = _load(llama_art, cache=True, dtype=torch.float32)
    assert stats.cache.startswith("hit: mapped")


def test_weights_changed_before_they_are_written_are_not_kept(root, llama_art):
    with lct.open(llama_art) as a:
        f = cache.Fill(a)
        bufs = [a.decode(c, a.read_stored(c)) for c in a.manifest.chunks]
        for c, b in zip(a.manifest.chunks, bufs):
            f.add(c.id, b)
    bufs[-1][0] ^= 1                # what a training step or load_state_dict would do
    f.start()
    f.wait()
    assert not f.done and f"chunk {len(bufs) - 1} is not the bytes the manifest pins" in f.reason
    assert cache.entries() == [] and not list(root.glob(f"{cache.FILL_PREFIX}*"))


def test_a_ctrl_c_while_the_copy_is_written_leaves_no_staging_folder(root, llama_art,
                                                                    monkeypatch):
    """A Ctrl-C while a process waits for its fill (``lct load``'s "keeping the decoded copy"):
    the fill is cancelled and its staging folder removed before the interrupt is raised again,
    so "nothing was left half-written" holds; the writes end within a piece, not a chunk."""
    import signal
    import threading

    real, pieces = os.pwrite, []

    def slow(fd, data, offset):     # a slow disk: 4 KiB a call, 5 ms each
        pieces.append(offset)
        if len(pieces) == 40:       # the user presses Ctrl-C while the copy is written
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        import time
        time.sleep(0.005)
        return real(fd, data[:4096], offset)
    monkeypatch.setattr(cache.os, "pwrite", slow)
    lct.load(llama_art, cache=True)
    with pytest.raises(KeyboardInterrupt):
        cache.wait_fills()
    monkeypatch.setattr(cache.os, "pwrite", real)
    fill = cache._FILLS[-1]
    assert fill.wait(0) and not fill.done and fill.reason == "cancelled"
    assert len(pieces) < 80         # it stopped within a piece of the interrupt
    assert cache.entries() == [] and list(root.iterdir()) == []


def test_a_ctrl_c_while_lct_load_generates_keeps_no_copy(root, llama_art, monkeypatch):
    """Found by a new user: a Ctrl-C while ``lct load`` generated said "interrupted", then the
    exit waited for the background fill and kept the copy anyway. The interrupt now cancels
    the fills this process started: nothing is kept, nothing is left."""
    import time

    from click.testing import CliRunner

    import lct.loader.generate as gen
    from lct.cli.main import cli
    real = os.pwrite

    def slow(fd, data, offset):     # a slow disk: the fill still runs when the Ctrl-C comes
        time.sleep(0.005)
        return real(fd, data[:4096], offset)

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(cache.os, "pwrite", slow)
    monkeypatch.setattr(gen, "generate_timed", interrupted)
    res = CliRunner().invoke(cli, ["load", str(llama_art), "--ids", "1,2"])
    assert res.exit_code == 130 and "interrupted; nothing was left half-written" in res.output
    fill = cache._FILLS[-1]
    assert fill.wait(0) and not fill.done and fill.reason == "cancelled"
    assert cache.entries() == [] and list(root.iterdir()) == []


def test_a_failed_load_keeps_nothing(root, llama_art, monkeypatch):
    import lct.loader.build as build

    def broken(model, path):
        raise RuntimeError("generation config unreadable")
    monkeypatch.setattr(build, "_generation_config", broken)
    with pytest.raises(RuntimeError, match="unreadable"):
        lct.load(llama_art, cache=True)
    cache.wait_fills()
    # the load decoded into a staging folder (StagedFill): removed with the failure
    assert cache.entries() == [] and list(root.iterdir()) == []


def test_a_damaged_entry_is_replaced_not_used(root, llama_art):
    _load(llama_art, cache=True)
    (entry,) = cache.entries()
    data = entry.path / cache.DATA
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 4096)
    model, stats, fills = _load(llama_art, cache=True)
    assert stats.cache == "filling" and stats.bytes_read > 0 and fills[-1].done
    (entry,) = cache.entries()
    assert data.stat().st_size == entry.size
    _, stats, _ = _load(llama_art, cache=True)
    assert stats.cache.startswith("hit: mapped")


def test_the_budget_evicts_the_least_recently_used(root, llama_art, gemma_art, monkeypatch):
    _load(llama_art, cache=True)
    (first,) = cache.entries()
    monkeypatch.setenv(cache.ENV_MAX, f"{-(-first.size // 1024) + 4}KiB")
    _, stats, fills = _load(gemma_art, cache=True)
    if stats.cache == "filling":                # gemma's entry fits the budget alone
        assert fills[-1].done and [e.artifact for e in cache.entries()] == [fills[-1].artifact]
    else:
        assert stats.cache.startswith("miss: not kept, ") and "over the cache's budget" in \
            stats.cache
    monkeypatch.setenv(cache.ENV_MAX, "4KiB")
    cache.prune(everything=True)
    _, stats, fills = _load(llama_art, cache=True)   # known before the load: it keeps nothing
    assert stats.cache.startswith("miss: not kept, ") and \
        stats.cache.endswith("is over the cache's budget of 4.10 KB (LCT_CACHE_MAX sets it)")
    monkeypatch.setenv(cache.ENV_MAX, "4096")                 # a size needs its unit
    with pytest.raises(LCTError, match="LCT_CACHE_MAX '4096' needs a number with a unit"):
        lct.load(gemma_art, cache=True)


def test_a_full_disk_is_not_filled(root, llama_art, monkeypatch):
    real = shutil.disk_usage

    def nearly_full(path):
        u = real(path)
        return type(u)(u.total, u.total - 1000, 1000)
    monkeypatch.setattr(cache.shutil, "disk_usage", nearly_full)
    # known before the load decodes (StagedFill.open): it decodes into memory of its own
    _, stats, _ = _load(llama_art, cache=True)
    assert stats.cache.startswith("miss: not kept, ") and "1.00 KB free" in stats.cache
    assert cache.entries() == [] and not list(root.glob(f"{cache.FILL_PREFIX}*"))


def test_the_disk_left_free_is_5_percent_unless_lct_cache_min_free_says(root, llama_art,
                                                                        monkeypatch):
    """Unset, the cache leaves the larger of 2 GiB and 5 % of the disk free (a 1 TB disk with
    40 GB free is too full); ``LCT_CACHE_MIN_FREE`` sets it instead, and a bad value fails the
    load that would fill, at once, by name."""
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda path: usage(10**12, 96 * 10**10,
                                                                       4 * 10**10))
    monkeypatch.delenv(cache.ENV_MIN_FREE, raising=False)
    assert cache.min_free_bytes(10**9) == cache.MIN_FREE_BYTES
    assert cache.min_free_bytes(10**12) == 5 * 10**10
    _, stats, _ = _load(llama_art, cache=True)
    assert stats.cache.startswith("miss: not kept, ") and cache.entries() == []
    assert stats.cache.endswith("50.00 GB kept free (LCT_CACHE_MIN_FREE sets how much)")
    monkeypatch.setenv(cache.ENV_MIN_FREE, "lots")
    with pytest.raises(LCTError, match="LCT_CACHE_MIN_FREE 'lots' needs a number with a unit"):
        lct.load(llama_art, cache=True)
    monkeypatch.setenv(cache.ENV_MIN_FREE, "10GB")
    _, _, fills = _load(llama_art, cache=True)
    assert fills[-1].done and len(cache.entries()) == 1


def test_only_the_caches_own_folders_are_removed(root, llama_art):
    _load(llama_art, cache=True)
    mine = cache.entries()[0].path
    foreign = root / ("a" * 64)                  # named like an entry, not one
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    other = root / "other"
    other.mkdir()
    stale = root / f"{cache.FILL_PREFIX}dead"    # a fill whose process ended
    stale.mkdir()
    (stale / cache.FILL_MARKER).write_text("x")
    (stale / cache.DATA).write_bytes(b"\0" * 10)
    running = root / f"{cache.FILL_PREFIX}running"   # a fill still writing: it holds the lock
    running.mkdir()
    (running / cache.FILL_MARKER).write_text("x")
    held = os.open(running / cache.FILL_MARKER, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    lookalike = root / f"{cache.FILL_PREFIX}notours"
    lookalike.mkdir()
    try:
        removed = cache.prune(everything=True)
    finally:
        os.close(held)
    assert [e.path for e in removed] == [mine] and not mine.exists() and not stale.exists()
    assert (foreign / "notes.txt").read_text() == "mine" and other.is_dir() and lookalike.is_dir()
    assert running.is_dir()
    cache.prune(everything=True)            # its process gone (the lock with it): removed now
    assert not running.exists()


def test_a_second_fill_of_the_same_artifact_leaves_one_entry(root, llama_art):
    with lct.open(llama_art) as a:
        fills = []
        for _ in range(2):
            f = cache.Fill(a)
            for c in a.manifest.chunks:
                f.add(c.id, a.decode(c, a.read_stored(c)))
            fills.append(f)
        # one after the other: the second finds the first's entry and writes nothing
        for f in fills:
            f.start()
            f.wait()
    assert [f.done for f in fills] == [True, False] and fills[1].reason == ""
    assert len(cache.entries()) == 1 and not list(root.glob(f"{cache.FILL_PREFIX}*"))
    # a folder under the digest's name that is not an entry is left alone, and said
    shutil.rmtree(cache.entries()[0].path)
    squatter = root / fills[0].digest.removeprefix("sha256:")
    squatter.mkdir()
    with lct.open(llama_art) as a:
        f = cache.Fill(a)
        for c in a.manifest.chunks:
            f.add(c.id, a.decode(c, a.read_stored(c)))
        f.start()
        f.wait()
    assert not f.done and "is not an entry of this cache; left alone" in f.reason
    assert squatter.is_dir() and os.listdir(squatter) == []
    squatter.rmdir()
    # an incomplete fill publishes nothing
    with lct.open(llama_art) as a:
        f = cache.Fill(a)
        f.add(0, np.zeros(a.manifest.chunks[0].decoded_size, np.uint8))
        f.start()
    assert "did not decode every chunk" in f.reason


def test_cli_lists_and_prunes(root, llama_art):
    runner = CliRunner()
    out = runner.invoke(cli, ["load", str(llama_art), "--cache", "--ids", "1,2", "-q"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(cli, ["cache", "list", "--json"])
    data = json.loads(out.output)
    assert data["dir"] == str(root) and len(data["entries"]) == 1
    assert data["total_bytes"] == data["entries"][0]["size"] > 0
    out = runner.invoke(cli, ["load", str(llama_art), "--cache", "--json"])
    assert json.loads(out.output)["breakdown"]["cache"].startswith("hit: mapped")
    # a hit decodes nothing: its throughput is not called a decode (a new user's trial)
    out = runner.invoke(cli, ["load", str(llama_art), "--cache", "--ids", "1,2"])
    assert re.search(r"stream throughput +\S+ \S+/s mapped from the decoded cache", out.output), \
        out.output
    assert runner.invoke(cli, ["cache", "prune"]).exit_code == 2
    # a digest no entry has, or a prefix of none, is an error, not "removed 0 entries"
    for wrong in ("foo", "sha256:0000000000000"):
        out = runner.invoke(cli, ["cache", "prune", "--digest", wrong])
        assert out.exit_code == 1 and "no entry of the decoded cache has digest" in \
            out.output, out.output
    shown = runner.invoke(cli, ["cache", "list"]).output      # the digest as the list prints it
    short = re.search(r"sha256:[0-9a-f]{12}", shown).group(0)
    out = runner.invoke(cli, ["cache", "prune", "--digest", short])
    assert out.exit_code == 0 and "removed 1 entry" in out.output, out.output
    runner.invoke(cli, ["load", str(llama_art), "--cache", "--ids", "1,2", "-q"])
    out = runner.invoke(cli, ["cache", "prune", "--max-size", "0KB"])
    assert out.exit_code == 0 and "removed 1 entry" in out.output
    # the quantized head's path measured by the loads stays: it is not an entry
    assert cache.entries() == [] and os.listdir(root) in ([], [paths.MEMO])
    (root / paths.MEMO).write_text(json.dumps({"kind": paths.MEMO_KIND, "machine": "M",
                                               "choices": {}}))
    out = runner.invoke(cli, ["cache", "prune", "--all"])
    assert out.exit_code == 0 and os.listdir(root) == [], out.output


def test_prune_orphaned_removes_the_entries_of_artifacts_gone_or_replaced(
        root, llama_art, gemma_art, tmp_path):
    """A new user's trial: every temporary demo and every re-convert left an entry behind that
    nothing would ever map again, and nothing but --all or --digest removed it."""
    a, b = tmp_path / "a.lct", tmp_path / "b.lct"
    shutil.copytree(llama_art, a)
    shutil.copytree(gemma_art, b)
    runner = CliRunner()
    for art in (a, b):
        assert runner.invoke(cli, ["cache", "fill", str(art)]).exit_code == 0
    out = runner.invoke(cli, ["cache", "prune", "--orphaned"])
    assert out.exit_code == 0 and "removed 0 entries" in out.output, out.output
    shutil.rmtree(b)                                    # a folder removed
    out = runner.invoke(cli, ["cache", "prune", "--orphaned"])
    assert out.exit_code == 0 and "removed 1 entry" in out.output, out.output
    (kept,) = cache.entries()
    assert kept.artifact == str(a)
    shutil.rmtree(a)                                    # converted again: another artifact there
    shutil.copytree(gemma_art, a)
    assert cache.orphaned(kept)
    assert [e.digest for e in cache.prune(orphans=True)] == [kept.digest]
    assert cache.entries() == []


def test_the_lct_command_leaves_its_entry(root, llama_art):
    """``lct`` ends its process with os._exit, past any atexit handler: it waits for the fill
    itself, here with LCT_CACHE=1 and a command that loads (``lct load``)."""
    import subprocess
    import sys
    env = {**os.environ, cache.ENV_SWITCH: "1", cache.ENV_DIR: str(root)}
    out = subprocess.run([sys.executable, "-m", "lct", "load", str(llama_art), "-q"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (entry,) = cache.entries()
    assert entry.artifact == str(llama_art.resolve()) or entry.artifact == str(llama_art)


def test_lct_load_layerwise_keeps_a_copy_and_says_so(root, llama_art):
    """`lct load --layerwise` with the cache on by default and no entry: the background fill
    runs to its end before the process (which ends with os._exit) does."""
    import subprocess
    import sys
    env = {**os.environ, cache.ENV_DIR: str(root)}
    env.pop(cache.ENV_SWITCH, None)
    out = subprocess.run([sys.executable, "-m", "lct", "load", str(llama_art), "--layerwise",
                          "-q"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (entry,) = cache.entries()
    with lct.open(llama_art) as a:
        assert entry.digest == a.digest


def _no_reads(monkeypatch):
    """Make reading any stored chunk of any artifact fail: what still loads maps the cache."""
    from lct.io.reader import Artifact

    def refuse(self, chunk, **kw):
        raise AssertionError(f"chunk {chunk.id} of {self.path} was read")
    monkeypatch.setattr(Artifact, "read_stored", refuse)


def test_lct_cache_fill_makes_the_entry_a_load_would(root, llama_art, tmp_path, monkeypatch):
    """`lct cache fill` decodes a group at a time, without a model, into the entry a whole
    load would have left (byte for byte); a load then maps it; a second fill leaves it."""
    res = CliRunner().invoke(cli, ["cache", "fill", str(llama_art)])
    assert res.exit_code == 0 and res.output.startswith("filled "), res.output
    (entry,) = cache.entries()
    other = tmp_path / "by-load"
    monkeypatch.setenv(cache.ENV_DIR, str(other))
    model, stats, fills = _load(llama_art, cache=True)
    assert stats.cache == "filling" and fills[-1].done
    (by_load,) = cache.entries()
    assert (entry.path / cache.DATA).read_bytes() == (by_load.path / cache.DATA).read_bytes()
    monkeypatch.setenv(cache.ENV_DIR, str(root))
    with monkeypatch.context() as m:
        _no_reads(m)
        again, stats2, _ = _load(llama_art, cache=True)
    assert stats2.cache.startswith("hit: mapped") and torch.equal(_logits(model), _logits(again))
    res = CliRunner().invoke(cli, ["cache", "fill", str(llama_art), "-q"])
    assert res.exit_code == 0 and res.output.strip() == str(entry.path), res.output
    assert len(cache.entries()) == 1


def test_lct_cache_fill_that_cannot_keep_says_why(root, llama_art, monkeypatch):
    monkeypatch.setenv(cache.ENV_MAX, "1KiB")
    res = CliRunner().invoke(cli, ["cache", "fill", str(llama_art)])
    assert res.exit_code == 1 and res.output.startswith("error: ") and "not cached: " in \
        res.output and "over the cache's budget of 1.02 KB (LCT_CACHE_MAX sets it)" in \
        res.output, res.output
    assert not cache.entries() and not list(root.glob(f"{cache.FILL_PREFIX}*"))


def _spoil(entry, cid: int) -> None:
    """Change one byte in the middle of chunk ``cid``'s bytes in the entry's data file."""
    with lct.open(entry.artifact) as a:
        spans, _ = cache.layout(a.manifest)
    at, size = spans[cid]
    with open(entry.path / cache.DATA, "r+b") as f:
        f.seek(at + size // 2)
        byte = f.read(1)[0]
        f.seek(at + size // 2)
        f.write(bytes([byte ^ 0x40]))


def test_a_changed_byte_in_an_entry_is_never_a_weight(root, llama_art, caplog):
    """One byte of an entry changed (same size, so only its hashes can tell): the hit decodes
    that chunk from the artifact instead, says so, removes the entry, and the next load fills
    it again; the weights are the artifact's every time."""
    want = lct.load(llama_art, cache=False).state_dict()
    _load(llama_art, cache=True)
    (entry,) = cache.entries()
    with lct.open(llama_art) as a:
        last = len(a.manifest.chunks) - 1
    _spoil(entry, last)
    with caplog.at_level("WARNING", logger="lct"):
        model, stats, _ = _load(llama_art, cache=True)
    assert stats.cache.startswith("hit, but 1 chunk(s) differed")
    assert f"chunk {last}'s bytes are not those" in caplog.text and not entry.path.exists()
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    _, stats, fills = _load(llama_art, cache=True)
    assert stats.cache == "filling" and fills[-1].done
    _, stats, _ = _load(llama_art, cache=True)
    assert stats.cache.startswith("hit: mapped")


def test_the_layerwise_model_checks_an_entry_too(root, llama_art):
    from lct.loader.layerwise import LayerwiseModel
    with LayerwiseModel(llama_art, cache=False) as lm:
        want = _logits(lm)
    with lct.open(llama_art) as art:
        assert cache.fill(art).done
    (entry,) = cache.entries()
    _spoil(entry, 1)
    with LayerwiseModel(llama_art, cache=True) as lm:
        assert torch.equal(_logits(lm), want) and torch.equal(_logits(lm), want)
    assert cache.entries() == []


def _other_weights(tmp_path_factory, llama_src):
    """An artifact of the same model type and shapes as ``llama_art`` but other weights."""
    from lct.demo import tiny
    src = tmp_path_factory.mktemp("other") / "src"
    tiny.save_tiny(src, "llama", seed=7)
    out = src.parent / "other.lct"
    lct.convert(str(src), out)
    return out


@pytest.mark.parametrize("pinned", [False, True])
def test_an_entry_swapped_in_from_another_artifact_never_gives_its_weights(
        root, llama_art, tmp_path_factory, llama_src, pinned):
    """Issue 36's attack: another artifact's entry (same shapes, other weights) put under this
    artifact's digest, its entry.json rewritten to name it: every chunk is checked against what
    this artifact's manifest pins, so the load gives this artifact's weights (with or without
    ``expect``), the entry is removed, and the next load fills the right one."""
    other = _other_weights(tmp_path_factory, llama_src)
    want = lct.load(llama_art, cache=False).state_dict()
    with lct.open(other) as o, lct.open(llama_art) as a:
        assert cache.fill(o).done
        assert cache.layout(o.manifest) == cache.layout(a.manifest)    # the same shapes
        theirs, mine = root / o.digest.removeprefix("sha256:"), \
            root / a.digest.removeprefix("sha256:")
        digest = a.digest
    theirs.rename(mine)
    meta = json.loads((mine / cache.ENTRY).read_text())
    meta.update(digest=digest, artifact=str(llama_art.absolute()))
    (mine / cache.ENTRY).write_text(json.dumps(meta))
    assert [e.path for e in cache.entries()] == [mine]
    model, stats, _ = _load(llama_art, cache=True, **({"expect": digest} if pinned else {}))
    assert stats.cache.startswith("hit, but") and not mine.exists()
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    _, stats, fills = _load(llama_art, cache=True)
    assert stats.cache == "filling" and fills[-1].done


def _before_1_6(art, out):
    """A copy of ``art`` as a format-1.5 writer wrote it: no decoded_checksum (bindings and the
    manifest checksum made again, so that it is a sound 1.5 artifact)."""
    from dataclasses import replace

    from lct.format.manifest import Manifest
    shutil.copytree(art, out)
    m = Manifest.from_json((out / "lct.json").read_bytes())
    m.format_version = (1, 5)
    m.chunks = [replace(c, decoded_checksum=None, binding=None) for c in m.chunks]
    (out / "lct.json").write_text(m.to_json())
    return out


def test_an_artifact_before_1_6_is_never_cached(root, llama_art, tmp_path):
    """A manifest that pins no decoded bytes: no entry is kept or used, and the load says why;
    `lct cache fill` refuses it in one line."""
    old = _before_1_6(llama_art, tmp_path / "old.lct")
    want = lct.load(llama_art, cache=False).state_dict()
    before = cache.wait_fills()
    model, stats, fills = _load(old, cache=True)
    assert stats.cache.startswith(f"off: {old} is format 1.5: its manifest pins no decoded bytes")
    assert cache.entries() == [] and fills == before
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    out = CliRunner().invoke(cli, ["cache", "fill", str(old)])
    assert out.exit_code != 0 and "pins no decoded bytes" in out.output
    assert len(out.output.strip().splitlines()) == 1, out.output


def test_a_deeply_nested_entry_json_is_not_an_entry(root, llama_art):
    """Issue 37 (1): an entry.json of '[' * 100000 + ']' * 100000 made `lct cache list`, prune,
    fill and a load end in a RecursionError. It is no entry of this cache: listed as none, left
    alone by prune, and a load or fill decodes instead."""
    with lct.open(llama_art) as a:
        folder = root / a.digest.removeprefix("sha256:")
    folder.mkdir(parents=True)
    (folder / cache.ENTRY).write_text("[" * 100000 + "]" * 100000)
    runner = CliRunner()
    for args in (["cache", "list"], ["cache", "prune", "--all"], ["cache", "fill", str(llama_art)],
                 ["load", str(llama_art), "--cache"]):
        out = runner.invoke(cli, args)
        assert "Traceback" not in out.output and "RecursionError" not in out.output, out.output
        assert not isinstance(out.exception, RecursionError), args
    assert cache.entries() == [] and (folder / cache.ENTRY).exists()
    _, stats, _ = _load(llama_art, cache=True)
    assert stats.cache.startswith("miss: not kept, ") and \
        stats.cache.endswith("exists and is not an entry of this cache; left alone")


def test_lct_cache_fill_checks_an_entry_that_exists(root, llama_art):
    """`lct cache fill` over an entry checks every chunk's hash: a sound one is left, one with a
    changed byte is filled again."""
    runner = CliRunner()
    out = runner.invoke(cli, ["cache", "fill", str(llama_art)])
    assert out.exit_code == 0, out.output
    (entry,) = cache.entries()
    before = (entry.path / cache.DATA).read_bytes()
    out = runner.invoke(cli, ["cache", "fill", str(llama_art)])
    assert out.exit_code == 0 and "already" in out.output, out.output
    _spoil(entry, 0)
    out = runner.invoke(cli, ["cache", "fill", str(llama_art)])
    assert out.exit_code == 0 and "already" not in out.output, out.output
    assert (entry.path / cache.DATA).read_bytes() == before


def test_a_load_without_checksums_still_checks_the_entry(root, llama_art):
    """``verify=False`` skips the artifact's stored checksums, but an entry is a copy outside
    the artifact: it is checked against the manifest's pins whatever ``verify`` says."""
    _load(llama_art, cache=True)
    (entry,) = cache.entries()
    _spoil(entry, 0)
    _, stats, _ = _load(llama_art, cache=True, verify=False)
    assert stats.cache.startswith("hit, but 1 chunk(s) differed") and not entry.path.exists()


def test_the_layerwise_model_and_a_device_map_keep_an_entry_then_map_it(root, llama_art,
                                                                        monkeypatch):
    """Without an entry, a device-mapped load and the layer-wise model each keep one for the
    next start, by a background fill (not with verify=False); with one, the layer-wise model's
    every forward and a device-mapped load map it: nothing of the artifact is read, the logits
    are the same."""
    from lct.loader.layerwise import LayerwiseModel
    with LayerwiseModel(llama_art, cache=False) as lm:
        want = _logits(lm)
    whole = _logits(lct.load(llama_art, cache=False))
    assert cache.entries() == []
    stats = lct.LoadStats()
    lct.load(llama_art, device_map={"": "cpu"}, cache=True, stats=stats)
    assert stats.cache == "miss: being kept for the next start (a background fill)"
    fills = cache.wait_fills()
    assert fills[-1].done, fills[-1].reason
    assert len(cache.entries()) == 1
    cache.prune(everything=True)
    with LayerwiseModel(llama_art, cache=True, verify=False) as lm:
        assert lm.filling is None               # an unchecked read is never kept
    with LayerwiseModel(llama_art) as lm:       # on by default
        assert lm.filling is not None and torch.equal(_logits(lm), want)
    assert lm.filling.wait() and lm.filling.done, lm.filling.reason
    (entry,) = cache.entries()
    with monkeypatch.context() as m:
        _no_reads(m)
        with LayerwiseModel(llama_art, cache=True) as lm:
            assert torch.equal(_logits(lm), want) and torch.equal(_logits(lm), want)
        stats = lct.LoadStats()
        mapped = lct.load(llama_art, device_map={"": "cpu"}, cache=True, stats=stats)
        assert torch.equal(_logits(mapped), whole) and stats.cache.startswith("hit: mapped")
        with pytest.raises(AssertionError, match="was read"):   # off: it reads
            LayerwiseModel(llama_art, cache=False)


def test_a_fill_of_a_damaged_artifact_raises_its_error_and_keeps_nothing(root, llama_art,
                                                                           tmp_path):
    """A chunk that fails its checksum mid-fill ends `lct cache fill` with the read's typed
    error (its one line), no entry and no staging folder; an artifact opened without checking
    checksums is refused, since an entry is trusted as a checked decode."""
    from lct.errors import ChecksumError
    bad = tmp_path / "bad.lct"
    shutil.copytree(llama_art, bad)
    with lct.open(bad) as art:
        chunk = art.manifest.group_chunks("layers.1")[0]
        path = bad / art.manifest.files[chunk.file]["name"]
    data = bytearray(path.read_bytes())
    data[chunk.offset + chunk.stored_size // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with lct.open(bad) as art, pytest.raises(ChecksumError, match=rf"chunk {chunk.id} "):
        cache.fill(art)
    assert not cache.entries() and not list(root.glob(f"{cache.FILL_PREFIX}*"))
    res = CliRunner().invoke(cli, ["cache", "fill", str(bad)])
    assert res.exit_code == 1 and f"chunk {chunk.id}" in res.output, res.output
    assert not cache.entries() and not list(root.glob(f"{cache.FILL_PREFIX}*"))
    with lct.open(llama_art, verify=False) as art, \
            pytest.raises(LCTError, match="opened without checking checksums"):
        cache.fill(art)


def test_a_fill_replaces_a_damaged_entry_and_says_when_one_is_there(root, llama_art):
    res = CliRunner().invoke(cli, ["cache", "fill", str(llama_art)])
    assert res.exit_code == 0 and res.output.startswith("filled "), res.output
    (entry,) = cache.entries()
    with open(entry.path / cache.DATA, "r+b") as f:        # truncated: not the entry any more
        f.truncate(4096)
    res = CliRunner().invoke(cli, ["cache", "fill", str(llama_art)])
    # the result on stdout; LCT's warning about the damaged entry on stderr (the CLI shows it)
    assert res.exit_code == 0 and res.stdout.startswith("filled "), res.output
    assert "decoded.bin is not the" in res.stderr and "lays out; removed" in res.stderr
    res = CliRunner().invoke(cli, ["cache", "fill", str(llama_art)])
    assert res.exit_code == 0 and res.output.startswith("already cached: "), res.output
    with lct.open(llama_art) as art:
        assert cache.lookup(art) is not None


def test_an_entry_names_its_artifact_by_an_absolute_path(root, llama_art, monkeypatch):
    """A new user's trial: `lct cache list` showed the relative path the fill was given."""
    monkeypatch.chdir(llama_art.parent)
    _load(Path(llama_art.name), cache=True)
    (entry,) = cache.entries()
    assert entry.artifact == str(llama_art.absolute())


def _mapped_rss(address: int) -> int:
    """Bytes of the mapping at ``address`` in this process's memory (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head[0].split("-")) == 2 and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= address < hi
            elif inside and head[0] == "Rss:":
                return int(head[1]) * 1024
    raise AssertionError(f"nothing mapped at {address:#x}")


def test_a_recycled_group_of_a_mapped_entry_leaves_this_process_memory(root, llama_art):
    """A consumer that copies every tensor out (vLLM's loader: a stream with ``recycle``)
    gives a mapped entry's pages back as it goes (``CachedChunks.put``): the copy is not held
    whole beside the copies; the bytes stay the artifact's, and a chunk used again is checked
    again (its pages came back from the file)."""
    import mmap
    _load(llama_art, cache=True)
    page = mmap.PAGESIZE
    with lct.open(llama_art) as a:
        hit = cache.lookup(a)
        address, chunks = hit._map.ctypes.data, a.manifest.chunks
        total = sum(c.decoded_size for c in chunks)
        # whole pages inside each chunk leave memory; what stays is at most a fault-around
        # window (64 KiB: the kernel maps pages near a touched one that are in the page cache)
        # per chunk, its neighbours' pages included
        stays = len(chunks) * (64 << 10)
        assert total > 2 * stays, "the test model's chunks are too small to tell"
        with a.stream(cached=hit, prefetch=0) as stream:
            kept = [g for g in stream]      # noqa: C416 (the groups hold the views)
        assert _mapped_rss(address) >= total - page
        del kept
        with a.stream(cached=hit, prefetch=0, recycle=True) as stream:
            for group in stream:
                want = {cid: bytes(buf) for cid, buf in group.buffers.items()}
                group.recycle()
                assert all(bytes(hit.chunk(cid)) == b for cid, b in want.items())
                for cid in want:
                    hit.put(hit.chunk(cid))
        assert _mapped_rss(address) <= stays
        assert not hit.damaged
        # a view that is not the entry's (a damaged chunk's decode) is left alone
        hit.put(np.zeros(chunks[0].decoded_size, np.uint8))


def test_a_hit_populates_only_the_chunks_on_the_disk(root, llama_art, monkeypatch):
    """A mapped entry's chunk whose pages are all in the page cache is checked through the
    hash's own faults, not ``populate`` (which holds the process's mmap lock for the whole
    chunk, stalling the skeleton's import beside it); one whose pages are on the disk is read
    in one ``populate`` call. The bytes are checked either way."""
    from lct.io import store
    _load(llama_art, cache=True)
    calls = []
    real = store.populate
    monkeypatch.setattr(store, "populate", lambda mm, at, size: calls.append(at) or real(
        mm, at, size))
    with lct.open(llama_art) as a:
        hit = cache.lookup(a)
        data = hit.entry.path / cache.DATA
        spans = [hit.spans[cid] for cid in sorted(hit.spans)]
        data.read_bytes()                       # every page in the page cache
        if not store.in_page_cache(hit._map._mmap, *spans[0]):
            pytest.skip("mincore cannot tell the page cache here")
        assert hit.check() and calls == []
        del hit                                 # its mapping ends: the pages can leave
        gc.collect()
        fd = os.open(data, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        hit = cache.lookup(a)
        if store.in_page_cache(hit._map._mmap, *spans[0]):
            pytest.skip("the page cache kept the entry's pages")
        assert hit.check() and not hit.damaged
        assert calls and calls[0] == spans[0][0], calls


@pytest.mark.parametrize("through", ["the C library", "Python's mmap (no C library)"])
def test_populate_maps_a_range_without_touching_it(tmp_path, monkeypatch, through):
    """``lct.io.store.populate`` maps the pages of a range of a file mapping in one call (what
    a mapped entry's check then reads without a fault per page), and no others; it says False
    where the kernel cannot (then the pages come as they are touched). Through the C library
    (the interpreter's lock let go while the kernel reads), else through ``mmap.madvise``."""
    import mmap

    from lct.io import store
    from lct.io.store import populate
    if through != "the C library":
        monkeypatch.setattr(store, "_libc", lambda: None)
    page = mmap.PAGESIZE
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(16 << 20))
    at = (8 << 20) + 100
    with open(f, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            address = np.frombuffer(mm, np.uint8).ctypes.data
            if not populate(mm, at, 20 * page):
                pytest.skip("this kernel has no MADV_POPULATE_READ (Linux 5.14+)")
            # from the page the offset rounds down to, through the page the range ends in,
            # and what the kernel maps beside them (its fault-around's 64 KiB windows, or the
            # page cache's large folios where it holds the file in them: up to 2 MiB each side),
            # far from the whole 16 MiB file
            rss = _mapped_rss(address)
            assert 21 * page <= rss <= 21 * page + 2 * (2 << 20), f"{rss} bytes mapped"
        finally:
            mm.close()
