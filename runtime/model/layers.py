"""Building blocks shared by every MoE family (runtime.model.families), single device, no collectives.

Shapes: T tokens (flattened over sequences), H hidden, nh query heads, nkv key/value heads,
D head dim, E routed experts, k experts per token, I expert intermediate size.

Numerics follow transformers: RMSNorm statistics and the router run in float32 (in float64 when
the model runs in float64: that dtype is the reference mode, float64 throughout); rotary
embeddings are runtime.model.rotary, multi-head latent attention runtime.model.mla.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from runtime.ops import batch_invariant as bi
from runtime.ops import cpu_ops
from runtime.model.config import ModelConfig
from runtime.model.experts import RoutedExperts
from runtime.model.rotary import apply_rotary


class AttentionContext(Protocol):
    """Where keys and values live for one forward: a paged KV cache, or plain causal attention."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [T, nh, D], k [T, nkv, D], v [T, nkv, Dv] of this step's tokens -> attention output
        [T, nh, Dv]. A latent cache (runtime.model.mla) keeps only k; its values are k's first Dv channels."""
        ...


class KVWriter(Protocol):
    """Where a forward that only writes keys and values puts them (a `runtime.executor.attention.PagedAttention`
    over a `writes_plan`):
    the positions [T] of its rows, and their cache writes."""

    positions: torch.Tensor

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k [T, nkv, D], v [T, nkv, Dv] of every row of the forward into cache layer `layer_idx`."""
        ...


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of norm statistics and routing: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`: every device's GEMM (`packed` unused)."""
    return F.linear(x, weight, bias)


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU's GEMM with the native library loaded, for the dtypes it takes (`cpu_ops.FEW_ROWS`): rows up to
    `cpu_ops.few_rows_max` through the native few-row kernel (a stream of the column-major weights,
    each row's result its own), called straight from a compiled step (`cpu_ops.load` registered its
    fake); from `packed` (`cpu_ops.pack` of `weight`) where one is kept, the same bits. Autograd's
    GEMM where gradients are wanted (training)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    if packed is not None and x.dtype == packed.dtype:   # the op picks: no guard on the rows in a compiled step
        return torch.ops.metrale_cpu.linear(x, weight, bias, cpu_ops.few_rows_max(x.dtype), packed)
    return torch.ops.metrale_cpu.linear(x, weight, bias, cpu_ops.few_rows_max(x.dtype))


def gemm_for(weight: torch.Tensor):
    """The GEMM for `weight` where it lives now: `native_linear` on the CPU with the native library
    built (loading it here) for the dtypes it takes, else `plain_linear` (the native library is
    the CPU's alone: never built for a GPU run)."""
    if weight.device.type != "cpu" or not cpu_ops.load() or weight.dtype not in cpu_ops.FEW_ROWS:
        return plain_linear
    return native_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """A GEMM called outside a module (tests, tools): `gemm_for(weight)` chosen for this call.
    Modules choose theirs once (`ChosenGemm`)."""
    return gemm_for(weight)(x, weight, bias, packed)


class ChosenGemm:
    """A module whose GEMM (`_gemm(x, weight, bias, packed)`) is chosen once for its weight's device
    and dtype (`choose_gemm`, by `choose_gemms` at load and when a runner is built); until then,
    and after a move to another dtype or device, `plain_linear`, which is right everywhere."""

    _gemm = staticmethod(plain_linear)

    def choose_gemm(self) -> None:
        object.__setattr__(self, "_gemm", gemm_for(self.weight))

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_gemm", None)   # a new dtype or device asks for a new choice
        return super()._apply(fn, *args, **kwargs)


