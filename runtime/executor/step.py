"""How a model's step forwards run: a `StepMode` chosen once, for the target by the runner and for
the MTP drafter by its proposer, the same classes for both.

A step forward is `fn(*inputs, positions, ctx, *extra)`: the target's `CausalLM.forward(tokens,
positions, ctx)`, the drafter's `MTPLayer.forward` / `MTPLayer.draft(tokens, prev_hidden,
positions, ctx, rows)`. A mode runs it over a step's `PagedAttention`:
- `EagerMode`: the function itself, the attention context handed straight in;
- `CompiledMode`: `torch.compile` of it (runtime.executor.compiled), inside a forward context so
  the graph's opaque attention op finds the cache and plan (runtime.executor.step_context);
- `RowTwiceMode`: compiled and batch-invariant, a one-row step run as two copies of its row so no
  graph is specialised to one row (runtime.model.decoder.RowTwice).
Static buckets (runtime.executor.static_step.StepGraphs) run the same mode over their padded
buffers, and on CUDA capture it: compiled where both are on.

Shapes: T step rows.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.executor.attention import PagedAttention
from runtime.executor.compiled import compile_step
from runtime.executor.step_context import forward_context
from runtime.model.decoder import RowTwice


class EagerMode:
    """The forward called as it is."""

    name = "eager"
    compiles = False

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn = fn

    def __call__(self, inputs: tuple[torch.Tensor, ...], positions: torch.Tensor, paged: PagedAttention,
                 extra: tuple = ()):
        return self.fn(*inputs, positions, paged, *extra)


class CompiledMode(EagerMode):
    """The forward through `torch.compile` (`compile_step`, inductor options `options`); the step's
    cache and plan reach its opaque attention op through the forward context, and `model` its
    opaque expert ops (`step_context.step_model`)."""

    name = "compiled"
    compiles = True

    def __init__(self, fn: Callable[..., object], model: torch.nn.Module, options: dict | None = None) -> None:
        super().__init__(compile_step(fn, options))
        self.model = model

    def __call__(self, inputs: tuple[torch.Tensor, ...], positions: torch.Tensor, paged: PagedAttention,
                 extra: tuple = ()):
        with forward_context(paged, self.model) as ctx:
            return self.fn(*inputs, positions, ctx, *extra)


class RowTwiceMode(CompiledMode):
    """A compiled batch-invariant target whose kernels are not row-invariant at one row: Dynamo
    would specialise a graph to one row (its kernels might round otherwise), so a one-row step
    runs as two copies of its row, the copy reusing its attention, and returns the first."""

    name = "compiled, one row as two"

    def __call__(self, inputs: tuple[torch.Tensor, ...], positions: torch.Tensor, paged: PagedAttention,
                 extra: tuple = ()):
        if positions.shape[0] != 1:
            return super().__call__(inputs, positions, paged, extra)
        with forward_context(RowTwice(paged), self.model) as ctx:
            return self.fn(*(x.repeat(2, *([1] * (x.dim() - 1))) for x in inputs), positions.repeat(2), ctx,
                           *extra)[:1]


def choose_step_mode(fn: Callable[..., object], model: torch.nn.Module, *, compiled: bool,
                     row_twice: bool = False, options: dict | None = None) -> EagerMode:
    """The mode `fn`'s steps run in, chosen once: eager, compiled, or compiled with a one-row step
    as two rows (`row_twice`: batch-invariant kernels that are not row-invariant at one row)."""
    if not compiled:
        return EagerMode(fn)
    return (RowTwiceMode if row_twice else CompiledMode)(fn, model, options)
