"""The MTP drafter: the checkpoint's multi-token-prediction layer, on its own KV plane.

Shapes: m fed rows, B sequences, H hidden, V vocab.

Drafter row i pairs the target's hidden at position i with the token at position i + 1 and
predicts the token at i + 2; its keys/values live at position i of cache layer
`num_hidden_layers`, in the same paged blocks as the sequence's target rows. A propose first feeds
the rows of committed positions the drafter has not seen (the prompt after prefill, the accepted
rows after a verify), whose last row gives draft 1; each further draft feeds the drafter's own
output and the previous draft. Draft rows past the committed ones are overwritten by the next feed.

Under a grammar (structured outputs) each depth's candidates are picked from the drafter's logits
masked by what the grammar allows after the spine drafted before them: the target's rows are
masked the same way at verification, so an unmasked pick the grammar forbids would only be
rejected there. The matcher consumes each path and rolls it back (`allowed_after`); its
committed state never moves here.
"""
from __future__ import annotations

import itertools
import logging
import math
import struct

import torch

from runtime.model.experts import uses_fused_experts
from runtime.executor.attention import PagedAttention, SeqChunk, drafter_attention, writes_plan
from runtime.executor.compiled import compile_step
from runtime.executor.step import choose_step_mode
from runtime.sample.grammar import GrammarMatcher
from runtime.executor.kv_cache import PagedKVCache
from runtime.model.causal_lm import CausalLM
from runtime.model.mtp import top_one
from runtime.executor.static_step import StepGraphs
from runtime.executor.step_context import CHAIN_ATTENTION, MAX_CHAIN, chains_natively, forward_context
from speculative.draft_stop import chain_depth
from speculative.fingerprint import hidden_fingerprint
from speculative.knobs import DrafterKnobs
from speculative.proposer import DraftProposer, Drafts, ProposerState, ProposeRequest

log = logging.getLogger("metrale.mtp")


def extends(probs: list[float], ln_tau: float) -> bool:
    """May a chain with these top-1 probabilities grow? Only while `chain_depth` over it plus one
    more place reaches past it, i.e. no draft so far fell below TAU (docs/design.md §5.4)."""
    lps = [math.log(p) if p > 0 else -math.inf for p in probs]
    return chain_depth(lps + [0.0], ln_tau) > len(lps)


def grammar_masked(logits: torch.Tensor, grammars: list[GrammarMatcher | None],
                   paths: list[list[int]]) -> torch.Tensor:
    """logits [B, V] -> a copy with -inf where row b's grammar refuses the token after `paths[b]`.
    A row without a grammar, whose path its grammar refuses (the row cannot be reached) or where it
    would allow nothing is left as it is; with no masked row this returns `logits` itself."""
    rows = []
    for b, (grammar, path) in enumerate(zip(grammars, paths)):
        allowed = grammar.allowed_after(path) if grammar is not None else None     # bool [V]
        if allowed is not None and bool(allowed.any()):
            rows.append((b, allowed))
    if not rows:
        return logits
    refused = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)    # [B, V]
    for b, allowed in rows:
        refused[b] = ~allowed
    return logits.masked_fill(refused, float("-inf"))


def hedges(depth: int, best: list[int], spine: int, count: int) -> list[tuple[int, int]]:
    """A tree depth's hedges: the spine is the arg-max, the hedges the best of the rest, `count - 1`
    of them, from that depth's best tokens `best` (best first)."""
    return [(depth, t) for t in best if t != spine][:count - 1]


