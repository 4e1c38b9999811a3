"""`make mutants`: the curated mutations of tools/mutants.toml, each applied alone to a scratch copy of the working
tree, with the tests that claim to guard that code run against it. A mutation the tests do not fail on survived:
the guard does not guard. docs/development.md ("Mutation testing") says when to run it and how to add an entry.

The real tree is never touched: the tracked and untracked-but-not-ignored files are copied into a scratch folder
(one per job), a mutation is written there, its tests run with PYTHONPATH at the copy (so the servers the tests start
run the mutated code too), and the file is put back. Statuses: caught (pytest failed), survived (pytest passed),
error (the entry no longer applies, pytest could not run the tests, or the per-mutation timeout). Before the
mutations, the guards run once on the unmutated copy: a guard that fails there would "catch" everything.

    python tools/mutants.py [--list] [--only NAME ...] [-j N] [--timeout S] [--no-baseline]

Exit status 0 only when every mutation selected was caught.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTATIONS_FILE = Path(__file__).with_name("mutants.toml")
DEFAULT_TIMEOUT_S = 1200  # one mutation's tests: the slowest guard (the parity tests) took ~110 s on 2 busy cores
FIELDS = ("name", "area", "file", "old", "new", "tests", "why")
# what the list guards (issue 26); every area has at least one entry (tests/test_mutants.py)
AREAS = ("model math", "exactness rule", "ticket release", "quota refunds", "handshake", "scheduler budget",
         "sampler seeding", "prefix-cache salt")
# pytest with SIGINT restored: a process started in the background inherits SIGINT ignored, and pytest runs its
# fixtures' teardown (which kills the servers the tests started, each in its own session) only on KeyboardInterrupt
PYTEST = ["-c", "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "sys.exit(pytest.main(sys.argv[1:]))", "-x", "-q", "-p", "no:cacheprovider"]
STOP_GRACE_S = 60  # for an interrupted pytest's teardown, before its process group is killed


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    area: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str


@dataclasses.dataclass
class Result:
    mutation: Mutation
    status: str  # caught | survived | error
    seconds: float
    detail: str  # the failing tests (caught), why it could not tell (error)
    log: Path | None = None


def load_mutations(path: Path = MUTATIONS_FILE) -> list[Mutation]:
    """The entries of the TOML file; ValueError naming the entry when one lacks a field, has an unknown one, or
    repeats a name."""
    data = tomllib.loads(path.read_text())
    out, seen = [], set()
    for i, entry in enumerate(data.get("mutation", [])):
        label = entry.get("name", f"entry {i + 1}")
        missing = [f for f in FIELDS if not entry.get(f)]
        unknown = sorted(set(entry) - set(FIELDS))
        if missing or unknown:
            raise ValueError(f"{path}: mutation {label!r}: missing {missing or 'nothing'}, unknown {unknown or 'none'}")
        if not isinstance(entry["tests"], list) or not all(isinstance(t, str) for t in entry["tests"]):
            raise ValueError(f"{path}: mutation {label!r}: tests must be a list of pytest paths or node ids")
        if entry["area"] not in AREAS:
            raise ValueError(f"{path}: mutation {label!r}: area {entry['area']!r} is none of {', '.join(AREAS)}")
        if label in seen:
            raise ValueError(f"{path}: mutation name {label!r} is used twice")
        if entry["old"] == entry["new"]:
            raise ValueError(f"{path}: mutation {label!r} changes nothing")
        seen.add(label)
        out.append(Mutation(entry["name"], entry["area"], entry["file"], entry["old"], entry["new"],
                            tuple(entry["tests"]), entry["why"]))
    return out


def test_path(node_id: str) -> str:
    """The file of a pytest node id (tests/x.py::test_y[param] -> tests/x.py)."""
    return node_id.split("::", 1)[0]


def problems(mutation: Mutation, root: Path = ROOT) -> list[str]:
    """Why the mutation cannot be applied as written to the tree at root (empty: it can): its file is missing, its
    `old` text does not occur exactly once there, or a test file it names does not exist."""
    out = []
    source = root / mutation.file
    if not source.is_file():
        out.append(f"{mutation.file} does not exist")
    else:
        count = source.read_text().count(mutation.old)
        if count != 1:
            out.append(f"its old text occurs {count} times in {mutation.file} (must be exactly once: did the code "
                       "move? update the entry)")
    for node in mutation.tests:
        path = root / test_path(node)
        if not path.is_file():
            out.append(f"test file {test_path(node)} does not exist")
            continue
        # a node id's test (tests/x.py::test_y[param]: test_y) must be defined in that file
        name = node.split("::")[-1].split("[")[0] if "::" in node else None
        if name is not None and not re.search(rf"^\s*(async\s+)?def {re.escape(name)}\(", path.read_text(), re.M):
            out.append(f"{test_path(node)} defines no {name}")
    if mutation.file.endswith(".py") and not out:
        mutated = source.read_text().replace(mutation.old, mutation.new, 1)
        try:
            compile(mutated, mutation.file, "exec")
        except SyntaxError as e:  # pytest would only say "interrupted"
            out.append(f"the mutated {mutation.file} does not compile: {e}")
    return out


def source_files(root: Path) -> list[str]:
    """The working tree as git sees it: tracked files (as they are now, edits included) and untracked files that
    are not ignored."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode()
    return sorted({f for f in listed.split("\0") if f and (root / f).is_file()})


