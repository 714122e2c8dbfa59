"""Writes that fail (issue 22): a full disk, a quota, a read-only file system, no permission,
during convert, export, pull and push end in one line naming the output, exit 1, and leave
nothing half-written. The errors are raised where the bytes are written (the artifact
writer's data file, safetensors' save, huggingface_hub's move into its cache), as the OS
would raise them."""

import errno
import os

import pytest

import lct
from lct.errors import HubError, WriteError
from test_hub import hub  # noqa: F401 - the loopback Hub fixture

pytestmark = pytest.mark.filterwarnings(  # huggingface_hub's own LFS PUT, not ours
    "ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

CASES = [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES]


def _oserror(code, filename=None):
    return OSError(code, os.strerror(code), *([str(filename)] if filename else []))


@pytest.mark.parametrize("code", CASES)
def test_convert_on_a_full_or_read_only_disk(gemma_src, tmp_path, monkeypatch, run, code):
    from lct.io import writer
    calls = []
    real = writer.ArtifactWriter.write_stored

    def write_stored(self, *a, **kw):       # on the writer thread, as the disk would fail
        calls.append(1)
        if len(calls) == 2:
            raise _oserror(code)
        return real(self, *a, **kw)
    monkeypatch.setattr(writer.ArtifactWriter, "write_stored", write_stored)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(WriteError, match=rf"{out / 'a.lct'}: cannot write the artifact "
                                         rf"\({os.strerror(code)}\)"):
        lct.convert(str(gemma_src), out / "a.lct")
    assert list(out.iterdir()) == []
    calls.clear()
    from click.testing import CliRunner

    from lct.cli.main import cli
    r = CliRunner().invoke(cli, ["convert", str(gemma_src), "-o", str(out / "a.lct"), "-q"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "cannot write" in lines[0]
    assert list(out.iterdir()) == []


def test_a_source_read_error_is_not_called_a_write_error(gemma_src, tmp_path, monkeypatch):
    """An EACCES naming a file of the source is the source's, not the output's."""
    from lct.io import writer
    monkeypatch.setattr(writer.ArtifactWriter, "copy_file", lambda self, src, name=None: (
        _ for _ in ()).throw(_oserror(errno.EACCES, src)))
    with pytest.raises(PermissionError) as got:
        lct.convert(str(gemma_src), tmp_path / "a.lct")
    assert not isinstance(got.value, WriteError)


@pytest.mark.parametrize("code", CASES)
def test_export_on_a_full_disk(gemma_art, tmp_path, monkeypatch, code):
    import safetensors.torch
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda tensors, path, metadata=None: (_ for _ in ()).throw(
                            _oserror(code, path)))
    out = tmp_path / "hf"
    with pytest.raises(WriteError, match=rf"{out}: cannot write the export "
                                         rf"\({os.strerror(code)}\)"):
        lct.export(gemma_art, out)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_pull_into_a_full_cache_and_push_reading_a_file(gemma_art, hub, monkeypatch, code):
    import huggingface_hub.file_download as fd
    lct.hub.push(gemma_art, "alice/g")
    real = fd._chmod_and_move

    def move(src, dst):
        raise _oserror(code, dst)
    monkeypatch.setattr(fd, "_chmod_and_move", move)
    with pytest.raises(WriteError, match=rf"cannot write alice/g into the Hugging Face cache "
                                         rf"\({os.strerror(code)}\)"):
        lct.hub.pull("alice/g")
    monkeypatch.setattr(fd, "_chmod_and_move", real)
    assert lct.hub.pull("alice/g").is_dir()          # the next pull is whole
    from huggingface_hub import HfApi

    def commit(self, *a, **kw):
        raise _oserror(errno.EACCES, gemma_art / "model-00000.lct")
    monkeypatch.setattr(HfApi, "create_commit", commit)
    with pytest.raises(HubError, match=r"push failed: a local file .*model-00000\.lct: "
                                       r"Permission denied"):
        lct.hub.push(gemma_art, "alice/g2")


def test_a_full_disk_in_safetensors_save_is_a_write_error(gemma_art, tmp_path, monkeypatch):
    """safetensors raises its own SafetensorError ("... (os error 28)"), not an OSError: the
    export and the Maximus state file printed its traceback (issue 22.8, a real full tmpfs)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def save_file(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(WriteError, match=r"cannot write the export \(No space left on device\)"):
        lct.export(gemma_art, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_a_copy_error_names_its_destination_second(tmp_path):
    """shutil.copyfile's OSError names the source first and the destination second: a full
    disk while copying a side file into the staging folder is the output's error."""
    from lct.io.writer import write_error
    out = tmp_path / "a.lct"
    e = OSError(errno.ENOSPC, "No space left on device", "/src/tokenizer.json", None,
                str(tmp_path / ".a.lct.tmp-1234" / "tokenizer.json"))
    assert isinstance(write_error(e, out), WriteError)
    theirs = OSError(errno.EACCES, "Permission denied", "/src/tokenizer.json", None, "/else/x")
    assert write_error(theirs, out) is None


def test_a_full_disk_at_the_last_flush_is_one_error(gemma_src, tmp_path, monkeypatch):
    """ENOSPC at finish's flush: the abort's close flushed the same buffer again and raised a
    second ENOSPC over the first (two tracebacks); now one WriteError, nothing left."""
    import builtins

    import lct.io.writer as writer

    class Full:
        """A data file on a full disk: its buffered bytes never get out (flush and close
        fail as the kernel would make them fail)."""

        def __init__(self, *a, **k):
            self.f = builtins.open(*a, **k)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def flush(self):
            raise _oserror(errno.ENOSPC)

        def close(self):
            self.f.close()
            raise _oserror(errno.ENOSPC)
    monkeypatch.setattr(writer, "open", Full, raising=False)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(WriteError, match="No space left on device"):
        lct.convert(str(gemma_src), out / "a.lct")
    assert list(out.iterdir()) == []


def test_exported_files_are_readable_by_all(gemma_art, tmp_path):
    """safetensors creates its files 0600; every file of an export is 0644, as LCT's others."""
    out = lct.export(gemma_art, tmp_path / "hf")
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def _as_unprivileged(cmd: list) -> list:
    """``cmd`` as a process on which mode bits apply: root without its DAC capabilities."""
    import shutil
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: mode bits do not apply")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", *cmd]


@pytest.mark.parametrize("what", ["convert", "export"])
def test_force_onto_a_read_only_output_is_refused_before_any_work(gemma_src, gemma_art,
                                                                 tmp_path, what):
    """--force onto a 0555 artifact or export succeeded, put the new output in place and left
    the whole old one in a hidden staging folder it could not empty: now one line first."""
    import shutil
    import subprocess
    import sys
    out = tmp_path / "out"
    if what == "convert":
        shutil.copytree(gemma_art, out)
        cmd = ["convert", str(gemma_src), "-o", str(out), "--force", "-q"]
    else:
        lct.export(gemma_art, out)
        cmd = ["export", str(gemma_art), str(out), "--force", "-q"]
    before = sorted(p.name for p in out.iterdir())
    out.chmod(0o555)
    try:
        r = subprocess.run(_as_unprivileged([sys.executable, "-m", "lct", *cmd]),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1, r.stderr[-2000:]
        assert r.stderr.strip().splitlines() == [
            f"error: {out}: cannot replace it: its files cannot be removed (permission "
            f"denied, or the folder is read-only); nothing was written"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
        assert sorted(p.name for p in out.iterdir()) == before
    finally:
        out.chmod(0o755)


def test_a_dead_writers_staging_folder_is_swept_by_the_next_writer(gemma_src, tmp_path):
    """kill -9 left .OTHER.tmp-* (a partial artifact) beside its output, removed only by a
    later run writing that same output: a writer in the same folder removes the staging
    folders whose output no process is writing, and leaves the live ones."""
    from lct.io.writer import OutputLock
    dead = tmp_path / ".gone.lct.tmp-0123abcd"
    dead.mkdir()
    (dead / "model-00000.lct").write_bytes(b"partial")
    live = tmp_path / ".busy.lct.tmp-4567ef01"
    (tmp_path / ".notours").mkdir()            # not LCT's pattern: never touched
    with OutputLock(tmp_path / "busy.lct"):    # a writer of busy.lct, at work
        live.mkdir()
        lct.convert(str(gemma_src), tmp_path / "new.lct")
    assert not dead.exists() and live.is_dir() and (tmp_path / ".notours").is_dir()
