"""The routed experts of a MoE layer: one module, three CPU/accelerator paths (per expert, padded
batched matmuls, grouped matmuls), the float64 reference loop, their batch-invariant variants,
and the opaque ops a compiled step calls them through.

Shapes: T rows, k choices per row, E local experts, H hidden, I expert intermediate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.ops import batch_invariant as bi
from runtime.ops import cpu_ops


class RoutedExperts(nn.Module):
    """Expert weights stacked per layer: gate and up fused as gate_up [E, 2I, H], down [E, H, I].

    `expert_offset` is the global id of local expert 0, so a shard holding a contiguous range of
    experts computes only those and leaves other tokens' rows at zero.
    """

    batch_invariant = False   # each touched expert's GEMMs through runtime.ops.batch_invariant.linear
    column_major_weights = True   # `pack_for_inference` lays each expert's matrices out for the CPU GEMM
    packed_weights = {"gate_up_packed": "gate_up_proj", "down_packed": "down_proj"}   # and packs them
    fused = False   # the Triton fused MoE kernels (`choose_fused_experts`), chosen once at load

    def __init__(self, num_experts: int, hidden: int, intermediate: int, expert_offset: int = 0) -> None:
        super().__init__()
        self.expert_offset = expert_offset
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.register_buffer("gate_up_packed", None, persistent=False)   # cpu_ops.pack of each, or None
        self.register_buffer("down_packed", None, persistent=False)

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] (global ids) -> weighted sum over the local experts [T, H].

        Rows routed to experts outside this shard contribute zero. float32 and bfloat16 take the
        grouped path on an accelerator (no host synchronisation) and the per-expert path on the
        CPU (`_per_expert`), batch-invariant there with `bi.linear` as each expert's GEMM (a row's
        result depends on its own choices only; 5.4 against 6.0 ms of routed experts per 16-row
        float32 step for the looped path, design §3.2); float64, the reference mode, loops over
        the touched experts. Every expert densely on fixed grouped-matmul tiles, tried for the
        batch-invariant mode, was slower (bench/records/batch_invariant_*_dense_experts.json).
        """
        if x.dtype == torch.float64:
            return self._looped(x, weights, ids)
        if self.batch_invariant:
            if torch.compiler.is_compiling():
                return invariant_experts(x, weights, ids, self.gate_up_proj, self.down_proj, self.expert_offset)
            return _invariant_experts(x, weights, ids, self.gate_up_proj, self.down_proj, self.expert_offset)
        if self.fused:   # sync-free in float32 and bfloat16: the step captures in either
            return fused_experts(x, weights, ids, self.gate_up_proj, self.down_proj, self.expert_offset)
        if torch.compiler.is_compiling():   # opaque to inductor: grouped_mm has no float32 meta kernel
            if x.device.type == "cpu" and cpu_ops.LOADED:   # the native op itself, no Python op around it
                return _native_experts(x, weights, ids, self.gate_up_proj, self.down_proj, self.expert_offset,
                                       self._packed(x))
            return grouped_experts(x, weights, ids, self.gate_up_proj, self.down_proj, self.expert_offset)
        return routed_experts(x, weights, ids, self.gate_up_proj, self.down_proj, self.expert_offset, self._packed(x))

    def _packed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The packed expert matrices (`pack_for_inference`) where the native op reads them: kept,
        and x of their type."""
        if self.gate_up_packed is None or self.down_packed is None or x.dtype != self.gate_up_packed.dtype:
            return None
        return self.gate_up_packed, self.down_packed

    def _per_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, mm=F.linear) -> torch.Tensor:
        """The CPU's path: choices sorted by local expert as in `_grouped`, then one pair of
        matmuls per touched expert. Reading the counts costs the CPU nothing (there is no device
        to wait for), and the loop skips the empty groups CPU `_grouped_mm` walks, each with its
        own matmul and a read of its offset: 111 against 164 us per layer for one row, 519
        against 571 for 16 (float32, one thread, 8 experts of 256 x 256; /tmp probe, design §3).
        Each expert's matmuls see the rows `_grouped_mm` gives that group, so the two paths agree
        bit for bit."""
        t, k = ids.shape
        if t == 0:                                  # an EP rank that received no rows this layer
            return x.new_zeros(0, x.shape[1])
        e_local = self.num_local_experts
        local = (ids - self.expert_offset).reshape(-1)                          # [T*k]
        key = torch.where((local >= 0) & (local < e_local), local, e_local)    # non-local: a last group
        order = torch.argsort(key, stable=True)                                # [T*k]
        counts = torch.bincount(key, minlength=e_local + 1).tolist()
        xs = x[order // k]                                                     # [T*k, H], expert-major
        outs, start = [], 0
        for e, n in enumerate(counts[:e_local]):
            if n:
                gate, up = mm(xs[start:start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(mm(F.silu(gate) * up, self.down_proj[e]))
                start += n
        if counts[e_local]:
            outs.append(x.new_zeros(counts[e_local], x.shape[1]))              # held by other ranks
        ys = torch.cat(outs) if len(outs) > 1 else outs[0]
        per_choice = torch.empty_like(ys).index_copy_(0, order, ys)             # back to choice order
        return (per_choice.view(t, k, x.shape[1]) * weights.to(x.dtype)[..., None]).sum(dim=1)

    def _padded(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The CPU's path for many choices: every local expert's rows padded to the busiest one's
        count, then one batched matmul per projection over all local experts (two GEMM calls a
        layer instead of two per touched expert: a CPU GEMM call costs 25-35 us in bfloat16
        whatever its rows; see `PADDED_MIN_EXPERTS`). Reads the busiest count on the host.
        `rows` (lo, hi), batch-invariant (`bi.bmm_plan`): every call takes lo..hi rows per expert,
        more rows run as calls of exactly hi."""
        t, k = ids.shape
        h = x.shape[1]
        e_local = self.num_local_experts
        local = (ids - self.expert_offset).reshape(-1)                          # [T*k]
        key = torch.where((local >= 0) & (local < e_local), local, e_local)    # non-local: a last group
        order = torch.argsort(key, stable=True)                                # [T*k]
        counts = torch.bincount(key, minlength=e_local + 1)
        p = int(counts[:e_local].max()) if t else 0
        if p == 0:                                  # no rows, or none routed to this shard
            return x.new_zeros(t, h)
        if rows is not None:
            lo, hi = rows
            p = max(p, lo) if p <= hi else -(-p // hi) * hi
        sorted_key = key[order]
        rank = torch.arange(t * k, device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_key]
        mine = sorted_key < e_local
        slot = (sorted_key * p + rank)[mine]                                   # [L] place in [E*p]
        choice = order[mine]                                                   # [L] choice index
        xs = x.new_zeros(e_local * p, h).index_copy_(0, slot, x.index_select(0, choice // k))
        tile = p if rows is None else min(p, rows[1])
        gate, up = _tiled_bmm(xs.view(e_local, p, h), self.gate_up_proj.transpose(1, 2), tile).chunk(2, dim=-1)
        ys = _tiled_bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2), tile).view(e_local * p, h)
        per_choice = x.new_zeros(t * k, h).index_copy_(0, choice, ys.index_select(0, slot))
        return (per_choice.view(t, k, h) * weights.to(x.dtype)[..., None]).sum(dim=1)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Choices sorted by local expert, two grouped matmuls over the runs, no host sync.

        Non-local choices sort after every local one, beyond the last group offset; their rows
        are never read (masked to zero before the combine).
        """
        t, k = ids.shape
        e_local = self.num_local_experts
        local = (ids - self.expert_offset).reshape(-1)                          # [T*k]
        is_local = (local >= 0) & (local < e_local)
        key = torch.where(is_local, local, e_local)                            # non-local: a last group
        order = torch.argsort(key, stable=True)                                # [T*k]
        if key.device.type != "cpu":   # CUDA (and the meta device of the dispatch test)
            # CUDA's bincount reads the largest id back on the host, which a CUDA graph capture
            # refuses: the group ends come from the sorted keys instead.
            groups = torch.arange(e_local, device=key.device)
            offs = torch.searchsorted(key[order], groups, right=True).to(torch.int32)     # [E]
        else:   # the CPU's bincount is the fastest here (measured on the compiled step)
            offs = torch.cumsum(torch.bincount(key, minlength=e_local + 1)[:e_local], 0).to(torch.int32)  # [E]
        xs = x[order // k]                                                     # [T*k, H], expert-major
        gate, up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        ys = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)  # [T*k, H]
        per_choice = torch.empty_like(ys).index_copy_(0, order, ys)             # back to choice order
        per_choice = torch.where(is_local[:, None], per_choice, 0.0)
        # Sum over the k choices in a fixed order: the result does not depend on the batch.
        return (per_choice.view(t, k, x.shape[1]) * weights.to(x.dtype)[..., None]).sum(dim=1)

    def _looped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The reference path: one pair of matmuls per touched local expert (syncs with the host)."""
        t, k = ids.shape
        flat = (ids - self.expert_offset).reshape(-1)              # [T*k] local expert of each choice
        is_local = (flat >= 0) & (flat < self.num_local_experts)
        per_choice = x.new_zeros(t * k, x.shape[1])                # [T*k, H]
        if bool(is_local.any()):
            slots = is_local.nonzero().squeeze(1)
            experts = flat[slots]
            order = torch.argsort(experts, stable=True)
            slots, experts = slots[order], experts[order]
            counts = torch.bincount(experts, minlength=self.num_local_experts).tolist()
            tokens = slots // k
            start = 0
            for e, n in enumerate(counts):
                if n == 0:
                    continue
                xs = x[tokens[start:start + n]]
                mm = bi.linear if self.batch_invariant else F.linear
                gate, up = mm(xs, self.gate_up_proj[e]).chunk(2, dim=-1)
                per_choice[slots[start:start + n]] = mm(F.silu(gate) * up, self.down_proj[e]).to(x.dtype)
                start += n
        return (per_choice.view(t, k, x.shape[1]) * weights.to(x.dtype)[..., None]).sum(dim=1)


def _tiled_bmm(x: torch.Tensor, w: torch.Tensor, tile: int) -> torch.Tensor:
    """bmm of x [E, p, K] by w [E, K, N] in calls of `tile` rows per expert (p a multiple of it)."""
    if x.shape[1] == tile:
        return torch.bmm(x, w)
    return torch.cat([torch.bmm(part, w) for part in x.split(tile, dim=1)], dim=1)


class _Experts:
    """The weights of `RoutedExperts` without the module, for its paths as plain functions."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, expert_offset: int) -> None:
        self.gate_up_proj, self.down_proj, self.expert_offset = gate_up_proj, down_proj, expert_offset
        self.num_local_experts = gate_up_proj.shape[0]


# Touched local experts from which the CPU runs the padded batched matmuls instead of a GEMM pair
# per touched expert, by dtype. Measured for 8 experts of 256 x 256 at two threads, choices spread
# over the experts (per layer, us, per expert vs padded): bfloat16 2 choices 154 vs 186, 8: 471 vs
# 194, 32: 659 vs 211, 64: 685 vs 254 (a bfloat16 GEMM call costs 25-35 us whatever its rows, a
# batched one over 8 experts ~130); float32 2: 61 vs 159, 8: 218 vs 180, 32: 314 vs 204, 64: 357
# vs 272, but in the served step (routing concentrated on fewer experts) float32 gained nothing
# measurable, so it stays per expert. In the step (two threads, one-thread CPU time halved):
# bfloat16 16 rows 9.6 -> 8.0 ms, k3 at 16 sequences 14.0 -> 12.2 ms. Counted in experts, not
# choices: a row's two copies (runtime.model.causal_lm.RowTwice) make 4 choices over 2 experts, where the
# padded path cost 655 against 488 us a layer.
PADDED_MIN_EXPERTS = {torch.bfloat16: 3, torch.float16: 3}
# ... and only while padding adds at most this many rows per touched expert (about what a GEMM
# pair's call costs in rows): routing skewed to a few experts, in a long prefill, can triple the
# rows (a random-weight model's 16 x 64-token prefill: batched matmuls 20.7 ms a forward against
# 12-14 per expert). The native op (`metrale_cpu::routed_experts`, kPaddedWasteRows) decides alike.
PADDED_WASTE_ROWS = 64


def _take_padded(x: torch.Tensor, ids: torch.Tensor, expert_offset: int, num_local: int) -> bool:
    """Whether the CPU's padded path is the cheaper one for these choices (`PADDED_MIN_EXPERTS`,
    `PADDED_WASTE_ROWS`)."""
    least = PADDED_MIN_EXPERTS.get(x.dtype)
    if least is None or x.device.type != "cpu" or ids.numel() < least:
        return False
    local = ids[(ids >= expert_offset) & (ids < expert_offset + num_local)] - expert_offset
    counts = torch.bincount(local, minlength=num_local)
    touched, busiest = int((counts > 0).sum()), int(counts.max()) if num_local else 0
    return touched >= least and num_local * busiest - local.numel() <= PADDED_WASTE_ROWS * touched


def _native_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, expert_offset: int,
                    packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The routed experts through the native op (`metrale_cpu::routed_experts`, loaded); its
    few-row GEMMs from `packed` (`cpu_ops.pack` of gate_up_proj and down_proj) when given."""
    return torch.ops.metrale_cpu.routed_experts(x, weights, ids, gate_up_proj, down_proj, expert_offset,
                                                PADDED_MIN_EXPERTS.get(x.dtype, 0), cpu_ops.few_rows_max(x.dtype),
                                                *(packed or ()))


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor, expert_offset: int,
                   packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The float32 / bfloat16 routed experts: on the CPU through the native op when it is built
    (runtime.ops.cpu_ops: without the host cost of ~30 small tensor ops a layer; each expert's GEMMs
    through the few-row kernel up to `cpu_ops.few_rows_max` rows, else the Python paths' kernels
    bit for bit), or per expert, or padded batched matmuls from `PADDED_MIN_EXPERTS` touched
    experts (16-bit types); grouped elsewhere. `packed`: the native op's packed matrices, if any."""
    if x.device.type == "cpu" and cpu_ops.load():
        return _native_experts(x, weights, ids, gate_up_proj, down_proj, expert_offset, packed)
    experts = _Experts(gate_up_proj, down_proj, expert_offset)
    if x.device.type != "cpu":
        return RoutedExperts._grouped(experts, x, weights, ids)
    if _take_padded(x, ids, expert_offset, experts.num_local_experts):
        return RoutedExperts._padded(experts, x, weights, ids)
    return RoutedExperts._per_expert(experts, x, weights, ids)


