"""The two compiled modules: the format's (lct/format/_native.c: decode and the NF4 codec) and the
kernels' (kernels/_native.c: the fused matmuls). Each exports only its own layer's loops, each
C file's header names every function it exports, and the heads give the torch path's result
without the kernels' module (not built, or ``LCT_NATIVE=0``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from lct.format import int8, nf4
from lct.format import native as fnative
from lct.kernels import Int8Linear, NF4Linear
from lct.kernels import native as knative

ROOT = Path(__file__).parent.parent
SOURCES = {"lct.format._native": ROOT / "lct" / "format" / "_native.c",
           "lct.kernels._native": ROOT / "kernels" / "_native.c"}
MATMUL = {"nf4_matmul", "int8_matmul", "q8_0_matmul", "q6_k_matmul", "tiled_matmul",
          "nf4_matmul_isa"}


def _exported(source: Path) -> set:
    """The names in a C module's PyMethodDef table."""
    table = re.search(r"PyMethodDef methods\[\] = \{(.*?)\{NULL", source.read_text(), re.S)
    return set(re.findall(r'\{"(\w+)"', table.group(1)))


def _header(source: Path) -> str:
    return re.match(r"/\*(.*?)\*/", source.read_text(), re.S).group(1)


def test_each_module_exports_only_its_layers_loops():
    """The kernels' module exports the matmuls and nothing else; the format's (its codecs and
    decode, whatever they are) no matmul."""
    decode = _exported(SOURCES["lct.format._native"])
    assert _exported(SOURCES["lct.kernels._native"]) == MATMUL
    assert not any("matmul" in name for name in decode)
    if fnative._native is None or knative._native is None:
        pytest.fail("a compiled module was not built (pip install needs a C compiler)")
    public = {m: {n for n in dir(mod) if not n.startswith("_")}
              for m, mod in (("lct.format._native", fnative._native),
                             ("lct.kernels._native", knative._native))}
    assert public == {"lct.format._native": decode, "lct.kernels._native": MATMUL}
    assert fnative._native.__name__ == "lct.format._native"
    assert knative._native.__name__ == "lct.kernels._native"


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_each_header_names_its_module_its_functions_and_real_paths(module):
    source = SOURCES[module]
    head = _header(source)
    assert head.split(":")[0].strip() == module
    for fn in _exported(source):
        assert re.search(rf"^ \*   {fn}\(", head, re.M), f"{source.name}'s header omits {fn}"
    for path in re.findall(r"[\w/]+/[\w/]+\.(?:py|c)\b", head):
        assert (ROOT / path).is_file(), f"{source.relative_to(ROOT)} names {path}, not a file"


def _weights(kind: str, n: int = 300, k: int = 128, bs: int = 64):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    if kind == "nf4":
        packed, absmax = nf4.quantize(w, bs)
        head = NF4Linear(packed, absmax, n, k, bs, torch.bfloat16, chunk_rows=100)
        full = nf4.dequantize(packed, absmax, (n, k), bs, torch.bfloat16)
    else:
        q, scale = int8.quantize(w)
        head = Int8Linear(q, scale, torch.bfloat16, chunk_rows=100)
        full = int8.dequantize(q, scale, (n, k), torch.bfloat16)
    return head, full


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_fused_head_against_its_fallback(kind, monkeypatch):
    """A short input: the fused kernel where built, and without it the torch path, which is
    ``F.linear`` over the dequantized weight exactly; both within bf16 rounding of each other."""
    head, full = _weights(kind)
    x = torch.randn(3, head.in_features, generator=torch.Generator().manual_seed(4))
    x = x.to(torch.bfloat16)
    monkeypatch.setattr(knative, "_ENABLED", False)
    fallback = head(x)
    assert torch.equal(fallback, F.linear(x, full))
    if knative._native is None:
        pytest.fail("lct.kernels._native was not built (pip install needs a C compiler)")
    monkeypatch.setattr(knative, "_ENABLED", True)
    fused = head(x)
    assert fused.dtype == fallback.dtype and fused.shape == fallback.shape
    assert torch.allclose(fused.float(), fallback.float(), rtol=2e-2, atol=2e-3)


_HEADS = """
import torch
from torch.nn import functional as F
import tests.test_kernels_native as t
from lct.format import native as fnative
from lct.kernels import native as knative
print(fnative.available(), knative.available())
for kind in ("nf4", "int8"):
    head, full = t._weights(kind)
    x = torch.randn(2, head.in_features).to(torch.bfloat16)
    assert torch.equal(head(x), F.linear(x, full)), kind
"""

_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "lct.kernels._native":
            raise ImportError("not built")
sys.meta_path.insert(0, Block())
"""


@pytest.mark.parametrize("how", ["LCT_NATIVE=0", "not built"])
def test_heads_fall_back_without_the_kernels_module(how):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = _HEADS
    if how == "LCT_NATIVE=0":
        env["LCT_NATIVE"] = "0"
        want = "False False"
    else:
        env.pop("LCT_NATIVE", None)
        code = _BLOCK + _HEADS
        want = f"{fnative._native is not None} False"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[0] == want
