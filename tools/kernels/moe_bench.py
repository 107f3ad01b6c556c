"""The routed-expert layer's two paths side by side, per row count and dtype, in one run.

    python tools/kernels/moe_bench.py --model models/tiny-glm-moe --json-out bench/records/moe_paths.json

For each row count T (a decode step of T sequences, a verify of T rows, a prefill chunk) and each
dtype, the reference loop over experts (host synchronisation, one pair of matmuls per touched
expert) and the grouped path (sorted choices, two grouped matmuls, no synchronisation) run on
the model's own first MoE layer with real routing, alternating, and the best of `--repeats`
timings is kept. Prints a table of microseconds and the ratio.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from runtime.model.layers import MoE  # noqa: E402
from runtime.model.weights import load_model  # noqa: E402


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-glm-moe"))
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256", help="comma list of row counts")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.repeats < 1 or min(rows) < 1:
        ap.error("--repeats and every row count must be at least 1")
    out = []
    print(f"{'dtype':>9} {'rows':>5} {'loop_us':>9} {'grouped_us':>11} {'speedup':>8}")
    for dtype in args.dtypes.split(","):
        model = load_model(args.model, dtype, device="cpu")   # the CPU routed-expert paths
        moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for t in rows:
                x = (torch.randn(t, model.config.hidden_size, generator=g)).to(model.dtype)
                _, weights, ids = moe.gate(x)
                ex = moe.experts
                loop = lambda: ex._looped(x, weights, ids)      # noqa: E731
                grouped = lambda: ex._grouped(x, weights, ids)  # noqa: E731
                if not torch.equal(loop(), grouped()):
                    raise SystemExit(f"moe_bench: the paths disagree at {dtype} T={t}")
                times = {"loop": float("inf"), "grouped": float("inf")}
                loop(), grouped()    # warm-up: first calls pick kernels
                for _ in range(2):   # alternate, so a slow spell falls on both
                    times["loop"] = min(times["loop"], best_of(loop, args.repeats))
                    times["grouped"] = min(times["grouped"], best_of(grouped, args.repeats))
                row = {"dtype": dtype, "rows": t, "loop_us": round(times["loop"] * 1e6, 1),
                       "grouped_us": round(times["grouped"] * 1e6, 1),
                       "speedup": round(times["loop"] / times["grouped"], 3)}
                out.append(row)
                print(f"{dtype:>9} {t:>5} {row['loop_us']:>9} {row['grouped_us']:>11} {row['speedup']:>8}")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"model": args.model, "threads": torch.get_num_threads(),
                                             "rows": out}, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
