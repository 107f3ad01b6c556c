"""`torch.compile` of one model's step function, with graphs and guards of its own.

Dynamo keeps compiled graphs on the code object of the function it compiles, and checks a
graph's guards on every call before it runs it. Compiling `model.forward` directly has two costs:

- Every `CausalLM` in a process shares `CausalLM.forward`'s code object, so every model, mode or
  EP shard built in it (tests, bench arms, a restarted group) adds its graphs to one list, which
  each call walks, and past Dynamo's recompile limit a step would silently run eager.
- Guards on every module and parameter the graph reads (their identity, attributes, sizes):
  ~330 us of guard checks on each 4 ms one-row step of the embedded model (a profile's
  "TorchDynamo Cache Lookup").

`compile_step` compiles a copy of the function with its own code object, so the graphs it keeps
belong to this one model, and drops the guards on the model's modules (Dynamo's
`skip_guard_on_all_nn_modules_unsafe`). That is safe here because nothing reaches these graphs but
this model, whose modules never change once its runner is built (its mode, `batch_invariant`, is
set before the first compile); the guards on the step's own inputs (the row count: one row and
several rows are separate graphs) and on globals stay.
"""
from __future__ import annotations

import types
from collections.abc import Callable

import torch


def own_code(method: Callable) -> Callable:
    """A bound method `obj.f` -> the same method over a copy of `f` with its own code object."""
    fn = method.__func__
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    return types.MethodType(copy, method.__self__)


def compile_step(method: Callable, options: dict | None = None) -> Callable:
    """`torch.compile` (inductor, dynamic shapes, `options`) of the bound method `model.f` of one
    model: its graphs are kept for this model alone, without guards on its modules."""
    opts = {"size_asserts": False, **(options or {}),
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    return torch.compile(own_code(method), dynamic=True, options=opts)
