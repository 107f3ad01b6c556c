"""`make run`: the project's main job on the embedded model.

Generates continuations of a few code prompts without speculation, with MTP speculation (3
drafts), and with MTP speculation at EP 2 (the experts split over two processes, the sharded
drafter), and prints the text and the speed and acceptance of each side by side.
"""
from __future__ import annotations

import argparse
import sys
import time
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="models/tiny-glm-moe")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-drafts", type=int, default=3)
    ap.add_argument("--ep", type=int, default=2, help="ranks for the EP arm (1 skips it)")
    ap.add_argument("--launcher", default="ray", choices=LAUNCHERS, help="what starts the EP arm's worker ranks")
    ap.add_argument("--enforce-eager", action="store_true", help="run the eager step (no compile: a quick check; the speeds are not the served ones)")
    args = ap.parse_args()
    if not Path(args.model).is_dir():
        print(f"make run: model folder {args.model!r} does not exist", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    texts = None
    arms = [("no speculation", "none", 1), (f"MTP, {args.num_drafts} drafts", "mtp", 1)]
    if args.ep > 1:
        name = {"ray": "Ray"}.get(args.launcher, args.launcher)
        arms.append((f"EP {args.ep} ({name}), MTP {args.num_drafts}", "mtp", args.ep))
    for label, spec, ep in arms:
        print(f"[{label}] loading {args.model} ...", flush=True)
        llm = LLM(args.model, dtype="float32", spec=spec, num_drafts=args.num_drafts, ep=ep,
                  launcher=launcher_for(args.launcher) if ep > 1 else None, enforce_eager=args.enforce_eager)
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(PROMPTS, params)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        verifies = sum(o.num_verifies for o in outs)
        accept = 1 + sum(o.accepted_tokens for o in outs) / verifies if verifies else None
        rows.append((label, tokens, wall, accept))
        if texts is None:
            texts = [o.text for o in outs]
        elif [o.text for o in outs] != texts:
            print("  warning: speculative output differs from plain output", flush=True)
        else:
            print("  same text as without speculation", flush=True)
        llm.shutdown()
    for prompt, text in zip(PROMPTS, texts):
        print("-" * 72)
        print(prompt + "\033[1m" + text + "\033[0m")
    print("-" * 72)
    print(f"{'arm':<20} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'accept_len':>11} {'vs none':>8}")
    base = rows[0][1] / rows[0][2]
    for label, tokens, wall, accept in rows:
        print(f"{label:<20} {tokens:>7} {wall:>8.2f} {tokens / wall:>8.1f} "
              f"{accept if accept is None else round(accept, 2)!s:>11} {tokens / wall / base:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
