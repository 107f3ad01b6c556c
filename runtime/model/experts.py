"""The routed experts of a MoE layer: one module, three CPU/accelerator paths (per expert, padded
batched matmuls, grouped matmuls), the float64 reference loop, their batch-invariant variants,
and the opaque ops a compiled step calls them through.

Shapes: T rows, k choices per row, E local experts, H hidden, I expert intermediate.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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

    column_major_weights = True   # `pack_for_inference` lays each expert's matrices out for the CPU GEMM
    packed_weights = {"gate_up_packed": "gate_up_proj", "down_packed": "down_proj"}   # and packs them
    backend: ExpertsBackend | None = None   # `choose_experts_backend`
    fp8: tuple[int, int] | None = None   # the scale block once the weights are kept in FP8 (`keep_fp8`)
    _batch_invariant = False
    _fused = False

    @property
    def batch_invariant(self) -> bool:
        """Each touched expert's GEMMs through runtime.ops.batch_invariant.linear
        (`set_batch_invariant`); switching it asks for a new backend."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._batch_invariant, self.backend = on, None

    @property
    def fused(self) -> bool:
        """The Triton fused MoE kernels (`choose_fused_experts`, once at load); switching it asks
        for a new backend."""
        return self._fused

    @fused.setter
    def fused(self, on: bool) -> None:
        self._fused, self.backend = on, None

    def __init__(self, num_experts: int, hidden: int, intermediate: int, expert_offset: int = 0) -> None:
        super().__init__()
        self.expert_offset = expert_offset
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.register_buffer("gate_up_packed", None, persistent=False)   # cpu_ops.pack of each, or None
        self.register_buffer("down_packed", None, persistent=False)

    def keep_fp8(self, block: tuple[int, int]) -> None:
        """Keep the expert weights as an FP8 checkpoint stores them, e4m3 beside float32 block scales
        (`gate_up_proj_scale_inv` [E, 2, ceil(I/br), ceil(H/bc)]: gate and up blocked apart, as stored;
        `down_proj_scale_inv` [E, ceil(H/br), ceil(I/bc)]), run by the fused Triton kernels reading
        them (`fused-fp8`, whatever the other switches: no other path reads FP8). Called once at
        load, on the meta model (the loader fills them)."""
        from runtime.model.quantization import FP8, scale_shape
        e, two_i, h = self.gate_up_proj.shape
        dev = self.gate_up_proj.device
        self.gate_up_proj = nn.Parameter(torch.empty(e, two_i, h, dtype=FP8, device=dev), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, two_i // 2, dtype=FP8, device=dev), requires_grad=False)
        self.register_buffer("gate_up_proj_scale_inv", torch.empty(e, 2, *scale_shape((two_i // 2, h), block),
                                                                   dtype=torch.float32, device=dev))
        self.register_buffer("down_proj_scale_inv", torch.empty(e, *scale_shape((h, two_i // 2), block),
                                                                dtype=torch.float32, device=dev))
        self.fp8 = tuple(block)
        self.packed_weights = {}
        self.backend = None

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] (global ids) -> weighted sum over the local experts [T, H];
        rows routed to experts outside this shard contribute zero. Runs the backend chosen for
        this module (`choose_experts_backend`: once, when the runner is built or the module's
        dtype or device last changed)."""
        backend = self.backend or choose_experts_backend(self)
        return backend(self, x, weights, ids)

    def _apply(self, fn, *args, **kwargs):
        # A new dtype or device (`.to`, `.double()`, `.cuda()`) asks for a new choice.
        self.backend = None
        return super()._apply(fn, *args, **kwargs)

    def native_invariant(self, dtype: torch.dtype) -> bool:
        """Whether the batch-invariant experts of `dtype` rows run the native op
        (`_native_invariant_experts`): its few-row kernel takes both matrices (`cpu_ops.invariant_linear`)."""
        return all(cpu_ops.invariant_linear(dtype, w[0]) for w in (self.gate_up_proj, self.down_proj))

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
        own matmul and a read of its offset (design §3.4). Each expert's matmuls see the rows `_grouped_mm` gives that group, so the two paths agree
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
        layer instead of two per touched expert: a CPU GEMM call has a fixed cost in bfloat16
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
        # The group ends from the sorted keys: bincount would read the largest id back on the host
        # (CUDA), which a CUDA graph capture refuses.
        groups = torch.arange(e_local, device=key.device)
        offs = torch.searchsorted(key[order], groups, right=True).to(torch.int32)     # [E]
        xs = x[order // k]                                                     # [T*k, H], expert-major
        gate, up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        ys = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)  # [T*k, H]
        per_choice = torch.empty_like(ys).index_copy_(0, order, ys)             # back to choice order
        per_choice = torch.where(is_local[:, None], per_choice, 0.0)
        # Sum over the k choices in a fixed order: the result does not depend on the batch.
        return (per_choice.view(t, k, x.shape[1]) * weights.to(x.dtype)[..., None]).sum(dim=1)

    def _looped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, mm=F.linear) -> torch.Tensor:
        """The reference path: one pair of matmuls per touched local expert (syncs with the host);
        `mm` each expert's GEMM (`bi.linear` in the batch-invariant reference)."""
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
# per touched expert, by dtype: a bfloat16 GEMM call has a fixed cost whatever its rows, so from
# three experts one batched call beats a pair per expert; float32 gained nothing measurable in the
# served step, so it stays per expert (the measurements: design §3.4). Counted in experts, not
# choices: a row's two copies (runtime.model.decoder.RowTwice) make 4 choices over 2 experts,
# where the padded path was the slower.
PADDED_MIN_EXPERTS = {torch.bfloat16: 3, torch.float16: 3}
# ... and only while padding adds at most this many rows per touched expert (about what a GEMM
# pair's call costs in rows): routing skewed to a few experts, in a long prefill, can triple the
# rows and lose to the pairs (design §3.4). The native op (`metrale_cpu::routed_experts`, kPaddedWasteRows) decides alike.
PADDED_WASTE_ROWS = 64


def _take_padded(x: torch.Tensor, ids: torch.Tensor, expert_offset: int, num_local: int) -> bool:
    """Whether the CPU's padded path is the cheaper one for these choices (`PADDED_MIN_EXPERTS`,
    `PADDED_WASTE_ROWS`)."""
    least = PADDED_MIN_EXPERTS.get(x.dtype)
    if least is None or ids.numel() < least:
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


def python_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor, expert_offset: int) -> torch.Tensor:
    """The CPU's routed experts without the native library: per expert, or padded batched matmuls
    from `PADDED_MIN_EXPERTS` touched experts (16-bit types, `_take_padded`)."""
    experts = _Experts(gate_up_proj, down_proj, expert_offset)
    if _take_padded(x, ids, expert_offset, experts.num_local_experts):
        return RoutedExperts._padded(experts, x, weights, ids)
    return RoutedExperts._per_expert(experts, x, weights, ids)


def _grouped_impl(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor, expert_offset: int) -> torch.Tensor:
    return RoutedExperts._grouped(_Experts(gate_up_proj, down_proj, expert_offset), x, weights, ids)


def _invariant_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                       down_proj: torch.Tensor, expert_offset: int) -> torch.Tensor:
    """The batch-invariant routed experts off the native op: per expert, each GEMM through
    `bi.linear` (its row plans looked up once for the layer)."""
    experts = _Experts(gate_up_proj, down_proj, expert_offset)
    return RoutedExperts._per_expert(experts, x, weights, ids, _planned_linear(gate_up_proj, down_proj, x.dtype))


def _invariant_cpu_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                           down_proj: torch.Tensor, expert_offset: int) -> torch.Tensor:
    """`_invariant_experts` on the CPU without the native op, where 16-bit types may take padded
    batched matmuls: where `bi.bmm_plan` finds row counts that give every row one result, padded on
    those (by `PADDED_MIN_EXPERTS` when each row equals `bi.linear`'s result, else always)."""
    if x.dtype in PADDED_MIN_EXPERTS:
        plans = bi.bmm_plan(gate_up_proj, x.dtype), bi.bmm_plan(down_proj, x.dtype)
        if None not in plans:
            (lo_a, hi_a, same_a), (lo_b, hi_b, same_b) = plans
            experts = _Experts(gate_up_proj, down_proj, expert_offset)
            if not (same_a and same_b) or _take_padded(x, ids, expert_offset, experts.num_local_experts):
                return RoutedExperts._padded(experts, x, weights, ids, (max(lo_a, lo_b), min(hi_a, hi_b)))
    return _invariant_experts(x, weights, ids, gate_up_proj, down_proj, expert_offset)


def _native_invariant_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                              down_proj: torch.Tensor, expert_offset: int,
                              packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The batch-invariant routed experts through the native op, every expert's GEMMs on the
    few-row kernel at any row count (each output summed in k order: a row's result is its own),
    one choice a row: each of a row's k choices is a row of its own with weight 1, so the op
    returns every choice's expert output rounded to x's type, and the weighted sum over the k
    choices runs here as the Python paths run it (products rounded to x's type, then summed in
    choice order), so EP 2's two ranks, each adding zeros for the other's choices, all-reduce what
    one rank adds."""
    t, k = ids.shape
    if t == 0:
        return x.new_zeros(0, x.shape[1])
    per_choice = torch.ops.metrale_cpu.routed_experts(
        x.repeat_interleave(k, dim=0), weights.new_ones(t * k, 1), ids.reshape(t * k, 1), gate_up_proj, down_proj,
        expert_offset, 0, cpu_ops.ALL_ROWS, *(packed or ()))
    return (per_choice.view(t, k, x.shape[1]) * weights.to(x.dtype)[..., None]).sum(dim=1)


def _planned_linear(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, dtype: torch.dtype):
    """`bi.linear` for one layer's expert matrices, their GEMM plans looked up once for the layer
    (an expert's matrix is a fresh view each call, so `bi.linear` would look its plan up anew);
    `bi.linear` itself where it runs the native kernel on every row count (no plan)."""
    if all(cpu_ops.invariant_linear(dtype, w[0]) for w in (gate_up_proj, down_proj)):
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


grouped_experts = _experts_op("grouped_experts", _grouped_impl)            # an accelerator's experts
cpu_experts = _experts_op("python_experts", python_experts)                 # the CPU's without the native op
invariant_experts = _experts_op("invariant_experts", _invariant_experts)  # the batch-invariant experts
invariant_cpu_experts = _experts_op("invariant_cpu_experts", _invariant_cpu_experts)   # and on the CPU


def _fused_impl(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, expert_offset: int) -> torch.Tensor:
    from runtime.ops.kernels.fused_moe import fused_experts as kernel
    return kernel(x, weights, ids, gate_up_proj, down_proj, expert_offset)


fused_experts = _experts_op("fused_experts", _fused_impl)   # the Triton kernels, opaque to a compiled step

torch.library.define("metrale::fused_fp8_experts", "(Tensor x, Tensor weights, Tensor ids, Tensor gate_up_proj, "
                     "Tensor down_proj, Tensor gate_up_scale, Tensor down_scale, int[] block, int expert_offset) -> Tensor")


@torch.library.impl("metrale::fused_fp8_experts", "CompositeExplicitAutograd")
def _fused_fp8_impl(x, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale, block, expert_offset):
    from runtime.ops.kernels.fused_moe import fused_experts as kernel
    return kernel(x, weights, ids, gate_up_proj, down_proj, expert_offset, gate_up_scale, down_scale, tuple(block))


torch.library.register_fake("metrale::fused_fp8_experts")(lambda x, *_: x.new_empty(x.shape))


def _fused_fp8_call(m: RoutedExperts, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.ops.metrale.fused_fp8_experts(x, w, ids, m.gate_up_proj, m.down_proj, m.gate_up_proj_scale_inv,
                                               m.down_proj_scale_inv, m.fp8, m.expert_offset)


def choose_fused_experts(model: nn.Module, on: bool | None = None) -> bool:
    """Whether the model's routed experts run the fused Triton kernels (runtime/ops/kernels/fused_moe.py),
    set on every `RoutedExperts` now, once: `on` None picks them on CUDA where triton is installed,
    for float32 and bfloat16 (float64 keeps the reference loop). Returns the choice."""
    from runtime.ops import kernels
    mods = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    if not mods:
        return False
    p = mods[0].gate_up_proj
    if mods[0].fp8 is not None:   # kept FP8 (`RoutedExperts.keep_fp8`): the fused kernels are the one path
        for m in mods:
            m.fused = True
            choose_experts_backend(m)
        return True
    fits = p.dtype in (torch.float32, torch.bfloat16)
    if on is None:
        on = p.device.type == "cuda" and kernels.available("cuda") and fits
    elif on and not (fits and kernels.available(p.device.type)):
        raise ValueError(f"the fused MoE kernels cannot run here ({p.dtype} on {p.device}; triton installed and, "
                         "for CPU tensors, TRITON_INTERPRET=1; float32 or bfloat16)")
    for m in mods:
        m.fused = on and not m.batch_invariant
        choose_experts_backend(m)
    return bool(on)


@dataclass(frozen=True, slots=True)
class ExpertsBackend:
    """One way to run the routed experts, chosen once per module (`choose_experts_backend`):
    `eager` runs in an eager forward, `traced` is what a compiled forward calls (an opaque op
    where inductor cannot take the path itself); both take (module, x, weights, ids)."""
    name: str
    eager: Callable[..., torch.Tensor]
    traced: Callable[..., torch.Tensor]

    def __call__(self, m: RoutedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        run = self.traced if torch.compiler.is_compiling() else self.eager
        return run(m, x, weights, ids)


def _op_call(op):
    return lambda m, x, w, ids: op(x, w, ids, m.gate_up_proj, m.down_proj, m.expert_offset)


def _native_call(m: RoutedExperts, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return _native_experts(x, w, ids, m.gate_up_proj, m.down_proj, m.expert_offset, m._packed(x))


def _native_invariant_call(m: RoutedExperts, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return _native_invariant_experts(x, w, ids, m.gate_up_proj, m.down_proj, m.expert_offset, m._packed(x))


def _eager_call(impl):
    return lambda m, x, w, ids: impl(x, w, ids, m.gate_up_proj, m.down_proj, m.expert_offset)


EXPERTS_BACKENDS = {b.name: b for b in (
    # float64, the reference mode: one GEMM pair per touched expert, in order.
    ExpertsBackend("reference", lambda m, x, w, ids: m._looped(x, w, ids), lambda m, x, w, ids: m._looped(x, w, ids)),
    ExpertsBackend("reference-invariant", lambda m, x, w, ids: m._looped(x, w, ids, bi.linear),
                   lambda m, x, w, ids: m._looped(x, w, ids, bi.linear)),
    # Each touched expert's GEMMs through `bi.linear` (or padded batched matmuls on fixed tiles).
    ExpertsBackend("invariant", _eager_call(_invariant_cpu_experts), _op_call(invariant_cpu_experts)),
    ExpertsBackend("invariant-per-expert", _eager_call(_invariant_experts), _op_call(invariant_experts)),
    # The native op on its few-row kernel at every row count, one choice a row (design §3.2).
    ExpertsBackend("native-invariant", _native_invariant_call, _native_invariant_call),
    # The Triton fused MoE kernels: sync-free in float32 and bfloat16, so the step captures.
    ExpertsBackend("fused", _op_call(fused_experts), _op_call(fused_experts)),
    # The same kernels reading FP8 expert weights and their block scales (an FP8 checkpoint on CUDA).
    ExpertsBackend("fused-fp8", _fused_fp8_call, _fused_fp8_call),
    # The native CPU op (`metrale_cpu::routed_experts`), its few-row GEMMs from the packed matrices.
    ExpertsBackend("native", _native_call, _native_call),
    # The CPU without the native library: per expert, or padded batched matmuls (`_take_padded`).
    ExpertsBackend("python", _eager_call(python_experts), _op_call(cpu_experts)),
    # An accelerator: two grouped matmuls over the choices sorted by expert, no host sync.
    ExpertsBackend("grouped", lambda m, x, w, ids: m._grouped(x, w, ids), _op_call(grouped_experts)),
)}


def experts_backend_name(m: RoutedExperts) -> str:
    """The backend a routed-experts module runs, from what was chosen for it (its dtype, device,
    batch-invariant switch, fused kernels) and whether the native CPU ops load."""
    p = m.gate_up_proj
    if m.fp8 is not None:
        return "fused-fp8"
    if p.dtype == torch.float64:
        return "reference-invariant" if m.batch_invariant else "reference"
    if m.batch_invariant:
        if m.native_invariant(p.dtype):
            return "native-invariant"
        return "invariant" if p.device.type == "cpu" else "invariant-per-expert"
    if m.fused:
        return "fused"
    if p.device.type != "cpu":
        return "grouped"
    return "native" if cpu_ops.load() else "python"


def choose_experts_backend(m: RoutedExperts) -> ExpertsBackend:
    """Choose `m`'s backend now (`experts_backend_name`) and keep it until its dtype or device
    changes; the runner calls this for every module once its modes are set."""
    m.backend = EXPERTS_BACKENDS[experts_backend_name(m)]
    return m.backend


def choose_experts_backends(model: nn.Module) -> dict[str, int]:
    """`choose_experts_backend` for every routed-experts module of `model`; returns how many
    modules run each backend (the start-up line names them)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            name = choose_experts_backend(m).name
            counts[name] = counts.get(name, 0) + 1
    return counts


def uses_fused_experts(model: nn.Module) -> bool:
    """Whether every routed expert module of `model` runs the fused kernels (so its step is sync-free)."""
    mods = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    return bool(mods) and all(m.fused for m in mods)
