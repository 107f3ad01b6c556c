"""The MTP drafter: the checkpoint's multi-token-prediction layer, on its own KV plane.

Shapes: m fed rows, B sequences, H hidden, V vocab.

Drafter row i pairs the target's hidden at position i with the token at position i + 1 and
predicts the token at i + 2; its keys/values live at position i of cache layer
`num_hidden_layers`, in the same paged blocks as the sequence's target rows. A propose first feeds
the rows of committed positions the drafter has not seen (the prompt after prefill, the accepted
rows after a verify), whose last row gives draft 1; each further draft feeds the drafter's own
output and the previous draft. Draft rows past the committed ones are overwritten by the next feed.
"""
from __future__ import annotations

import torch

from runtime.attention import PagedAttention, SeqChunk, build_plan
from runtime.kv_cache import PagedKVCache
from runtime.model import Glm4MoeForCausalLM
from speculative.proposer import DraftProposer, Drafts, ProposeRequest


class MTPProposer(DraftProposer):
    def __init__(self, model: Glm4MoeForCausalLM, cache: PagedKVCache) -> None:
        if model.mtp is None:
            raise ValueError("this checkpoint has no MTP layer (no model.layers.{num_hidden_layers}.* tensors): "
                             "MTP speculation needs one")
        self.model = model
        self.cache = cache

    def propose(self, req: ProposeRequest) -> Drafts:
        return self.propose_batch([req])[0]

    @torch.inference_mode()
    def propose_batch(self, reqs: list[ProposeRequest]) -> list[Drafts]:
        out: list[Drafts] = [Drafts([], []) for _ in reqs]
        live = [i for i, r in enumerate(reqs) if r.num_drafts > 0 and r.state.pending_hidden]
        if not live:
            return out
        # Feed: every unseen committed row, one chunk per sequence.
        tokens, chunks, hiddens = [], [], []
        for i in live:
            st = reqs[i].state
            feed = torch.cat(st.pending_hidden) if len(st.pending_hidden) > 1 else st.pending_hidden[0]
            m = feed.shape[0]
            tokens.extend(reqs[i].token_ids[st.fed_upto + 1:st.fed_upto + 1 + m])
            chunks.append(SeqChunk(st.seq_id, st.fed_upto, m))
            hiddens.append(feed)
            st.fed_upto += m
            st.pending_hidden.clear()
        hidden, last = self._forward(tokens, torch.cat(hiddens), chunks)
        positions = [c.end - 1 for c in chunks]
        active = list(live)
        for depth in range(max(reqs[i].num_drafts for i in live)):
            logits = self.model.mtp_logits(hidden[last]).float()
            probs = torch.softmax(logits, dim=-1)
            top_p, top_t = probs.max(dim=-1)
            for j, i in enumerate(active):
                out[i].tokens.append(int(top_t[j]))
                out[i].probs.append(float(top_p[j]))
            keep = [j for j, i in enumerate(active) if len(out[i].tokens) < reqs[i].num_drafts]
            if not keep:
                break
            prev = hidden[last[keep]]
            active = [active[j] for j in keep]
            positions = [positions[j] + 1 for j in keep]
            chunks = [SeqChunk(reqs[i].state.seq_id, p, 1) for i, p in zip(active, positions)]
            hidden, last = self._forward([out[i].tokens[-1] for i in active], prev, chunks)
        return out

    def _forward(self, tokens: list[int], prev_hidden: torch.Tensor, chunks: list[SeqChunk]):
        plan = build_plan(self.cache, chunks)
        h = self.model.mtp_forward(torch.tensor(tokens, dtype=torch.long), prev_hidden, plan.positions,
                                   PagedAttention(self.cache, plan))
        return h, plan.last_rows

    def after_verify(self, state, num_accepted: int) -> None:
        """Nothing to trim: rows past `fed_upto` are drafts and are overwritten by the next feed."""
