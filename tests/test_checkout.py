"""The checkout's top-level folders are LCT's packages under ``lct.`` only: run from the
checkout's root (``python -m pytest``, ``python -m lct``, which put it on ``sys.path``), the
folder ``kernels/`` (``lct.kernels``) must not stand in for the ``kernels`` distribution that
transformers imports for its hub kernels."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _import_kernels_from_root():
    code = "import kernels, sys; print(kernels.__file__); print(hasattr(kernels, 'embedding_for'))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_kernels_from_the_checkouts_root_is_the_distribution_where_installed():
    """transformers 5.25 requires the ``kernels`` distribution: from the checkout's root,
    ``import kernels`` gives its module, not LCT's folder. Without it (vLLM's environment),
    the folder imports as it always did: transformers finds no version there and takes it
    for no hub kernels."""
    out = _import_kernels_from_root()
    assert out.returncode == 0, out.stderr
    where, ours = out.stdout.split()
    try:
        installed = bool(importlib.metadata.distribution("kernels"))
    except importlib.metadata.PackageNotFoundError:
        installed = False
    if installed:
        assert Path(where).parent != ROOT / "kernels" and ours == "False", out.stdout
    else:
        assert Path(where).parent == ROOT / "kernels", out.stdout

