"""Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash) over a compressed KV cache.

Shapes: T tokens, nh query heads, C = kv_lora_rank (the latent), Dr = qk_rope_head_dim,
Dn = qk_nope_head_dim, Dv = v_head_dim.

Each token's keys and values are a function of one latent c [C] (after `kv_a_layernorm`) plus
one rotary key part kr [Dr] shared by all heads: head h's key is [W_uk[h] c ; kr] and its value
W_uv[h] c, where `kv_b_proj` stacks W_uk [Dn, C] and W_uv [Dv, C] per head. The cache keeps only
[c ; kr] per token (C + Dr values, runtime.executor.kv_cache's latent layout), not nh * (Dn + Dr + Dv).

Attention runs absorbed, as multi-query attention over the latent: head h's query becomes
[W_uk[h]^T q_nope ; q_rope] [C + Dr], the one key/value head is [c ; kr] with the value its first
C channels, and W_uv[h] maps the output back to Dv. Scores are equal to the expanded form's
(q_nope . W_uk c = (W_uk^T q_nope) . c), so prefill, decode, chain and tree verify rows all go
through the same paged attention with the same masks. Absorbing costs C + Dr per (query, key,
head) instead of Dn + Dr (+ Dv for values); it is the cheaper form whenever keys are read from
the cache (decode, verify: few queries, many keys, no per-key expansion to pay). A long prefill
would be cheaper expanded; this runtime absorbs everywhere (one code path, one rounding).
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.ops import batch_invariant as bi
from runtime.model.config import ModelConfig
from runtime.model.layers import AttentionContext, KVWriter, Linear, RMSNorm
from runtime.model.rotary import apply_rotary, softmax_scale
from runtime.model.sparse_attention import DsaSelection, Indexer


def per_head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, nh, a], weight [nh, b, a] -> [T, nh, b]: head h's rows times weight[h]^T."""
    return torch.einsum("tna,nba->tnb", x, weight)


def per_head_linear_invariant(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`per_head_linear` as one fixed-tile GEMM per head: a row's result does not depend on T."""
    return torch.stack([bi.linear(x[:, h], weight[h]) for h in range(weight.shape[0])], dim=1)


class MLAttention(bi.InvariantSwitch, nn.Module):
    """Checkpoint names as transformers' DeepseekV3Attention: q_proj (no q_lora_rank) or
    q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj."""

    switched = {"_per_head": "_per_head_invariant"}
    # Linears whose weight is read as a matrix (kv_b_proj: absorbed into per-head products), so an
    # FP8 checkpoint's is dequantized on load whatever the weight format (runtime.model.weights).
    dense_weights = ("kv_b_proj",)
    _per_head = staticmethod(per_head_linear)
    _per_head_invariant = staticmethod(per_head_linear_invariant)

    def __init__(self, cfg: ModelConfig, layer_idx: int, sparse: DsaSelection | None = None) -> None:
        """`sparse`: the model's DeepSeek sparse attention (runtime.model.sparse_attention), shared by its
        layers; this layer then has an `indexer` unless it reuses the selection before it."""
        super().__init__()
        self.layer_idx = layer_idx
        self.sparse = sparse
        self.indexer = Indexer(cfg) if sparse is not None and cfg.has_indexer(layer_idx) else None
        self.num_heads = cfg.num_attention_heads
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope
        h = cfg.hidden_size
        self.scale = softmax_scale(cfg, qk)
        self.interleaved = cfg.rope_interleave
        self.has_q_lora = cfg.q_lora_rank is not None
        if not self.has_q_lora:
            self.q_proj = Linear(h, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, cfg.kv_lora_rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=cfg.o_proj_bias)
        self.o_proj.in_parts = bi.halves(self.num_heads)   # batch-invariant: EP 2 adds what EP 1 adds

    @property
    def num_kv_heads(self) -> int:
        """One latent 'head' shared by every query head."""
        return 1

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; with `rows` [B], every row's latent keys but only those rows'
        queries and output [B, H] (`ctx` attends for them alone)."""
        cos, sin = rope
        xq, q_cos, q_sin = (x, cos, sin) if rows is None else (x[rows], cos[rows], sin[rows])
        t = xq.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(xq)) if self.has_q_lora else None
        q = self.q_b_proj(q_resid) if self.has_q_lora else self.q_proj(xq)
        q = q.view(t, -1, self.nope + self.rope)                                   # [T, nh, Dn + Dr]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)                                       # [T, C]
        q_rope = apply_rotary(q_rope, q_cos, q_sin, self.interleaved)
        k_rope = apply_rotary(k_rope[:, None], cos, sin, self.interleaved)         # [T, 1, Dr]
        w = self.kv_b_proj.weight.view(-1, self.nope + self.v_dim, self.kv_lora_rank)   # [nh, Dn + Dv, C]
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        q_latent = self._per_head(q_nope, w_uk.transpose(1, 2))                    # [T, nh, C]
        key = torch.cat((latent[:, None], k_rope), dim=-1)                          # [T, 1, C + Dr]
        if self.sparse is not None:   # the indexer's key goes to the cache beside the latent
            cell = self.sparse.cache_key(key, None if self.indexer is None else self.indexer.key(x, rope))
            out = self.sparse.attend(ctx, self.layer_idx, torch.cat((q_latent, q_rope), dim=-1), cell, self.indexer,
                                     q_resid, xq, (q_cos, q_sin), self.scale, self.kv_lora_rank)
        else:
            out = ctx.attend(self.layer_idx, torch.cat((q_latent, q_rope), dim=-1), key,
                             key[..., :self.kv_lora_rank], self.scale)              # [T, nh, C]
        out = self._per_head(out, w_uv)                                             # [T, nh, Dv]
        return self.o_proj(out.reshape(t, -1))

    def write_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: KVWriter) -> None:
        """x [T, H]: every row's latent key into `ctx` (computed as `forward` does), nothing else."""
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        key = torch.cat((self.kv_a_layernorm(latent)[:, None], apply_rotary(k_rope[:, None], *rope, self.interleaved)),
                        dim=-1)                                                     # [T, 1, C + Dr]
        if self.sparse is not None:
            key = self.sparse.cache_key(key, None if self.indexer is None else self.indexer.key(x, rope))
        ctx.write(self.layer_idx, key, key[..., :self.kv_lora_rank])

