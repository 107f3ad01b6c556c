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
    caches = [r["prefix_cache"] for r in runs if r.get("prefix_cache")]
    if caches:   # every run's lookups, not the median run's alone
        prompt, hit = sum(x["prompt_tokens"] for x in caches), sum(x["hit_tokens"] for x in caches)
        cell["prefix_cache"] = {"policy": caches[0]["policy"], "prompt_tokens": prompt, "hit_tokens": hit,
                                "hit_rate": round(hit / prompt, 4) if prompt else None}
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


# Peer arms by depth: vLLM's (vllm: no speculation, vllm-mtpK: K MTP drafts) and transformers'
# (hf: its best set-up, hf-eager: eager generate for reference). Ours: the fixed depths none, k1..k4.
OURS_DEPTH = re.compile(r"^(?:none|k([1-4]))$")
PEER_ARMS = {"vllm": re.compile(r"^vllm(?:-mtp([1-4]))?$"), "hf": re.compile(r"^hf(-eager)?$")}


def _depth(pattern: re.Pattern, arm: str) -> int | None:
    m = pattern.match(arm)
    return None if m is None else int(m.group(1)) if (m.group(1) or "").isdigit() else 0


def peer_ratios(cells: list[dict], peer: str) -> list[dict]:
    """Ours against a peer (`vllm` or `hf`) at each concurrency, each pair with its range over the
    runs and its paired ratio: `best` (our best of none, k1..k4 against the peer's best arm that
    ran: every depth of both sides), for vLLM `best mtp` (the best drafting depth of each side) and
    the per-depth pairs (none/vllm, kK/vllm-mtpK), for transformers `none` (none against hf at its
    best) and `eager` (none-eager against hf-eager: neither compiled)."""
    pattern = PEER_ARMS[peer]
    out = []
    for c in sorted({x["concurrency"] for x in cells}):
        level = [x for x in cells if x["concurrency"] == c]
        ours = {d: x for x in level if (d := _depth(OURS_DEPTH, x["arm"])) is not None}
        theirs = [x for x in level if pattern.match(x["arm"])]
        pairs = [("best", list(ours.values()), theirs)]
        if peer == "vllm":
            pairs.append(("best mtp", [x for d, x in ours.items() if d], [x for x in theirs if _depth(pattern, x["arm"])]))
            for d in sorted(ours):
                pairs.append(("none" if d == 0 else f"k{d}", [ours[d]], [x for x in theirs if _depth(pattern, x["arm"]) == d]))
        else:
            pairs.append(("none", [ours[0]] if 0 in ours else [], [x for x in theirs if x["arm"] == "hf"]))
            pairs.append(("eager", [x for x in level if x["arm"] == "none-eager"],
                          [x for x in theirs if x["arm"] == "hf-eager"]))
        for label, a, b in pairs:
            if not a or not b:
                continue
            best_a, best_b = max(a, key=lambda x: x["tok_s"]), max(b, key=lambda x: x["tok_s"])
            r = ratio(best_a, best_b)
            out.append({"concurrency": c, "pair": label, "ours": best_a["arm"], "theirs": best_b["arm"],
                        "ours_tok_s": best_a["tok_s"], "theirs_tok_s": best_b["tok_s"],
                        "ours_accept_len": best_a.get("accept_len"), "theirs_accept_len": best_b.get("accept_len"),
                        "ratio": r["ratio"], "range": r["range"], "tie": r["tie"], "paired": paired(best_a, best_b)})
    return out


def peer_text(peer: str, p: dict) -> str:
    """One printed line of a peer ratio."""
    text = (f"vs {peer} c={p['concurrency']} {p['pair']}: {p['ours']} {p['ours_tok_s']:.1f} / {p['theirs']} "
            f"{p['theirs_tok_s']:.1f} = {'tie' if p['tie'] else format(p['ratio'], '.3f')} "
            f"[{p['range'][0]:.2f}-{p['range'][1]:.2f}]")
    if p["ours_accept_len"] is not None or p["theirs_accept_len"] is not None:
        text += f" (accept_len {p['ours_accept_len']} / {p['theirs_accept_len']})"
    if p.get("paired"):
        q = p["paired"]
        text += f", paired {q['median']:.3f} [{q['range'][0]:.2f}-{q['range'][1]:.2f}]"
    return text


def record_ratios(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> list[dict]:
    """Record a's cells over record b's, per (arm, concurrency) both have: refused (ValueError, one
    line) when the records come from different or unrecorded hosts (bench.host.same_host)."""
    from bench.host import same_host
    same_host(a, b, names)
    theirs = {(x["arm"], x["concurrency"]): x for x in b["cells"]}
    out = []
    for x in a["cells"]:
        y = theirs.get((x["arm"], x["concurrency"]))
        if y is not None and "tok_s_min" in x and "tok_s_min" in y:
            out.append({"arm": x["arm"], "concurrency": x["concurrency"], "a_tok_s": x["tok_s"], "b_tok_s": y["tok_s"],
                        **ratio(x, y)})
    return out
