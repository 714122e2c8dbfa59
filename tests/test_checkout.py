"""The checkout's top-level folders are LCT's packages under ``lct.`` only: run from the
checkout's root (``python -m pytest``, ``python -m lct``, which put it on ``sys.path``), the
folder ``kernels/`` (``lct.kernels``) must not stand in for the ``kernels`` distribution that
transformers imports for its hub kernels."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _import_kernels_from_root(*flags):
    code = "import kernels, sys; print(kernels.__file__); print(hasattr(kernels, 'embedding_for'))"
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_kernels_from_the_checkouts_root_is_the_distribution_or_none():
    out = _import_kernels_from_root()
    try:
        installed = bool(importlib.metadata.distribution("kernels"))
    except importlib.metadata.PackageNotFoundError:
        installed = False
    if installed:       # transformers 5.25 requires it: its module, not LCT's folder
        assert out.returncode == 0, out.stderr
        where, ours = out.stdout.split()
        assert Path(where).parent != ROOT / "kernels" and ours == "False", out.stdout
    else:
        assert out.returncode != 0 and "No module named 'kernels'" in out.stderr, out.stderr


def test_without_the_distribution_a_top_level_kernels_is_not_found():
    out = _import_kernels_from_root("-S")         # no site-packages: no distribution either
    assert out.returncode != 0
    assert "ModuleNotFoundError: No module named 'kernels'" in out.stderr, out.stderr
