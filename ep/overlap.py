"""Two-batch overlap (`--two-batch-overlap`, docs/design.md §4.3): under `--dp-attention` each
rank's rows of a step run as two micro-batches, and one micro-batch's expert exchange is in flight
(`async_op=True` all_to_alls) while the other computes.

Each micro-batch is a generator over the target's layers that yields at the two points where it
has started collectives it does not need yet: after routing its rows and starting their dispatch
(`EPMoE.dp_dispatch`; its shared expert runs before the yield, under the dispatch), and after its
experts ran and their results started back (`EPMoE.dp_experts`). `interleave` alternates the two,
so per MoE layer:

    mb0: attention, route, dispatch ->   mb1: attention, route, dispatch ->
    mb0: wait rows, experts, combine ->  mb1: wait rows, experts, combine ->
    mb0: wait results, add, next layer's attention ... (the same for mb1)

mb0's dispatch travels while mb1's attention runs, mb1's while mb0's experts run, mb0's results
while mb1's experts run. Every rank runs both micro-batches' stages in this order, a micro-batch
without rows (or a rank without rows) included, so every rank starts the same collectives in the
same order. The split is by sequence, the same rule on every rank (`split_point`), and every rank
computes every rank's split from the FORWARD's chunks, so all agree on each micro-batch's exchange
form: padded to half the step's budget when every micro-batch of every rank fits it, exact counts
otherwise (`micro_budget`); and a step where no rank holds two sequences runs as one batch.

Chosen once at load (`choose_dp_step`): `OneBatch` (ep.dp) or `TwoBatchOverlap`; steps never ask
which. The micro-batch loop runs the layers eagerly, so a compiled, static or one-row-as-two step
is refused there in one line.
"""
from __future__ import annotations

from collections.abc import Generator

import torch

from ep.dp import OneBatch
from ep.parallel import EPMoE
from runtime.executor.attention import PagedAttention, SeqChunk
from runtime.executor.runner import ModelRunner

MicroBatch = Generator[None, None, torch.Tensor]


def split_point(rows: list[int]) -> int:
    """Where a rank's chunks (their rows, in order) split into two micro-batches [:i] and [i:]:
    the most even split of the rows, the first micro-batch the larger on a tie (one sequence goes
    to the first, leaving the second empty)."""
    total, best, best_gap, at = sum(rows), 0, sum(rows), 0
    for i, r in enumerate(rows, start=1):
        at += r
        if abs(total - 2 * at) <= best_gap:
            best, best_gap = i, abs(total - 2 * at)
    return best


def micro_budget(budget: int, halves: list[tuple[int, int]]) -> int:
    """The padded budget of each micro-batch's exchange: half the step's when every rank's two
    micro-batches (`halves`, rows) fit it, else 0 (exact counts; so is a step with budget 0)."""
    half = budget // 2
    return half if half and all(max(a, b) <= half for a, b in halves) else 0