def _invariant_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                       down_proj: torch.Tensor, expert_offset: int) -> torch.Tensor:
    """The batch-invariant routed experts: where the CPU takes padded batched matmuls for 16-bit
    types and `bi.bmm_plan` finds row counts that give every row one result, padded on those
    (by `PADDED_MIN_EXPERTS` when each row equals `bi.linear`'s result, else always); otherwise
    per expert with each GEMM through `bi.linear` (always where that runs the native kernel on
    every row count: bfloat16 without native bfloat16, whose batched matmul took ~3 ms for 16
    rows of a 256 x 512 matrix)."""
    experts = _Experts(gate_up_proj, down_proj, expert_offset)
    native = all(cpu_ops.takes_all_rows(x.dtype, w[0]) for w in (gate_up_proj, down_proj))
    if x.dtype in PADDED_MIN_EXPERTS and x.device.type == "cpu" and not native:
        plans = bi.bmm_plan(gate_up_proj, x.dtype), bi.bmm_plan(down_proj, x.dtype)
        if None not in plans:
            (lo_a, hi_a, same_a), (lo_b, hi_b, same_b) = plans
            if not (same_a and same_b) or _take_padded(x, ids, expert_offset, experts.num_local_experts):
                return RoutedExperts._padded(experts, x, weights, ids, (max(lo_a, lo_b), min(hi_a, hi_b)))
    return RoutedExperts._per_expert(experts, x, weights, ids, _planned_linear(gate_up_proj, down_proj, x.dtype))


