"""The MoE causal LM of every served family (runtime.model.families), single device, no
collectives inside: decoder layers (runtime.model.decoder) as the config says, and its MTP layer
(runtime.model.mtp, which holds the drafter's entry points).

Shapes: T tokens flattened over sequences, H hidden, V vocab.
`forward` returns hidden states *before* the final norm; `compute_logits` applies the norm and
the head. The MTP drafter needs the pre-norm hidden of the last committed position (docs/design.md §3).
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.ops import batch_invariant as bi
from runtime.model.config import ModelConfig
from runtime.model.decoder import DecoderLayer, RowTwice, bind_rows_twice
from runtime.model.layers import AttentionContext, Linear, make_norm
from runtime.model.mla import MLAttention
from runtime.model.mtp import MTPLayer
from runtime.model.rotary import RotaryEmbedding
from runtime.model.sparse_attention import DsaSelection


class CausalLM(bi.InvariantSwitch, nn.Module):
    # Set with batch invariance (runtime.ops.batch_invariant.set_batch_invariant): one-row steps run
    # as two copies of the row where one-row GEMMs round otherwise than the rest (`_switched`).
    one_row_twice = False

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
        self.mtp = (MTPLayer(cfg, self, mtp_own_embed, mtp_own_head, self.sparse)
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
        x = self.embed_tokens(tokens)
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, ctx)
        return x

    def _switched(self, on: bool) -> None:
        """Whether a batch-invariant step of one row runs as two copies of it: where a GEMM
        gives one row alone another result than rows in company (float32 on this CPU, by
        `bi.gemm_plan`), `bi.linear` would pad every call (~60 a step, a pad and a slice each);
        two copies make every call, the routed experts' included, two rows long without them. The
        copy's keys and values are never written (`RowTwice`). Not with a recurrent state (it
        would take the copy in too)."""
        w = self.lm_head.weight
        self.one_row_twice = on and not self.config.linear_layers and bi.gemm_plan(w, w.dtype, False)[0] > 1
        bind_rows_twice(self, self.one_row_twice)

    def _rows_twice(self, tokens: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """`forward`, a one-row step as two copies of its row (bound as `forward` by `_switched`)."""
        if tokens.shape[0] == 1:
            return CausalLM.forward(self, tokens.expand(2), positions.expand(2), RowTwice(ctx))[:1]
        return CausalLM.forward(self, tokens, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [N, H] -> logits [N, V]."""
        return self.lm_head(self.norm(hidden))
