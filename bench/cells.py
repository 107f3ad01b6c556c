"""A benchmark cell from its repeated runs, and the ratios between arms, with their spread.

A cell (one arm at one concurrency) is its median run (by tokens/s; the lower middle one for an
even count) with the min / median / max tokens/s of every run beside it. A ratio between two
cells comes with its range (worst run against best run and back); when the two cells' runs
overlap, the ratio is a tie: the noise between runs is as large as the difference.

The arms take turns within each repeat, so a run of one arm and the same repeat's run of
another are minutes apart at most; a shared host's speed drifts over longer spans (the same arm's
runs spread up to 1.5x on the suite's 2-core machine). The paired ratio divides them repeat by
repeat, so that drift touches both sides alike: its median and range, and whether every repeat
put the same arm ahead.
"""
from __future__ import annotations

import re
from statistics import median

FIXED_ARM = re.compile(r"^(none|k\d+)(-eager)?$")   # a fixed depth: no speculation, or k drafts at every width


def summarize(runs: list[dict]) -> dict:
    """The median run of `runs` with the spread of tokens/s over all of them."""
    if not runs:
        raise ValueError("a cell needs at least one run")
    ranked = sorted(runs, key=lambda c: c["tok_s"])
    cell = dict(ranked[(len(ranked) - 1) // 2])
    rates = [r["tok_s"] for r in runs]
    cell["tok_s_runs"] = rates
    cell["tok_s_min"], cell["tok_s_median"], cell["tok_s_max"] = min(rates), round(median(rates), 2), max(rates)
    cell["repeats"] = len(runs)
    return cell


def overlaps(a: dict, b: dict) -> bool:
    """Do the tokens/s ranges of two cells' runs overlap?"""
    return a["tok_s_min"] <= b["tok_s_max"] and b["tok_s_min"] <= a["tok_s_max"]


def ratio(a: dict, b: dict) -> dict:
    """a's tokens/s over b's: the medians' ratio, its range over the runs, and whether it is a tie."""
    return {"ratio": round(a["tok_s"] / b["tok_s"], 3),
            "range": [round(a["tok_s_min"] / b["tok_s_max"], 3), round(a["tok_s_max"] / b["tok_s_min"], 3)],
            "tie": overlaps(a, b)}


def paired(a: dict, b: dict) -> dict | None:
    """a's runs over b's, repeat by repeat (`tok_s_runs` keep the repeats' order): the median and
    range of those ratios, and `consistent` when every repeat puts the same arm ahead. None when
    either cell lacks its runs or their counts differ."""
    ra, rb = a.get("tok_s_runs"), b.get("tok_s_runs")
    if not ra or not rb or len(ra) != len(rb):
        return None
    rs = sorted(x / y for x, y in zip(ra, rb))
    return {"median": round(median(rs), 3), "range": [round(rs[0], 3), round(rs[-1], 3)],
            "consistent": rs[0] > 1 or rs[-1] < 1}


def add_ratios(cells: list[dict], first_arm: str) -> None:
    """Per concurrency: every cell's ratio to the first arm's cell, and every cell's ratio to the
    best fixed-depth arm present of the same request kind (none, k1, k2, ...: the highest median
    tokens/s among them; a fixed arm is compared with the best of the others)."""
    for c in {x["concurrency"] for x in cells}:
        level = [x for x in cells if x["concurrency"] == c]
        base = next(x for x in level if x["arm"] == first_arm)
        for cell in level:
            fixed = [x for x in level if FIXED_ARM.match(x["arm"].split("/")[0])
                     and x.get("request_kind") == cell.get("request_kind")]
            r = ratio(cell, base)
            cell[f"tok_s_ratio_vs_{first_arm}"] = r["ratio"]
            cell[f"tok_s_ratio_vs_{first_arm}_range"] = r["range"]
            if (p := paired(cell, base)) is not None:
                cell[f"tok_s_paired_vs_{first_arm}"] = p
            others = [x for x in fixed if x is not cell]
            if not others:
                continue
            best = max(others, key=lambda x: x["tok_s"])
            r = ratio(cell, best)
            cell["best_fixed_arm"] = best["arm"]
            cell["tok_s_ratio_vs_best_fixed"] = r["ratio"]
            cell["tok_s_ratio_vs_best_fixed_range"] = r["range"]
            cell["tie_with_best_fixed"] = r["tie"]
            if (p := paired(cell, best)) is not None:
                cell["tok_s_paired_vs_best_fixed"] = p


def ratio_text(cell: dict) -> str:
    """'1.053 vs k2', 'tie vs k2' when the runs overlap, or '-' without a fixed arm to compare."""
    if "tok_s_ratio_vs_best_fixed" not in cell:
        return "-"
    word = "tie" if cell["tie_with_best_fixed"] else f"{cell['tok_s_ratio_vs_best_fixed']:.3f}"
    return f"{word} vs {cell['best_fixed_arm']}"


def paired_text(cell: dict) -> str:
    """'1.062 [1.01-1.12]' (the paired ratio to the best fixed arm, its range over the repeats;
    '*' when every repeat put the same arm ahead), or '-'."""
    p = cell.get("tok_s_paired_vs_best_fixed")
    if p is None:
        return "-"
    return f"{p['median']:.3f} [{p['range'][0]:.2f}-{p['range'][1]:.2f}]{'*' if p['consistent'] else ''}"