def make_scratch(root: Path, files: list[str], parent: Path, name: str) -> Path:
    dest = parent / name
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)
    return dest


def run_pytest(tree: Path, tests: list[str], timeout: float, log: Path, cache_dir: str) -> tuple[int | None, str]:
    """(pytest's exit status, or None at the timeout; its output). Runs in its own process group, killed whole at
    the timeout (the servers a test started with it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the copy first on the path, and nothing of the real tree; no .pyc, in the processes the tests start too
    # (INFERD_NO_BYTECODE: tests/conftest.py): a mutation as long as the text it replaces, written within the same
    # second, would otherwise leave a stale .pyc that still holds the original
    env.update(PYTHONPATH=str(tree), INFERD_CACHE_DIR=cache_dir, PYTHONDONTWRITEBYTECODE="1", INFERD_NO_BYTECODE="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *PYTEST, *tests], cwd=tree, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        with _running_lock:
            _running.add(proc)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            stop_group(proc)
            with _running_lock:
                _running.discard(proc)
    return rc, log.read_text(errors="replace")


_running: set[subprocess.Popen] = set()  # the pytest runs under way (their process groups are stopped on Ctrl-C)
_running_lock = threading.Lock()


def stop_group(proc: subprocess.Popen) -> None:
    """Ends proc, a pytest we started as a session leader: SIGINT (pytest tears its fixtures down, the servers they
    started included), then SIGKILL to its process group after STOP_GRACE_S or once it exited (anything left)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def failures(output: str) -> str:
    """The failing tests named in pytest's short summary (-ra), first line of each."""
    found = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return ", ".join(found) or "(see the log)"


def classify(rc: int | None, output: str, timeout: float) -> tuple[str, str]:
    if rc is None:
        return "error", f"timed out after {timeout:g} s"
    if rc == 0:
        return "survived", "every guard passed"
    if rc == 1:
        return "caught", failures(output)
    what = {2: "interrupted (a collection error, unless this run was stopped: does the mutated code import?)",
            3: "pytest internal error",
            4: "pytest usage error (a test node id that does not exist?)", 5: "no tests collected"}
    return "error", f"pytest exit {rc}: {what.get(rc, 'unexpected')}; {failures(output)}"


def mutate_and_test(mutation: Mutation, tree: Path, timeout: float, logs: Path, cache_dir: str) -> Result:
    started = time.monotonic()
    issues = problems(mutation, tree)
    if issues:
        return Result(mutation, "error", 0.0, "; ".join(issues))
    source = tree / mutation.file
    original = source.read_text()
    source.write_text(original.replace(mutation.old, mutation.new, 1))
    log = logs / f"{mutation.name}.log"
    try:
        rc, output = run_pytest(tree, list(mutation.tests), timeout, log, cache_dir)
    finally:
        source.write_text(original)
    status, detail = classify(rc, output, timeout)
    return Result(mutation, status, time.monotonic() - started, detail, log)