def choose_gemms(model: nn.Module) -> dict[str, int]:
    """`choose_gemm` for every module of `model` that has one; returns how many run each GEMM."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, ChosenGemm):
            m.choose_gemm()
            name = "native" if m._gemm is native_linear else "torch"
            counts[name] = counts.get(name, 0) + 1
    return counts


class Linear(ChosenGemm, bi.InvariantSwitch, nn.Linear):
    """`nn.Linear` with a batch-invariant path (`runtime.ops.batch_invariant.linear`) when switched on;
    `in_parts` > 1 sums that path over equal slices of the input features (an attention output
    projection's two halves of its heads: `runtime.ops.batch_invariant.split_linear`)."""

    switched = {"_run": "_invariant"}
    packed_weights = {"packed": "weight"}   # buffer: weight it packs (`pack_for_inference`)
    in_parts = 1
    bi_rows: tuple[int, int] | None = None   # its GEMM plan (`bi.set_batch_invariant`)
    packed_parts: tuple[torch.Tensor, ...] | None = None   # each `in_parts` slice packed (`bi.pack_parts`)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("packed", None, persistent=False)   # `pack_for_inference`: cpu_ops.pack(weight)

    # (block, offset) once its weight is kept in FP8 (`keep_fp8`): the scale block shape, and the rows
    # and columns its weight (a window of the stored one) starts inside its first block.
    fp8: tuple[tuple[int, int], tuple[int, int]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, self.weight, self.bias, self.packed)

    def keep_fp8(self, block: tuple[int, int], offset: tuple[int, int] = (0, 0)) -> None:
        """Keep this linear's weight as the checkpoint stores it, FP8 e4m3 beside its float32
        `weight_scale_inv` blocks, and run it through the Triton block-scaled kernel
        (runtime/ops/kernels/fp8_linear.py). Called once at load, before the weights are read (on
        the meta model: the loader fills both). Binds the path now, for the default and the
        batch-invariant switch alike (the kernel's rows do not depend on their batch)."""
        from runtime.model.quantization import FP8, scale_shape
        from runtime.ops.kernels import fp8_linear  # noqa: F401  (registers metrale::fp8_linear)
        rows, cols = self.weight.shape
        dev = self.weight.device
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8, device=dev), requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.empty(scale_shape((rows + offset[0], cols + offset[1]), block),
                                                             dtype=torch.float32, device=dev))
        self.fp8 = (tuple(block), tuple(offset))
        self.packed_weights = {}   # no packed copy: the kernel reads the FP8 bytes
        self._switched(self.batch_invariant)

    def _switched(self, on: bool) -> None:
        if self.fp8 is not None:
            object.__setattr__(self, "_run", self._fp8)

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        return self._fp8_matmul(x, self.bias)

    def _fp8_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.metrale.fp8_linear(x, self.weight, self.weight_scale_inv, bias, *self.fp8)

    def _invariant(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_parts == 1:
            return bi.linear(x, self.weight, self.bias, self.bi_rows, self.packed)
        out = bi.split_linear(x, self.weight, self.in_parts, self.bi_rows, self.packed_parts)
        return out if self.bias is None else out + self.bias


class FusedProjection(ChosenGemm, bi.InvariantSwitch, nn.Module):
    """Linears that read the same input (an attention's q/k/v, an MLP's gate/up) as one GEMM: the
    weights concatenated along the outputs, each linear's weight left as a view of its rows (so
    loading and saving, which keep the separate linears, share the memory). One GEMM instead of
    several saves the per-call cost that dominates small steps (design §3.4)."""

    switched = {"_run": "_invariant"}
    packed_weights = {"packed": "weight"}   # buffer: weight it packs (`pack_for_inference`)
    bi_rows: tuple[int, int] | None = None   # its GEMM plan (`bi.set_batch_invariant`)

    def __init__(self, linears: list[Linear]) -> None:
        super().__init__()
        weights = [lin.weight for lin in linears]
        if len({w.shape[1] for w in weights}) != 1 or len({w.device for w in weights}) != 1:
            raise ValueError("fused linears must share their input features and device")
        self.sizes = [w.shape[0] for w in weights]
        cpu = weights[0].device.type == "cpu"
        with torch.no_grad():
            fused = (torch.cat([w.t() for w in weights], dim=1).contiguous().t() if cpu   # GEMM-friendly layout
                     else torch.cat(weights, dim=0))
        self.register_buffer("weight", fused, persistent=False)
        biases = [lin.bias for lin in linears]
        self.register_buffer("bias", None if biases[0] is None else torch.cat(biases), persistent=False)
        self.register_buffer("packed", None, persistent=False)   # `pack_for_inference`: cpu_ops.pack(weight)
        start = 0
        for lin, n in zip(linears, self.sizes):
            lin.weight.data = fused[start:start + n]
            if lin.bias is not None:
                lin.bias.data = self.bias[start:start + n]
            start += n

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._run(x).split(self.sizes, dim=-1)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, self.weight, self.bias, self.packed)

    def _invariant(self, x: torch.Tensor) -> torch.Tensor:
        return bi.linear(x, self.weight, self.bias, self.bi_rows, self.packed)


