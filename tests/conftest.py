"""Shared fixtures: tiny random models saved as Hugging Face folders, and their artifacts."""

import os
import shutil
import signal
import tempfile
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # tests read outputs, not bars
# the decoded cache leaves 5 % of the disk free by default: its tests must not depend on how
# full the host's disk is (CI's was 95 % full); tests/test_cache.py checks that default
os.environ.setdefault("LCT_CACHE_MIN_FREE", "1MB")
# The decoded cache is on by default (lct/io/cache.py DEFAULT_ON); tests that are not about it
# load without it, so that one test's entry never serves another's artifact (a copy of a
# fixture damaged on purpose has the same digest); tests/test_cache.py, the architecture sweep
# and the loaders' cache tests switch it on themselves, in a folder of their own.
os.environ.setdefault("LCT_CACHE", "0")
# never ~/.cache; a folder of this session's, removed when it ends (pytest_sessionfinish)
_CACHE_DIR = None if "LCT_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="lct-test-cache-")
if _CACHE_DIR is not None:
    os.environ["LCT_CACHE_DIR"] = _CACHE_DIR
# With LCT_CACHE_MAP=auto, whether a load maps an entry or decodes the artifact depends on how
# much of the entry is in the page cache (lct.io.cache.choose), which other processes, and on
# this project's VM the host's reclaim of pages idle for a minute, change: tests that load an
# entry map it always (the default too); tests/test_cache_choice.py, which tests the choice,
# sets auto.
os.environ.setdefault("LCT_CACHE_MAP", "always")
warnings.filterwarnings("ignore", message=".*gemm_4bit.*")
# A suite started in the background by a shell without job control inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler: the Ctrl-C tests would see no interrupt.
# They test what a user's process does, whose Ctrl-C raises KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _save(tmp_path_factory, arch, **kw):
    from lct.demo import tiny
    return tiny.save_tiny(tmp_path_factory.mktemp(f"src-{arch}") / "model", arch, **kw)


@pytest.fixture(scope="session")
def gemma_src(tmp_path_factory):
    """A tiny random Gemma (bf16, tied head) saved with save_pretrained."""
    return _save(tmp_path_factory, "gemma")


@pytest.fixture(scope="session")
def llama_src(tmp_path_factory):
    """A tiny random Llama (bf16, untied head)."""
    return _save(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def wide_srcs(tmp_path_factory):
    """``{"gemma": folder, "llama": folder}``: tiny random models with a hidden size of 256, so
    that their rows are whole blocks of the block encodings (Q6_K's 256, int8_b128's 128)."""
    return {arch: _save(tmp_path_factory, arch, hidden_size=256, intermediate_size=256)
            for arch in ("gemma", "llama")}


@pytest.fixture(scope="session")
def gemma_art(gemma_src, tmp_path_factory):
    """The default conversion of ``gemma_src`` (read-only: copy before corrupting)."""
    import lct
    out = tmp_path_factory.mktemp("art") / "gemma.lct"
    lct.convert(str(gemma_src), out)
    return out


@pytest.fixture(scope="session")
def llama_art(llama_src, tmp_path_factory):
    """The default conversion of ``llama_src``."""
    import lct
    out = tmp_path_factory.mktemp("art") / "llama.lct"
    lct.convert(str(llama_src), out)
    return out


@pytest.fixture
def run():
    """Invoke the ``lct`` CLI in-process: ``run("info", path)`` -> click Result."""
    from click.testing import CliRunner

    from lct.cli.main import cli
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return invoke


@pytest.fixture(params=["native", "numpy"])
def native_mode(request, monkeypatch):
    """Run a test once with the compiled loops (lct.format.native, lct.kernels.native) and once
    with the numpy/torch fallbacks."""
    from lct.format import native
    from lct.kernels import native as knative
    if request.param == "native" and (native._native is None or knative._native is None):
        pytest.fail("lct.format._native or lct.kernels._native was not built (pip install needs "
                    "a C compiler); the fallbacks are still tested")
    monkeypatch.setattr(native, "_ENABLED", request.param == "native")
    monkeypatch.setattr(knative, "_ENABLED", request.param == "native")
    return request.param


def manifest_text(m: dict, rebind: bool = False) -> str:
    """An edited manifest dict as text, its own checksum set again (as a tool that edits a
    manifest would): the edit itself then meets the structural checks and the chunk bindings,
    which is what the tests probe. With ``rebind`` the chunk bindings are computed again too
    (an attacker who rewrites everything consistently), so that the checks behind them (codecs,
    loader) are what the test reaches. A manifest without exactly one checksum is written as
    is."""
    import json
    from unittest import mock

    from lct.errors import ManifestError
    from lct.format import manifest as M
    from lct.format.manifest import Manifest, chunk_bindings, seal
    if rebind:
        try:
            # parsed at its own version (each encoding needs its own), the bindings unchecked
            with mock.patch.object(M, "SEALED_SINCE", (1 << 16, 0)), \
                    mock.patch.object(M, "DECODED_PINNED_SINCE", (1 << 16, 0)):
                parsed = Manifest.from_dict(m)
        except ManifestError:
            parsed = None     # invalid anyway: the reader refuses it before any binding
        if parsed is not None:
            binds = chunk_bindings(parsed.chunks, parsed.tensors, parsed.ties)
            for c in m["chunks"]:
                c["binding"] = binds[c["id"]]
    text = json.dumps(m)
    try:
        return seal(text)
    except ManifestError:
        return text


def pytest_sessionfinish(session, exitstatus):
    """Remove the session's decoded-cache folder (each run left one in /tmp)."""
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