def baseline(tree: Path, mutations: list[Mutation], timeout: float, logs: Path, cache_dir: str) -> tuple[bool, str]:
    """Every guard named, once, on the unmutated copy: they must pass for a failure under a mutation to mean
    anything."""
    tests = list(dict.fromkeys(t for m in mutations for t in m.tests))
    rc, output = run_pytest(tree, tests, timeout * max(1, len(tests)), logs / "baseline.log", cache_dir)
    return rc == 0, "" if rc == 0 else (f"exit {rc}: {failures(output)}" if rc is not None else "timed out")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the mutations and their guards, run nothing")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    p.add_argument("-j", "--jobs", type=int, default=1, help="mutations run at once, each in its own copy (default 1)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds for one mutation's tests (default {DEFAULT_TIMEOUT_S})")
    p.add_argument("--no-baseline", action="store_true", help="skip the guards' run on the unmutated tree")
    p.add_argument("--file", type=Path, default=MUTATIONS_FILE, help="the mutations (default tools/mutants.toml)")
    p.add_argument("--logs", type=Path, help="keep pytest's output of each run here (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("-j must be at least 1")
    return args


def _terminate(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops a run as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mutations = load_mutations(args.file)
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in mutations})
        if unknown:
            print(f"unknown mutation(s): {', '.join(unknown)}", file=sys.stderr)
            return 2
        mutations = [m for m in mutations if m.name in args.only]
    if args.list:
        for m in mutations:
            print(f"{m.name:40} {m.area:18} {m.file}\n    {m.why}\n    guards: {' '.join(m.tests)}")
        return 0
    cache_dir = os.environ.get("INFERD_CACHE_DIR") or str(ROOT / ".cache" / "inferd")
    cache_dir = str(Path(cache_dir).resolve())
    logs = args.logs or Path(tempfile.mkdtemp(prefix="inferd-mutants-logs-"))  # kept: a few text files
    logs.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="inferd-mutants-"))  # the copies: removed at the end
    started = time.monotonic()
    try:
        files = source_files(ROOT)
        trees: queue.Queue[Path] = queue.Queue()
        for j in range(max(1, min(args.jobs, len(mutations)))):
            trees.put(make_scratch(ROOT, files, scratch, f"tree{j}"))
        print(f"{len(mutations)} mutation(s), {args.jobs} at a time; pytest logs in {logs}", flush=True)
        if not args.no_baseline:
            tree = trees.get()
            ok, why = baseline(tree, mutations, args.timeout, logs, cache_dir)
            trees.put(tree)
            if not ok:
                print(f"the guards fail on the unmutated tree ({why}; {logs / 'baseline.log'}): fix that first",
                      file=sys.stderr)
                return 2
            print(f"baseline: every guard passes unmutated ({time.monotonic() - started:.0f} s)", flush=True)
        lock = threading.Lock()
        stopping = threading.Event()

        def job(m: Mutation) -> Result:
            if stopping.is_set():
                return Result(m, "error", 0.0, "not run (interrupted)")
            tree = trees.get()
            try:
                result = mutate_and_test(m, tree, args.timeout, logs, cache_dir)
            finally:
                trees.put(tree)
            with lock:
                print(f"{result.status.upper():9} {m.name} ({result.seconds:.0f} s): {result.detail}", flush=True)
            return result

        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(job, m) for m in mutations]
            try:
                results = [f.result() for f in futures]
            except KeyboardInterrupt:  # start nothing more; what runs tears down (its servers too), then we stop
                stopping.set()
                with _running_lock:
                    running = list(_running)
                for proc in running:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGINT)
                print("interrupted: stopping the tests that run", file=sys.stderr, flush=True)
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.monotonic() - started
    counts = {s: sum(r.status == s for r in results) for s in ("caught", "survived", "error")}
    print(f"\n{counts['caught']} caught, {counts['survived']} survived, {counts['error']} error; "
          f"{elapsed / 60:.1f} min")
    for status in ("survived", "error"):
        for r in results:
            if r.status == status:
                print(f"  {status}: {r.mutation.name} [{r.mutation.area}] {r.mutation.file}: {r.mutation.why}")
    return 0 if counts["caught"] == len(results) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
