"""One prepared GPU check (`make gpu-check`): the `cuda` tests, then `metrale bench` on the embedded
model and on a random checkpoint of about a billion parameters, printed as one table and written as
JSON under `--out-dir`.

    python tools/gpu_check.py --out-dir gpu-check-out              # on a GPU machine (10-minute budget)
    python tools/gpu_check.py --device cpu --smoke --out-dir /tmp/x   # the plumbing, on any machine

Arms (metrale bench): none (on CUDA: CUDA graphs for decode and verify steps, the rest compiled),
none-eager (no capture, no compile), k1..k3 and ladder (MTP), hf (transformers' generate). Beside
each cell: the step time against the weight bytes one step reads (non-expert weights plus the k
routed experts of one token, of the target layers) over the memory bandwidth measured here. The
targets of issue 15 are checked at concurrency 1: graphs over eager >= 3x, best K over none >= 1.8x,
engine over transformers >= 5x. Needs only torch, transformers and the project's small
dependencies (no Ray). Every stage runs in a subprocess under what is left of `--budget-s`; a stage
that does not fit is reported as skipped, so the table always comes out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "models" / "tiny-glm-moe"

# Stage sizes: (arms, concurrency, max tokens, requests per cell).
FULL = {"embedded": (("none", "none-eager", "k1", "k2", "k3", "ladder", "hf"), "1,8", 64, 8),
        "big": (("none", "none-eager", "k1", "k3", "hf"), "1", 48, 4)}
SMOKE = {"embedded": (("none-eager", "k1-eager", "hf"), "1", 6, 2),
         "big": (("none-eager",), "1", 6, 2)}
# About 1.1e9 parameters: hidden 1024, 10 layers (1 dense), 64 routed experts, an MTP layer.
BIG = {"hidden": 1024, "layers": 10, "experts": 64}
SMOKE_BIG = {"hidden": 64, "layers": 2, "experts": 4}
TARGETS = {"graphs_over_eager": 3.0, "best_k_over_none": 1.8, "engine_over_hf": 5.0}


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run(cmd: list[str], budget: Budget, limit_s: float, log: Path) -> tuple[int | None, str]:
    """Run one stage; (return code or None when it ran out of time, its output)."""
    timeout = min(limit_s, budget.left())
    if timeout < 5:
        return None, "skipped: no time left"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out += f"\n[timed out after {timeout:.0f} s]"
        code = None
    log.write_text(f"$ {' '.join(cmd)}\n[{time.monotonic() - t0:.1f} s]\n{out}")
    return code, out


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
    return 2 * n * reps / (time.perf_counter() - t0)


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


def write_big_checkpoint(out: Path, size: dict, budget: Budget, logs: Path) -> tuple[Path | None, str]:
    if (out / "config.json").is_file():
        return out, "reused"
    code = (
        "import json, shutil, sys, torch\n"
        "from pathlib import Path\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from tools.random_checkpoint import family_config, write_checkpoint\n"
        "out, tok = Path(sys.argv[2]), Path(sys.argv[3])\n"
        "h, layers, experts = map(int, sys.argv[4:7])\n"
        "vocab = len(json.loads(tok.read_text())['model']['vocab'])\n"
        "cfg = {**family_config('glm4_moe', h, layers, experts), 'vocab_size': vocab}\n"
        "torch.set_num_threads(max(1, torch.get_num_threads()))\n"
        "write_checkpoint(out, 'glm4_moe', cfg, seed=0, mtp=True, dtype=torch.bfloat16)\n"
        "shutil.copy(tok, out / 'tokenizer.json')\n")
    rc, text = run([sys.executable, "-c", code, str(ROOT), str(out), str(EMBEDDED / "tokenizer.json"),
                    str(size["hidden"]), str(size["layers"]), str(size["experts"])], budget, 150,
                   logs / "big_checkpoint.log")
    if rc != 0:
        return None, "failed" if rc is not None else "timed out"
    return out, "written"


def run_tests(device: torch.device, budget: Budget, out: Path) -> dict:
    rc, text = run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                    "tests/runtime/test_cuda.py"], budget, 200, out / "cuda_tests.log")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text.splitlines()[-1]
                                                  if text.strip() else "")}
    return {"returncode": rc, **counts, "log": "cuda_tests.log"}


def run_bench(name: str, model: Path, dtype: str, device: torch.device, sizes: tuple, budget: Budget,
              out: Path, limit_s: float) -> dict:
    arms, conc, max_tokens, requests = sizes
    record = out / f"bench_{name}.json"
    cmd = [sys.executable, "-m", "launch", "bench", "--model", str(model), "--dtype", dtype, "--device", str(device),
           "--arms", ",".join(arms), "--concurrency", conc, "--max-tokens", str(max_tokens),
           "--requests", str(requests), "--json-out", str(record)]
    rc, _ = run(cmd, budget, limit_s, out / f"bench_{name}.log")
    if rc != 0 or not record.is_file():
        return {"status": "failed" if rc is not None else "timed out", "cells": [], "log": f"bench_{name}.log"}
    return {"status": "ok", "cells": json.loads(record.read_text())["cells"], "log": f"bench_{name}.log"}


def table_rows(name: str, cells: list[dict], weights: dict, bandwidth: float) -> list[dict]:
    roof_ms = 1000 * weights["per_token"] / bandwidth
    rows = []
    for c in cells:
        step = c.get("step_ms")
        rows.append({"model": name, "arm": c["arm"], "conc": c["concurrency"], "tok_s": c["tok_s"],
                     "accept_len": c.get("accept_len"), "step_ms": step, "roof_ms": round(roof_ms, 4),
                     "step_over_roof": round(step / roof_ms, 1) if step else None,
                     "compiled": c.get("compiled"), "device": c.get("device")})
    return rows


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
    t = summary["tests"]
    print(f"cuda tests: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, {t.get('skipped', 0)} skipped"
          f" (exit {t.get('returncode')})")
    print(f"device {summary['device']} ({summary['device_name']}), copy bandwidth {summary['bandwidth_gb_s']} GB/s, "
          f"{summary['elapsed_s']} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (with --smoke: the plumbing)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: every stage runs in seconds")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole check stays inside this")
    ap.add_argument("--big-dir", type=Path, default=None,
                    help="where the ~1B random checkpoint is written or reused (default OUT_DIR/random-1b)")
    args = ap.parse_args(argv)
    from runtime.device import resolve_device
    device = resolve_device(args.device)
    if device.type != "cuda" and not args.smoke:
        ap.error(f"--device {device} measures nothing useful; use --smoke for the plumbing on the CPU")
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    t0 = time.monotonic()
    sizes = SMOKE if args.smoke else FULL
    bandwidth = memory_bandwidth(device)
    summary: dict = {"device": str(device), "smoke": args.smoke, "torch": torch.__version__,
                     "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "bandwidth_gb_s": round(bandwidth / 1e9, 1), "stages": {}, "ratios": {}}
    print(f"gpu-check: {summary['device_name']}, copy bandwidth {summary['bandwidth_gb_s']} GB/s", flush=True)

    summary["tests"] = run_tests(device, budget, out)
    print(f"gpu-check: cuda tests {summary['tests']}", flush=True)

    rows: list[dict] = []
    emb = run_bench("embedded", EMBEDDED, "bfloat16", device, sizes["embedded"], budget, out, limit_s=240)
    summary["stages"]["embedded"] = {k: v for k, v in emb.items() if k != "cells"}
    emb_rows = table_rows("embedded", emb["cells"], weight_bytes(EMBEDDED, 2), bandwidth)
    print(f"gpu-check: embedded bench {emb['status']}", flush=True)

    big_dir, how = write_big_checkpoint(args.big_dir or out / "random-1b", SMOKE_BIG if args.smoke else BIG,
                                        budget, out)
    summary["stages"]["big_checkpoint"] = how
    big_rows: list[dict] = []
    if big_dir is not None:
        w = weight_bytes(big_dir, 2)
        summary["big_params"] = w["all"] // 2
        big = run_bench("big", big_dir, "bfloat16", device, sizes["big"], budget, out, limit_s=300)
        summary["stages"]["big"] = {k: v for k, v in big.items() if k != "cells"}
        params = w["all"] // 2
        label = f"random-{params / 1e9:.2f}B" if params >= 1e8 else f"random-{params / 1e6:.1f}M"
        big_rows = table_rows(label, big["cells"], w, bandwidth)
        print(f"gpu-check: big bench {big['status']}", flush=True)
    rows = emb_rows + big_rows
    for model in dict.fromkeys(r["model"] for r in rows):
        summary["ratios"][model] = ratios([r for r in rows if r["model"] == model])
    summary["rows"] = rows
    summary["elapsed_s"] = round(time.monotonic() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(rows, summary)
    print(f"wrote {out / 'gpu_check.json'}")
    failed = summary["tests"].get("failed", 0) or summary["tests"].get("returncode") not in (0, 5)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    raise SystemExit(main())
