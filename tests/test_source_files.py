"""Issue 37 item 2: a source whose weights file is a FIFO hung lct convert silently (killed at
120 s): safetensors' open waits for a writer that never comes. Anything that is not a regular
file where a source file is expected (a FIFO, a device, a socket, a directory named like a
weights file) is named in one line at once; links to regular files (a Hugging Face cache
snapshot's files are links to its blobs) are read as before.

What could hang is run in a subprocess (or a thread) with a time limit, so that a regression
fails instead of hanging the test run."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

import lct
from lct.errors import SourceError

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")


@pytest.fixture
def src(llama_src, tmp_path):
    s = tmp_path / "src"
    shutil.copytree(llama_src, s)
    return s


def _lct(*args, timeout=60):
    """``python -m lct ARGS`` in a subprocess, killed (and the test failed) after ``timeout``."""
    try:
        return subprocess.run([sys.executable, "-m", "lct", *map(str, args)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"lct {' '.join(map(str, args))} still running after {timeout} s")


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_a_fifo_for_the_weights_is_one_line_at_once(src, llama_art, tmp_path, command):
    (src / "model.safetensors").unlink()
    os.mkfifo(src / "model.safetensors")
    out = tmp_path / "out.lct"
    args = ("convert", src, "-o", out) if command == "convert" else \
        ("verify", llama_art, "--against", src)
    r = _lct(*args)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    assert f"{src / 'model.safetensors'}: is not a regular file (a FIFO); expected a " \
           f"safetensors weights file" in lines[0]
    assert not out.exists()


def _make(path, kind, monkeypatch):
    if kind == "a directory":
        path.mkdir()
    elif kind == "a character device":
        os.symlink("/dev/zero", path)           # a link, followed: what it names is a device
    elif kind == "a socket":
        monkeypatch.chdir(path.parent)          # AF_UNIX paths are short; bind a relative one
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path.name)
        return sock
    elif kind == "a link to nothing":
        os.symlink(path.parent / "gone.safetensors", path)


@pytest.mark.parametrize("kind", ["a directory", "a character device", "a socket",
                                  "a link to nothing"])
def test_what_is_not_a_regular_weights_file_is_named(src, tmp_path, kind, monkeypatch):
    """Before: a directory named model.safetensors or a socket got safetensors' own error (or
    /dev/zero its header error), not what the file is."""
    f = src / "model.safetensors"
    f.unlink()
    held = _make(f, kind, monkeypatch)
    try:
        with pytest.raises(SourceError, match=rf"model\.safetensors: is not a regular file "
                                              rf"\({kind}\); expected a safetensors weights file"):
            lct.convert(str(src), tmp_path / "out.lct")
    finally:
        if held is not None:
            held.close()
    assert not (tmp_path / "out.lct").exists()


def test_a_shard_the_index_names_and_the_index_and_config_themselves(src, tmp_path):
    """A sharded source: the index's shard, the index and config.json are each checked."""
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "model.safetensors").rename(tmp_path / "weights")
    (src / "model.safetensors").mkdir()
    with pytest.raises(SourceError, match=r"model\.safetensors: is not a regular file "
                                          r"\(a directory\); expected a safetensors weights"):
        lct.convert(str(src), tmp_path / "out.lct")
    for name, what in (("model.safetensors.index.json", "a safetensors index"),
                       ("config.json", "the model's JSON config")):
        (src / name).unlink()
        (src / name).mkdir()
        with pytest.raises(SourceError, match=rf"{name}: is not a regular file \(a directory\); "
                                              rf"expected {what}"):
            lct.convert(str(src), tmp_path / "out.lct")
        (src / name).rmdir()
    assert not (tmp_path / "out.lct").exists()


def test_links_to_blobs_convert_and_a_fifo_side_file_is_left_out_and_named(llama_src, tmp_path):
    """A Hugging Face cache snapshot: every file a link to a blob named by its hash; a FIFO
    beside them (tokenizer.json here) was left out silently before, as if it were not there."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for p in llama_src.iterdir():
        shutil.copy(p, blobs / p.name)
        os.symlink(os.path.relpath(blobs / p.name, snap), snap / p.name)
    os.mkfifo(snap / "tokenizer.json")
    rep = lct.convert(str(snap), tmp_path / "a.lct")
    assert dict(rep.skipped_files) == {"tokenizer.json": "a FIFO, not a regular file"}
    assert not (tmp_path / "a.lct" / "tokenizer.json").exists()
    assert lct.verify(tmp_path / "a.lct", against=str(snap)).ok
    recorded = json.loads((tmp_path / "a.lct" / "lct.json").read_text())["source"]["files"]
    assert set(recorded) == {"model.safetensors", "config.json", "generation_config.json"}


def test_sha256_file_refuses_a_fifo_at_once(tmp_path):
    """The hash of every source file read; its open waited for a writer forever on a FIFO."""
    from lct.hashing import sha256_file
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    result = {}

    def hash_it():
        try:
            result["digest"] = sha256_file(fifo)
        except OSError as e:
            result["error"] = e
    t = threading.Thread(target=hash_it, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():        # let the waiting open return (a writer comes and goes), then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("sha256_file still waiting on a FIFO after 30 s")
    assert "error" in result, result
    assert result["error"].strerror == "not a regular file"
    assert result["error"].filename == str(fifo)
