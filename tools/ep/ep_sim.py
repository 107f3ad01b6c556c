"""Predicts the decode step time and output tokens/s per node of a MoE model served with expert
parallelism, for a model (DeepSeek-V3, GLM-5, Qwen3.5-397B-A17B), a GPU (H100, H200, B200) and a
layout, from roofline terms at the kernel libraries' published achieved rates, DeepEP's published
exchange times and DeepSeek's two-micro-batch schedule (`tools/ep/ep_cost.py`) and a routing trace
(`tools/ep/ep_balance.py`).

    python tools/ep/ep_sim.py --model deepseek-v3 --hw h100 --ep 72 --dp-attention --eplb 32 --overlap \\
        --mtp 1 --accept 0.85 [--batch 256] [--context 2000] [--sweep 8,16,...] [--json-out F] [--plot F]
    python tools/ep/ep_sim.py --reproduce-sglang   # SGLang's 96-H100 decode figure, DeepSeek's profile, EP 8 today
    python tools/ep/ep_sim.py --grid --json-out F.json --plot F.png   # the measurements of docs/design.md §4.1

`--dp-attention`: data-parallel attention with the all-to-all expert exchange (otherwise today's
tensor-parallel attention over all EP ranks); `--eplb R`: EPLB with R redundant experts;
`--overlap`: two-batch overlap (with --dp-attention); `--mtp K --accept a[,b...]`: K drafts at per-position acceptance;
`--load X`: a measured max/mean expert load instead of the trace's. Prints a table (one row per
batch of `--sweep`: step, exposed exchange, what the imbalance adds, tokens/s a node and what limits
the step: compute, hbm or network) and, with `--plot`, tokens/s per node against sequences per GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ep_balance  # noqa: E402
import ep_cost  # noqa: E402,F401
from ep_cost import (COLLECTIVE_FLOOR_S, DEEPEP_LOW_LATENCY_US, EFFICIENCY, Layout, alltoall_bytes,  # noqa: E402,F401
                     allreduce_bytes, exchange_us, expert_load, memory_per_rank, run, simulate)
from ep_models import HARDWARE, MODELS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


SGLANG_96_H100 = dict(
    # LMSYS blog, May 5 2025, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism
    # on 96 H100 GPUs" (lmsys.org/blog/2025-05-05-large-scale-ep), decode table: 9 nodes (EP72, DP
    # attention, DeepEP low-latency, two-batch overlap), batch 256 a device, KV length 2,000, no MTP:
    # 22,282 output tokens/s per node. Redundant experts 32 and --cuda-graph-bs 256 from the reproduction
    # command the blog links (github.com/sgl-project/sglang/issues/6017).
    layout=Layout(ep=72, batch=256, context=2000, dp_attention=True, eplb=32, overlap=True),
    tok_s_per_node=22282.0,
    # The same blog's two-batch-overlap ablation (decode, "Real Test Cases"): "The speedup reaches 25.5%
    # at 256 tokens with a performance of 22,310 tokens per second", so without overlap 22,310 / 1.255;
    # "-27% at 32 tokens/device"; the gain turns positive "between 64 and 128".
    no_overlap_tok_s_per_node=22310.0 / 1.255, overlap_gain_at=((32, 1 - 0.27), (256, 1.255)),
)


DEEPSEEK_PROFILE = dict(
    # The same blog's decode table, "DeepSeek Profile" column, from github.com/deepseek-ai/profile-data
    # (decode: EP128, batch 128 requests a GPU, 4K prompts, two micro-batches; "we simulate an
    # absolutely balanced MoE routing strategy for profiling"): 18,598 tokens/s per node. The blog sets
    # it beside its own "simulated MTP" run that processes "128 requests to generate 256 tokens per
    # decode step", so the profile is read as one MTP draft a request with both tokens counted
    # (acceptance 1); the same layout without MTP is predicted too.
    layout=Layout(ep=128, batch=128, context=4096, dp_attention=True, eplb=0, overlap=True, mtp=1, accept=(1.0,)),
    load=1.0, tok_s_per_node=18598.0,
)


def reproduce_sglang(trace: Path = ep_balance.DEFAULT_TRACE) -> dict:
    """SGLang's layout with and without two-batch overlap, DeepSeek's decode profile, and today's
    tensor-parallel attention on one 8-GPU node of H100 (where DeepSeek-V3's FP8 weights alone
    exceed 80 GB a GPU: `fits` is false) and of H200."""
    model, h100 = MODELS["deepseek-v3"], HARDWARE["h100"]
    layout = SGLANG_96_H100["layout"]
    theirs = run(model, h100, layout, trace)
    serial = run(model, h100, replace(layout, overlap=False), trace)
    gains = [{"batch": b, "published": g,
              "predicted": simulate(model, h100, replace(layout, batch=b), trace)["tok_s_per_node"]
              / simulate(model, h100, replace(layout, batch=b, overlap=False), trace)["tok_s_per_node"]}
             for b, g in SGLANG_96_H100["overlap_gain_at"]]
    today = [run(model, HARDWARE[hw], Layout(ep=8, batch=b, context=2000), trace)
             for hw in ("h100", "h200") for b in (4, 8, 16, 32, 64)]
    base = DEEPSEEK_PROFILE["layout"]
    profile = [run(model, h100, replace(base, mtp=k, accept=base.accept[:k]), trace, DEEPSEEK_PROFILE["load"])
               for k in (base.mtp, 0)]
    return {"sglang_layout": theirs, "published_tok_s_per_node": SGLANG_96_H100["tok_s_per_node"],
            "ratio": theirs["tok_s_per_node"] / SGLANG_96_H100["tok_s_per_node"],
            "sglang_no_overlap": serial,
            "published_no_overlap_tok_s_per_node": SGLANG_96_H100["no_overlap_tok_s_per_node"],
            "no_overlap_ratio": serial["tok_s_per_node"] / SGLANG_96_H100["no_overlap_tok_s_per_node"],
            "overlap_gains": gains, "today_tp_attention_ep8": today,
            "deepseek_profile": profile, "deepseek_profile_tok_s_per_node": DEEPSEEK_PROFILE["tok_s_per_node"],
            "deepseek_profile_ratios": [r["tok_s_per_node"] / DEEPSEEK_PROFILE["tok_s_per_node"] for r in profile]}


COLUMNS = ("layout", "model", "hw", "ep", "batch", "context", "dp_attention", "eplb", "overlap", "mtp",
           "load_max_over_mean",
           "step_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "imbalance_ms", "tok_s_per_node", "limit",
           "weights_gb", "cache_gb", "fits")


def print_table(rows: list[dict]) -> None:
    def fmt(v: object) -> str:
        return f"{v:.1f}" if isinstance(v, float) else "-" if v is None else str(v)
    cells = [[fmt(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def print_reproduction(rep: dict) -> None:
    """The predicted / published ratios of `reproduce_sglang`, one line each."""
    print("DeepSeek's balanced-routing decode profile: predicted / published "
          + ", ".join(f"{r:.3f}" for r in rep["deepseek_profile_ratios"]) + " (one draft counted as 2 tokens; no MTP)")
    print("SGLang two-batch overlap gain, predicted / published: "
          + ", ".join(f"batch {g['batch']} {g['predicted']:.3f} / {g['published']:.3f}" for g in rep["overlap_gains"]))
    print(f"SGLang layout without overlap predicted {rep['sglang_no_overlap']['tok_s_per_node']:.0f} tok/s per node, "
          f"published {rep['published_no_overlap_tok_s_per_node']:.0f}: ratio {rep['no_overlap_ratio']:.3f}")
    print(f"SGLang layout predicted {rep['sglang_layout']['tok_s_per_node']:.0f} tok/s per node, published "
          f"{rep['published_tok_s_per_node']:.0f}: ratio {rep['ratio']:.3f}")


def plot(series: dict[str, list[dict]], path: Path, title: str,
         published: tuple[tuple[str, float, float], ...] = ()) -> None:
    """Tokens/s per node against batch per rank, one line per layout, and published measurements
    (label, batch, tokens/s per node) as stars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rows in series.items():
        ax.plot([r["batch"] for r in rows], [r["tok_s_per_node"] for r in rows], marker="o", label=label)
        over = [r for r in rows if not r["fits"]]
        if over:
            ax.scatter([r["batch"] for r in over], [r["tok_s_per_node"] for r in over], marker="x", color="black",
                       s=60, zorder=3)
    for (label, batch, tok_s), color in zip(published, ("gold", "white")):
        ax.scatter([batch], [tok_s], marker="*", s=220, color=color, edgecolor="black", zorder=4, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences per GPU (black x: weights + cache exceed the GPU's memory)")
    ax.set_ylabel("output tokens/s per node (predicted)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The embedded model's measured MTP acceptance (bench/records/depth_by_width_f32_ae5390e.json: one draft,
# p1 0.8201) and DeepSeek's published second-token acceptance, 85-90% (DeepSeek-V3 technical report,
# arXiv 2412.19437, section 5.4.3). With two drafts the same record measures p1 0.7948 and an accept
# length of 2.403, so the second position's conditional acceptance is (2.403 - 1 - 0.7948) / 0.7948.
ACCEPT_EMBEDDED, ACCEPT_DEEPSEEK = 0.8201, (0.85, 0.90)
ACCEPT_EMBEDDED_2 = (0.7948, (2.403 - 1 - 0.7948) / 0.7948)


def grid_layouts(ep: int) -> dict[str, Layout]:
    """The layouts measured at each EP size: today's (32 sequences a GPU), and DP attention (128)
    with and without EPLB (32 redundant experts), two-batch overlap and one MTP draft at the
    embedded model's and DeepSeek's published acceptances; and two drafts at the embedded model's."""
    dp = Layout(ep=ep, batch=128, context=2000, dp_attention=True)
    out = {"today tp-attn b32": Layout(ep=ep, batch=32, context=2000)}
    for eplb in (None, 32):
        for overlap in (False, True):
            base = replace(dp, eplb=eplb, overlap=overlap)
            label = "dp" + ("+eplb" if eplb else "") + ("+tbo" if overlap else "")
            out[label] = base
            for a in (ACCEPT_EMBEDDED, *ACCEPT_DEEPSEEK):
                out[f"{label}+mtp1 a{a:.2f}"] = replace(base, mtp=1, accept=(a,))
    out["dp+eplb+tbo+mtp2 embedded"] = replace(dp, eplb=32, overlap=True, mtp=2, accept=ACCEPT_EMBEDDED_2)
    return out


SUMMARY = (("today", "today tp-attn b32"), ("DP", "dp"), ("+EPLB", "dp+eplb"), ("+TBO", "dp+tbo"),
           ("+EPLB+TBO", "dp+eplb+tbo"), ("+EPLB+MTP .85", "dp+eplb+mtp1 a0.85"),
           ("+EPLB+TBO+MTP .82", "dp+eplb+tbo+mtp1 a0.82"), ("+EPLB+TBO+MTP .85", "dp+eplb+tbo+mtp1 a0.85"),
           ("+EPLB+TBO+MTP .90", "dp+eplb+tbo+mtp1 a0.90"), ("+EPLB+TBO+MTP2 .79/.77", "dp+eplb+tbo+mtp2 embedded"))


def summary_markdown(rows: list[dict]) -> str:
    """The grid as one markdown row per model, GPU and EP size: tokens/s a node in the `SUMMARY`
    layouts (* where weights and cache exceed the GPU's memory, "-" where refused), and what limits
    the full layout (EPLB + overlap + MTP at 0.85): ms a step by limit and what the imbalance adds."""
    def cell(r: dict | None) -> str:
        if r is None or "refused" in r:
            return "-"
        return f"{r['tok_s_per_node'] / 1e3:.1f}k" + ("" if r["fits"] else "*")
    index = {(r["model"], r["hw"], r["ep"], r["layout"]): r for r in rows}
    head = ["model", "GPU", "EP", *(h for h, _ in SUMMARY), "limits, full layout (ms a step)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, hw, ep in dict.fromkeys((r["model"], r["hw"], r["ep"]) for r in rows):
        full = index.get((model, hw, ep, "dp+eplb+tbo+mtp1 a0.85"))
        lim = "-" if full is None or "refused" in full else (
            f"{full['limit']}: " + ", ".join(f"{k} {v:.0f}" for k, v in full["ms_by_limit"].items())
            + f"; imbalance +{full['imbalance_ms']:.1f}")
        out.append("| " + " | ".join([model, hw.upper(), str(ep), *(cell(index.get((model, hw, ep, label)))
                                                                      for _, label in SUMMARY), lim]) + " |")
    return "\n".join(out)


def measure_grid(trace: Path = ep_balance.DEFAULT_TRACE) -> list[dict]:
    """DeepSeek-V3 and GLM-5 on H100 and H200 at EP 8, 32, 72, 96 in every `grid_layouts` layout;
    a layout the model cannot take is a row with its refusal."""
    rows = []
    for name in ("deepseek-v3", "glm-5"):
        for hw in ("h100", "h200"):
            for ep in (8, 32, 72, 96):
                for label, layout in grid_layouts(ep).items():
                    try:
                        row = run(MODELS[name], HARDWARE[hw], layout, trace)
                    except ValueError as exc:
                        row = {"model": name, "hw": hw, "ep": ep, "refused": str(exc)}
                    rows.append({"layout": label, **row})
    return rows


def batch_series(trace: Path = ep_balance.DEFAULT_TRACE) -> dict[str, list[dict]]:
    """Tokens/s per node against batch per GPU for the plot: DeepSeek-V3 at SGLang's scale and
    today's layout on one node."""
    batches = (8, 16, 32, 64, 128, 256, 512)
    base = Layout(ep=72, batch=1, context=2000, dp_attention=True, eplb=32)
    series = {"h100 ep72 dp+eplb": base, "h100 ep72 dp+eplb+tbo": replace(base, overlap=True),
              "h100 ep72 dp+eplb+tbo+mtp1 a0.85": replace(base, overlap=True, mtp=1, accept=(0.85,)),
              "h200 ep72 dp+eplb+tbo": replace(base, overlap=True)}
    out = {label: [run(MODELS["deepseek-v3"], HARDWARE[label.split()[0]], replace(layout, batch=b), trace)
                   for b in batches] for label, layout in series.items()}
    for hw in ("h100", "h200"):
        out[f"{hw} ep8 today tp-attn"] = [run(MODELS["deepseek-v3"], HARDWARE[hw], Layout(ep=8, batch=b, context=2000),
                                              trace) for b in batches]
    return out


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="deepseek-v3", help=f"one of {', '.join(MODELS)}")
    ap.add_argument("--hw", default="h100", help=f"one of {', '.join(HARDWARE)}")
    ap.add_argument("--ep", type=int, default=8, help="GPUs in the EP group")
    ap.add_argument("--dp-attention", action="store_true", help="data-parallel attention + all-to-all experts")
    ap.add_argument("--eplb", type=int, default=None, metavar="R", help="EPLB placement with R redundant experts")
    ap.add_argument("--overlap", action="store_true", help="two-batch overlap")
    ap.add_argument("--mtp", type=int, default=0, help="MTP drafts a step")
    ap.add_argument("--accept", default="", help="acceptance per draft position (one value repeats)")
    ap.add_argument("--batch", type=int, default=256, help="sequences per GPU")
    ap.add_argument("--context", type=int, default=2000, help="tokens of context a sequence")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--peak", action="store_true", help="bare roofline: no published efficiency fractions")
    ap.add_argument("--load", type=float, default=None, help="max/mean rank load of the routed experts "
                    "(instead of the one measured on --trace): a what-if for a measured production imbalance")
    ap.add_argument("--trace", type=Path, default=ep_balance.DEFAULT_TRACE, help="routing trace (tools/ep/ep_balance.py)")
    ap.add_argument("--sweep", default="", help="comma list of batches per GPU: a table and a plot over them")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of tokens/s per node against batch (with --sweep)")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--reproduce-sglang", action="store_true", help="SGLang's 96-H100 decode figure, and EP 8 today")
    ap.add_argument("--grid", action="store_true", help="DeepSeek-V3 and GLM-5, H100 and H200, EP 8/32/72/96, "
                    "every layout; with --json-out and --plot")
    args = ap.parse_args(argv)
    try:
        if args.reproduce_sglang:
            rep = reproduce_sglang(args.trace)
            print_table([rep["sglang_layout"], rep["sglang_no_overlap"], *rep["today_tp_attention_ep8"],
                         *rep["deepseek_profile"]])
            print_reproduction(rep)
            if args.json_out:
                args.json_out.parent.mkdir(parents=True, exist_ok=True)
                args.json_out.write_text(json.dumps(rep, indent=1) + "\n")
            return 0
        if args.grid:
            return _write_grid(args)
        if args.model not in MODELS:
            raise ValueError(f"unknown model {args.model!r} (expected one of {', '.join(MODELS)})")
        if args.hw not in HARDWARE:
            raise ValueError(f"unknown hardware {args.hw!r} (expected one of {', '.join(HARDWARE)})")
        accept = _floats(args.accept)
        if len(accept) == 1 and args.mtp > 1:
            accept = accept * args.mtp
        base = Layout(ep=args.ep, batch=args.batch, context=args.context, dp_attention=args.dp_attention,
                      eplb=args.eplb, overlap=args.overlap, mtp=args.mtp, accept=accept,
                      kv_bytes=1 if args.kv_dtype == "fp8" else 2, peak=args.peak)
        model, hw = MODELS[args.model], HARDWARE[args.hw]
        batches = [int(b) for b in args.sweep.split(",") if b.strip()] or [args.batch]
        rows = [run(model, hw, replace(base, batch=b), args.trace, args.load) for b in batches]
    except ValueError as exc:
        ap.error(str(exc))
    print_table(rows)
    if args.plot:
        plot({f"{args.model} {args.hw} EP{args.ep}": rows}, args.plot, " ".join(sys.argv[1:]))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    return 0


def _write_grid(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    from bench.report import provenance
    start = provenance()
    rows, series, rep = measure_grid(args.trace), batch_series(args.trace), reproduce_sglang(args.trace)
    print_table([r for r in rows if "refused" not in r])
    for r in rows:
        if "refused" in r:
            print(f"{r['model']} {r['hw']} EP{r['ep']} {r['layout']}: refused: {r['refused']}")
    print(summary_markdown(rows))
    print_reproduction(rep)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({**start, "trace": str(Path(args.trace).name), "efficiency": EFFICIENCY,
                                             "collective_floor_us": COLLECTIVE_FLOOR_S * 1e6, "grid": rows,
                                             "batch_series": series, "sglang": rep}, indent=1) + "\n")
    if args.plot:
        layout = SGLANG_96_H100["layout"]
        plot(series, args.plot, "DeepSeek-V3 decode, 2,000-token context: predicted tokens/s per node",
             (("SGLang, 72 H100 decode, overlap (published)", layout.batch, SGLANG_96_H100["tok_s_per_node"]),
              ("SGLang, no overlap (published +25.5% gain)", layout.batch,
               SGLANG_96_H100["no_overlap_tok_s_per_node"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
