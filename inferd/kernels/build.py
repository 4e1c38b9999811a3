"""Builds and loads inferd's fused CPU operators (cpu_ops.cpp) as torch.ops.inferd.*.

The library is compiled once per (source, torch version, compiler, CPU) with the host's g++ at -O3 -march=native, so
it uses the vector units this CPU has (AVX2, AVX-512, AVX-512 BF16) and never an instruction another CPU lacks: a
virtualenv moved to another machine builds again instead of dying with SIGILL. `make setup` builds it
(`python -m inferd.kernels.build`); a process that finds no build compiles it on first use, under a file lock, so
concurrent workers compile once. Where it cannot be built (no compiler), load() returns False and the model runs
the torch references (inferd/kernels/reference.py).

Where: $INFERD_KERNELS_DIR, else <virtualenv>/inferd-kernels (it goes with the torch it was built against).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("inferd.kernels")

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
HEADERS = ("cpu_lora.h",)  # included by SOURCE: part of the build key
LIB_NAME = "inferd_cpu_ops"
BUILD_TIMEOUT_S = 600  # a cold compile takes ~30-60 s on 2 cores
DISABLE_ENV = "INFERD_KERNELS"  # "reference": never load the fused library (tests of the references, debugging)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "error": str


def kernels_dir() -> Path:
    root = os.environ.get("INFERD_KERNELS_DIR")
    return Path(root) if root else Path(sys.prefix) / "inferd-kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build_key(compiler: str) -> str:
    h = hashlib.sha256()
    headers = [SOURCE.with_name(name).read_bytes() for name in HEADERS]
    for part in (SOURCE.read_bytes(), *headers, torch.__version__.encode(), compiler.encode(), _cpu_flags().encode(),
                 sys.version.encode(), " ".join(_command(compiler, Path("out"))).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _command(compiler: str, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libdirs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [compiler, "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
            "-std=c++17", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, f"-I{sysconfig.get_paths()['include']}",
            str(SOURCE), "-o", str(out),
            *[f"-L{d}" for d in libdirs], *[f"-Wl,-rpath,{d}" for d in libdirs],
            "-lc10", "-ltorch_cpu", "-ltorch"]


def build(force: bool = False) -> Path:
    """Compiles the library unless a build for this key exists; returns its path. Raises RuntimeError on failure."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH: the fused CPU kernels cannot be built")
    folder = kernels_dir() / build_key(compiler)
    lib = folder / f"{LIB_NAME}.so"
    if lib.exists() and not force:
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one compile at a time; the others wait and then find it built
        if lib.exists() and not force:
            return lib
        tmp = folder / f"{LIB_NAME}.{os.getpid()}.tmp.so"
        started = time.monotonic()
        log.info("building the fused CPU kernels (%s)", folder)
        try:
            done = subprocess.run(_command(compiler, tmp), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"building the fused CPU kernels took over {BUILD_TIMEOUT_S} s") from None
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"building the fused CPU kernels failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, lib)  # atomic: a reader sees no file or a whole one
        log.info("built the fused CPU kernels in %.1f s", time.monotonic() - started)
    return lib


def load() -> bool:
    """Loads the library into this process once (building it if needed). False, with the reason in error(), when it
    is disabled or cannot be built; the caller then runs the references."""
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        if os.environ.get(DISABLE_ENV, "").strip().lower() == "reference":
            _state.update(loaded=False, error=f"{DISABLE_ENV}=reference")
            return False
        try:
            torch.ops.load_library(str(build()))
            _state["loaded"] = True
        except Exception as e:  # noqa: BLE001 - no compiler, a failed build: run the references
            log.warning("fused CPU kernels unavailable, running the torch references: %s", e)
            _state.update(loaded=False, error=str(e))
        return bool(_state["loaded"])


def error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def main() -> int:
    started = time.monotonic()
    try:
        lib = build()
    except RuntimeError as e:
        print(f"inferd kernels: {e}", file=sys.stderr)
        return 1
    torch.ops.load_library(str(lib))
    print(f"inferd kernels: {lib} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
