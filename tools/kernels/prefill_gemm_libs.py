"""A prefill wave's GEMMs in the two CPU libraries torch offers: `torch.mm` (MKL, what the step
runs today) against oneDNN with the weight reordered once (`mkldnn._reorder_linear_weight`, then
`mkldnn._linear_pointwise`: what vLLM's CPU build and inductor's weight prepacking use).

    python tools/kernels/prefill_gemm_libs.py --model models/tiny-glm-moe --rows 2048 \
        --rounds 5 [--json-out R.json] [--plot-out R.png]

The shapes are the model's per layer at `--rows` prefill rows (a wave of 16 prompts of 128 tokens
is 2,048): the fused q/k/v and output projections, the dense MLP's fused gate/up and down, a
routed expert's at its even share of the rows (rows * top_k / experts) and the shared expert's.
Per round and dtype each shape runs both ways, the order swapped every round (20 timed calls
each, the median); the record keeps every round's ms and the medians of the per-round ratios
mm / oneDNN (above 1: oneDNN faster), and the layer's sum weighted by how often each GEMM runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def shapes(config: dict, rows: int) -> list[dict]:
    """(name, rows m, in k, out n, calls a layer) of one decoder layer's GEMMs at `rows` rows."""
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    experts, k = config["n_routed_experts"], config["num_experts_per_tok"]
    moe, dense = config["moe_intermediate_size"], config["intermediate_size"]
    shared = config.get("n_shared_experts", 0) * moe
    per_expert = max(1, rows * k // experts)
    out = [dict(name="qkv", m=rows, k=h, n=(heads + 2 * kv) * d, calls=1),
           dict(name="o", m=rows, k=heads * d, n=h, calls=1),
           dict(name="dense gate/up", m=rows, k=h, n=2 * dense, calls=1),
           dict(name="dense down", m=rows, k=dense, n=h, calls=1),
           dict(name="expert gate/up", m=per_expert, k=h, n=2 * moe, calls=experts),
           dict(name="expert down", m=per_expert, k=moe, n=h, calls=experts)]
    if shared:
        out += [dict(name="shared gate/up", m=rows, k=h, n=2 * shared, calls=1),
                dict(name="shared down", m=rows, k=shared, n=h, calls=1)]
    return out


def median_ms(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(shape: dict, dtype: torch.dtype, swap: bool) -> tuple[float, float, float]:
    """(mm ms, oneDNN ms, max |difference|) of one shape, the two in the order `swap` says."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape["m"], shape["k"], generator=gen).to(dtype)
    w = (torch.randn(shape["n"], shape["k"], generator=gen) * shape["k"] ** -0.5).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, shape["m"])
    mm = lambda: torch.mm(x, w.t())
    dnn = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    diff = (mm().float() - dnn().float()).abs().max().item()
    if swap:
        b, a = median_ms(dnn), median_ms(mm)
    else:
        a, b = median_ms(mm), median_ms(dnn)
    return a, b, diff


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(record["dtypes"]), figsize=(4.5 * len(record["dtypes"]), 3.6), squeeze=False)
    for ax, (dtype, cells) in zip(axes[0], record["dtypes"].items()):
        names = [c["name"] for c in cells["shapes"]]
        for i, c in enumerate(cells["shapes"]):
            ax.plot([i] * len(c["ratio_runs"]), c["ratio_runs"], "k.", ms=4)
            ax.bar(i, c["mm_over_onednn"], color="tab:blue", alpha=0.5)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("mm ms / oneDNN ms (above 1: oneDNN faster)", fontsize=7)
        ax.set_title(f"{dtype}: layer {cells['layer_mm_over_onednn']:.2f}x", fontsize=9)
    fig.suptitle(f"{record['model']}, {record['rows']} prefill rows, {record['rounds']} rounds, "
                 f"{record['threads']} threads (load {record['load'][0]:.1f})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-glm-moe")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--plot-out", type=Path, default=None)
    args = ap.parse_args()
    if args.rows < 1 or args.rounds < 1:
        ap.error("--rows and --rounds must be at least 1")
    config = json.loads((args.model / "config.json").read_text())
    cells = shapes(config, args.rows)
    record = {"tool": "prefill_gemm_libs", "model": args.model.name, "rows": args.rows, "rounds": args.rounds,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "dtypes": {}}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        runs = {c["name"]: [] for c in cells}
        for r in range(args.rounds):
            for c in cells:
                runs[c["name"]].append(measure(c, dtype, swap=r % 2 == 1))
        out = []
        for c in cells:
            got = runs[c["name"]]
            ratios = [a / b for a, b, _ in got]
            out.append({**c, "mm_ms": round(statistics.median(a for a, _, _ in got), 4),
                        "onednn_ms": round(statistics.median(b for _, b, _ in got), 4),
                        "mm_over_onednn": round(statistics.median(ratios), 3),
                        "ratio_runs": [round(x, 3) for x in ratios], "max_abs_diff": max(d for _, _, d in got)})
            print(f"{name:9s} {c['name']:15s} {c['m']:5d}x{c['k']}x{c['n']} x{c['calls']}: mm {out[-1]['mm_ms']:7.3f} ms"
                  f"  oneDNN {out[-1]['onednn_ms']:7.3f} ms  mm/oneDNN {out[-1]['mm_over_onednn']:.2f}", flush=True)
        mm_layer = sum(c["mm_ms"] * c["calls"] for c in out)
        dnn_layer = sum(c["onednn_ms"] * c["calls"] for c in out)
        record["dtypes"][name] = {"shapes": out, "layer_mm_ms": round(mm_layer, 3), "layer_onednn_ms": round(dnn_layer, 3),
                                  "layer_mm_over_onednn": round(mm_layer / dnn_layer, 3)}
        print(f"{name:9s} one layer's GEMMs: mm {mm_layer:.2f} ms, oneDNN {dnn_layer:.2f} ms, "
              f"mm/oneDNN {mm_layer / dnn_layer:.2f}")
    from bench.report import machine
    record.update(load=os.getloadavg(), machine=machine())
    if args.json_out:
        args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    if args.plot_out:
        plot(record, args.plot_out)


if __name__ == "__main__":
    main()
