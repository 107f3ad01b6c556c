"""The context of a compiled forward: the attention plan and the model its opaque ops find.

Inductor cannot hold the paged KV cache: functionalizing the in-place write copies the whole
cache. So a compiled forward calls attention through an opaque custom op, which finds this step's
cache and plan in a forward context set by the runner for the length of the call (as vLLM's
unified attention does); everything around it is fused. On the CPU with the native ops the plan
goes to them once a step and each layer is one `metrale_cpu::planned_attention` call; a drafter's
chained steps (`speculative.mtp`) add their plans to the same context.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from runtime.ops import cpu_ops
from runtime.executor.attention import PagedAttention, StepPlan

_step_context = threading.local()   # .paged, .model: the attention and model of the forward running on this thread


def _native_plan(paged) -> bool:
    """Whether the layers of a forward over `paged` run their attention natively from one plan set
    for the forward (`metrale_cpu::planned_attention`): a padded-batch plan on the CPU with the
    native ops loaded (not the batch-invariant tiles, not a static step's wrapper)."""
    if type(paged) is not PagedAttention or paged.cache.device.type != "cpu" or paged.plan.tiles is not None:
        return False
    return bool(cpu_ops.LOADED if cpu_ops.LOADED is not None else cpu_ops.load())


def chains_natively(paged: PagedAttention) -> bool:
    """Whether a forward over `paged` can chain further steps in the same graph
    (`forward_context(chain=...)`): its plan goes to the native ops."""
    return _native_plan(paged)


@contextmanager
def forward_context(paged: PagedAttention, model: torch.nn.Module | None = None,
                    chain: list[StepPlan] | None = None):
    """Make `paged` the attention, and `model` the model, of the forward that runs inside this
    block (opaque ops of the compiled graph find them here: `step_model`). On the CPU with the
    native ops the plan goes to them once here (`_native_plan`). The block gets the attention
    context its compiled forward takes: `NATIVE_ATTENTION` then, else `CONTEXT_ATTENTION`.
    `chain`: the plans of steps 1, 2, ... that the same forward runs after `paged`'s (a drafter's
    chained drafts, `chain_attention(s)`), on the same cache; native plans only."""
    if getattr(_step_context, "paged", None) is not None:
        raise RuntimeError("a forward is already running on this thread: forward contexts do not nest")
    native = _native_plan(paged)
    if chain and (not native or any(p.tiles is not None for p in chain)):
        raise ValueError("chained steps need the native attention plan (CPU, native ops, no batch-invariant tiles)")
    if native:
        writes, cache = paged.plan, paged.cache
        p = paged.queries if paged.queries is not None else writes
        torch.ops.metrale_cpu.set_attention_plan(cache.k, cache.v, cache.latent_dim is None, writes.cell_mapping,
                                                 p.gather, p.q_index, p.valid, p.mask, p.mask_mode)
        for step in chain or ():
            torch.ops.metrale_cpu.add_attention_plan(step.cell_mapping, step.gather, step.q_index, step.valid,
                                                     step.mask, step.mask_mode)
    _step_context.paged, _step_context.model = paged, model
    try:
        yield NATIVE_ATTENTION if native else CONTEXT_ATTENTION
    finally:
        _step_context.paged = _step_context.model = None
        if native:
            torch.ops.metrale_cpu.clear_attention_plan()


def step_model() -> torch.nn.Module:
    """The model of the compiled forward running on this thread."""
    model = getattr(_step_context, "model", None)
    if model is None:
        raise RuntimeError("no model in this thread's forward context")
    return model


# Defined with the low-level registration (a schema and one kernel for every backend), not
# `torch.library.custom_op`, whose Python wrappers (alias checks, dynamo guards) cost more per
# call than this op's own host work on a one-row step.
torch.library.define("metrale::paged_attention",
                     "(Tensor q, Tensor k, Tensor v, int layer_idx, float scale) -> Tensor")


@torch.library.impl("metrale::paged_attention", "CompositeExplicitAutograd")
def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                     scale: float) -> torch.Tensor:
    """q [T, nh, D], k [T, nkv, D], v [T, nkv, Dv] -> [T, nh, Dv], through the forward context's cache."""
    paged = getattr(_step_context, "paged", None)
    if paged is None:
        raise RuntimeError("paged_attention called outside a forward context")
    return paged.attend(layer_idx, q, k, v, scale).contiguous()


@torch.library.register_fake("metrale::paged_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


paged_attention = torch.ops.metrale.paged_attention


class ContextAttention:
    """`AttentionContext` of a compiled forward: every layer goes through `paged_attention`."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        return paged_attention(q, k, v, layer_idx, scale)


class NativeContextAttention:
    """`AttentionContext` of a compiled forward whose plan the native ops hold (`forward_context`
    said so): every layer is one `metrale_cpu::planned_attention` call."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        return torch.ops.metrale_cpu.planned_attention(q, k, v, layer_idx, scale)


class ChainStepAttention:
    """`AttentionContext` of step `step` >= 1 of a chained forward: the native plan added for it
    (`forward_context(chain=...)`)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        return torch.ops.metrale_cpu.planned_attention_at(q, k, v, layer_idx, self.step, scale)


CONTEXT_ATTENTION = ContextAttention()
NATIVE_ATTENTION = NativeContextAttention()   # the plan held by the native ops (`forward_context`)
MAX_CHAIN = 32   # steps of one chained forward, at most
# The attention of chained step s (index s; 0 unused: step 0 is NATIVE_ATTENTION): constants, so a
# compiled chain sees the same objects every call.
CHAIN_ATTENTION = tuple(ChainStepAttention(s) for s in range(MAX_CHAIN))


