"""What `metrale bench` writes beside its cells: the machine, the commit, the table and the plot."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from bench.cells import paired_text, ratio_text


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance() -> dict:
    """What produced a record: the commit, whether the tree had changes to tracked files or new
    untracked (not ignored) files, and the command line. Read when a run starts."""
    status = _git("status", "--porcelain", "--untracked-files=normal")
    return {"git_sha": _git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
            "dirty_files": [] if not status else [line[3:] for line in status.splitlines()][:20],
            "command": " ".join(sys.argv)}


def check_provenance(start: dict) -> dict:
    """The same reading at the end of a run: a changed commit or tree means the record may not
    come from the code its start names (reported, and printed as a warning)."""
    end = provenance()
    changed = end["git_sha"] != start["git_sha"] or end["dirty"] != start["dirty"] \
        or end["dirty_files"] != start["dirty_files"]
    if changed:
        print(f"WARNING: the tree changed during the run (start {start['git_sha']} dirty={start['dirty']}, "
              f"end {end['git_sha']} dirty={end['dirty']})", flush=True)
    return {"git_sha_at_end": end["git_sha"], "dirty_at_end": end["dirty"], "changed_during_run": changed}


def machine() -> dict:
    """The machine: its real CPU count (and the CPUs this process may use), not torch's threads."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "processor": platform.machine(), "cpu_count": os.cpu_count(),
            "usable_cpus": usable, "python": sys.version.split()[0], "torch": torch.__version__}


def verify_key_settings() -> dict:
    """The canonical-order knobs this process read (METRALE_CANONICAL_KEY_MIN_WIDTH, ..._NO_CANONICAL_...)."""
    from speculative import knobs
    return {"canonical_key_min_width": knobs.canonical_key_min_width(),
            "no_canonical_verify_key": knobs.no_canonical_verify_key()}


def print_table(cells: list[dict]) -> None:
    """One row per cell: the median run's tokens/s with the [min - max] of its repeats, the
    ratio to the best fixed arm ("tie" when their runs overlap) and the paired one (repeat by
    repeat: `bench.cells.paired`)."""
    cols = ["arm", "conc", "tok_s", "tok_s [min - max]", "vs best fixed", "paired", "accept_len", "drafts/verify",
            "cap", "p1", "p2_uncond", "requests", "ttft_p50_ms", "tpot_p50_ms", "grammar_ms/step"]

    def row(c: dict) -> list[str]:
        spread = f"[{c['tok_s_min']:.1f} - {c['tok_s_max']:.1f}]" if "tok_s_min" in c else "-"
        vals = [c["arm"], c["concurrency"], f"{c['tok_s']:.1f}", spread, ratio_text(c), paired_text(c), c.get("accept_len"),
                c.get("drafts_per_verify"), c.get("width_cap"), c.get("p1"), c.get("p2_uncond"), c.get("requests"),
                c.get("ttft_p50_ms"), c.get("tpot_p50_ms"), c.get("grammar_ms_per_step")]
        return ["-" if v is None else str(v) for v in vals]

    rows = [row(c) for c in cells]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(cols)]
    print("  ".join(h.rjust(w) for h, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def _baseline(arm: str) -> str:
    """The `none` cell an arm's speedup divides by: none of the same request kind (k3/json -> none/json)."""
    kind = arm.partition("/")[2]
    return "none" + (f"/{kind}" if kind else "")


def figure(cells: list[dict], title: str):
    """Tokens/s per arm over concurrency (the median run, bars from the slowest to the fastest
    repeat), the speedup of every other arm against `none` at each concurrency (when `none` ran),
    and acceptance of the speculating arms; the x ticks are the concurrencies measured."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator
    arms = list(dict.fromkeys(c["arm"] for c in cells))
    tok_s = {(c["arm"], c["concurrency"]): c["tok_s"] for c in cells}
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(16, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(arms):
        mine = sorted((c for c in cells if c["arm"] == arm), key=lambda c: c["concurrency"])
        xs = [c["concurrency"] for c in mine]
        ys = [c["tok_s"] for c in mine]
        lo = [y - c.get("tok_s_min", y) for y, c in zip(ys, mine)]
        hi = [c.get("tok_s_max", y) - y for y, c in zip(ys, mine)]
        color = colors[i % len(colors)]  # the same arm has the same colour in every panel
        ax1.errorbar(xs, ys, yerr=[lo, hi], marker="o", label=arm, color=color, capsize=3)
        base = _baseline(arm)
        pairs = [(x, y / tok_s[(base, x)]) for x, y in zip(xs, ys) if tok_s.get((base, x))]
        if arm != base and pairs:
            ax3.plot([x for x, _ in pairs], [r for _, r in pairs], marker="o", label=arm, color=color)
        if any(c["accept_len"] is not None for c in mine):
            ax2.plot(xs, [c["accept_len"] or float("nan") for c in mine], marker="o", label=arm, color=color)
    levels = sorted({c["concurrency"] for c in cells})
    for ax, label in ((ax1, "output tokens/s (median; bars: min-max of repeats)"),
                      (ax3, "tokens/s / none's tokens/s"), (ax2, "accept_len (1 + mean accepted)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(levels))      # only the concurrencies measured
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    ax3.axhline(1.0, color="grey", linewidth=1, linestyle="--")
    ax3.set_title("speedup against none")
    if not ax3.get_legend_handles_labels()[0]:
        ax3.text(0.5, 0.5, "no none arm to divide by", ha="center", va="center", transform=ax3.transAxes)
    if not ax2.get_legend_handles_labels()[0]:
        ax2.text(0.5, 0.5, "no speculating arm", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_title("acceptance (speculating arms)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(cells: list[dict], path: Path, title: str) -> None:
    """`figure`, written to `path` as a PNG."""
    import matplotlib.pyplot as plt
    fig = figure(cells, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
