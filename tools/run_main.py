"""`make run`: the project's main job on the embedded model.

Generates continuations of a few code prompts without speculation, with MTP speculation at fixed
depths, with the default depth policy (what `--spec mtp` gets: the model folder's ladder and width
cap), and with the default policy at EP 2 (the experts split over two processes, the sharded
drafter). It prints the text, then each arm's speed and acceptance side by side, then one line
saying why drafting does or does not pay on this machine, from the run's own figures: the share of
drafts accepted, what a drafting step cost against a plain decode step, and the acceptance at
which the two break even.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch import LAUNCHERS, launcher_for  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n",
    "def read_config(path):\n    with open(path, encoding=\"utf-8\") as f:\n",
    "    def __repr__(self):\n        return ",
]
LABEL_WIDTH = 24


@dataclass(slots=True)
class ArmRun:
    """One arm's generation: what it committed and drafted, and its pure decode steps' seconds by width."""
    label: str
    texts: list[str]
    tokens: int
    wall_s: float
    verifies: int
    drafted: int
    accepted: int
    decode_steps: dict[int, list[float]] = field(default_factory=dict)   # width -> seconds of each step

    @property
    def accept_len(self) -> float | None:
        """Tokens committed per sequence per verify (1 + the accepted drafts), None without drafts."""
        return 1 + self.accepted / self.verifies if self.verifies else None

    @property
    def accept_rate(self) -> float | None:
        """The share of drafted tokens the target accepted."""
        return self.accepted / self.drafted if self.drafted else None

    def step_s(self, width: int) -> float | None:
        """The median seconds of a pure decode step (drafting and verify included) at `width` sequences."""
        steps = self.decode_steps.get(width)
        return statistics.median(steps) if steps else None


def generate_timed(llm: LLM, label: str, prompts: list[str], params: SamplingParams) -> ArmRun:
    """`llm.generate(prompts, params)`, timing every step apart: a step where every running sequence
    decodes (no prompt waiting or being prefilled) is recorded under its width."""
    engine = llm.engine
    seqs = [engine.add_request(llm.encode(p), params) for p in prompts]
    steps: dict[int, list[float]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        running = engine.scheduler.running
        decode = not engine.scheduler.waiting and all(s.num_pending == 1 for s in running)
        width = len(running)
        t = time.perf_counter()
        llm.step()
        if decode:
            steps.setdefault(width, []).append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    return ArmRun(label, [s.text for s in seqs], sum(s.num_output for s in seqs), wall,
                  sum(s.num_verifies for s in seqs), sum(s.drafted_tokens for s in seqs),
                  sum(s.accepted_tokens for s in seqs), steps)


def compared_width(plain: ArmRun, arm: ArmRun) -> int | None:
    """The width both arms ran the most pure decode steps at (the widest on a tie), None if none."""
    shared = set(plain.decode_steps) & set(arm.decode_steps)
    if not shared:
        return None
    return max(shared, key=lambda w: (min(len(plain.decode_steps[w]), len(arm.decode_steps[w])), w))


def why_line(label: str, width: int, plain_step_s: float, step_s: float, verifies: int, drafted: int,
             accepted: int) -> str:
    """One line on why drafting does or does not pay, from measured figures: a drafting step
    commits 1 + accepted/verifies tokens a sequence and costs step_s / plain_step_s plain decode
    steps, so it pays when the tokens beat the cost; with `drafted / verifies` drafts a verify, the
    share of drafts accepted that breaks even is (cost - 1) / drafts a verify."""
    if verifies <= 0 or drafted <= 0 or plain_step_s <= 0 or step_s <= 0:
        raise ValueError(f"why_line needs drafts and positive step times (verifies={verifies}, drafted={drafted}, "
                         f"plain_step_s={plain_step_s}, step_s={step_s})")
    cost = step_s / plain_step_s
    tokens = 1 + accepted / verifies
    per_verify = drafted / verifies
    rate = accepted / drafted
    break_even = (cost - 1) / per_verify
    verdict = "pays" if tokens > cost else "does not pay"
    if break_even <= 0:
        reach = "breaks even at any acceptance"
    elif break_even >= 1:
        reach = "breaks even beyond any acceptance"
    else:
        reach = f"breaks even at {break_even:.0%} of drafts accepted"
    return (f"why: {label} had {rate:.0%} of its {per_verify:.1f} drafts a step accepted ({tokens:.2f} tokens a "
            f"step); at {width} sequences a drafting step cost {cost:.2f}x a plain decode step "
            f"({step_s * 1e3:.1f} ms against {plain_step_s * 1e3:.1f}), so drafting {reach} and {verdict} on this "
            f"machine ({tokens / cost:.2f}x expected).")


def no_drafts_line(label: str, llm: LLM, width: int) -> str:
    """Why an arm drafted nothing: the width cap or the ladder it was given."""
    spec = llm.spec
    if width > spec.width_cap:
        return (f"why: {label} drafted nothing: {width} sequences is above its width cap {spec.width_cap} "
                f"(from {spec.width_cap_origin}).")
    return f"why: {label} drafted nothing at {width} sequences (ladder from {spec.ladder_origin})."


def explain(plain: ArmRun, run: ArmRun, llm: LLM) -> str:
    """The why line of `run` (the default policy's arm) against the plain arm."""
    width = compared_width(plain, run)
    if width is None:
        return f"why: too few pure decode steps to compare {run.label} with no speculation"
    if not run.verifies:
        return no_drafts_line(run.label, llm, width)
    return why_line(run.label, width, plain.step_s(width), run.step_s(width), run.verifies, run.drafted,
                    run.accepted)


def policy_words(llm: LLM) -> str:
    """The default depth policy as resolved for this model, in words."""
    spec = llm.spec
    if spec.depth_policy == "ladder":
        ladder = ",".join(f"{n}:{d}" for n, d in spec.ladder)
        what = f"ladder {ladder} (from {spec.ladder_origin})"
    elif spec.depth_policy == "auto":
        what = "depth measured online (auto)"
    else:
        what = f"{spec.num_drafts} drafts at every width"
    return f"{what}, no drafting above {spec.width_cap} sequences (from {spec.width_cap_origin})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="models/tiny-glm-moe")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-drafts", type=int, default=3, help="the most drafts the default policy may take")
    ap.add_argument("--depths", default="1,3", help="the fixed-depth arms, comma-separated (empty: none)")
    ap.add_argument("--ep", type=int, default=2, help="ranks for the EP arm (1 skips it)")
    ap.add_argument("--launcher", default="ray", choices=LAUNCHERS, help="what starts the EP arm's worker ranks")
    ap.add_argument("--enforce-eager", action="store_true", help="run the eager step (no compile: a quick check; the speeds are not the served ones)")
    args = ap.parse_args()
    if not Path(args.model).is_dir():
        print(f"make run: model folder {args.model!r} does not exist", file=sys.stderr)
        return 2
    try:
        depths = [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        depths = [-1]
    if any(not 1 <= d <= 16 for d in depths):
        print(f"make run: --depths {args.depths!r} must be depths in 1..16, comma-separated", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    # (label, spec, fixed depth or None for the default policy, ranks)
    arms = [("no speculation", "none", None, 1)]
    arms += [(f"MTP k{d} (fixed)", "mtp", d, 1) for d in depths]
    arms.append(("MTP default", "mtp", None, 1))
    if args.ep > 1:
        name = {"ray": "Ray"}.get(args.launcher, args.launcher)
        arms.append((f"EP {args.ep} ({name}), default", "mtp", None, args.ep))
    runs: list[ArmRun] = []
    why = ""
    for label, spec, depth, ep in arms:
        print(f"[{label}] loading {args.model} ...", flush=True)
        llm = LLM(args.model, dtype="float32", spec=spec, num_drafts=depth or args.num_drafts,
                  draft_policy="fixed" if depth else None, ep=ep,
                  launcher=launcher_for(args.launcher) if ep > 1 else None, enforce_eager=args.enforce_eager)
        if label == "MTP default":
            print(f"  default depth policy: {policy_words(llm)}", flush=True)
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))  # warm-up
        run = generate_timed(llm, label, PROMPTS, params)
        if runs and run.texts != runs[0].texts:
            print("  warning: speculative output differs from plain output", flush=True)
        elif runs:
            print("  same text as without speculation", flush=True)
        runs.append(run)
        if label == "MTP default":
            why = explain(runs[0], run, llm)
        llm.shutdown()
    for prompt, text in zip(PROMPTS, runs[0].texts):
        print("-" * 72)
        print(prompt + "\033[1m" + text + "\033[0m")
    print("-" * 72)
    plain = runs[0]
    print(f"{'arm':<{LABEL_WIDTH}} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'accept_len':>11} {'accepted':>9} "
          f"{'step_cost':>10} {'vs none':>8}")
    base = plain.tokens / plain.wall_s
    for run in runs:
        width = compared_width(plain, run)
        cost = None if width is None or run is plain else run.step_s(width) / plain.step_s(width)
        accept = "-" if run.accept_len is None else f"{run.accept_len:.2f}"
        rate = "-" if run.accept_rate is None else f"{run.accept_rate:.0%}"
        cost_text = "-" if cost is None else f"{cost:.2f}x"
        print(f"{run.label:<{LABEL_WIDTH}} {run.tokens:>7} {run.wall_s:>8.2f} {run.tokens / run.wall_s:>8.1f} "
              f"{accept:>11} {rate:>9} {cost_text:>10} {run.tokens / run.wall_s / base:>7.2f}x")
    print("(accepted: the share of drafts the target accepted; step_cost: a pure decode step's median seconds "
          "against no speculation's, at the width both ran most)")
    print(why)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
