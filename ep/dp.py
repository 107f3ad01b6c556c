"""Data-parallel attention (`--dp-attention`, docs/design.md §4.3): each rank runs the step over its
own sequences' rows and the routed experts get their rows through an all-to-all exchange.

Rank 0's scheduler still decides for every rank: `DPBook` gives each new sequence a rank (the
one with the fewest used KV blocks, then the fewest running sequences), and the FORWARD carries
each chunk's rank and the step's padded row budget. `dp_forward` is what every rank (rank 0 and
the workers alike) runs for one FORWARD: its own chunks (or, with none, only the exchanges), then
one all-gather that gives every rank the step's hidden rows in the FORWARD's chunk order, which
the drafter mirror and rank 0's logits read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ep.comm import Communicator
from ep.parallel import dp_join_empty, set_dp_step
from runtime.executor.attention import SeqChunk
from runtime.executor.runner import ModelRunner


def row_budget(max_num_seqs: int, dp_size: int, rows_per_seq: int) -> int:
    """The padded exchange's rows a rank: ceil(max_num_seqs / dp_size) sequences of
    `rows_per_seq` rows (1 + the drafts a verify checks), rounded up to a power of two."""
    rows = -(-max_num_seqs // dp_size) * rows_per_seq
    return 1 << (rows - 1).bit_length()


class DPBook:
    """Rank 0's record of which rank runs each sequence, over the cache whose block tables every
    rank replays: a sequence keeps its rank from its first forward until its blocks are freed."""

    def __init__(self, dp_size: int, budget: int) -> None:
        self.dp_size = dp_size
        self.budget = budget
        self.owner: dict[int, int] = {}
        self.assigned = [0] * dp_size   # sequences given to each rank since start
        self.idle_rank_steps = 0        # forwards in which some rank had no rows of its own

    def assign(self, chunks: list[SeqChunk], cache) -> list[int]:
        """Each chunk's rank; a sequence seen for the first time goes to the rank with the fewest
        used blocks, then the fewest sequences, then the lowest index."""
        for c in chunks:
            if c.seq_id not in self.owner:
                blocks, seqs = [0] * self.dp_size, [0] * self.dp_size
                for s, r in self.owner.items():
                    blocks[r] += len(cache.block_table(s))
                    seqs[r] += 1
                rank = min(range(self.dp_size), key=lambda r: (blocks[r], seqs[r], r))
                self.owner[c.seq_id] = rank
                self.assigned[rank] += 1
        owners = [self.owner[c.seq_id] for c in chunks]
        self.idle_rank_steps += len(set(owners)) < self.dp_size
        return owners

    def step_budget(self, chunks: list[SeqChunk], owners: list[int]) -> int:
        """The padded budget when every rank's rows fit it (decode and verify steps), else 0."""
        rows = [0] * self.dp_size
        for c, r in zip(chunks, owners):
            rows[r] += c.num_tokens
        return self.budget if max(rows, default=0) <= self.budget else 0

    def pin(self, seq_id: int, rank: int) -> None:
        """Run `seq_id` on `rank` from now on (the warm-up's scratch sequence visits every rank)."""
        self.owner[seq_id] = rank

    def free(self, seq_id: int) -> None:
        self.owner.pop(seq_id, None)


class OneBatch:
    """A DP-attention rank's rows in one forward (the default; `ep.overlap.choose_dp_step`)."""

    name = "one batch"

    def run(self, runner: ModelRunner, tokens: list[int], chunks: list[SeqChunk], budget: int,
            ranks_rows: list[list[int]], rank: int) -> torch.Tensor:
        """This rank's (group's) `chunks` and their `tokens` -> their hidden rows [T, H]; without
        chunks it joins every exchange. `ranks_rows[r]`: the rows of rank r's chunks in order."""
        model = runner.model
        set_dp_step(model, budget, sum(sum(r) for r in ranks_rows[:rank]))
        if chunks:
            return runner.forward(tokens, chunks)[0]
        dp_join_empty(model)
        return torch.zeros(0, model.config.hidden_size, dtype=model.dtype, device=model.device)


@torch.inference_mode()
def dp_forward(runner: ModelRunner, comm: Communicator, tokens: list[int], chunks: list[SeqChunk],
               owners: list[int], budget: int) -> torch.Tensor:
    """One DP-attention forward on this rank: its attention group's chunks (`owners` name groups
    of `--attention-tp` ranks, which all run them) as the model's `dp_step` runs them (one batch
    or two overlapped micro-batches, chosen at load), then the gather. Returns every chunk's hidden
    rows [T, H] in `chunks` order, on every rank."""
    k = getattr(runner.model, "attention_tp", 1)
    n, rank = comm.world_size // k, comm.rank // k
    starts, at = [], 0
    for c in chunks:
        starts.append(at)
        at += c.num_tokens
    ranks_rows = [[c.num_tokens for c, o in zip(chunks, owners) if o == r] for r in range(n)]
    rows = [sum(r) for r in ranks_rows]
    mine = [i for i, o in enumerate(owners) if o == rank]
    own_tokens = [t for i in mine for t in tokens[starts[i]:starts[i] + chunks[i].num_tokens]]
    hidden = runner.model.dp_step.run(runner, own_tokens, [chunks[i] for i in mine], budget, ranks_rows, rank)
    width = max(rows)
    gathered = comm.all_gather(F.pad(hidden[:rows[rank]], (0, 0, 0, width - rows[rank])))   # [N * k * width, H]
    # Row j of rank r's part is the j-th row of its chunks in order: put each back at its chunk's place.
    place = torch.tensor([starts[i] + j for r in range(n) for i, o in enumerate(owners) if o == r
                          for j in range(chunks[i].num_tokens)], dtype=torch.long, device=hidden.device)
    src = torch.tensor([r * k * width + j for r in range(n) for j in range(rows[r])], dtype=torch.long,
                       device=hidden.device)   # group r's rows from its first rank
    out = hidden.new_empty(at, hidden.shape[1])
    out[place] = gathered[src]
    return out
