"""The mutation list of `make mutants` (tools/mutants.toml) stays applicable without running it (that is slow): every
entry's `old` text occurs exactly once in its file, the mutated Python still compiles, the tests it names exist, every
guarded area has an entry, and docs/development.md lists them all. A refactor that moves guarded code fails here."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_tool():
    spec = importlib.util.spec_from_file_location("inferd_mutants_tool", ROOT / "tools" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mutants = _load_tool()
MUTATIONS = mutants.load_mutations()


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_mutation_applies_to_the_tree(mutation):
    assert mutants.problems(mutation, ROOT) == []


def test_every_guarded_area_has_a_mutation():
    missing = set(mutants.AREAS) - {m.area for m in MUTATIONS}
    assert not missing, f"no mutation guards {sorted(missing)}"


def test_the_development_guide_lists_every_mutation():
    text = (ROOT / "docs" / "development.md").read_text()
    assert "make mutants" in text
    unlisted = [m.name for m in MUTATIONS if f"`{m.name}`" not in text]
    assert not unlisted, f"docs/development.md's mutation table lacks {unlisted}"


def _rotted_tree(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\ny = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text("def test_x():\n    pass\n")
    return tmp_path


@pytest.mark.parametrize("change,problem", [
    (dict(old="x = 2"), "occurs 0 times"),
    (dict(old="= 1"), "occurs 2 times"),
    (dict(file="pkg/gone.py"), "pkg/gone.py does not exist"),
    (dict(tests=("tests/test_gone.py",)), "test file tests/test_gone.py does not exist"),
    (dict(tests=("tests/test_mod.py::test_renamed",)), "defines no test_renamed"),
    (dict(new="x = ("), "does not compile"),
])
def test_a_rotted_entry_is_refused_naming_why(tmp_path, change, problem):
    tree = _rotted_tree(tmp_path)
    good = mutants.Mutation("m", "model math", "pkg/mod.py", "x = 1", "x = 2", ("tests/test_mod.py::test_x",), "w")
    assert mutants.problems(good, tree) == []
    bad = dataclasses.replace(good, **change)
    found = mutants.problems(bad, tree)
    assert len(found) == 1 and problem in found[0], found


@pytest.mark.parametrize("entry,message", [
    ('name = "a"\narea = "model math"\nfile = "f"\nold = "o"\nnew = "n"\ntests = ["t"]\n', "missing ['why']"),
    ('name = "a"\narea = "colour"\nfile = "f"\nold = "o"\nnew = "n"\ntests = ["t"]\nwhy = "w"\n', "area 'colour'"),
    ('name = "a"\narea = "model math"\nfile = "f"\nold = "o"\nnew = "o"\ntests = ["t"]\nwhy = "w"\n',
     "changes nothing"),
])
def test_a_malformed_list_is_refused(tmp_path, entry, message):
    path = tmp_path / "m.toml"
    path.write_text("[[mutation]]\n" + entry)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        mutants.load_mutations(path)


def test_a_name_used_twice_is_refused(tmp_path):
    entry = 'name = "a"\narea = "model math"\nfile = "f"\nold = "o"\nnew = "n"\ntests = ["t"]\nwhy = "w"\n'
    path = tmp_path / "m.toml"
    path.write_text(f"[[mutation]]\n{entry}\n[[mutation]]\n{entry}")
    with pytest.raises(ValueError, match="used twice"):
        mutants.load_mutations(path)


@pytest.mark.parametrize("rc,status", [(0, "survived"), (1, "caught"), (2, "error"), (4, "error"), (5, "error"),
                                       (None, "error")])
def test_only_failing_tests_count_as_caught(rc, status):
    output = "FAILED tests/x.py::test_y - AssertionError: no\n"
    assert mutants.classify(rc, output, 60)[0] == status
