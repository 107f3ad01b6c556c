"""One prepared GPU check (`make gpu-check`): a preflight line, the `cuda` tests, then `metrale bench`
on the embedded model and on a random checkpoint of about a billion parameters, printed as one table
and written under `--out-dir` as it goes.

    python tools/gpu_check.py --out-dir gpu-check-out              # on a GPU machine (9-minute budget)
    python tools/gpu_check.py --device cpu --smoke --out-dir /tmp/x   # the plumbing, on any machine

Built to work the first time on a machine lent for minutes: it runs from a plain checkout (the
project need not be installed) with torch, transformers and the project's small dependencies (no
Ray, starlette, uvicorn, llguidance, openai or jsonschema). Stages go cheapest first, each with a
time limit printed before it starts (the limits add up to less than `--budget-s`); every arm runs in
its own process, and each finished cell is appended to `cells.jsonl` at once, so a crash or a
timeout loses only the cell it was in. The ~2 GB random checkpoint goes outside the output folder
(`--big-dir`). The output folder holds four small files: cells.jsonl, gpu_check.json, cuda_tests.xml
(pytest's junit XML, where the test counts come from) and stages.log (the tail of each stage's output).

Arms (metrale bench): none (on CUDA in bfloat16: CUDA graphs for decode and verify steps, the rest
compiled), none-eager (no capture, no compile), k1..k3 and ladder (MTP), hf (transformers'
generate). Beside each cell: the step time against the weight bytes one step reads (non-expert
weights plus the k routed experts of one token, of the target layers) over the memory bandwidth
measured here. The targets at concurrency 1: graphs over eager >= 3x, best K over none >= 1.8x,
engine over transformers >= 5x, step within 2x of its bytes-over-bandwidth bound.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # a plain checkout: `runtime` and `tools` importable without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

EMBEDDED = ROOT / "models" / "tiny-glm-moe"

# Stage sizes: ({arm: seconds allowed, in the order run}, concurrency, max tokens, requests per cell).
# An arm's process imports torch and transformers and loads the model (~10 s); the compiled arms
# (none, k*, ladder: torch.compile plus CUDA graphs on CUDA) compile first. Estimates: no GPU has
# run this yet.
FULL = {"embedded": ({"none-eager": 25, "none": 60, "k1": 35, "k3": 30, "ladder": 30, "hf": 20},
                     "1", 64, 6),
        "big": ({"none-eager": 30, "none": 50, "k1": 30, "hf": 20}, "1", 48, 4)}
SMOKE = {"embedded": ({"none-eager": 100, "k1-eager": 100, "hf": 100}, "1", 6, 2),
         "big": ({"none-eager": 100}, "1", 6, 2)}
TESTS_S = {False: 110, True: 60}        # the cuda tests (smoke: they skip)
KERNELS_S = {False: 40, True: 100}      # tools/kernels/kernel_bench.py (smoke: under the Triton interpreter)
CHECKPOINT_S = {False: 50, True: 40}    # writing the random checkpoint
# About 1.1e9 parameters: hidden 1024, 10 layers (1 dense), 64 routed experts, an MTP layer.
BIG = {"hidden": 1024, "layers": 10, "experts": 64}
SMOKE_BIG = {"hidden": 64, "layers": 2, "experts": 4}
TARGETS = {"graphs_over_eager": 3.0, "best_k_over_none": 1.8, "engine_over_hf": 5.0}
LOG_TAIL = 6000   # characters of each stage's output kept in stages.log


def planned_seconds(smoke: bool) -> int:
    """The stages' limits added up (the check's own start and the table come on top)."""
    sizes = SMOKE if smoke else FULL
    return TESTS_S[smoke] + KERNELS_S[smoke] + CHECKPOINT_S[smoke] + sum(sum(s[0].values()) for s in sizes.values())


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Out:
    """The output folder: the cells as they come, the stage logs' tails, the summary."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.cells = folder / "cells.jsonl"
        self.log = folder / "stages.log"
        for p in (self.cells, self.log):
            p.write_text("")

    def cell(self, row: dict) -> None:
        with self.cells.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def stage_log(self, name: str, cmd: list[str], seconds: float, text: str) -> None:
        tail = text[-LOG_TAIL:]
        with self.log.open("a") as f:
            f.write(f"=== {name} [{seconds:.1f} s] $ {' '.join(cmd)}\n{tail}\n")