def _planned_linear(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, dtype: torch.dtype):
    """`bi.linear` for one layer's expert matrices, their GEMM plans looked up once for the layer
    (an expert's matrix is a fresh view each call, so `bi.linear` would look its plan up anew);
    `bi.linear` itself where it runs the native kernel on every row count (no plan)."""
    if all(cpu_ops.takes_all_rows(dtype, w[0]) for w in (gate_up_proj, down_proj)):
        return bi.linear
    plans = {(w.shape[1:], w.stride()[1:]): bi.gemm_plan(w[0], dtype, False) for w in (gate_up_proj, down_proj)}

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        lo, hi = plans[(w.shape, w.stride())]
        return F.linear(x, w) if lo <= x.shape[0] <= hi else bi.linear(x, w)
    return mm


def _experts_op(name: str, impl):
    """`impl` as an opaque op of a compiled graph, with the low-level registration, as
    `runtime.executor.step_context.paged_attention` (fewer Python wrappers per call)."""
    torch.library.define(f"metrale::{name}", "(Tensor x, Tensor weights, Tensor ids, Tensor gate_up_proj, "
                         "Tensor down_proj, int expert_offset) -> Tensor")
    torch.library.impl(f"metrale::{name}", "CompositeExplicitAutograd")(impl)
    torch.library.register_fake(f"metrale::{name}")(lambda x, *_: x.new_empty(x.shape))
    return getattr(torch.ops.metrale, name)


