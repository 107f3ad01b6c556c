"""The runtime's native CPU ops (runtime/csrc/cpu_ops.cpp), built once per source and torch build
with the host's C++ compiler and loaded into torch.ops.metrale_cpu.

Why: on the CPU a step's host time is mostly the per-call cost of small tensor ops (5-30 us each
here). The routed experts of one layer took ~30 of them around their GEMMs: 280 us against 78 us
of GEMMs for one row, 740 against 335 for a four-row verify (two threads, 8 experts of 256 x 256).
The native op does the same GEMMs with the bookkeeping on host vectors, bit for bit the Python
path's results. Paged attention (`PagedAttention.attend` over a padded batch) is the other op:
the same cache write, gather and SDPA call in one native call instead of ~15 from Python.

The library is built on first use (~15 s; `make venv` builds it ahead) into `CACHE_DIR`
(`~/.cache/metrale/cpu_ops`), under a name that hashes the source, the torch version and the
compiler flags, so a changed source or torch rebuilds it. The compiler is the first of `COMPILERS`
on the PATH. When none is found or the build fails, `load` logs why once and returns False, and
the Python paths run instead (same results, slower).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger("metrale.cpu_ops")

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
# No contraction of a*b+c into one rounding: the ops must round as the ATen kernels they mirror;
# `omp simd` reductions (the in-place attention's dot products) vectorise.
FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-ffp-contract=off", "-fopenmp-simd", "-w")
BUILD_TIMEOUT_S = 600
CACHE_DIR = Path.home() / ".cache" / "metrale" / "cpu_ops"
COMPILERS = ("c++", "g++", "clang++")

_state: dict[str, object] = {}   # "loaded": bool, "error": str


def library_path(cache_dir: Path = CACHE_DIR) -> Path:
    """Where this source's library for this torch build lives (built or not)."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(FLAGS).encode(),
                 str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(), sys.version.encode()):
        digest.update(part)
    return cache_dir / f"metrale_cpu_ops_{digest.hexdigest()[:16]}.so"


def build(path: Path, compilers: tuple[str, ...] = COMPILERS) -> None:
    """Compile the library into `path` (atomically: a temp file renamed into place) with the first
    of `compilers` on the PATH. Raises RuntimeError with the compiler's output on failure."""
    from torch.utils import cpp_extension   # its import costs ~0.3 s: only when building
    cxx = next((name for name in compilers if shutil.which(name)), None)
    if cxx is None:
        raise RuntimeError(f"no C++ compiler found ({', '.join(compilers)})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{p}" for p in cpp_extension.include_paths()), str(SOURCE), "-o", tmp,
           *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]
    log.info("building the native CPU ops (once per source and torch build, ~15 s): %s", path)
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the native CPU ops in %.1f s", time.monotonic() - t0)


def load(cache_dir: Path = CACHE_DIR, compilers: tuple[str, ...] = COMPILERS) -> bool:
    """Load the native CPU ops, building them first when this source and torch have no library yet.
    True when `torch.ops.metrale_cpu` is usable; False (logged once, with the reason) otherwise.
    The first call decides for the process; later calls return its answer."""
    loaded = _state.get("loaded")
    if loaded is not None:
        return bool(loaded)
    try:
        path = library_path(cache_dir)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.parent / ".build.lock", "w") as lock:   # one build when processes start together
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not path.exists():
                    build(path, compilers)
        torch.ops.load_library(str(path))
        _state["loaded"] = True
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _state["loaded"], _state["error"] = False, str(exc)
        log.warning("native CPU ops unavailable, the routed experts run the Python path (slower, same "
                    "results): %s", exc)
    return bool(_state["loaded"])


def error() -> str | None:
    """Why `load` returned False (None when it has not failed)."""
    return _state.get("error")   # type: ignore[return-value]


if __name__ == "__main__":   # `python -m runtime.cpu_ops`: build ahead (make venv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if load() else 1)
