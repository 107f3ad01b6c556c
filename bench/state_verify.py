"""What a verify costs over a recurrent state (Qwen3.5's Gated DeltaNet layers) against plain decode.

    python -m bench.state_verify --model DIR --dtype float32 --context 256 --batch 1,16 \
        --repeats 7 --json-out R.json --plot-out R.png

Per batch width B, one group of B sequences per arm, each prefilled to `--context` random tokens.
Then every repeat runs each arm once, the order rotated, and each arm's sequences grow by the same
4 tokens, so every arm sees the same context lengths:
- `decode`: 4 one-row steps of B rows (the target's work without speculation);
- `verify`: one step of B chains of 4 rows (the pending token and 3 drafts, all accepted): the
  recurrent rule row by row with the state kept after each row (`SNAPSHOT_ROWS`);
- `verify_chunked`: the same step with the rows run by the chunked rule, no state kept per row
  (what the verify would cost without snapshots; such a step could not be rewound);
- `tree`: one step of B draft trees of shape 1,2,2 (6 rows, each row's state from its own
  ancestors), the path through depth 3's hedge accepted: its move and the rewind to 4 tokens.
The record keeps every run, each arm's median step-group time, and `decode / arm` ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.report import provenance
from runtime.executor.attention import SeqChunk
from runtime.executor.runner import ModelRunner
from runtime.model import linear_attention
from runtime.model.weights import load_model
from speculative.tree_shape import TreeShape

ROWS = 4                                   # tokens each arm's sequences gain per repeat
TREE = TreeShape.parse("1,2,2")
TREE_PATH_MOVE = (5, 3)                    # depth 3's hedge (row 5) taken: it goes to depth 3's place
ARMS = ("decode", "verify", "verify_chunked", "tree")


@contextmanager
def no_snapshots():
    """Continuing chunks run the chunked rule and keep no state per row."""
    kept = linear_attention.SNAPSHOT_ROWS
    linear_attention.SNAPSHOT_ROWS = 0
    try:
        yield
    finally:
        linear_attention.SNAPSHOT_ROWS = kept


def run_arm(runner: ModelRunner, arm: str, seqs: list[int], gen: torch.Generator, vocab: int) -> float:
    """One repeat of `arm` over `seqs` (each grows by ROWS tokens) -> seconds."""
    cache = runner.cache

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def step(chunks: list[SeqChunk]) -> None:
        for c in chunks:
            cache.reserve(c.seq_id, c.end)
        hidden, _ = runner.forward(tokens(sum(c.num_tokens for c in chunks)), chunks)
        runner.logits(hidden, list(range(hidden.shape[0])))

    t0 = time.perf_counter()
    if arm == "decode":
        for _ in range(ROWS):
            step([SeqChunk(s, cache.length(s), 1) for s in seqs])
    elif arm in ("verify", "verify_chunked"):
        chunks = [SeqChunk(s, cache.length(s), ROWS) for s in seqs]
        if arm == "verify":
            step(chunks)
        else:
            with no_snapshots():
                step(chunks)
    else:
        parents = tuple(TREE.parents(TREE.spine_len))
        starts = {s: cache.length(s) for s in seqs}
        step([SeqChunk(s, starts[s], len(parents), parents) for s in seqs])
        for s in seqs:
            cache.move(s, starts[s] + TREE_PATH_MOVE[0], starts[s] + TREE_PATH_MOVE[1])
            cache.rewind(s, starts[s] + ROWS)
    return time.perf_counter() - t0


def measure(model_dir: Path, dtype: str, context: int, batches: list[int], repeats: int) -> dict:
    torch.manual_seed(0)
    model = load_model(model_dir, dtype, device="cpu")
    if not model.config.linear_layers:
        raise SystemExit(f"{model_dir}: {model.config.architecture} has no linear-attention layers")
    need = len(ARMS) * max(batches) * (context + ROWS * (repeats + 1) + 16)
    runner = ModelRunner(model, kv_cache_tokens=need * 2)
    gen, vocab = torch.Generator().manual_seed(1), model.config.vocab_size
    out = {"batches": {}}
    for b in batches:
        groups = {arm: list(range(i * b, (i + 1) * b)) for i, arm in enumerate(ARMS)}
        for seqs in groups.values():
            for s in seqs:   # prefill, one sequence a step
                runner.cache.reserve(s, context)
                runner.forward(torch.randint(0, vocab, (context,), generator=gen).tolist(), [SeqChunk(s, 0, context)])
        for arm, seqs in groups.items():   # warm-up, one untimed repeat each
            run_arm(runner, arm, seqs, gen, vocab)
        runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for r in range(repeats):
            for i in range(len(ARMS)):
                arm = ARMS[(r + i) % len(ARMS)]
                runs[arm].append(run_arm(runner, arm, groups[arm], gen, vocab))
        med = {arm: statistics.median(v) for arm, v in runs.items()}
        out["batches"][str(b)] = {
            "runs_s": runs, "median_ms": {a: round(1e3 * v, 2) for a, v in med.items()},
            "decode_over": {a: round(med["decode"] / v, 3) for a, v in med.items()}}
        print(f"B={b}: " + ", ".join(f"{a} {1e3 * v:.1f} ms" for a, v in med.items())
              + " | decode/verify " + f"{med['decode'] / med['verify']:.2f}x", flush=True)
        for seqs in groups.values():
            for s in seqs:
                runner.cache.free(s)
    states = runner.states
    out["state_bytes_per_sequence"] = states.bytes_per_sequence
    out["kv_bytes_per_token"] = runner.cache.bytes_per_token
    return out


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = list(record["batches"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        ax.bar([j + i * width for j in range(len(batches))],
               [record["batches"][b]["median_ms"][arm] for b in batches], width, label=arm)
    ax.set_xticks([j + width * (len(ARMS) - 1) / 2 for j in range(len(batches))], [f"B={b}" for b in batches])
    ax.set_ylabel(f"ms per {ROWS} tokens a sequence (median)")
    ax.set_title(f"Verify over a recurrent state vs {ROWS} decode steps ({record['dtype']}, context {record['context']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", default="1,16", help="batch widths, comma separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--plot-out", type=Path)
    args = ap.parse_args()
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        ap.error(f"--batch {args.batch!r}: expected comma-separated whole numbers, e.g. 1,16")
    if min(batches) < 1 or args.context < 1 or args.repeats < 1:
        ap.error("--batch, --context and --repeats must be at least 1")
    record = {**provenance(), "model": str(args.model), "dtype": args.dtype, "context": args.context,
              "rows": ROWS, "tree": TREE.text, "threads": torch.get_num_threads(),
              **measure(args.model, args.dtype, args.context, batches, args.repeats),
              "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if args.json_out:
        args.json_out.write_text(json.dumps(record, indent=2) + "\n")
    if args.plot_out:
        plot(record, args.plot_out)


if __name__ == "__main__":
    main()