def pack_for_inference(model: nn.Module) -> None:
    """Once a model's weights are loaded: fuse the projections that share an input, and on the CPU
    store every linear and expert weight column-major (its transpose contiguous), which MKL's
    GEMM runs faster for the few rows of a decode or verify step (design §3.4). Values are unchanged;
    shapes and names too. Modules that name `packed_weights` (buffer: weight) also get a packed
    copy of each bfloat16 and float32 CPU weight, which the few-row kernel reads instead
    (`cpu_ops.pack`, the same bits; a non-persistent buffer, not in the state dict): the weights
    must not change after."""
    if any(p.device.type == "cpu" for p in model.parameters()):
        cpu_ops.load()   # before any step is compiled
    for mod in model.modules():   # an FP8-kept linear runs its own kernel: not fused
        if isinstance(mod, Attention) and type(mod.q_proj) is Linear and mod.qkv is None \
                and not _any_fp8(mod.q_proj, mod.k_proj, mod.v_proj):
            mod.qkv = FusedProjection([mod.q_proj, mod.k_proj, mod.v_proj])
        elif isinstance(mod, MLP) and mod.gate_up is None and not _any_fp8(mod.gate_proj, mod.up_proj):
            mod.gate_up = FusedProjection([mod.gate_proj, mod.up_proj])
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    fused = {id(lin) for m in model.modules() if isinstance(m, Attention) and m.qkv is not None
             for lin in (m.q_proj, m.k_proj, m.v_proj)}
    fused |= {id(lin) for m in model.modules() if isinstance(m, MLP) and m.gate_up is not None
              for lin in (m.gate_proj, m.up_proj)}
    for mod in model.modules():
        if isinstance(mod, FusedProjection) or id(mod) in fused:   # views of a fused weight: laid out there
            continue
        for name, p in mod.named_parameters(recurse=False):
            if p.device.type != "cpu" or id(p) in tied or p.dim() < 2 or p.shape[-2] == 1 \
                    or getattr(mod, "fp8", None) is not None:
                continue
            if (isinstance(mod, nn.Linear) or getattr(mod, "column_major_weights", False)) \
                    and not p.data.transpose(-1, -2).is_contiguous():
                p.data = p.data.transpose(-1, -2).contiguous().transpose(-1, -2)
    for mod in model.modules():   # packed copies for the few-row bfloat16 kernel (`cpu_ops.pack`)
        if id(mod) in fused:   # its weight is a view of a fused projection's, which is packed
            continue
        for name, weight in getattr(mod, "packed_weights", {}).items():
            w = getattr(mod, weight)
            if getattr(mod, name) is None and cpu_ops.packs(w):
                setattr(mod, name, cpu_ops.pack(w))
    choose_gemms(model)   # every linear's GEMM, for its final device and dtype


