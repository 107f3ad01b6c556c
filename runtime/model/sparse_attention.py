"""DeepSeek sparse attention (DSA: GLM-5, DeepSeek-V3.2) over the MLA latent cache (runtime.model.mla).

Shapes: T step tokens, R query rows, B sequences, K longest context, nh query heads, C the
latent (kv_lora_rank), Dr the rotary key, Di = index_head_dim, ni = index_n_heads.

Each layer marked "full" in `indexer_types` (and the MTP layer) has an `Indexer`: per token one
key [Di] (`wk`, LayerNorm `k_norm`, rotary on its first Dr channels: interleaved for GLM-5,
half-split for V3.2), kept in the paged cache in the same cell as the token's latent: a sparse
model's cache cell is [c ; kr ; ik] (C + Dr + Di values), so blocks, tables, prefix caching,
preemption and the moves of a tree verify carry it unchanged. A row's query (`wq_b` of the q LoRA
residual, ni heads) scores every key the row may see, relu(q . k) / sqrt(Di) weighted per head by
`weights_proj`, and the row attends to its `index_topk` best (all of them when it sees fewer).
A "shared" layer reuses the selection of the full layer before it (`DsaSelection.last`).

The context a layer attends through gives the layer's context keys and the step's `SparseStep`:
per query row the keys it may see (prefill causal, decode, chain and tree verify rows, a tree
row's ancestors and not its siblings, exactly the visibility of the dense plan), built once with
the step's plan (runtime.executor.attention.SparseAttention), and the step's selection. The
selection is that visibility narrowed to the top-k, made by each full layer and kept in the
step for the shared layers after it (nothing of a step stays in the model); attention is the
absorbed MLA over the selected keys.
Scores follow transformers (`GlmMoeDsaIndexer`): computed in float32, whatever the model dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.config import ModelConfig
from runtime.model.layers import Linear
from runtime.model.rotary import apply_rotary


@dataclass(slots=True)
class SparseStep:
    """What sparse attention reads of one step besides the keys: each query row's sequence `seq`
    [R] and the keys it may see `visible` [R, K] (bool), built with the step's plan; and the
    selection the last full indexer layer made this step (`chosen`, `DsaSelection.select`'s
    answer, by layer `chosen_by`; -1 before any), which the shared layers after it read."""
    seq: torch.Tensor
    visible: torch.Tensor
    chosen: tuple[torch.Tensor, torch.Tensor] | None = None
    chosen_by: int = -1


class SparseContext(Protocol):
    """What sparse attention needs of an attention context (runtime.executor.attention.PagedAttention)."""

    def visible_keys(self, layer_idx: int, k: torch.Tensor) -> tuple[torch.Tensor, SparseStep]:
        """Write this step's keys k [T, 1, W] into cache layer `layer_idx`, then return that layer's
        context keys per sequence [B, K, W] and the step's `SparseStep`."""
        ...


