"""Data-parallel attention (`--dp-attention`, docs/design.md §4.3): each rank runs the step over its
own sequences' rows and the routed experts get their rows through an all-to-all exchange.

Rank 0's scheduler still decides for every rank. The KV cache is split into a pool a rank (an
attention group: `PagedKVCache.split_pools`), whose blocks rank 0's book counts and whose memory
only that rank holds: a sequence takes its pool at its first reservation (the one with the most
free blocks, then the fewest sequences), the same on every rank replaying the journal, and runs
there until freed; `DPBook` reads each chunk's rank off it, and the FORWARD carries each chunk's
rank and the step's padded row budget. `dp_forward` is what every rank (rank 0 and the workers
alike) runs for one FORWARD: its own chunks (or, with none, only the exchanges), then one
all-gather that gives every rank the step's hidden rows in the FORWARD's chunk order, which the
drafter mirror and rank 0's logits read. `dp_draft` is the same for one propose: each rank drafts
its own sequences, and one all-gather brings the drafts to rank 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ep.comm import Communicator
from ep.parallel import dp_join_empty, set_dp_step
from runtime.executor.attention import SeqChunk
from runtime.executor.kv_cache import PagedKVCache
from runtime.executor.runner import ModelRunner
from speculative.mtp import MTPProposer
from speculative.proposer import ProposerState
from speculative.tree_shape import MAX_COUNT


def row_budget(max_num_seqs: int, dp_size: int, rows_per_seq: int) -> int:
    """The padded exchange's rows a rank: ceil(max_num_seqs / dp_size) sequences of
    `rows_per_seq` rows (1 + the drafts a verify checks), rounded up to a power of two."""
    rows = -(-max_num_seqs // dp_size) * rows_per_seq
    return 1 << (rows - 1).bit_length()


class DPBook:
    """Rank 0's record of which rank runs each sequence: the pool of the split cache its blocks
    are in (`PagedKVCache.pool_of`), from its first reservation until its blocks are freed."""

    def __init__(self, dp_size: int, budget: int) -> None:
        self.dp_size = dp_size
        self.budget = budget
        self.owner: dict[int, int] = {}
        self.assigned = [0] * dp_size   # sequences given to each rank since start
        self.idle_rank_steps = 0        # forwards in which some rank had no rows of its own

    def assign(self, chunks: list[SeqChunk], cache: PagedKVCache) -> list[int]:
        """Each chunk's rank: its sequence's pool."""
        owners = [cache.pool_of(c.seq_id) for c in chunks]
        for c, rank in zip(chunks, owners):
            if c.seq_id not in self.owner:
                self.owner[c.seq_id] = rank
                self.assigned[rank] += 1
        self.idle_rank_steps += len(set(owners)) < self.dp_size
        return owners

    def step_budget(self, chunks: list[SeqChunk], owners: list[int]) -> int:
        """The padded budget when every rank's rows fit it (decode and verify steps), else 0."""
        rows = [0] * self.dp_size
        for c, r in zip(chunks, owners):
            rows[r] += c.num_tokens
        return self.budget if max(rows, default=0) <= self.budget else 0

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


# What a rank sends back of each sequence it drafted (`dp_draft`): the drafts, their top-1
# probabilities and, at each depth, the next-best candidates a tree's hedges come from (the
# widest tree count less the spine), as float64 words (token ids are exact below 2^53).
CANDIDATES = MAX_COUNT - 1


@torch.inference_mode()
def dp_draft(drafter: MTPProposer, comm: Communicator, states: list[ProposerState], feeds: list[list[int]],
             num_drafts: list[int], stop: float | None
             ) -> list[tuple[list[int], list[float], list[list[int]]]]:
    """One data-parallel propose, the same on every rank: each rank (attention group) feeds and
    drafts its own sequences, those of its pool, with `MTPProposer.draft` (its attention over its
    own rows; a MoE MTP layer's routed experts exchanged, every rank joining each of the
    `max(num_drafts)` draft steps' exchanges, with nothing once its own chains have stopped),
    then one all-gather brings every drafted sequence's drafts to rank 0. Returns there, for each
    state, (drafts, their probabilities, per depth the `CANDIDATES` next-best tokens best first),
    which rank 0 turns into hedges (elsewhere empty lists); every rank's states of other ranks'
    sequences count their rows fed."""
    cache, model = drafter.cache, drafter.model
    k = getattr(model, "attention_tp", 1)
    n, rank = comm.world_size // k, comm.rank // k
    owners = [cache.pool_of(st.seq_id) for st in states]
    mine = [i for i, o in enumerate(owners) if o == rank]
    for st, feed, o in zip(states, feeds, owners):
        if o != rank:   # its own rank feeds it: the rows count as fed here, as they do there
            if len(feed) != st.pending_rows:
                raise ValueError(f"sequence {st.seq_id}: {st.pending_rows} unfed rows but {len(feed)} feed tokens")
            st.fed_upto += st.pending_rows
            st.clear_pending()
    drafting = [[i for i in range(len(states)) if owners[i] == r and num_drafts[i] > 0] for r in range(n)]
    width = max(len(d) for d in drafting)
    depth = max(num_drafts, default=0)
    set_dp_step(model, 1 << (width - 1).bit_length() if width else 0, sum(len(d) for d in drafting[:rank]),
                drafter=True)
    before = drafter.forwards
    got = dict(zip(mine, MTPProposer.draft(drafter, [states[i] for i in mine], [feeds[i] for i in mine],
                                           [num_drafts[i] for i in mine], stop,
                                           [(MAX_COUNT,) * num_drafts[i] for i in mine]))) if mine else {}
    for _ in range(drafter.forwards - before, depth if width else 0):
        dp_join_empty(model, drafter=True)   # its chains stopped, or it drafts nothing: the others' exchanges
    out: list[tuple[list[int], list[float], list[list[int]]]] = [([], [], []) for _ in states]
    if not width:
        return out
    cols = 1 + depth * (2 + CANDIDATES)
    table = torch.full((width, cols), -1.0, dtype=torch.float64)
    for j, i in enumerate(drafting[rank]):
        d = got[i]
        table[j, 0] = len(d.tokens)
        table[j, 1:1 + len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.float64)
        table[j, 1 + depth:1 + depth + len(d.probs)] = torch.tensor(d.probs, dtype=torch.float64)
        seen = [0] * depth
        for at, token in d.hedges:   # each depth's next-best tokens, best first
            table[j, 1 + 2 * depth + (at - 1) * CANDIDATES + seen[at - 1]] = token
            seen[at - 1] += 1
    gathered = comm.all_gather(table.to(comm.device))
    if comm.rank:
        return out
    gathered = gathered.cpu().view(comm.world_size, width, cols)
    for r in range(n):
        rows = gathered[r * k].tolist()   # an attention group's drafts from its first rank
        for j, i in enumerate(drafting[r]):
            row = rows[j]
            m = int(row[0])
            cands = [[int(t) for t in row[1 + 2 * depth + d * CANDIDATES:1 + 2 * depth + (d + 1) * CANDIDATES]
                      if t >= 0] for d in range(m)]
            out[i] = ([int(t) for t in row[1:1 + m]], row[1 + depth:1 + depth + m], cands)
    return out
