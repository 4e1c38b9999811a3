"""The repository is self-contained: no tracked file points at documents a clone does not have (the design notes and
performance notes that once lived beside the repository). What they said is in docs/architecture.md and
docs/machines.md."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the names of what lies outside, spelled in pieces so that this file does not name them itself
OUTSIDE = ("../" + "shared", "DESIGN" + ".md", "PERF" + "-NOTES")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def outside_references(root: Path, names: list[str]) -> list[str]:
    """'name:line: text' for each line of the text files root/name that names something outside the repository."""
    hits = []
    for name in names:
        try:
            text = (root / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary (images, weights), or deleted in the working tree
        for number, line in enumerate(text.splitlines(), 1):
            if any(word in line for word in OUTSIDE):
                hits.append(f"{name}:{number}: {line.strip()[:120]}")
    return hits


def test_no_tracked_file_refers_outside_the_repository():
    names = tracked_files()
    assert "README.md" in names and "inferd/config.py" in names, "git ls-files did not list the repository"
    hits = outside_references(ROOT, names)
    assert not hits, "files refer to documents outside the repository:\n" + "\n".join(hits)


def test_the_check_sees_each_form(tmp_path):
    samples = {"a.md": "Design: `../" "shared/DESIGN" ".md`\n", "b.py": '"""bandwidth (as in PERF' '-NOTES.md)"""\n',
               "c.sh": "# DESIGN" '.md, "The cluster"\n', "d.md": "docs/machines.md, docs/architecture.md\n",
               "e.bin": b"\xff\xfe DESIGN" b".md"}
    for name, text in samples.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    hits = outside_references(tmp_path, sorted(samples) + ["gone.md"])
    assert sorted(hit.split(":")[0] for hit in hits) == ["a.md", "b.py", "c.sh"]
