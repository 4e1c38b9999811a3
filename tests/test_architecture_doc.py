"""docs/architecture.md stays true of the code: every module it names exists, every object of its "Main objects"
table is defined in the module the table names, and its "Package layers" table says what tests/test_layering.py
enforces."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_layering import LAYERS

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def module_paths(text: str) -> list[str]:
    """Every `path.py` (or `path_*.py`) the text names in backticks, as written."""
    return re.findall(r"`([\w/*.-]+\.(?:py|cpp))`", text)


def resolve(name: str) -> list[Path]:
    """The files a name in the document means: relative to the repository, else to inferd/."""
    for base in (ROOT, ROOT / "inferd"):
        found = sorted(base.glob(name))
        if found:
            return found
    return []


def defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def table_rows(text: str) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|")]
    return rows[2:]  # past the header and its rule


def test_every_module_named_exists():
    text = DOC.read_text()
    names = module_paths(text)
    assert len(names) > 40, names
    missing = [n for n in names if not resolve(n)]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_main_objects_are_where_the_table_says():
    rows = table_rows(section(DOC.read_text(), "Main objects"))
    assert len(rows) > 15, rows
    wrong = []
    for objects, module, _ in rows:
        names = re.findall(r"`(\w+)`", objects)
        paths = resolve(module.strip("`")) if module.endswith(".py`") else []
        if module.endswith("/`"):  # a package: the objects are in its modules
            paths = sorted((ROOT / "inferd" / module.strip("`")).glob("*.py"))
        defined = set().union(*(defined_names(p) for p in paths)) if paths else set()
        if names and not paths:
            wrong.append(f"{module}: no such module")
        wrong += [f"{name} is not defined in {module}" for name in names if name not in defined]
    assert not wrong, "docs/architecture.md, Main objects:\n" + "\n".join(wrong)


def test_the_layers_table_is_what_the_layering_test_enforces():
    rows = table_rows(section(DOC.read_text(), "Package layers"))
    documented = {}
    for package, _, may_import in rows:
        name = package.strip("`").removesuffix("/").removesuffix(".py")
        allowed = set() if may_import.startswith("nothing") else set(re.findall(r"[a-z_]+", may_import))
        documented[name] = allowed
    cli = documented.pop("cli")
    assert cli == {"everything"}, cli
    enforced = {k: v for k, v in LAYERS.items() if k not in ("cli", "__main__")}
    assert documented == enforced