class MTPProposer(DraftProposer):
    writes_cache_rows = True
    # Whether the spine is picked from the grammar-masked logits. The sharded drafter (ep.driver)
    # keeps the raw arg-max, which every rank feeds onward in lockstep; only its hedges are masked.
    masks_spine = True

    def __init__(self, model: CausalLM, cache: PagedKVCache, confidence_stop: float | None = None,
                 knobs: DrafterKnobs | None = None, static_steps: bool = False, cuda_graphs: bool = False,
                 compiled: bool = False) -> None:
        """`confidence_stop`: TAU of the confidence stop (None: chains are never stopped early);
        `knobs`: the debugging knobs of docs/design.md §5.7, resolved once. `static_steps` /
        `cuda_graphs`: the drafter's short steps padded to buckets and, on CUDA, captured
        (runtime.executor.static_step), as the target's are. `compiled`: the drafter's forward runs
        through `torch.compile` (inductor, dynamic shapes) as the target's does (not in float64,
        not for a batch-invariant drafter; with static steps their buckets run it compiled too):
        eager, its many small ops cost host time on every draft (tools/step_split.py measures it).
        It compiles at its first forward, or before serving in `warm_up`."""
        if model.mtp is None:
            raise ValueError("this checkpoint has no MTP layer (no model.layers.{num_hidden_layers}.* tensors): "
                             "MTP speculation needs one")
        self.model = model
        self.cache = cache
        self.attention = drafter_attention(cache)   # chosen with the runner's, once
        self.knobs = knobs or DrafterKnobs()
        sparse = model.sparse is not None   # sparse attention runs eager over padded plans (runtime.executor.runner)
        self._compile = compiled and not sparse and model.dtype != torch.float64 and not (
            model.mtp is not None and getattr(model.mtp, "batch_invariant", False))
        # How the drafter's steps run, chosen here once with the target's classes (runtime.executor.step):
        # a step and its distribution as one function (`MTPLayer.draft`), eager or compiled.
        self.mode = choose_step_mode(model.mtp.draft, model, compiled=self._compile)
        self.graphs: StepGraphs | None = None
        if (static_steps or cuda_graphs) and not sparse:
            max_keys = min(model.config.max_position_embeddings, cache.capacity_tokens)
            self.graphs = StepGraphs(choose_step_mode(model.mtp.forward, model, compiled=self._compile), cache,
                                     max_keys, capture=cuda_graphs and model.dtype != torch.float64,
                                     hidden=(model.config.hidden_size, model.dtype),
                                     sync_free_experts=uses_fused_experts(model))
        self._compiled_chain = None    # the chained drafts' graphs (`_chain`)
        self._chain_shapes: set[tuple[int, int]] = set()   # (depth, width) chains compiled (`warm_up_chain`)
        self.forwards = 0   # drafter steps run (`_forward`): a data-parallel drafter counts its exchanges by it
        tau = confidence_stop
        # Rounded to float32: the value EP workers receive on the wire, so every rank decides alike.
        self.confidence_stop = None if tau is None else struct.unpack("<f", struct.pack("<f", tau))[0]

    def observe_target(self, state: ProposerState, hidden: torch.Tensor, rows: range, start: int) -> None:
        """As `DraftProposer.observe_target`, the rows as the MTP layer is fed them
        (`MTPLayer.target_hidden`: after the target's final norm for Qwen3.5)."""
        if self.model.mtp.normed:
            with torch.inference_mode():
                hidden, rows = self.model.mtp.target_hidden(hidden[rows.start:rows.stop]), range(len(rows))
        super().observe_target(state, hidden, rows, start)

    def propose(self, req: ProposeRequest) -> Drafts:
        return self.propose_batch([req])[0]

    def feed_tokens(self, req: ProposeRequest) -> list[int]:
        """The committed tokens paired with the request's unfed hidden rows (position i + 1 for row
        i). With the catch-up ring on, METRALE_MTP_REFEED_SHIFT moves every label by its offset
        (clamped to the committed tokens), to test that mapping by acceptance."""
        st = req.state
        m = st.pending_rows
        shift = self.knobs.refeed_shift
        if shift == 0:
            return list(req.token_ids[st.fed_upto + 1:st.fed_upto + 1 + m])
        last = len(req.token_ids) - 1
        return [req.token_ids[min(max(i + shift, 0), last)] for i in range(st.fed_upto + 1, st.fed_upto + 1 + m)]

    def propose_batch(self, reqs: list[ProposeRequest]) -> list[Drafts]:
        """Drafts for every request; one with no unfed rows gets none, one with `num_drafts` 0 is
        only fed (its rows written, so its blocks become final for the prefix cache)."""
        flags = [r.state.pending_rows > 0 for r in reqs]
        live = [r for r, is_live in zip(reqs, flags) if is_live]
        feeds = [self.feed_tokens(r) for r in live]
        self.before_draft(live, feeds)
        got = iter(self.draft([r.state for r in live], feeds, [r.num_drafts for r in live], self.confidence_stop,
                              [r.tree for r in live], [r.grammar for r in live]))
        return [next(got) if is_live else Drafts([], []) for is_live in flags]

    def before_draft(self, live: list[ProposeRequest], feeds: list[list[int]]) -> None:
        """Hook run just before drafting (the sharded drafter tells its workers here)."""

    @torch.inference_mode()
    def draft(self, states: list[ProposerState], feeds: list[list[int]], num_drafts: list[int],
              stop: float | None = None, trees: list[tuple[int, ...]] | None = None,
              grammars: list[GrammarMatcher | None] | None = None) -> list[Drafts]:
        """Feed each state's unfed rows with their tokens, then draft (nothing for a state whose
        `num_drafts` is 0: it is only fed); a chain whose last draft's
        top-1 probability is below `stop` is not extended. `trees[i]`, when given, is candidates
        per depth: the next-best tokens of each depth's distribution become hedges. `grammars[i]`,
        when given, masks each depth's distribution to what state i's grammar allows after the
        spine before it (the spine only when `masks_spine`; the hedges always). Every EP rank
        runs this with the same arguments except `trees` and `grammars`, rank 0's alone (hedges
        change no forward, and the sharded drafter leaves its spine unmasked), so it must be
        deterministic given them."""
        out: list[Drafts] = [Drafts([], []) for _ in states]
        ln_tau = None if stop is None else math.log(stop)
        if not states:
            return out
        live = list(range(len(states)))
        # Feed: every unseen committed row, one chunk per sequence.
        tokens, chunks, hiddens = [], [], []
        for i in live:
            st = states[i]
            m = st.pending_rows
            if len(feeds[i]) != m:
                raise ValueError(f"sequence {st.seq_id}: {m} unfed rows but {len(feeds[i])} feed tokens")
            tokens.extend(feeds[i])
            if self.knobs.refeed_debug:
                feed = torch.cat(st.pending_hidden)
                for r in range(m):
                    log.info("mtp feed seq %d pos %d token %d hidden %016x", st.seq_id, st.fed_upto + r,
                             feeds[i][r], hidden_fingerprint(feed[r]))
            chunks.append(SeqChunk(st.seq_id, st.fed_upto, m))
            hiddens.extend(st.pending_hidden)   # one concatenation below for every state's rows
            st.fed_upto += m
            st.clear_pending()
        keep = [j for j in live if num_drafts[j] > 0]          # the rest are only fed
        prev = torch.cat(hiddens) if len(hiddens) > 1 else hiddens[0]
        if not keep:   # only fed: the rows' keys and values, and nothing past them (eager, no graph)
            token_tensor = torch.tensor(tokens, dtype=torch.long, device=self.cache.device)
            self.model.mtp.write(token_tensor, prev, PagedAttention(self.cache, writes_plan(self.cache, chunks)))
            return out
        # Only drafting sequences' last rows go past the drafter's attention (the others only
        # write keys and values).
        shape = self._chain_shape(keep, num_drafts, stop, trees, grammars)
        if shape is not None:
            chained = self._chain(tokens, prev, chunks, keep, *shape)
            if chained is not None:
                drafts, probs, best = chained
                for j, i in enumerate(keep):
                    d = out[live[i]]
                    d.tokens.extend(drafts[j])
                    d.probs.extend(probs[j])
                    tree = trees[i] if trees else ()
                    for depth, (count, top) in enumerate(zip(tree, drafts[j]), start=1):
                        if count > 1:
                            d.hedges.extend(hedges(depth, best[j][depth - 1], top, count))
                return out
        hidden, dist = self._forward(tokens, prev, chunks, keep)
        active = [live[j] for j in keep]
        positions = [chunks[j].end - 1 for j in keep]
        for _ in range(max(num_drafts)):
            logits, top_t, top_p = dist   # the logits [B, V], their arg-max and its probability
            masked = logits if grammars is None else grammar_masked(
                logits, [grammars[i] for i in active], [out[i].tokens for i in active])
            spine = masked if self.masks_spine else logits
            if spine is not logits:
                top_t, top_p = top_one(spine)
            if self.knobs.shadow_topk:
                cand_p, cand_t = torch.softmax(logits, dim=-1).topk(self.knobs.shadow_topk, dim=-1)
                for j, i in enumerate(active):
                    log.info("mtp shadow seq %d depth %d top%d %s", states[i].seq_id, len(out[i].tokens) + 1,
                             self.knobs.shadow_topk, list(zip(cand_t[j].tolist(), [round(x, 4) for x in cand_p[j].tolist()])))
            widths = [trees[i][len(out[i].tokens)] if trees and len(trees[i]) > len(out[i].tokens) else 1
                      for i in active]
            cand = masked.topk(max(widths), dim=-1).indices.tolist() if max(widths) > 1 else None
            top_t, top_p = top_t.tolist(), top_p.tolist()
            for j, i in enumerate(active):
                out[i].tokens.append(top_t[j])
                out[i].probs.append(top_p[j])
                if widths[j] > 1:
                    out[i].hedges.extend(hedges(len(out[i].tokens), cand[j], top_t[j], widths[j]))
            # The confidence stop (docs/design.md §5.4): a chain whose last draft fell below TAU is not extended.
            keep = [j for j, i in enumerate(active) if len(out[i].tokens) < num_drafts[i]
                    and (ln_tau is None or extends(out[i].probs, ln_tau))]
            if not keep:
                break
            prev = hidden if len(keep) == len(active) else hidden[keep]
            active = [active[j] for j in keep]
            positions = [positions[j] + 1 for j in keep]
            chunks = [SeqChunk(states[i].seq_id, p, 1) for i, p in zip(active, positions)]
            hidden, dist = self._forward([out[i].tokens[-1] for i in active], prev, chunks)
        return out

    def _chain_shape(self, keep: list[int], num_drafts: list[int], stop: float | None,
                     trees: list[tuple[int, ...]] | None,
                     grammars: list[GrammarMatcher | None] | None) -> tuple[int, int] | None:
        """(depth, width) when the drafts of the sequences `keep` run as one chained graph
        (`_chain`), else None: a compiled drafter, one sequence drafting a chain, or a tree, whose
        shape was compiled (`warm_up_chain`), and nothing that looks at a depth's distribution
        before the next depth runs: no confidence stop, grammar or shadow log. (Several sequences
        would chain too, but gained little there and their graphs would double the chain's compile
        time, docs/design.md §3 "Chained drafts"; they run step by step.)"""
        if not self._compile or self.knobs.shadow_topk or stop is not None or len(keep) != 1:
            return None
        if grammars is not None and any(g is not None for g in grammars):
            return None
        depth = num_drafts[keep[0]]
        tree = trees[keep[0]] if trees else ()
        shape = (depth, max(tree[:depth], default=1))
        return shape if shape in self._chain_shapes else None

    @torch.inference_mode()
    def _chain(self, tokens: list[int], prev_hidden: torch.Tensor, chunks: list[SeqChunk], query: list[int],
               steps: int, width: int = 1) -> tuple[list[list[int]], list[list[float]], list | None] | None:
        """`steps` drafts of each chunk in `query` as one compiled graph (`MTPLayer.draft_chain`):
        the first step feeds every chunk's rows, as `_forward` does, and each later one drafts from
        the last, with its attention planned here beforehand (`AttentionBackend.chain_plans`). The same drafts as
        `steps` separate steps, without the host work between them (a graph call, a plan, a read
        of the draft). Returns the drafts, their probabilities and, with `width` > 1, each step's
        `width` best tokens [chunk][step][width]; None where the native attention plan cannot hold
        the chain."""
        paged, rows, token_tensor = self._step_inputs(tokens, chunks, query)
        if not chains_natively(paged):
            return None
        later = self.attention.chain_plans(self.cache, [chunks[j].seq_id for j in query],
                                           [chunks[j].end - 1 for j in query], steps)
        if self._compiled_chain is None:
            self._compiled_chain = compile_step(self.model.mtp.draft_chain)
        with forward_context(paged, self.model, chain=later) as ctx:
            got = self._compiled_chain(token_tensor, prev_hidden, paged.plan.positions, ctx, rows, steps,
                                       CHAIN_ATTENTION, width)
        return got[0].tolist(), got[1].tolist(), got[2].tolist() if width > 1 else None

    def _distribution(self, hidden: torch.Tensor):
        """Draft logits of the rows `hidden` [B, H] -> (logits in float32 [B, V], arg-max [B], its
        probability [B]), as `MTPLayer.draft` computes them."""
        logits = self.model.mtp.logits(hidden).float()
        return logits, *top_one(logits)

    def _step_inputs(self, tokens: list[int], chunks: list[SeqChunk],
                     query: list[int]) -> tuple[PagedAttention, torch.Tensor, torch.Tensor]:
        """A drafter step's attention over `chunks` (every row writes its keys and values; the
        last rows of the chunks `query` attend), those rows' indices [B] and the tokens [T]."""
        ends = list(itertools.accumulate(c.num_tokens for c in chunks))
        plan = self.attention.plan(self.cache, chunks)
        # One row per chunk, every chunk asked: the step's own plan already attends for those rows.
        own = len(query) == len(chunks) and ends[-1] == len(chunks)
        queries = None if own else self.attention.query_plan(self.cache, [chunks[j] for j in query])
        rows = plan.last_rows if own else torch.tensor([ends[j] - 1 for j in query], dtype=torch.long,
                                                        device=self.cache.device)
        token_tensor = torch.tensor(tokens, dtype=torch.long, device=self.cache.device)
        return PagedAttention(self.cache, plan, queries), rows, token_tensor

    def _forward(self, tokens: list[int], prev_hidden: torch.Tensor, chunks: list[SeqChunk],
                 query: list[int] | None = None):
        """One drafter step over `chunks` -> (the output [B, H] of the last rows of the chunks
        `query` (default: all), their distribution (`_distribution`)). Every row writes its keys
        and values; only those last rows go on through attention, the MLP and the head (a static
        bucket runs every row, then picks them)."""
        self.forwards += 1
        ends = list(itertools.accumulate(c.num_tokens for c in chunks))
        query = list(range(len(chunks))) if query is None else query
        shape = self.graphs.shape_of(chunks) if self.graphs is not None else None
        if shape is not None:
            h, _ = self.graphs.run(tokens, chunks, shape, prev_hidden)
            h = h[torch.tensor([ends[j] - 1 for j in query], dtype=torch.long, device=self.cache.device)]
            return h, self._distribution(h)
        paged, rows, token_tensor = self._step_inputs(tokens, chunks, query)
        h, *dist = self.mode((token_tensor, prev_hidden), paged.plan.positions, paged, (rows,))
        return h, tuple(dist)

    @property
    def compiles(self) -> bool:
        """Whether the drafter's forward runs compiled (`compiled` above)."""
        return self._compile

    @torch.inference_mode()
    def warm_up(self, chunks: list[SeqChunk]) -> None:
        """One drafter step over `chunks` (their positions reserved by the caller, whose drafter
        cells it overwrites) and its drafts' distribution: a compiled drafter builds the graph of
        that shape now rather than in a request. The graphs differ by row count (one, several)
        and by sequence count (one, several), dynamic otherwise."""
        rows = sum(c.num_tokens for c in chunks)
        hidden = torch.zeros(rows, self.model.config.hidden_size, dtype=self.model.dtype, device=self.cache.device)
        self._forward([0] * rows, hidden, chunks)

    @torch.inference_mode()
    def warm_up_chain(self, chunks: list[SeqChunk], steps: int, width: int = 1) -> bool:
        """Compile the chained drafts (`_chain`) of `steps` drafts (a tree's spine when `width`, its
        widest count, is above 1) after a first step over `chunks` (one sequence; the caller
        reserved its positions up to `steps - 1` past the chunk and gives up its drafter cells
        there); from then on a one-sequence propose of that shape runs as one graph. The graphs
        differ by the first step's row count (one, several). False when the chain cannot run here
        (not compiled, no native attention plan)."""
        if not self._compile or len(chunks) != 1 or not 2 <= steps < MAX_CHAIN or width < 1:
            return False
        rows = chunks[0].num_tokens
        hidden = torch.zeros(rows, self.model.config.hidden_size, dtype=self.model.dtype, device=self.cache.device)
        if self._chain([0] * rows, hidden, chunks, [0], steps, width) is None:
            return False
        self._chain_shapes.add((steps, width))
        return True

    def num_final(self, state: ProposerState, num_computed: int) -> int:
        """Only rows already fed are final: row i is written when the token at i + 1 is fed with it."""
        return min(num_computed, state.fed_upto)

    def after_verify(self, state, num_accepted: int) -> None:
        """Nothing to trim: rows past `fed_upto` are drafts and are overwritten by the next feed."""
