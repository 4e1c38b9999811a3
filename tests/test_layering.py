"""The package's layering: inferd/models/ imports nothing from inferd/engine/ (the engine builds on the models, never
the other way round). Checked on the source with ast, so imports inside functions and `if TYPE_CHECKING:` blocks
count too."""

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
