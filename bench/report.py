"""What `metrale bench` writes beside its cells: the machine, the commit, the table and the plot."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import torch


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.machine(), "cpus": torch.get_num_threads(),
            "python": sys.version.split()[0], "torch": torch.__version__}


def verify_key_settings() -> dict:
    """The canonical-order knobs this process read (METRALE_CANONICAL_KEY_MIN_WIDTH, ..._NO_CANONICAL_...)."""
    from speculative import knobs
    return {"canonical_key_min_width": knobs.canonical_key_min_width(),
            "no_canonical_verify_key": knobs.no_canonical_verify_key()}


def print_table(cells: list[dict]) -> None:
    cols = ["arm", "concurrency", "tok_s", "accept_len", "p1", "p2_uncond", "verifies", "ttft_p50_ms",
            "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms"]
    rows = [[("-" if c[k] is None else str(c[k])) for k in cols] for c in cells]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(cols)]
    print("  ".join(h.rjust(w) for h, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def plot(cells: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(dict.fromkeys(c["arm"] for c in cells)):
        mine = sorted((c for c in cells if c["arm"] == arm), key=lambda c: c["concurrency"])
        xs = [c["concurrency"] for c in mine]
        color = colors[i % len(colors)]  # the same arm has the same colour in both panels
        ax1.plot(xs, [c["tok_s"] for c in mine], marker="o", label=arm, color=color)
        if any(c["accept_len"] is not None for c in mine):
            ax2.plot(xs, [c["accept_len"] or float("nan") for c in mine], marker="o", label=arm, color=color)
    for ax, label in ((ax1, "output tokens/s"), (ax2, "accept_len (1 + mean accepted)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax2.set_title("acceptance (speculating arms)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

