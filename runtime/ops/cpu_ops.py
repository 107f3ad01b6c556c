"""The runtime's native CPU ops (runtime/ops/csrc/cpu_ops.cpp), built once per source and torch build
with the host's C++ compiler and loaded into torch.ops.metrale_cpu.

Why: on the CPU a step's host time is mostly the per-call cost of small tensor ops. The routed
experts of one layer took ~30 of them around their GEMMs, more time than the GEMMs themselves
(design §3.4). The native op does the bookkeeping on host vectors. Its GEMMs, and every float32 / bfloat16 linear
of a few rows (`few_rows_max`), run a few-row kernel (`metrale_cpu::linear`): a stream of the
column-major weights with float accumulators, each output summed in order (bfloat16: in pairs, on
AVX512-BF16's dot products where the CPU has them), so a row's result is its own whatever the batch; MKL's GEMM of a few rows reads the weights far
below the memory's bandwidth, and oneDNN's bfloat16 GEMM without native bfloat16 (AVX2) is slower
still (design §3.4). Without the kernel (more rows,
other types) the op runs the Python path's ATen calls, bit for bit its results. Paged attention
(`PagedAttention.attend` over a padded batch) is the other op: the same cache write, then the
decode and verify rows read the cache in place (prefills gather for SDPA), in one native call.

The library is built on first use (seconds; `make venv` builds it ahead) into `CACHE_DIR`
(`~/.cache/metrale/cpu_ops`), under a name that hashes the source, the torch version and the
compiler flags, so a changed source or torch rebuilds it. The compiler is the first of `COMPILERS`
on the PATH. When none is found or the build fails, `load` logs why once and returns False, and
the Python paths run instead (slower; within rounding of the kernel's results).
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
# No contraction of a*b+c into one rounding: the ops must round as the ATen kernels they mirror,
# and the few-row GEMM the same on every ISA. -fopenmp: at::parallel_for is inline OpenMP, which
# without it runs on one thread (the library then links libgomp.so.1, the name torch's bundled
# copy has, so the process keeps one OpenMP runtime); `omp simd` reductions vectorise.
FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-ffp-contract=off", "-fopenmp", "-w")
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
    from torch.utils import cpp_extension   # a slow import: only when building
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
        _register_fakes()
        FEW_ROWS.update(_few_rows_table())
        _state["loaded"] = True
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _state["loaded"], _state["error"] = False, str(exc)
        FEW_ROWS.clear()
        log.warning("native CPU ops unavailable, the routed experts, attention and linears run the Python "
                    "paths (slower): %s", exc)
    global LOADED
    LOADED = bool(_state["loaded"])
    return LOADED


# Most rows a GEMM may have to run through the native few-row kernel (`metrale_cpu::linear`, the
# routed experts' per-expert GEMMs), by dtype; more rows go to MKL / oneDNN. Measured at two
# threads on an AVX2 CPU (EPYC), a column-major 256 x 512 matrix (weights cycled through 15 MB),
# us a call, kernel / MKL: float32 1 row 21/21, 4: 26/48, 8: 35/53, 16: 54/61, 32: 107/93, 64:
# 187/140; bfloat16 1: 24/212, 16: 62/3140, 256: 884/48995 (oneDNN without native bfloat16;
# row-major weights 3917). So float32 up to 16 rows, and bfloat16 always where oneDNN has no
# native bfloat16 (else up to 16, as float32). With AVX512-BF16 the kernel sums bfloat16 on its dot
# products and beats oneDNN (which uses them too) up to 32 rows: AVX-512 EPYC, two threads, us a
# call, kernel / oneDNN: 512 x 256 16 rows 28.8/38.6, 32: 45.3/55.5, 48: 65.4/60.1; 4096 x 256 32:
# 314/359, 48: 500/391; 256 x 768 32: 44.1/63.3. float64, the reference mode, always: a column's
# result is then its own wherever it sits in the matrix (MKL's float64 GEMM on AVX2 rounds a column
# by its place, so an EP rank's slice of an attention's heads gave other bits than one rank's).
# With AVX-512 the float32 kernel runs 16-column tiles of up to 8 rows at a time and beats MKL up to
# 32 rows at least: the embedded model's decode step, two threads, limit 32 against 16, ms a step,
# 16 rows 4.86/5.45, 24: 6.73/10.86, 32: 8.29/11.99 (tools/few_rows_ab.py, design §2 serving).
FEW_ROWS_FLOAT32 = 16
FEW_ROWS_FLOAT32_AVX512 = 32
FEW_ROWS_BF16_DOT = 32
ALL_ROWS = 1 << 30

# Set by `load` (plain globals, so a compiled step reads them as constants): whether the library is
# loaded (None: not tried yet), and `few_rows_max` by dtype.
LOADED: bool | None = None
FEW_ROWS: dict[torch.dtype, int] = {}
_FAKES: list[str] = []


def few_rows_max(dtype: torch.dtype) -> int:
    """Most rows of a `dtype` GEMM that the native few-row kernel takes (0: none, or not loaded)."""
    return FEW_ROWS.get(dtype, 0)


def _few_rows_table() -> dict[torch.dtype, int]:
    native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    bf16_dot = bool(torch.ops.metrale_cpu.use_bf16_dot_products(True))   # the default: on where the CPU has them
    float32 = FEW_ROWS_FLOAT32_AVX512 if torch.cpu._is_avx512_supported() else FEW_ROWS_FLOAT32
    return {torch.float32: float32,
            torch.bfloat16: ALL_ROWS if not native_bf16 else FEW_ROWS_BF16_DOT if bf16_dot else FEW_ROWS_FLOAT32,
            torch.float64: ALL_ROWS}


def takes_all_rows(dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Whether `metrale_cpu::linear` runs x . weight^T for x of `dtype` and every row count (the
    kernel loaded, this dtype always through it, weight column-major on the CPU): its results are
    then row- and column-invariant by construction. Loads the library on first use."""
    if LOADED is None and not torch.compiler.is_compiling():
        load()
    return (FEW_ROWS.get(dtype, 0) >= ALL_ROWS and weight.dtype == dtype and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) == weight.shape[0])


