"""One `metrale bench` command run alternately from two checkouts (a tree before a change and
after it, each with its own code on PYTHONPATH), paired run by run: one record of both.

    python tools/bench_pairs.py --before old_1.json,old_2.json --after new_1.json,new_2.json \\
        --before-name 6eda1b9 --json-out bench/records/NAME.json --plot-out bench/records/NAME.png

Run i of `--before` and run i of `--after` were made one after the other, so their ratio is
paired; each side's cells become the arm `ARM@NAME` with one run per record (median, min, max over
the runs, as the bench's repeats). Per arm and concurrency the record gives the paired ratio
after / before, and, where the runs hold a reference arm (`--reference`, unchanged by the
change), each run's ratio to it, after against before: a figure that cancels the host's drift
between the two runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load(paths: str) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths.split(",")]


def side_cells(records: list[dict], name: str) -> list[dict]:
    """Each (arm, concurrency) of the records as one cell of `len(records)` runs, named ARM@NAME."""
    from bench.cells import summarize
    keys = list(dict.fromkeys((c["arm"], c["concurrency"]) for c in records[0]["cells"]))
    out = []
    for arm, conc in keys:
        runs = [next(c for c in r["cells"] if (c["arm"], c["concurrency"]) == (arm, conc)) for r in records]
        cell = summarize([{k: v for k, v in c.items() if not k.startswith("tok_s_")} for c in runs])
        cell["arm"] = f"{arm}@{name}"
        cell["accept_len_runs"] = [c.get("accept_len") for c in runs]
        out.append(cell)
    return out


def pair(before: list[dict], after: list[dict], before_name: str, after_name: str, reference: str | None) -> list[dict]:
    from bench.cells import paired
    cells = {(c["arm"], c["concurrency"]): c for c in before + after}
    out = []
    for (arm, conc), a in cells.items():
        if not arm.endswith(f"@{after_name}"):
            continue
        base = arm[:-len(after_name) - 1]
        b = cells[(f"{base}@{before_name}", conc)]
        row = {"arm": base, "concurrency": conc, "after_tok_s": a["tok_s"], "before_tok_s": b["tok_s"],
               "paired_after_over_before": paired(a, b)}
        ref_a, ref_b = cells.get((f"{reference}@{after_name}", conc)), cells.get((f"{reference}@{before_name}", conc))
        if reference and base != reference and ref_a and ref_b:
            ra = [x / y for x, y in zip(a["tok_s_runs"], ref_a["tok_s_runs"])]
            rb = [x / y for x, y in zip(b["tok_s_runs"], ref_b["tok_s_runs"])]
            row[f"over_{reference}"] = {"after": round(median(ra), 3), "before": round(median(rb), 3),
                                        "after_over_before": round(median(x / y for x, y in zip(ra, rb)), 3)}
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="comma list of the before tree's bench records, in run order")
    p.add_argument("--after", required=True, help="comma list of the after tree's records, run i right after before's i")
    p.add_argument("--before-name", required=True)
    p.add_argument("--after-name", required=True)
    p.add_argument("--reference", default=None, help="an arm the change leaves alone (each run's ratios to it)")
    p.add_argument("--json-out", required=True)
    p.add_argument("--plot-out", default=None)
    args = p.parse_args(argv)
    before, after = load(args.before), load(args.after)
    if len(before) != len(after):
        raise SystemExit(f"--before has {len(before)} records, --after {len(after)}: they pair run by run")
    bc, ac = side_cells(before, args.before_name), side_cells(after, args.after_name)
    pairs = pair(bc, ac, args.before_name, args.after_name, args.reference)
    for row in pairs:
        print(json.dumps(row), flush=True)
    keep = ("git_sha", "command", "recorded_at", "dirty")
    record = {"model": after[0]["model"], "command": " ".join(sys.argv),
              "before": [{k: r.get(k) for k in keep} for r in before],
              "after": [{k: r.get(k) for k in keep} for r in after],
              "machine": after[0].get("machine"), "host": after[0].get("host"), "params": after[0].get("params"),
              "pairs": pairs, "cells": bc + ac}
    Path(args.json_out).write_text(json.dumps(record, indent=1))
    if args.plot_out:
        from bench.report import plot
        plot(bc + ac, Path(args.plot_out), f"{args.before_name} (before) against {args.after_name}, paired runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
