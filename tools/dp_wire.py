"""Bytes rank 0 puts on the wire in one decode step, tensor-parallel attention (today's layout,
`--moe-a2a auto`) against `--dp-attention`, counted from the collectives' tensors
(`ep.comm.Communicator.wire_bytes`), not timed.

    python tools/dp_wire.py --json-out bench/records/dp_wire_SHA.json --plot-out bench/records/dp_wire_SHA.png

For each EP size, layout, speculation (none, MTP 3 drafts) and concurrency: `c` requests are
admitted and prefilled, then one step in which every sequence decodes (a verify with MTP) is
counted by collective; per MoE layer, the exchange's all_to_all bytes (DP) or the all-reduces of a
layer (TP: its attention output projection and its experts) are given beside the formulas of
docs/design.md §4.3.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = ROOT / "models" / "tiny-glm-moe"


def count(ep: int, dp: bool, spec: str, concurrency: list[int], max_num_seqs: int) -> list[dict]:
    from launch.mp import MPGroup
    from runtime.sample.sampler import SamplingParams
    from serving.llm import LLM
    llm = LLM(MODEL, dtype="float32", ep=ep, dp_attention=dp, launcher=MPGroup, enforce_eager=True,
              warm_standby=False, max_num_seqs=max_num_seqs, spec=spec, num_drafts=3, draft_policy="fixed",
              mtp_max_seqs=max_num_seqs if spec != "none" else None, kv_cache_tokens=16384, prefix_cache=False)
    cfg = llm.engine.runner.config
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    out = []
    try:
        engine, comm = llm.engine, llm.deployment.comm
        for c in concurrency:
            seqs = [engine.add_request([(7 * i + j) % 300 + 1 for j in range(8)],
                                       SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(c)]
            while any(s.num_output == 0 for s in seqs):
                llm.step()
            before = dict(comm.wire_bytes)
            llm.step()
            step = {k: v - before.get(k, 0) for k, v in comm.wire_bytes.items() if v - before.get(k, 0)}
            rows = sum(1 for _ in seqs) * (1 + (3 if spec != "none" else 0))
            cell = {"ep": ep, "layout": "dp" if dp else "tp", "spec": spec, "concurrency": c, "rows": rows,
                    "bytes_per_step": step}
            if dp:
                cell["budget"] = llm.engine.runner.dp.budget
                cell["exchange_bytes_per_moe_layer"] = step.get("all_to_all", 0) // moe_layers
            else:
                # 8-byte status words of the commands aside, every all-reduce is a layer's attention
                # output or its experts' sum, of the same size.
                per = step.get("all_reduce", 0) // (cfg.num_hidden_layers + moe_layers) if step.get("all_reduce") else 0
                cell["allreduce_bytes_per_moe_layer"] = 2 * per
            out.append(cell)
            while engine.has_unfinished():
                llm.step()
    finally:
        llm.shutdown()
    return out


def plot(cells: list[dict], path: str) -> None:
    """Bytes a MoE layer puts on rank 0's wire in a decode step, by concurrency: one panel per
    EP size and speculation, TP attention's all-reduces against DP attention's exchange."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(c["ep"], c["spec"]) for c in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (ep, spec) in zip(axes[0], panels):
        for layout, key in (("tp", "allreduce_bytes_per_moe_layer"), ("dp", "exchange_bytes_per_moe_layer")):
            pts = sorted((c["concurrency"], c[key]) for c in cells if (c["ep"], c["spec"], c["layout"]) == (ep, spec, layout))
            ax.plot([x for x, _ in pts], [y / 1024 for _, y in pts], marker="o",
                    label="TP attention (all-reduces)" if layout == "tp" else "DP attention (padded exchange)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"EP {ep}, {'MTP 3 drafts' if spec == 'mtp' else 'no speculation'}")
        ax.set_xlabel("concurrency")
        ax.set_ylabel("KiB a MoE layer a decode step (rank 0)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", default="2,4")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--json-out", required=True)
    p.add_argument("--plot-out", default=None)
    p.add_argument("--from-json", default=None, help="plot a record already written instead of counting")
    args = p.parse_args(argv)
    if args.from_json:
        plot(json.loads(Path(args.from_json).read_text())["cells"], args.plot_out)
        return 0
    conc = [int(x) for x in args.concurrency.split(",")]
    cells = []
    for ep in (int(x) for x in args.ep.split(",")):
        for spec in ("none", "mtp"):
            for dp in (False, True):
                cells += count(ep, dp, spec, conc, max(conc))
                print(json.dumps(cells[-len(conc):]), flush=True)
    Path(args.json_out).write_text(json.dumps({"model": "models/tiny-glm-moe", "dtype": "float32",
                                               "command": " ".join(sys.argv), "cells": cells}, indent=1))
    if args.plot_out:
        plot(cells, args.plot_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
