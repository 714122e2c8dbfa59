"""The package's layers (issue 13): no import cycles, and no import that goes up the layer order
written at the top of ``lct/__init__.py``; imports inside functions count."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = {"lct": ROOT / "lct", "lct.loader": ROOT / "loader", "lct.kernels": ROOT / "kernels",
            "lct.cli": ROOT / "cli"}


def _modules() -> dict:
    """``{dotted name: path}`` of every module of the installed package, from the source tree."""
    out = {}
    for pkg, root in PACKAGES.items():
        for p in root.rglob("*.py"):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg] + parts)] = p
    return out


MODULES = _modules()


def _layers() -> list:
    """``[(layer name, [package or module prefixes])]``, bottom first, from lct/__init__.py."""
    doc = ast.get_docstring(ast.parse((ROOT / "lct" / "__init__.py").read_text()))
    rows = re.findall(r"^ {4}(\w+) +(lct\S*(?:, lct\S*)*)$", doc, re.M)
    assert rows, "lct/__init__.py documents no layer order"
    return [(name, [m.strip() for m in mods.split(",")]) for name, mods in rows]


def _layer_of(module: str, layers: list) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    if level is None:
        raise AssertionError(f"{module} is in no layer of lct/__init__.py")
    return level


def _target(name: str) -> str | None:
    """The LCT module an import of ``name`` loads (the longest module prefix), or None."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        cand = ".".join(parts[:k])
        if cand in MODULES:
            return cand
    return None


def imports(module: str) -> set:
    """Every LCT module ``module`` imports, at the top or inside functions."""
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[:None if is_pkg else -1]
                base = base[:len(base) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            names = [f"{full}.{a.name}" if f"{full}.{a.name}" in MODULES else full
                     for a in node.names]
        for n in names:
            t = _target(n)
            if t is not None and t != module:
                out.add(t)
    return out


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_is_in_a_layer():
    layers = _layers()
    for m in MODULES:
        _layer_of(m, layers)


def test_no_import_goes_up_the_layer_order():
    layers = _layers()
    up = [f"{m} ({layers[_layer_of(m, layers)][0]}) imports {t} "
          f"({layers[_layer_of(t, layers)][0]})"
          for m, targets in sorted(GRAPH.items()) for t in sorted(targets)
          if _layer_of(t, layers) > _layer_of(m, layers)]
    assert not up, "imports up the layer order:\n" + "\n".join(up)


def test_no_import_cycles():
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2
    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items()
                                           if p.name == "__init__.py"))
def test_each_layer_folder_says_what_it_does_and_may_import(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text()))
    assert doc, f"{package} has no docstring"
    if package not in ("lct", "lct.cli"):
        assert "May import" in doc, f"{package}'s docstring does not say what it may import"


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The walker itself: a function-level import and a relative one are both edges."""
    assert "lct.io.reader" in GRAPH["lct.io.stream"] or "lct.io.reader" in GRAPH["lct"] or any(
        "lct.io.reader" in v for v in GRAPH.values())
    src = ast.parse("def f():\n    from .reader import Artifact\n")
    assert any(isinstance(n, ast.ImportFrom) and n.level == 1 for n in ast.walk(src))