def interleave(micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
    """Run the micro-batches' stages in turn (one stage of each, then the next of each) until all
    return; their return values in order."""
    out: list[torch.Tensor | None] = [None] * len(micro_batches)
    live = list(range(len(micro_batches)))
    while live:
        for i in list(live):
            try:
                next(micro_batches[i])
            except StopIteration as stop:
                out[i] = stop.value
                live.remove(i)
    return out


class TwoBatchOverlap:
    """A DP-attention rank's rows as two overlapped micro-batches (the module docstring)."""

    name = "two-batch overlap"

    def __init__(self) -> None:
        self.one = OneBatch()
        self.padded_steps = 0   # steps whose micro-batches exchanged padded (half the budget)
        self.exact_steps = 0    # steps whose micro-batches exchanged exact counts
        self.one_batch_steps = 0   # steps no rank had two sequences in: run as one batch
        self.empty_micro_batches = 0   # micro-batches without rows, over every rank (each rank counts all)

    def run(self, runner: ModelRunner, tokens: list[int], chunks: list[SeqChunk], budget: int,
            ranks_rows: list[list[int]], rank: int) -> torch.Tensor:
        """This rank's (group's) `chunks` and their `tokens` -> their hidden rows [T, H] in chunk
        order. `ranks_rows[r]`: the rows of rank r's chunks in order (every rank's, to agree on
        the micro-batches' exchange form); `budget`: the step's padded rows a rank (0: exact).
        A step in which no rank holds two sequences runs as one batch (every rank sees it alike):
        a second micro-batch would be empty everywhere, its exchanges latency with nothing under."""
        if all(len(r) < 2 for r in ranks_rows):
            self.one_batch_steps += 1
            return self.one.run(runner, tokens, chunks, budget, ranks_rows, rank)
        splits = [split_point(r) for r in ranks_rows]
        halves = [(sum(r[:i]), sum(r[i:])) for r, i in zip(ranks_rows, splits)]
        self.empty_micro_batches += sum((a == 0) + (b == 0) for a, b in halves)
        mb_budget = micro_budget(budget, halves)
        if mb_budget:
            self.padded_steps += 1
        else:
            self.exact_steps += 1
        offset = sum(sum(r) for r in ranks_rows[:rank])
        cut, first = splits[rank], halves[rank][0]
        gens = [micro_batch(runner, tokens[:first], chunks[:cut], mb_budget, offset),
                micro_batch(runner, tokens[first:], chunks[cut:], mb_budget, offset + first)]
        return torch.cat(interleave(gens))


def micro_batch(runner: ModelRunner, tokens: list[int], chunks: list[SeqChunk], budget: int,
                row_offset: int) -> MicroBatch:
    """One micro-batch's pass over the target's layers (`CausalLM.forward`, `DecoderLayer.forward`
    and `EPMoE.forward` in stages), yielding after each start of an exchange's collectives; returns
    its hidden rows before the final norm [T, H]. Without rows it joins every exchange only."""
    model = runner.model
    if chunks:
        plan = runner.attention.plan(runner.cache, chunks)
        ctx = PagedAttention(runner.cache, plan)
        ctx.states = runner.states.step(chunks)
        x = model.embed_tokens(torch.tensor(tokens, dtype=torch.long, device=runner.device))
        rope = model.rotary(plan.positions, x.dtype)
    else:
        x = torch.zeros(0, model.config.hidden_size, dtype=model.dtype, device=model.device)
    for layer in model.layers:
        if chunks:
            x = x + layer.mixer(layer.input_layernorm(x), rope, ctx, None)
        mlp = layer.mlp
        if not isinstance(mlp, EPMoE):   # a dense layer: nothing to exchange
            if chunks:
                x = x + mlp(layer.post_attention_layernorm(x))
            continue
        if chunks:
            h = layer.post_attention_layernorm(x)
            weights, ids = mlp.dp_route(h)
        else:
            h, k = x, mlp.gate.top_k
            weights, ids = x.new_zeros(0, k), torch.zeros(0, k, dtype=torch.long, device=x.device)
        ex = mlp.dp_dispatch(h, weights, ids, budget, row_offset, async_op=True)
        shared = mlp.shared_out(h) if chunks else None   # under the dispatch
        yield
        mlp.dp_experts(ex, async_op=True)
        yield
        out = mlp.dp_combine(ex)
        x = x + (out if shared is None else out + shared)
    return x


# The refusals, one line each (serving.deployment gives the first two before a group starts).
NOT_EAGER = ("--two-batch-overlap runs its micro-batches' layers eagerly (a compiled step is one graph with the "
             "exchange blocking inside it); add --enforce-eager")
NOT_STATIC = ("--two-batch-overlap: static (padded or captured) steps are one step of all rows; serve it without "
              "--static-steps")
NOT_ROW_TWICE = ("--two-batch-overlap: this dtype's batch-invariant kernels run a one-row step as two copies of its "
                 "row, which the micro-batch loop does not; drop --batch-invariant")


def choose_dp_step(runner: ModelRunner, two_batch: bool) -> OneBatch | TwoBatchOverlap:
    """How a DP-attention rank runs its rows, chosen once at load: one forward, or two overlapped
    micro-batches (`two_batch`), refused in one line where the step cannot run as them."""
    if not two_batch:
        return OneBatch()
    if runner.compiled:
        raise ValueError(NOT_EAGER)
    if runner.graphs is not None:
        raise ValueError(NOT_STATIC)
    if getattr(runner.model, "one_row_twice", False):
        raise ValueError(NOT_ROW_TWICE)
    return TwoBatchOverlap()
