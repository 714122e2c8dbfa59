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
    """``{dotted name: path}`` of every module of the installed package, from the source tree:
    Python files, and the C sources of the compiled modules (``_native.c``), which import
    nothing of LCT's."""
    out = {}
    for pkg, root in PACKAGES.items():
        for p in [*root.rglob("*.py"), *root.rglob("*.c")]:
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
            # "lct" (the API) is the package's own module only: a prefix of every name, it
            # would otherwise take in any module the order forgot.
            within = module == p or (p != "lct" and module.startswith(p + "."))
            if within and len(p) > best:
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


def imports(module: str, source: str | None = None) -> set:
    """Every LCT module ``module`` imports, at the top or inside functions (``source``: its
    text, read from the tree by default)."""
    path = MODULES[module]
    if path.suffix == ".c":
        return set()
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
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


def test_the_checker_sees_function_level_and_relative_imports():
    """The walker itself: imports inside functions, relative ones (resolved from the module's
    package) and ``from package import module`` are all edges; a standard-library import is
    none."""
    src = ("import os\n"
           "def f():\n"
           "    from .stream import GroupStream\n"
           "    from lct.format import constants as C\n"
           "    if True:\n"
           "        import lct.hub.address\n")
    assert imports("lct.io.reader", src) == {"lct.io.stream", "lct.format.constants",
                                             "lct.hub.address"}
    # and in the tree: push's artifact check is imported inside a function
    assert "lct.io.check" in GRAPH["lct.hub.push"]
    # and a compiled module is a module of its own, not its package (whose __init__ imports the
    # heads, which import lct.kernels.native: a cycle, were the import its package)
    assert "lct.kernels._native" in GRAPH["lct.kernels.native"]