class Indexer(nn.Module):
    """One layer's DSA indexer; checkpoint names as transformers' `GlmMoeDsaIndexer`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.interleaved = cfg.index_rope_interleave
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.scale = self.head_dim ** -0.5

    def key(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, H] -> each token's indexer key [T, Di] (what the cache keeps)."""
        k = self.k_norm(self.wk(x))[:, None]
        return apply_rotary(k, *rope, self.interleaved)[:, 0]

    def scores(self, q_resid: torch.Tensor, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               keys: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """Query rows' q LoRA residual [R, q_lora_rank] and input [R, H], the cached indexer keys
        [B, K, Di] and each row's sequence [R] -> index scores [R, K] in float32."""
        q = apply_rotary(self.wq_b(q_resid).view(q_resid.shape[0], self.n_heads, self.head_dim), *rope,
                         self.interleaved).float()                                   # [R, ni, Di]
        k = keys.float()
        per_head = (torch.einsum("rhd,kd->rhk", q, k[0]) if k.shape[0] == 1
                    else torch.einsum("rhd,rkd->rhk", q, k[seq]))
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5                # [R, ni]
        return torch.einsum("rh,rhk->rk", weights, F.relu(per_head * self.scale))


class DsaSelection:
    """The model's sparse attention, chosen once at build (`CausalLM`) and handed to every MLA
    layer: the top-k selection and attention over the selected keys. Holds no weights (each
    layer's `Indexer` does) and nothing of a step (the step's `SparseStep` does)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.topk = cfg.index_topk
        self.key_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim    # the MLA key; the indexer key follows
        self.index_dim = cfg.index_head_dim

    def cache_key(self, key: torch.Tensor, index_key: torch.Tensor | None) -> torch.Tensor:
        """An MLA key [T, 1, C + Dr] and its indexer key [T, Di] (None on a shared layer: zeros,
        never read) -> the cache cell [T, 1, C + Dr + Di]."""
        if index_key is None:
            index_key = key.new_zeros(key.shape[0], self.index_dim)
        return torch.cat((key, index_key[:, None].to(key.dtype)), dim=-1)

    def select(self, scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Index scores [R, K] and visibility [R, K] -> the keys each row attends to: their
        indices [R, topk] and which of them it may see [R, topk] (a row that sees fewer than
        `topk` keys keeps them all), or None when no row has more than `topk` keys to choose from
        (every visible key is kept: dense MLA)."""
        if visible.shape[1] <= self.topk:
            return None
        best = scores.masked_fill(~visible, float("-inf")).topk(self.topk, dim=-1).indices
        return best, visible.gather(1, best)

    def attend(self, ctx: SparseContext, layer_idx: int, q: torch.Tensor, key: torch.Tensor,
               indexer: Indexer | None, q_resid: torch.Tensor, x: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], scale: float, latent_dim: int) -> torch.Tensor:
        """Absorbed MLA queries q [R, nh, C + Dr] of the query rows (their q LoRA residual, input
        and rotary in `q_resid`, `x`, `rope`), this step's cache cells `key` [T, 1, C + Dr + Di] ->
        attention output [R, nh, C] over each row's selected keys: the `topk` selected keys are
        gathered (attention reads topk keys a row, not the context), or with no selection every
        visible key under the mask."""
        if not hasattr(ctx, "visible_keys"):
            raise TypeError(f"sparse attention needs a paged attention context, not {type(ctx).__name__}")
        keys, step = ctx.visible_keys(layer_idx, key)                          # [B, K, W]
        seq, visible = step.seq, step.visible                                   # [R], [R, K]
        if indexer is not None:
            scores = indexer.scores(q_resid, x, rope, keys[..., self.key_dim:], seq)
            step.chosen, step.chosen_by = self.select(scores, visible), layer_idx
        elif not 0 <= step.chosen_by < layer_idx:
            raise RuntimeError(f"layer {layer_idx} shares the selection of a full indexer layer before it; "
                               "none ran this step")
        chosen = step.chosen
        mla_keys = keys[..., :self.key_dim].to(q.dtype)
        if chosen is None:     # every visible key
            sel, ok = (mla_keys[0] if mla_keys.shape[0] == 1 else mla_keys[seq]), visible
            logits = (torch.einsum("rhc,kc->rhk", q, sel) if sel.dim() == 2
                      else torch.einsum("rhc,rkc->rhk", q, sel))
        else:                  # the selected keys of each row [R, topk, C + Dr]
            idx, ok = chosen
            sel = mla_keys[0][idx] if mla_keys.shape[0] == 1 else mla_keys[seq[:, None], idx]
            logits = torch.einsum("rhc,rkc->rhk", q, sel)
        probs = torch.softmax((logits * scale).masked_fill(~ok[:, None], float("-inf")), dim=-1)
        values = sel[..., :latent_dim]
        if values.dim() == 2:
            return torch.einsum("rhk,kc->rhc", probs, values)
        return torch.einsum("rhk,rkc->rhc", probs, values)
