"""Rank 0's side of an EP group: `DriverRunner` (the `ModelRunner` interface, broadcasting each
step's command before running its own shard) and the sharded MTP drafter that tells the workers
before every propose."""
from __future__ import annotations

from collections import Counter

import torch

from ep.channel import OP_CODES, send_command
from ep.comm import Communicator
from ep import placement
from ep.dp import DPBook, dp_draft, dp_forward
from ep.protocol import (EP_CMD_LOGITS, EP_CMD_SHUTDOWN, NO_SLOT, Command, ForwardPayload, Observation, Op,
                         ProposePayload, eplb_command, forward_command, propose_command)
from runtime.executor.attention import SeqChunk
from runtime.executor.runner import ModelRunner
from speculative.knobs import DrafterKnobs
from runtime.sample.grammar import GrammarMatcher
from speculative.mtp import MTPProposer, hedges
from speculative.proposer import Drafts, ProposerState, ProposeRequest, cut_at_grammar


class DriverRunner:
    """Rank 0's runner: broadcasts each step to the workers, then runs its own shard.

    `sent` counts the commands that went on the wire, by name (`Command.name`)."""

    def __init__(self, local: ModelRunner, comm: Communicator, eplb_interval_steps: int | None = None,
                 dp_budget: int | None = None, attention_tp: int = 1) -> None:
        """`eplb_interval_steps`: with EPLB on (`ep.placement.enable`), re-place the experts from
        the loads counted since the last placement before every that many forwards. `dp_budget`:
        data-parallel attention (`ep.dp`) with that padded row budget a rank (None: off), in
        attention groups of `attention_tp` ranks."""
        self.local = local
        self.compiled = local.compiled   # every rank alike (the handshake's COMPILED_BIT)
        self.batch_invariant = local.batch_invariant
        self.comm = comm
        self.model = local.model
        self.config = local.config
        self.cache = local.cache
        self.sampler = local.sampler     # the engine draws on rank 0 through the local runner's choice
        self.cache.journal = []
        # Drafter inputs observed since the last command (they index the last forward's hidden).
        self.obs_journal: list[Observation] = []
        # The last FORWARD the workers executed, as they parsed it: a three-word propose is read off it.
        self.last_forward: ForwardPayload | None = None
        self.sent: Counter[str] = Counter()
        layers = placement.moe_layers(self.model)
        self.eplb = bool(layers) and layers[0].eplb_slots is not None
        if eplb_interval_steps is not None and not self.eplb:
            raise ValueError(f"--eplb-interval-steps {eplb_interval_steps} needs --eplb-redundant-experts")
        self.eplb_interval = eplb_interval_steps
        self.forwards = 0                 # forwards since start (or since `eplb_reset`)
        self.placements = 0               # live re-placements done
        self.eplb_bytes_received = 0      # expert weight bytes rank 0 received in them
        self._eplb_since: list | None = None   # the load counters at the last re-placement
        self.dp = DPBook(comm.world_size // attention_tp, dp_budget) if dp_budget else None
        if self.dp is not None:   # a pool a rank: rank 0 counts every pool's blocks, holds its own
            self.cache.split_pools(self.dp.dp_size, comm.rank // attention_tp)

    def send(self, cmd: Command) -> None:
        """Broadcast one command and wait for every rank's verdict (`CommandRefused` on a refusal)."""
        send_command(self.comm, cmd)
        self.sent[cmd.name] += 1

    def take_obs(self) -> list[Observation]:
        obs, self.obs_journal = self.obs_journal, []
        return obs

    def take_ops(self) -> list[Op]:
        ops = [(OP_CODES[op], seq, n) for op, seq, n in self.cache.journal]
        self.cache.journal.clear()
        if self.dp is not None:
            for op, seq, _ in ops:
                if op == OP_CODES["free"]:
                    self.dp.free(seq)
        return ops

    def forward(self, tokens: list[int], chunks: list[SeqChunk]):
        if self.eplb_interval and self.forwards and self.forwards % self.eplb_interval == 0:
            self.rebalance_experts()
        self.forwards += 1
        ops = self.take_ops()
        owners = self.dp.assign(chunks, self.cache) if self.dp is not None else []
        budget = self.dp.step_budget(chunks, owners) if self.dp is not None else 0
        sent = ForwardPayload(ops=ops, chunks=[(c.seq_id, c.start, c.num_tokens) for c in chunks],
                              tokens=list(tokens), obs=self.take_obs(),
                              trees={i: list(c.parents) for i, c in enumerate(chunks) if c.parents is not None},
                              owners=owners, budget=budget)
        self.send(forward_command(sent.ops, sent.chunks, sent.tokens, sent.obs, sent.trees,
                                  owners if self.dp is not None else None, budget))
        self.last_forward = sent
        if self.dp is not None:
            return dp_forward(self.local, self.comm, tokens, chunks, owners, budget), None
        return self.local.forward(tokens, chunks)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if self.dp is not None:   # the gathered hidden and the whole LM head are on rank 0: no command
            return self.local.logits(hidden, rows)
        self.send(Command(EP_CMD_LOGITS, NO_SLOT, (len(rows), len(rows)), list(rows)))
        return self.local.logits(hidden, rows)

    def propose(self, payload: ProposePayload, stop: float | None, pending: list[tuple[int, int]]) -> None:
        """Tell the workers to run `payload` on their drafter mirror: the three-word MTP_PROPOSE
        when they can derive it from the last forward, else the batched form. `pending[i]` is
        (last_token, position) of `payload.seqs[i]`."""
        self.send(propose_command(self.last_forward, payload, stop, pending))

    def rebalance_experts(self) -> int:
        """Re-place every MoE layer's experts from the loads counted since the last placement
        (`ep.placement.replan`): send the EPLB command, then move rank 0's own weights with the
        workers. Between two steps: no sequence's cache or tokens change. Returns the expert
        weight bytes rank 0 received."""
        tables = placement.replan(self.model, self._eplb_since)
        self._eplb_since = placement.loads(self.model)
        self.send(eplb_command([t.reshape(-1).tolist() for t in tables]))
        got = placement.apply(self.model, tables, self.comm)
        self.placements += 1
        self.eplb_bytes_received += got
        return got

    def expert_loads(self) -> list[list[int]]:
        """Tokens routed to each expert of each MoE layer (model order) since start; [] without
        EPLB. One host read of the device counters."""
        return [row.tolist() for row in placement.loads(self.model)] if self.eplb else []

    def eplb_reset(self) -> None:
        """Forget the forwards and loads so far (after the warm-up's scratch steps)."""
        self.forwards = 0
        self._eplb_since = None
        for layer in placement.moe_layers(self.model) if self.eplb else ():
            layer.expert_loads.zero_()

    def shutdown(self) -> None:
        self.send(Command(EP_CMD_SHUTDOWN))


class ShardedMTPProposer(MTPProposer):
    """Rank 0's sharded MTP drafter: its propose tells the workers first, so they enter the
    drafter's collectives with it; the hiddens it is fed are mirrored on every rank. Its
    `confidence_stop` must be the one given to `driver_handshake` (workers refuse another).

    Under a grammar (which lives on rank 0 only) the spine stays the raw arg-max: the gathered
    logits are on every rank, but each spine draft is the next draft step's input on every rank
    (attention heads and experts are split) and its probability decides the confidence stop, so a
    pick masked on rank 0 alone would desynchronise the ranks. Masking it would need rank 0 to
    send its picks to the workers at every depth; instead the hedges, which feed nothing, are
    masked, and the spine is cut before its first token the grammar refuses, which verification
    would reject anyway. Acceptance under a grammar is therefore lower than the single-device
    (or METRALE_NO_MTP_EP_PROPOSE) drafter's, never the output."""

    masks_spine = False

    def __init__(self, driver: DriverRunner, confidence_stop: float | None = None,
                 knobs: DrafterKnobs | None = None) -> None:
        super().__init__(driver.model, driver.cache, confidence_stop, knobs)
        self.driver = driver

    def observe_target(self, state: ProposerState, hidden: torch.Tensor, rows: range, start: int) -> None:
        super().observe_target(state, hidden, rows, start)
        self.driver.obs_journal.append((state.seq_id, rows.start, len(rows), start))

    def propose_batch(self, reqs: list[ProposeRequest]) -> list[Drafts]:
        return [cut_at_grammar(d, r.grammar) for d, r in zip(super().propose_batch(reqs), reqs)]

    def draft(self, states: list[ProposerState], feeds: list[list[int]], num_drafts: list[int],
              stop: float | None = None, trees: list[tuple[int, ...]] | None = None,
              grammars: list[GrammarMatcher | None] | None = None) -> list[Drafts]:
        """With DP attention each rank drafts its own sequences (`ep.dp.dp_draft`) and rank 0 takes
        each depth's hedges from the candidates that come back: the best the sequence's grammar
        allows after the spine before them, where it has one (so a hedge the unmasked top
        candidates leave out is missing, never one the grammar refuses)."""
        if self.driver.dp is None:
            return super().draft(states, feeds, num_drafts, stop, trees, grammars)
        out = []
        for i, (tokens, probs, cands) in enumerate(dp_draft(self, self.driver.comm, states, feeds, num_drafts, stop)):
            tree = trees[i] if trees else ()
            grammar = grammars[i] if grammars else None
            got = Drafts(tokens, probs)
            for depth, count in enumerate(tree[:len(tokens)], start=1):
                if count > 1:
                    best = cands[depth - 1]
                    allowed = grammar.allowed_after(tokens[:depth - 1]) if grammar is not None else None
                    if allowed is not None and bool(allowed.any()):
                        best = [t for t in best if bool(allowed[t])]
                    got.hedges.extend(hedges(depth, best, tokens[depth - 1], count))
            out.append(got)
        return out

    def before_draft(self, live: list[ProposeRequest], feeds: list[list[int]]) -> None:
        # The observations before the ops: they index the last forward, whose rows a FREE among the ops may drop.
        obs = self.driver.take_obs()
        payload = ProposePayload(ops=self.driver.take_ops(), obs=obs,
                                 seqs=[(r.state.seq_id, r.num_drafts, f) for r, f in zip(live, feeds)])
        self.driver.propose(payload, self.confidence_stop,
                            [(r.token_ids[-1], len(r.token_ids) - 1) for r in live])