def invariant_linear(dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Whether `metrale_cpu::linear` with `ALL_ROWS` runs x . weight^T for x of `dtype` at every row
    count (the library loaded; float32, bfloat16 or float64; weight of that type, column-major, on
    the CPU): each output is then summed in k order from zero, whatever the rows beside it, the
    thread count or the weight being packed, so the batch-invariant mode takes it for every GEMM
    (tests/runtime/test_native_linear.py checks every row count 1..80 at 1 and 2 threads). Loads
    the library on first use."""
    if LOADED is None and not torch.compiler.is_compiling():
        load()
    return (bool(LOADED) and dtype in (torch.float32, torch.bfloat16, torch.float64) and weight.dtype == dtype
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.stride(0) == 1
            and weight.stride(1) == weight.shape[0])


def packs(weight: torch.Tensor) -> bool:
    """Whether `pack_for_inference` keeps a packed copy of `weight` (`pack`): a CPU bfloat16
    [N, K] or [E, N, K] matrix with N a multiple of 32, or a float32 one with N a multiple of 16,
    the library loaded."""
    multiple = {torch.bfloat16: 32, torch.float32: 16}.get(weight.dtype)
    return (bool(LOADED) and weight.device.type == "cpu" and multiple is not None
            and weight.dim() in (2, 3) and weight.shape[-2] % multiple == 0 and weight.shape[-1] > 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight`'s packed form for `metrale_cpu::linear` and the routed experts' few-row
    GEMMs (`metrale_cpu::pack`; the same bits as the unpacked weight): bfloat16 in 64-column
    panels of interleaved pairs down the depth, float32 in 16-column panels down the depth, each
    panel one stream. A copy: the weight must not change after."""
    return torch.ops.metrale_cpu.pack(weight.detach())


def kernel_clock(on: bool) -> float:
    """Start (`on`) or stop the native kernel clock; returns the seconds it counted since the last
    call (and counts from 0 again): the calling threads' wall time inside the compute ops (linears,
    routed experts, paged attention), an op nested in another once. 0.0 without the library."""
    if LOADED is None:
        load()
    return torch.ops.metrale_cpu.kernel_clock(on) / 1e9 if LOADED else 0.0


def _register_fakes() -> None:
    """Output shapes of the ops a compiled step calls directly (the others run inside opaque
    Python ops that have their own); once a process."""
    if _FAKES:
        return
    _FAKES.append("metrale_cpu::linear")

    @torch.library.register_fake("metrale_cpu::linear")
    def _(x, w, bias, max_rows, packed=None):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake("metrale_cpu::routed_experts")
    def _(x, weights, ids, gate_up, down, expert_offset, padded_min_experts, few_rows_max, gate_up_packed=None,
          down_packed=None):
        return x.new_empty(x.shape)

    @torch.library.register_fake("metrale_cpu::planned_attention")
    def _(q, k, v, layer_idx, scale):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    @torch.library.register_fake("metrale_cpu::planned_attention_at")
    def _(q, k, v, layer_idx, step, scale):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))


def error() -> str | None:
    """Why `load` returned False (None when it has not failed)."""
    return _state.get("error")   # type: ignore[return-value]


if __name__ == "__main__":   # `python -m runtime.ops.cpu_ops`: build ahead (make venv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if load() else 1)