def stage_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run(name: str, cmd: list[str], budget: Budget, limit_s: float, out: Out) -> tuple[int | None, str]:
    """Run one stage under min(its limit, what is left); (return code or None when it ran out of
    time, its output: stdout and stderr together, kept on a timeout too)."""
    timeout = min(limit_s, budget.left())
    if timeout < 5:
        out.stage_log(name, cmd, 0.0, "skipped: no time left")
        return None, "skipped: no time left"
    print(f"gpu-check: {name} (at most {timeout:.0f} s, {budget.left():.0f} s left)", flush=True)
    t0 = time.monotonic()
    # SIGINT at its default in the stage (a shell's background job inherits it ignored), so Python
    # there turns it into KeyboardInterrupt
    proc = subprocess.Popen(cmd, cwd=ROOT, env=stage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        text, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        # SIGINT first: pytest still writes its junit XML and a bench its finished cells' log
        proc.send_signal(signal.SIGINT)
        try:
            text, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        text = (text or "") + f"\n[timed out after {timeout:.0f} s]"
        code = None
    out.stage_log(name, cmd, time.monotonic() - t0, text)
    return code, text


def preflight(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["capability"] = "sm%d%d" % torch.cuda.get_device_capability(device)
    else:
        info["device_name"], info["capability"] = "cpu", None
    return info


def memory_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write), measured here."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    del src, dst
    return 2 * n * reps / seconds


def weight_bytes(model_dir: Path, dtype_size: int) -> dict:
    """Target-layer weight bytes of a checkpoint (the MTP layer apart): all, and what one token's
    step reads (everything but the routed experts, plus k of the E routed experts per layer)."""
    from safetensors import safe_open
    cfg = json.loads((model_dir / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    k, e = cfg.get("num_experts_per_tok", 1), cfg.get("n_routed_experts") or cfg.get("num_experts") or 1
    routed = other = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                m = re.match(r"^model\.layers\.(\d+)\.", name)
                if m and int(m.group(1)) >= layers:
                    continue   # the MTP layer
                size = 1
                for d in f.get_slice(name).get_shape():
                    size *= d
                if re.search(r"\.mlp\.experts\.\d+\.", name):
                    routed += size * dtype_size
                else:
                    other += size * dtype_size
    return {"all": routed + other, "per_token": other + routed * k // e, "routed": routed}


def write_big_checkpoint(folder: Path, size: dict, budget: Budget, limit_s: float, out: Out) -> tuple[Path | None, str]:
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder, "reused"
    code = (
        "import json, shutil, sys, torch\n"
        "from pathlib import Path\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from tools.random_checkpoint import family_config, write_checkpoint\n"
        "out, tok = Path(sys.argv[2]), Path(sys.argv[3])\n"
        "h, layers, experts = map(int, sys.argv[4:7])\n"
        "vocab = len(json.loads(tok.read_text())['model']['vocab'])\n"
        "cfg = {**family_config('glm4_moe', h, layers, experts), 'vocab_size': vocab}\n"
        "write_checkpoint(out, 'glm4_moe', cfg, seed=0, mtp=True, dtype=torch.bfloat16)\n"
        "shutil.copy(tok, out / 'tokenizer.json')\n")
    rc, _ = run("big checkpoint", [sys.executable, "-c", code, str(ROOT), str(folder), str(EMBEDDED / "tokenizer.json"),
                                   str(size["hidden"]), str(size["layers"]), str(size["experts"])],
                budget, limit_s, out)
    if rc != 0:
        return None, "failed" if rc is not None else "timed out"
    return folder, "written"


def junit_counts(path: Path) -> dict:
    """passed/failed/errors/skipped from pytest's junit XML (every testsuite element summed)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"]}


def cuda_test_files() -> list[str]:
    """The test files that hold `cuda` tests (only those are collected: the others may import what
    the GPU image lacks)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.cuda" in p.read_text())


def run_tests(budget: Budget, limit_s: float, out: Out) -> dict:
    xml = out.folder / "cuda_tests.xml"
    xml.unlink(missing_ok=True)
    rc, _ = run("cuda tests", [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                               "-o", "addopts=", f"--junitxml={xml}", *cuda_test_files()], budget, limit_s, out)
    counts = junit_counts(xml) if xml.is_file() else {}
    return {"returncode": rc, **counts, "junit": xml.name if xml.is_file() else None}


def run_kernels(device: torch.device, smoke: bool, budget: Budget, limit_s: float, out: Out) -> list[dict]:
    """tools/kernels/kernel_bench.py: each Triton kernel against the path it replaces; its cells (each
    already in cells.jsonl when the stage ends, whatever stopped it)."""
    lines = out.folder / "kernel_cells.tmp"
    lines.unlink(missing_ok=True)
    cmd = [sys.executable, "tools/kernels/kernel_bench.py", "--device", str(device), "--json-out", str(lines)]
    rc, text = run("kernel bench", cmd + (["--smoke"] if smoke else []), budget, limit_s, out)
    cells = [json.loads(x) for x in lines.read_text().splitlines()] if lines.is_file() else []
    lines.unlink(missing_ok=True)
    for c in cells:
        out.cell(c)
    return cells


def run_arm(model_name: str, model: Path, arm: str, device: torch.device, sizes: tuple, budget: Budget,
            out: Out, scratch: Path) -> list[dict]:
    """One arm of one model in its own process; its cells (none when it failed or timed out)."""
    arms, conc, max_tokens, requests = sizes
    limit_s = arms[arm]
    record = scratch / f"{model_name}_{arm}.json"
    cmd = [sys.executable, "-m", "launch", "bench", "--model", str(model), "--dtype", "bfloat16",
           "--device", str(device), "--arms", arm, "--concurrency", conc, "--max-tokens", str(max_tokens),
           "--requests", str(requests), "--json-out", str(record)]
    rc, _ = run(f"{model_name} {arm}", cmd, budget, limit_s, out)
    if rc != 0 or not record.is_file():
        return []
    return json.loads(record.read_text())["cells"]


def table_row(name: str, c: dict, weights: dict, bandwidth: float) -> dict:
    roof_ms = 1000 * weights["per_token"] / bandwidth
    step = c.get("step_ms")
    return {"model": name, "arm": c["arm"], "conc": c["concurrency"], "tok_s": c["tok_s"],
            "accept_len": c.get("accept_len"), "step_ms": step, "roof_ms": round(roof_ms, 4),
            "step_over_roof": round(step / roof_ms, 1) if step else None,
            "compiled": c.get("compiled"), "device": c.get("device")}


def ratios(rows: list[dict]) -> dict:
    """The issue's ratios at concurrency 1 (None where an arm is missing)."""
    at1 = {r["arm"]: r["tok_s"] for r in rows if r["conc"] == 1}
    eager = at1.get("none-eager")
    none = at1.get("none") or eager
    ks = [v for a, v in at1.items() if re.match(r"^(k\d|ladder)", a)]
    engine = max((v for a, v in at1.items() if a != "hf"), default=None)
    return {"graphs_over_eager": round(at1["none"] / eager, 2) if "none" in at1 and eager else None,
            "best_k_over_none": round(max(ks) / none, 2) if ks and none else None,
            "engine_over_hf": round(engine / at1["hf"], 2) if engine and at1.get("hf") else None}


def print_table(rows: list[dict], summary: dict) -> None:
    cols = ["model", "arm", "conc", "tok_s", "accept_len", "step_ms", "roof_ms", "step_over_roof"]
    text = [[str(r.get(c) if r.get(c) is not None else "-") for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in text)) if text else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for t in text:
        print("  ".join(v.rjust(w) for v, w in zip(t, widths)))
    for model, rs in summary["ratios"].items():
        parts = []
        for key, target in TARGETS.items():
            v = rs.get(key)
            parts.append(f"{key} {v if v is not None else '-'} (target {target}"
                         f"{', met' if v is not None and v >= target else ''})")
        print(f"{model}: " + "; ".join(parts))
    for c in summary.get("kernels", []):
        print("kernel: " + ", ".join(f"{k} {v}" for k, v in c.items() if k != "kernel") + f" ({c['kernel']})")
    t = summary["tests"]
    print(f"cuda tests: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, {t.get('errors', 0)} errors, "
          f"{t.get('skipped', 0)} skipped (exit {t.get('returncode')})")
    print(f"device {summary['device']} ({summary['device_name']}), copy bandwidth {summary['bandwidth_gb_s']} GB/s, "
          f"{summary['elapsed_s']} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (with --smoke: the plumbing)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: every stage runs in seconds")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole check stays inside this")
    ap.add_argument("--big-dir", type=Path, default=None,
                    help="where the ~1B random checkpoint is written or reused (default: under the system's "
                         "temporary folder, never inside --out-dir)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    from runtime.platform.device import resolve_device
    device = resolve_device(args.device)
    if device.type != "cuda" and not args.smoke:
        ap.error(f"--device {device} measures nothing useful; use --smoke for the plumbing on the CPU")
    planned = planned_seconds(args.smoke)
    if planned > args.budget_s:
        ap.error(f"the stages' limits add up to {planned} s, over --budget-s {args.budget_s:.0f}")
    out = Out(args.out_dir)
    budget = Budget(args.budget_s)
    sizes = SMOKE if args.smoke else FULL
    tag = "smoke" if args.smoke else "full"
    big_dir = args.big_dir or Path(tempfile.gettempdir()) / f"metrale-gpu-check-{tag}" / "random-1b"
    if big_dir.resolve().is_relative_to(args.out_dir.resolve()):
        ap.error(f"--big-dir {big_dir} is inside --out-dir: the output folder comes back as a few small files")
    info = preflight(device)
    bandwidth = memory_bandwidth(device)
    summary: dict = {**info, "smoke": args.smoke, "bandwidth_gb_s": round(bandwidth / 1e9, 1),
                     "planned_s": planned, "stages": {}, "ratios": {}}
    print("gpu-check: " + ", ".join(f"{k} {v}" for k, v in info.items())
          + f", copy bandwidth {summary['bandwidth_gb_s']} GB/s; stages planned at {planned} s", flush=True)

    summary["tests"] = run_tests(budget, TESTS_S[args.smoke], out)
    print(f"gpu-check: cuda tests {summary['tests']}", flush=True)

    summary["kernels"] = run_kernels(device, args.smoke, budget, KERNELS_S[args.smoke], out)
    print(f"gpu-check: kernel cells {len(summary['kernels'])}", flush=True)

    rows: list[dict] = []
    scratch = Path(tempfile.mkdtemp(prefix="metrale-gpu-check-"))

    def bench(model_name: str, model: Path, label: str, weights: dict) -> None:
        arms = sizes[model_name][0]
        print(f"gpu-check: {label}: {len(arms)} arms, {sum(arms.values())} s at most", flush=True)
        done = []
        for arm in arms:
            cells = run_arm(model_name, model, arm, device, sizes[model_name], budget, out, scratch)
            for c in cells:
                row = table_row(label, c, weights, bandwidth)
                rows.append(row)
                out.cell(row)
            done.append(arm if cells else f"{arm} (failed)")
        summary["stages"][label] = done

    bench("embedded", EMBEDDED, "embedded", weight_bytes(EMBEDDED, 2))
    found, how = write_big_checkpoint(big_dir, SMOKE_BIG if args.smoke else BIG, budget, CHECKPOINT_S[args.smoke], out)
    summary["stages"]["big_checkpoint"] = f"{how} at {big_dir}"
    if found is not None:
        w = weight_bytes(found, 2)
        params = w["all"] // 2
        summary["big_params"] = params
        label = f"random-{params / 1e9:.2f}B" if params >= 1e8 else f"random-{params / 1e6:.1f}M"
        bench("big", found, label, w)
    for model in dict.fromkeys(r["model"] for r in rows):
        summary["ratios"][model] = ratios([r for r in rows if r["model"] == model])
    summary["rows"] = rows
    summary["elapsed_s"] = round(time.monotonic() - t0, 1)
    (out.folder / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(rows, summary)
    print(f"wrote {out.folder / 'gpu_check.json'}")
    t = summary["tests"]
    failed = t.get("failed", 0) or t.get("errors", 0) or t.get("returncode") not in (0, 5)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    raise SystemExit(main())