grouped_experts = _experts_op("grouped_experts", routed_experts)          # the default experts
invariant_experts = _experts_op("invariant_experts", _invariant_experts)  # the batch-invariant experts


def _fused_impl(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, expert_offset: int) -> torch.Tensor:
    from runtime.ops.kernels.fused_moe import fused_experts as kernel
    return kernel(x, weights, ids, gate_up_proj, down_proj, expert_offset)


fused_experts = _experts_op("fused_experts", _fused_impl)   # the Triton kernels, opaque to a compiled step


def choose_fused_experts(model: nn.Module, on: bool | None = None) -> bool:
    """Whether the model's routed experts run the fused Triton kernels (runtime/ops/kernels/fused_moe.py),
    set on every `RoutedExperts` now, once: `on` None picks them on CUDA where triton is installed,
    for float32 and bfloat16 (float64 keeps the reference loop). Returns the choice."""
    from runtime.ops import kernels
    mods = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    if not mods:
        return False
    p = mods[0].gate_up_proj
    fits = p.dtype in (torch.float32, torch.bfloat16)
    if on is None:
        on = p.device.type == "cuda" and kernels.available("cuda") and fits
    elif on and not (fits and kernels.available(p.device.type)):
        raise ValueError(f"the fused MoE kernels cannot run here ({p.dtype} on {p.device}; triton installed and, "
                         "for CPU tensors, TRITON_INTERPRET=1; float32 or bfloat16)")
    for m in mods:
        m.fused = on and not m.batch_invariant
    return bool(on)


def uses_fused_experts(model: nn.Module) -> bool:
    """Whether every routed expert module of `model` runs the fused kernels (so its step is sync-free)."""
    mods = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    return bool(mods) and all(m.fused for m in mods)
