"""The multi-token-prediction layer and the drafter's entry points: one draft step, a fed row's
keys and values alone, a chain of drafts as one function (a compiled drafter runs it as one
graph). The target CausalLM (runtime.model.causal_lm) holds it as `model.mtp`.

Shapes: T rows, B drafting sequences, H hidden, V vocab.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.ops import batch_invariant as bi
from runtime.model.config import ModelConfig
from runtime.model.decoder import DecoderLayer, RowTwice, bind_rows_twice
from runtime.model.layers import AttentionContext, KVWriter, Linear, make_norm
from runtime.model.sparse_attention import DsaSelection


def top_one(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, V] -> (arg-max [B], its probability [B]): a draft and its confidence."""
    top_l, top_t = logits.max(dim=-1)
    return top_t, torch.exp(top_l - torch.logsumexp(logits, dim=-1))


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = make_norm(cfg, cfg.hidden_size)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_head else None


class MTPLayer(bi.InvariantSwitch, nn.Module):
    """One multi-token-prediction layer (checkpoint index `num_hidden_layers`).

    Draft step: x = eh_proj(concat(enorm(embed(token)), hnorm(hidden))), then a decoder layer with
    its own KV plane (cache layer index `num_hidden_layers`), then `shared_head.norm` and the head.
    Embedding and head fall back to the target model's when the checkpoint does not carry them.
    `hidden` is pre-norm (the target's, or the previous draft step's output before
    `shared_head.norm`), except where `normed` (Qwen3.5, `ModelConfig.mtp_normed_hidden`): there
    it is the target's after its final norm (`target_hidden`) or the previous step's after
    `shared_head.norm`, which is also what the head reads.
    """

    one_row_twice = False   # as its target's, where its own kernels are batch-invariant too (`_switched`)

    def __init__(self, cfg: ModelConfig, target: nn.Module, own_embed: bool = False, own_head: bool = False,
                 sparse: DsaSelection | None = None) -> None:
        super().__init__()
        # The target CausalLM whose embedding, head and rotary the layer falls back to: a plain
        # reference, not a submodule (its weights stay the target's in the state dict).
        object.__setattr__(self, "target", target)
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embed else None
        self.enorm = make_norm(cfg, h)
        self.hnorm = make_norm(cfg, h)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers, sparse)
        self.shared_head = SharedHead(cfg, own_head)
        self.normed = cfg.mtp_normed_hidden

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's pre-norm hidden rows [T, H] -> what this layer is fed for them (`hidden`, or
        after the target's final norm where `normed`)."""
        return self.target.norm(hidden) if self.normed else hidden

    def _switched(self, on: bool) -> None:
        self.one_row_twice = on and self.target.one_row_twice
        bind_rows_twice(self, self.one_row_twice)

    def _rows_twice(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                    ctx: AttentionContext, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`forward`, a one-row step as two copies of its row (bound as `forward` by `_switched`;
        with one row, `rows` can only be [0])."""
        if tokens.shape[0] == 1:
            return MTPLayer.forward(self, tokens.expand(2), prev_hidden.expand(2, -1), positions.expand(2),
                                    RowTwice(ctx))[:1]
        return MTPLayer.forward(self, tokens, prev_hidden, positions, ctx, rows)

    def forward(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                    ctx: AttentionContext, rows: torch.Tensor | None = None) -> torch.Tensor:
        """One MTP step: tokens [T] at `positions`, the previous position's hidden [T, H] ->
        the MTP layer's output [T, H] (the input hidden of the next draft step; pre-norm, or
        after `shared_head.norm` where `normed`). With
        `rows` [B] (and `ctx` attending for those rows alone), the output of those rows [B, H]:
        every row's keys and values are still written, and nothing else is computed for the rest."""
        x = self._input(tokens, prev_hidden)
        out = self.block(x, self.target.rotary(positions, x.dtype), ctx, rows)
        return self.shared_head.norm(out) if self.normed else out

    def _input(self, tokens: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's input [T, H]: eh_proj(concat(enorm(embed(token)), hnorm(hidden)))."""
        embed = self.embed_tokens if self.embed_tokens is not None else self.target.embed_tokens
        return self.eh_proj(torch.cat((self.enorm(embed(tokens)), self.hnorm(prev_hidden)), dim=-1))

    def write(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, ctx: KVWriter) -> None:
        """Feed rows that draft nothing: tokens [T] at `ctx.positions` with the previous
        positions' hidden [T, H] write the MTP layer's keys and values, computed as `forward`
        computes them over the same rows, and nothing else runs: no attention, MLP or head."""
        x = self._input(tokens, prev_hidden)
        self.block.write_kv(x, self.target.rotary(ctx.positions, x.dtype), ctx)

    def draft(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                  ctx: AttentionContext, rows: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One MTP step and the distributions it drafts from, as one function (a compiled drafter
        runs it as one graph): `forward` for the rows `rows` [B] (each drafting sequence's last
        row; `ctx` attends for them alone), then their draft logits in float32 [B, V], arg-max [B]
        and its probability [B]. Returns (those rows' pre-norm output [B, H], logits, arg-max,
        probability)."""
        hidden = self.forward(tokens, prev_hidden, positions, ctx, rows)
        logits = self.logits(hidden).float()
        return hidden, logits, *top_one(logits)

    def draft_chain(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                        ctx: AttentionContext, rows: torch.Tensor, steps: int,
                        later: tuple[AttentionContext, ...], width: int = 1) -> tuple[torch.Tensor, ...]:
        """`steps` MTP draft steps as one function (a compiled drafter runs them as one graph): the
        first as `draft` (its rows fed, `rows` [B] going on), then each later step s takes the
        last step's arg-max and output at the next position, one row a sequence, through attention
        context `later[s]`. Returns the drafts [B, steps] and their probabilities [B, steps], as
        `steps` calls of `draft` give them, and with `width` > 1 each step's `width` best
        tokens [B, steps, width] (a draft tree's hedges come from them)."""
        hidden, logits, token, prob = self.draft(tokens, prev_hidden, positions, ctx, rows)
        drafts, probs, best = [token], [prob], []
        position = positions[rows]
        for s in range(1, steps + 1):
            if width > 1:
                best.append(logits.topk(width, dim=-1).indices)
            if s == steps:
                break
            position = position + 1
            hidden, logits, token, prob = self.draft(token, hidden, position, later[s], None)
            drafts.append(token)
            probs.append(prob)
        out = (torch.stack(drafts, dim=1), torch.stack(probs, dim=1))
        return (*out, torch.stack(best, dim=1)) if width > 1 else out

    def logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """MTP output [N, H] (`forward`'s) -> draft logits [N, V]."""
        head = self.shared_head
        lm = head.head if head.head is not None else self.target.lm_head
        return lm(mtp_hidden if self.normed else head.norm(mtp_hidden))
