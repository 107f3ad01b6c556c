"""The MoE causal LM of every served family (runtime.model.families) and its MTP layer, single
device, no collectives inside. A decoder layer takes grouped-query or multi-head latent attention
and a dense or MoE MLP as the config says.

Shapes: T tokens flattened over sequences, H hidden, V vocab.
`forward` returns hidden states *before* the final norm; `compute_logits` applies the norm and
the head. The MTP drafter needs the pre-norm hidden of the last committed position (docs/design.md §3).
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.ops import batch_invariant as bi
from runtime.model.config import ModelConfig
from runtime.model.layers import MLP, Attention, AttentionContext, KVWriter, Linear, MoE, make_norm
from runtime.model.linear_attention import GatedDeltaNet
from runtime.model.mla import MLAttention
from runtime.model.rotary import RotaryEmbedding
from runtime.model.sparse_attention import DsaSelection


def top_one(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, V] -> (arg-max [B], its probability [B]): a draft and its confidence."""
    top_l, top_t = logits.max(dim=-1)
    return top_t, torch.exp(top_l - torch.logsumexp(logits, dim=-1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, sparse: DsaSelection | None = None) -> None:
        super().__init__()
        # The token mixer, chosen here once: Gated DeltaNet (`linear_attn`, a recurrent state per
        # sequence) for the linear-attention layers of `layer_types`, else attention (`self_attn`).
        if layer_idx in cfg.linear_layers:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            plane = cfg.cache_index(layer_idx)
            self.self_attn: nn.Module = MLAttention(cfg, plane, sparse) if cfg.is_mla else Attention(cfg, plane)
        self.mlp: nn.Module = (MoE(cfg) if cfg.is_moe_layer(layer_idx)
                               else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)

    @property
    def mixer(self) -> nn.Module:
        return self._modules.get("self_attn") or self._modules["linear_attn"]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; with `rows` [B], every row's keys and values are written but only
        those rows go on past attention ([B, H]: a fed row that drafts nothing needs no more)."""
        attn = self.mixer(self.input_layernorm(x), rope, ctx, rows)
        x = (x if rows is None else x[rows]) + attn
        return x + self.mlp(self.post_attention_layernorm(x))

    def write_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: KVWriter) -> None:
        """x [T, H]: every row's keys and values into `ctx`, as `forward` writes them; nothing else."""
        self.self_attn.write_kv(self.input_layernorm(x), rope, ctx)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = make_norm(cfg, cfg.hidden_size)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_head else None


class MTPLayer(nn.Module):
    """One multi-token-prediction layer (checkpoint index `num_hidden_layers`).

    Draft step: x = eh_proj(concat(enorm(embed(token)), hnorm(hidden))), then a decoder layer with
    its own KV plane (cache layer index `num_hidden_layers`), then `shared_head.norm` and the head.
    Embedding and head fall back to the target model's when the checkpoint does not carry them.
    """

    batch_invariant = False   # its modules' kernels (runtime.ops.batch_invariant.set_batch_invariant)

    def __init__(self, cfg: ModelConfig, own_embed: bool = False, own_head: bool = False,
                 sparse: DsaSelection | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embed else None
        self.enorm = make_norm(cfg, h)
        self.hnorm = make_norm(cfg, h)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers, sparse)
        self.shared_head = SharedHead(cfg, own_head)


class RowTwice:
    """The `AttentionContext` of a one-row step run as two copies of its row: the first row
    attends (and writes its keys and values) through `ctx`, the copy reuses its output."""

    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx = ctx

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        out = self.ctx.attend(layer_idx, q[:1], k[:1], v[:1], scale)
        return out.expand(2, *out.shape[1:])

    def visible_keys(self, layer_idx: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sparse attention's view (runtime.model.sparse_attention): the first row's, for both copies."""
        keys, seq, visible = self.ctx.visible_keys(layer_idx, k[:1])
        return keys, seq.expand(2), visible.expand(2, -1)


class CausalLM(nn.Module):
    # Switched by runtime.ops.batch_invariant.set_batch_invariant: one-row steps run as two copies of
    # the row where one-row GEMMs round otherwise than the rest (`_twice`).
    batch_invariant = False

    def __init__(self, cfg: ModelConfig, *, mtp_own_embed: bool = False, mtp_own_head: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # Sparse attention (GLM-5, DeepSeek-V3.2), chosen here once and handed to every MLA layer.
        self.sparse = DsaSelection(cfg) if cfg.is_sparse else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.sparse) for i in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        self.mtp = (MTPLayer(cfg, mtp_own_embed, mtp_own_head, self.sparse)
                    if cfg.num_nextn_predict_layers else None)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights live; the runner puts the cache and every step tensor there too."""
        return self.embed_tokens.weight.device

    def cache_layout(self) -> dict[str, int | None]:
        """`PagedKVCache` keywords for this model's (this rank's) attention: key/value heads and
        head dim, and for multi-head latent attention the latent width (runtime.model.mla)."""
        full = [layer for layer in self.layers if "self_attn" in layer._modules]
        attn = (full[0] if full else self.mtp.block).self_attn
        if isinstance(attn, MLAttention):
            index = self.sparse.index_dim if self.sparse is not None else 0   # the indexer key beside the latent
            return {"num_kv_heads": 1, "head_dim": attn.kv_lora_rank + attn.rope + index,
                    "latent_dim": attn.kv_lora_rank}
        return {"num_kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim, "latent_dim": None}

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """tokens, positions [T] -> hidden states before the final norm [T, H]."""
        if self._twice(tokens):
            return self.forward(tokens.expand(2), positions.expand(2), RowTwice(ctx))[:1]
        x = self.embed_tokens(tokens)
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, ctx)
        return x

    def _twice(self, tokens: torch.Tensor) -> bool:
        """Whether this batch-invariant step of one row runs as two copies of it: where a GEMM
        gives one row alone another result than rows in company (float32 on this CPU, by
        `bi.gemm_plan`), `bi.linear` would pad every call (~60 a step, a pad and a slice each);
        two copies make every call, the routed experts' included, two rows long without them. The
        copy's keys and values are never written (`RowTwice`)."""
        if not self.batch_invariant or tokens.shape[0] != 1 or self.config.linear_layers:
            return False   # (a recurrent state would take the copy in too)
        w = self.lm_head.weight
        return bi.gemm_plan(w, w.dtype, False)[0] > 1

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [N, H] -> logits [N, V]."""
        return self.lm_head(self.norm(hidden))

    def mtp_forward(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                    ctx: AttentionContext, rows: torch.Tensor | None = None) -> torch.Tensor:
        """One MTP step: tokens [T] at `positions`, the previous position's hidden [T, H] ->
        the MTP layer's pre-norm output [T, H] (the input hidden of the next draft step). With
        `rows` [B] (and `ctx` attending for those rows alone), the output of those rows [B, H]:
        every row's keys and values are still written, and nothing else is computed for the rest."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer (num_nextn_predict_layers is 0)")
        if self.mtp.batch_invariant and self._twice(tokens):   # one row: `rows` can only be [0]
            return self.mtp_forward(tokens.expand(2), prev_hidden.expand(2, -1), positions.expand(2),
                                    RowTwice(ctx))[:1]
        x = self._mtp_input(tokens, prev_hidden)
        return self.mtp.block(x, self.rotary(positions, x.dtype), ctx, rows)

    def _mtp_input(self, tokens: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's input [T, H]: eh_proj(concat(enorm(embed(token)), hnorm(hidden)))."""
        mtp = self.mtp
        embed = mtp.embed_tokens if mtp.embed_tokens is not None else self.embed_tokens
        return mtp.eh_proj(torch.cat((mtp.enorm(embed(tokens)), mtp.hnorm(prev_hidden)), dim=-1))

    def mtp_write(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, ctx: KVWriter) -> None:
        """Feed rows that draft nothing: tokens [T] at `ctx.positions` with the previous
        positions' hidden [T, H] write the MTP layer's keys and values, computed as `mtp_forward`
        computes them over the same rows, and nothing else runs: no attention, MLP or head."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer (num_nextn_predict_layers is 0)")
        x = self._mtp_input(tokens, prev_hidden)
        self.mtp.block.write_kv(x, self.rotary(ctx.positions, x.dtype), ctx)

    def mtp_draft(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                  ctx: AttentionContext, rows: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One MTP step and the distributions it drafts from, as one function (a compiled drafter
        runs it as one graph): `mtp_forward` for the rows `rows` [B] (each drafting sequence's last
        row; `ctx` attends for them alone), then their draft logits in float32 [B, V], arg-max [B]
        and its probability [B]. Returns (those rows' pre-norm output [B, H], logits, arg-max,
        probability)."""
        hidden = self.mtp_forward(tokens, prev_hidden, positions, ctx, rows)
        logits = self.mtp_logits(hidden).float()
        return hidden, logits, *top_one(logits)

    def mtp_draft_chain(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                        ctx: AttentionContext, rows: torch.Tensor, steps: int,
                        later: tuple[AttentionContext, ...], width: int = 1) -> tuple[torch.Tensor, ...]:
        """`steps` MTP draft steps as one function (a compiled drafter runs them as one graph): the
        first as `mtp_draft` (its rows fed, `rows` [B] going on), then each later step s takes the
        last step's arg-max and output at the next position, one row a sequence, through attention
        context `later[s]`. Returns the drafts [B, steps] and their probabilities [B, steps], as
        `steps` calls of `mtp_draft` give them, and with `width` > 1 each step's `width` best
        tokens [B, steps, width] (a draft tree's hedges come from them)."""
        hidden, logits, token, prob = self.mtp_draft(tokens, prev_hidden, positions, ctx, rows)
        drafts, probs, best = [token], [prob], []
        position = positions[rows]
        for s in range(1, steps + 1):
            if width > 1:
                best.append(logits.topk(width, dim=-1).indices)
            if s == steps:
                break
            position = position + 1
            hidden, logits, token, prob = self.mtp_draft(token, hidden, position, later[s], None)
            drafts.append(token)
            probs.append(prob)
        out = (torch.stack(drafts, dim=1), torch.stack(probs, dim=1))
        return (*out, torch.stack(best, dim=1)) if width > 1 else out

    def mtp_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """MTP pre-norm output [N, H] -> draft logits [N, V]."""
        head = self.mtp.shared_head
        lm = head.head if head.head is not None else self.lm_head
        return lm(head.norm(mtp_hidden))
