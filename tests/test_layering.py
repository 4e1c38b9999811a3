"""The package's layering, checked on the source with ast (imports inside functions and `if TYPE_CHECKING:` blocks
count too): inferd/models/ imports nothing from inferd/engine/ (the engine builds on the models, never the other
way round); no import cycle anywhere in inferd/; no module over MAX_MODULE_LINES; each package imports only the
layers docs/architecture.md ("Package layers") allows it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parent.parent / "inferd" / "models"


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at path, a module of `package` (e.g.
    "inferd.models"); relative imports are resolved against it. `from X import Y` yields X and X.Y (Y may be a
    submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level > 1:
                    parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def engine_imports(path: Path, root: Path | None = None, package: str = "inferd.models") -> list[str]:
    """'file:line imports module' for each import of inferd.engine in path (a file under root, the folder of
    package; by default inferd/models/)."""
    sub = path.relative_to(MODELS if root is None else root).parent.parts
    hits = {}
    for line, name in imported_modules(path, ".".join([package, *sub])):
        if (name == "inferd.engine" or name.startswith("inferd.engine.")) and line not in hits:
            hits[line] = f"{path}:{line} imports {name}"
    return list(hits.values())


def test_models_import_nothing_from_the_engine():
    files = sorted(MODELS.rglob("*.py"))
    assert files, f"no Python files under {MODELS}"
    bad = [hit for f in files for hit in engine_imports(f)]
    assert not bad, "inferd/models/ must not import inferd/engine/:\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    "from ..engine.runner import StepRow\n",
    "from .. import engine\n",
    "import inferd.engine.runner\n",
    "from inferd.engine import Engine\n",
    "from inferd import engine\n",
    "def f():\n    from ..engine.runner import ModelRunner\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine.runner import StepRow\n",
])
def test_the_check_sees_every_form(tmp_path, source):
    f = tmp_path / "mod.py"
    f.write_text(source)
    assert engine_imports(f, tmp_path), source


@pytest.mark.parametrize("source", [
    "from .config import ModelConfig\n",
    "from ..config import EngineConfig\n",
    "import inferd.engines_elsewhere\n",
    "from . import engine\n",  # inferd.models.engine: not the engine package
])
def test_the_check_lets_other_imports_pass(tmp_path, source):
    f = tmp_path / "mod.py"
    f.write_text(source)
    assert not engine_imports(f, tmp_path), source


# ---- the whole package: no import cycle, small modules, and each package imports only the layers below it ---------

PACKAGE = MODELS.parent

# The most lines one module may have: past it a module holds more than one idea (docs/architecture.md, "Package
# layers"). The largest module had 607 lines when this limit was set.
MAX_MODULE_LINES = 700

# What each part of inferd may import from the others (docs/architecture.md, "Package layers"): data flows one way
# along the request path, nothing below the API knows HTTP, and models never know the engine.
LAYERS: dict[str, set[str]] = {
    "config": set(),
    "kernels": set(),
    "telemetry": {"config"},
    "models": {"config", "kernels"},
    "engine": {"config", "kernels", "models", "telemetry"},
    "worker": {"config", "engine", "models", "telemetry"},
    "gateway": {"config", "engine", "telemetry", "worker"},
    "cluster": {"config", "gateway", "worker"},
    "api": {"cluster", "config", "engine", "gateway", "models", "telemetry", "worker"},
    "planner": {"cluster", "config", "engine"},
    "bench": {"config", "engine", "telemetry"},
    "cli": {"api", "bench", "cluster", "config", "engine", "gateway", "models", "planner", "telemetry", "worker"},
    "__main__": {"cli"},
}


def module_name(path: Path, root: Path, package: str) -> tuple[str, str]:
    """(the module's dotted name, the package its relative imports resolve against) of a file under root."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        name = ".".join([package, *parts[:-1]])
        return name, name
    return ".".join([package, *parts]), ".".join([package, *parts[:-1]])


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {module of this package it imports: the line of the first such import}, for every module under root
    (imports inside functions and under TYPE_CHECKING included)."""
    files = {module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    names = {name for name, _ in files}
    graph: dict[str, dict[str, int]] = {}
    for (name, base), path in files.items():
        edges: dict[str, int] = {}
        for line, target in imported_modules(path, base):
            if target in names and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(cycle)
    edges = [f"  {a}:{line} imports {b}" for a in cycle for b, line in sorted(graph[a].items()) if b in members]
    return " <-> ".join(cycle) + "\n" + "\n".join(edges)


def test_no_import_cycle():
    graph = import_graph(PACKAGE, "inferd")
    assert len(graph) > 50, sorted(graph)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles in inferd/:\n" + "\n".join(describe(c, graph) for c in cycles)


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    (tmp_path / "d.py").write_text("from .a import f\n")
    graph = import_graph(tmp_path, "pkg")
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_modules_stay_small():
    big = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by idea):\n" + "\n".join(big)


def layer_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_each_package_imports_only_the_layers_below_it():
    graph = import_graph(PACKAGE, "inferd")
    assert {layer_of(m) for m in graph if m != "inferd"} == set(LAYERS), "a package is missing from LAYERS"
    bad = [f"{m}:{line} imports {t} (inferd/{layer_of(m)} may import: {', '.join(sorted(LAYERS[layer_of(m)]))})"
           for m, edges in sorted(graph.items()) if m != "inferd"
           for t, line in sorted(edges.items())
           if layer_of(t) != layer_of(m) and t != "inferd" and layer_of(t) not in LAYERS[layer_of(m)]]
    assert not bad, "imports across the layers:\n" + "\n".join(bad)


def private_imports(root: Path, package: str) -> list[str]:
    """'module:line imports name from module' for every import of another module's private (_name) name."""
    out = []
    for path in sorted(root.rglob("*.py")):
        name, base = module_name(path, root, package)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith(package)):
                continue
            out += [f"{name}:{node.lineno} imports {alias.name} from {node.module or '.'}" for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")]
    return out


def test_no_module_imports_another_modules_private_names():
    bad = private_imports(PACKAGE, "inferd")
    assert not bad, "a private name is its module's own (make it public, or move the code):\n" + "\n".join(bad)


def test_the_private_import_check_sees_one(tmp_path):
    (tmp_path / "a.py").write_text("def _helper():\n    pass\n")
    (tmp_path / "b.py").write_text("from .a import (\n    __doc__,\n    _helper,\n)\n")
    assert private_imports(tmp_path, "pkg") == ["pkg.b:1 imports _helper from a"]
