"""EPLB on the embedded model: per-rank expert load (max / mean) before and after, and the bytes
each MoE dispatch scheme and each re-placement puts on the wire (counted, not timed).

    python tools/ep/eplb_record.py --json-out bench/records/eplb_SHA.json --plot bench/records/eplb_SHA.png

Two sources of expert loads:
- the routing trace (`tools/ep/ep_balance.py record`: 16 held-out prompts, greedy decode): per MoE
  layer, a placement made from the first half of the decode steps is judged on the second half,
  step by step (max over ranks / mean over ranks of the rows each rank's experts get, averaged
  over steps), against the contiguous split, at EP 2 and EP 4;
- a live EP 2 group (spawned processes, gloo, float32 eager) serving the same prompts with
  `--eplb-redundant-experts 2 --eplb-interval-steps S`: the runtime's own counters, read after
  every forward, judge each decode step's rank loads under the placement it ran with (placed from
  earlier steps only) against the contiguous split; also the whole run's loads under the final
  placement, the re-placements' weight bytes, and rank 0's wire bytes inside each MoE layer's
  dispatch per step (`ep.comm.Communicator.wire_bytes`) under `--moe-a2a allreduce` and `alltoall`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ep_balance  # noqa: E402
from ep.eplb import contiguous_placement, eplb_slots, imbalance, slot_share  # noqa: E402

MODEL = ROOT / "models" / "tiny-glm-moe"


def trace_imbalance(trace: ep_balance.Trace, ep: int, redundant: int) -> dict:
    """Per layer: max/mean rank load of the contiguous split and of EPLB placed from the first
    half of the steps, both judged step by step on the second half."""
    steps = trace.steps.shape[1]
    fit, judge = slice(0, steps // 2), slice(steps // 2, steps)
    rows = []
    for layer in trace.steps:
        placed = eplb_slots(layer[fit].sum(axis=0), num_redundant=redundant, num_ranks=ep, ranks_per_node=ep,
                            num_groups=1)
        rows.append({"contiguous": imbalance(contiguous_placement(trace.num_experts, ep), layer[judge]),
                     "eplb": imbalance(slot_share(placed, trace.num_experts), layer[judge])})
    return {"ep": ep, "redundant": redundant, "fit_steps": steps // 2, "judged_steps": steps - steps // 2,
            "layers": rows,
            "mean_contiguous": float(np.mean([r["contiguous"] for r in rows])),
            "mean_eplb": float(np.mean([r["eplb"] for r in rows]))}


def live(mode: str, prompts: list[str], max_tokens: int, interval: int, redundant: int) -> dict:
    """One EP 2 group with EPLB: counted loads, placements, and rank 0's MoE dispatch bytes."""
    from ep.parallel import EPMoE
    from ep.placement import moe_layers
    from launch.mp import MPGroup
    from runtime.sample.sampler import SamplingParams
    from serving.llm import LLM

    calls: list[tuple[int, int]] = []          # (rows, wire bytes) of each MoE dispatch on rank 0
    forward = EPMoE.forward

    active: dict[int, np.ndarray] = {}        # the placement each layer ran its last dispatch with

    def counted(self, x):
        active[id(self)] = self.eplb_slots.copy()
        before = sum(self.comm.wire_bytes.values())
        out = forward(self, x)
        calls.append((x.shape[0], sum(self.comm.wire_bytes.values()) - before))
        return out

    EPMoE.forward = counted
    steps: list[dict] = []                     # per forward: rows per rank per layer, active placement vs contiguous
    from ep.driver import DriverRunner
    from ep.placement import loads as read_loads
    drive = DriverRunner.forward

    def stepped(self, tokens, chunks):
        before = read_loads(self.model)
        active.clear()
        out = drive(self, tokens, chunks)      # re-places first when its interval is due
        delta = [a - b for a, b in zip(read_loads(self.model), before)]
        ran = [active.get(id(m)) for m in moe_layers(self.model)]
        e = len(delta[0])
        steps.append({"rows": len(tokens), "placed": self.placements,
                      "contiguous": [imbalance(contiguous_placement(e, 2), d) for d in delta if d.sum()],
                      "eplb": [imbalance(slot_share(a, e), d) for a, d in zip(ran, delta) if d.sum()]})
        return out

    DriverRunner.forward = stepped
    llm = LLM(MODEL, dtype="float32", ep=2, moe_a2a=mode, launcher=MPGroup, enforce_eager=True,
              eplb_redundant_experts=redundant, eplb_interval_steps=interval, prefix_cache=False,
              warm_standby=False)
    try:
        runner = llm.engine.runner
        calls.clear()
        t0 = time.perf_counter()
        out = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        seconds = time.perf_counter() - t0
        stats = llm.expert_stats()
        layers = moe_layers(runner.model)
        final = [m.eplb_slots.tolist() for m in layers]
        num_experts = layers[0].topo.num_experts
    finally:
        llm.shutdown()
        EPMoE.forward = forward
        DriverRunner.forward = drive
    loads = np.asarray(stats["loads"], dtype=np.float64)
    target = [i for i, row in enumerate(loads) if row.sum() > 0]
    before = [imbalance(contiguous_placement(num_experts, 2), loads[i]) for i in target]
    after = [imbalance(slot_share(np.asarray(final[i]), num_experts), loads[i]) for i in target]
    decode = [st for st in steps if st["rows"] <= len(prompts) and st["placed"] > 0]
    per_step = {"decode_steps_after_first_placement": len(decode),
                "contiguous": float(np.mean([np.mean(st["contiguous"]) for st in decode])),
                "eplb": float(np.mean([np.mean(st["eplb"]) for st in decode]))}
    rows = np.asarray([r for r, _ in calls], dtype=np.float64)
    wire = np.asarray([b for _, b in calls], dtype=np.float64)
    return {"mode": mode, "ep": 2, "redundant": redundant, "interval_steps": interval, "prompts": len(prompts),
            "max_tokens": max_tokens, "tokens": sum(len(o.token_ids) for o in out), "seconds_untimed": seconds,
            "placements": stats["placements"], "replacement_bytes_rank0": stats["bytes_received"],
            "replacement_bytes_per_layer_per_placement": stats["bytes_received"] / max(1, stats["placements"])
            / len(layers),
            "loads": stats["loads"], "final_slots": final,
            "imbalance_contiguous": before, "imbalance_eplb_final": after, "per_step": per_step, "steps": steps,
            "moe_dispatches": len(calls), "rows_per_dispatch_mean": float(rows.mean()),
            "wire_bytes_per_dispatch_mean": float(wire.mean()),
            "wire_bytes_per_row": float(wire.sum() / rows.sum()),
            "decode_wire_bytes_per_dispatch": float(wire[rows <= len(prompts)].mean())}


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels, cont, eplb = [], [], []
    for t in record["trace"]:
        labels.append(f"trace EP{t['ep']} R{t['redundant']}")
        cont.append(t["mean_contiguous"])
        eplb.append(t["mean_eplb"])
    for run in record["live"][:1]:
        labels.append(f"live EP2 R{run['redundant']} per step")
        cont.append(run["per_step"]["contiguous"])
        eplb.append(run["per_step"]["eplb"])
        labels.append(f"live EP2 R{run['redundant']} run total")
        cont.append(float(np.mean(run["imbalance_contiguous"])))
        eplb.append(float(np.mean(run["imbalance_eplb_final"])))
    x = np.arange(len(labels))
    a.bar(x - 0.2, cont, 0.4, label="contiguous split")
    a.bar(x + 0.2, eplb, 0.4, label="EPLB")
    a.axhline(1.0, color="grey", lw=0.8)
    a.set_xticks(x, labels, rotation=15)
    a.set_ylabel("max / mean rank load (mean over MoE layers)")
    a.set_title("tiny-glm-moe routing: expert load per rank")
    a.legend()
    modes = [r["mode"] for r in record["live"]]
    b.bar(modes, [r["wire_bytes_per_row"] for r in record["live"]])
    b.set_ylabel("rank 0 wire bytes per row per MoE layer")
    b.set_title("MoE dispatch bytes at EP 2 (counted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=ep_balance.DEFAULT_TRACE)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--json-out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    trace = ep_balance.load_trace(args.trace)
    lines = (MODEL / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][:args.prompts]
    record = {"model": MODEL.name, "trace": [trace_imbalance(trace, 2, 2), trace_imbalance(trace, 2, 4),
                                             trace_imbalance(trace, 4, 4)],
              "live": [live(mode, prompts, args.max_tokens, args.interval, 2) for mode in ("allreduce", "alltoall")]}
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    if args.plot is not None:
        plot(record, args.plot)
    for t in record["trace"]:
        print(f"trace EP {t['ep']} R {t['redundant']}: max/mean {t['mean_contiguous']:.3f} contiguous -> "
              f"{t['mean_eplb']:.3f} EPLB")
    for r in record["live"]:
        print(f"live EP 2 {r['mode']}: max/mean {np.mean(r['imbalance_contiguous']):.3f} contiguous -> "
              f"{np.mean(r['imbalance_eplb_final']):.3f} EPLB ({r['placements']} placements, "
              f"{r['replacement_bytes_per_layer_per_placement']:.0f} B a layer each); "
              f"{r['wire_bytes_per_row']:.0f} wire B per row per MoE layer, "
              f"{r['decode_wire_bytes_per_dispatch']:.0f} per decode dispatch; per decode step after the first "
              f"placement {r['per_step']['contiguous']:.3f} contiguous -> {r['per_step']['eplb']:.3f} EPLB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