def _any_fp8(*linears: Linear) -> bool:
    return any(lin.fp8 is not None for lin in linears)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(stats_dtype(dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight), in the statistics' dtype (Gemma-style; Qwen3.5)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = stats_dtype(x.dtype)
        xf = x.to(dt)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.to(dt))).to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    """The RMSNorm of this family: (1 + weight) where `norm_unit_offset`, weight otherwise."""
    return (OffsetRMSNorm if cfg.norm_unit_offset else RMSNorm)(dim, cfg.rms_norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.interleaved = cfg.rope_interleave
        h, d = cfg.hidden_size, cfg.head_dim
        # With an output gate (Qwen3.5) the q projection gives each head's query then its gate.
        self.output_gate = cfg.attn_output_gate
        self.q_proj = Linear(h, self.num_heads * d * (2 if self.output_gate else 1), bias=cfg.attention_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=cfg.o_proj_bias)
        self.o_proj.in_parts = bi.halves(self.num_heads)
        self.q_norm = make_norm(cfg, d) if cfg.use_qk_norm else None
        self.k_norm = make_norm(cfg, d) if cfg.use_qk_norm else None
        self.qkv: FusedProjection | None = None   # set by `pack_for_inference`

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; with `rows` [B], every row's keys and values but only those rows'
        queries and output [B, H] (`ctx` attends for them alone)."""
        t = x.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(t, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(t, -1)
        q = q.reshape(t, -1, self.head_dim)  # [T, nh, D]
        k = k.view(t, -1, self.head_dim)  # [T, nkv, D]
        v = v.view(t, -1, self.head_dim)
        cos, sin = rope
        if rows is not None:
            q, q_cos, q_sin = q[rows], cos[rows], sin[rows]
            gate = None if gate is None else gate[rows]
        else:
            q_cos, q_sin = cos, sin
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, q_cos, q_sin, self.interleaved), apply_rotary(k, cos, sin, self.interleaved)
        out = ctx.attend(self.layer_idx, q, k, v, self.scale).reshape(q.shape[0], -1)  # [T or B, nh * D]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def write_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: KVWriter) -> None:
        """x [T, H]: every row's keys and values into `ctx`, and nothing else. The projection is
        the one `forward` runs (the fused q/k/v GEMM over the same rows), so the cache gets the
        same keys and values bit for bit; only what follows it is skipped."""
        t = x.shape[0]
        if self.qkv is not None:
            _, k, v = self.qkv(x)
        else:
            k, v = self.k_proj(x), self.v_proj(x)
        k = k.view(t, -1, self.head_dim)
        v = v.view(t, -1, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        ctx.write(self.layer_idx, apply_rotary(k, *rope, self.interleaved), v)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.gate_up: FusedProjection | None = None   # set by `pack_for_inference`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Router(bi.InvariantSwitch, nn.Module):
    """Top-k routing in float32 (float64 for a float64 model), in one of two scorings.

    sigmoid (GLM, DeepSeek): sigmoid scores plus `e_score_correction_bias` choose, grouped top-k
    keeps the best `topk_group` of `n_group` groups, the chosen scores are the weights. softmax
    (Qwen3-MoE): the top-k of the softmax over all experts. Both optionally renormalise the k
    weights (`norm_topk_prob`) and scale them (`routed_scaling_factor`).
    """

    switched = {"_logits": "_logits_invariant", "_sigmoid": "_sigmoid_invariant"}
    column_major_weights = True   # `pack_for_inference` lays the router matrix out for the CPU GEMM

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.is_softmax = cfg.router_scoring == "softmax"
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = (None if self.is_softmax else nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (scores [T, E], weights [T, k], expert ids [T, k]); scores and weights in
        `stats_dtype(x.dtype)`."""
        dt = stats_dtype(x.dtype)
        if self.is_softmax:
            # transformers keeps this router in the model dtype: logits there, softmax in float32.
            scores = torch.softmax(self._logits(x, self.weight.to(x.dtype)).to(dt), dim=-1)
            weights, ids = scores.topk(self.top_k, dim=-1)
        else:
            scores = self._sigmoid(x.to(dt), self.weight.to(dt))
            ids = self._grouped_top_k(scores + self.e_score_correction_bias.to(dt))
            weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (0.0 if self.is_softmax else 1e-20))
        return scores, weights * self.routed_scaling_factor, ids

    @staticmethod
    def _logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    @staticmethod
    def _logits_invariant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return bi.linear(x, w)

    @staticmethod
    def _sigmoid(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w).sigmoid()

    @staticmethod
    def _sigmoid_invariant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return bi.rowwise(torch.sigmoid, bi.linear(x, w))

    def _grouped_top_k(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] -> ids [T, k] of the best experts inside the best `topk_group` groups."""
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
            keep = group_mask[:, :, None].expand_as(grouped).reshape(-1, self.num_experts)
            choice = choice.masked_fill(keep == 0, float("-inf"))
        return choice.topk(self.top_k, dim=-1, sorted=False)[1]




class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size
                                   or cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts > 0 else None)
        # Qwen3.5: the shared expert's output times sigmoid(a 1-wide linear of the input).
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_experts(x)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
