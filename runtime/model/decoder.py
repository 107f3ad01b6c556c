"""A decoder layer of every served family (its token mixer and MLP chosen once from the config),
and `RowTwice`, the attention context of a one-row batch-invariant step run as two copies.

Shapes: T rows, B query rows, H hidden.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.model.config import ModelConfig
from runtime.model.layers import MLP, Attention, AttentionContext, KVWriter, MoE, make_norm
from runtime.model.linear_attention import GatedDeltaNet
from runtime.model.mla import MLAttention
from runtime.model.sparse_attention import DsaSelection, SparseStep


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


class RowTwice:
    """The `AttentionContext` of a one-row step run as two copies of its row: the first row
    attends (and writes its keys and values) through `ctx`, the copy reuses its output."""

    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx = ctx
        self.sparse: SparseStep | None = None   # the step's sparse rows, as two copies of its row

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        out = self.ctx.attend(layer_idx, q[:1], k[:1], v[:1], scale)
        return out.expand(2, *out.shape[1:])

    def visible_keys(self, layer_idx: int, k: torch.Tensor) -> tuple[torch.Tensor, SparseStep]:
        """Sparse attention's view (runtime.model.sparse_attention): the first row's, for both
        copies (one `SparseStep` for the whole step, so its selection reaches the shared layers)."""
        keys, step = self.ctx.visible_keys(layer_idx, k[:1])
        if self.sparse is None:
            self.sparse = SparseStep(step.seq.expand(2), step.visible.expand(2, -1))
        return keys, self.sparse


def bind_rows_twice(module: nn.Module, on: bool) -> None:
    """Bind `module.forward` to its `_rows_twice` (on) or back to the class's (off): chosen when
    batch invariance is switched, never read per call."""
    if on:
        object.__setattr__(module, "forward", module._rows_twice)
    else:
        module.__dict__.pop("forward", None)
