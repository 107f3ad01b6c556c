"""Compiled steps called past Dynamo (runtime.executor.compiled.CompiledStep): the same results as through
Dynamo, and back through Dynamo whenever a graph's shape guards or a call's signature say the
recorded graph does not fit."""
from __future__ import annotations

import torch

from runtime.executor.compiled import CompiledStep, signature


class Toy(torch.nn.Module):
    """A step whose graph depends on its row count beyond 0 and 1: Dynamo guards on it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.eps = 0.25                                   # a module number Dynamo passes as a 0-d tensor
        self.register_buffer("bias", torch.randn(8))

    def forward(self, x: torch.Tensor, scale: torch.Tensor, tag: object):
        y = torch.nn.functional.linear(x, self.w) * scale.sum()
        if x.shape[0] > 4:                                # a guard on the row count
            y = y * 2
        return y + self.eps + self.bias, y.sum(dim=0)


def reference(model: Toy, x, scale, tag):
    with torch.inference_mode():
        return model(x, scale, tag)


def test_direct_calls_follow_the_graphs_guards_and_equal_dynamos_results():
    torch.manual_seed(0)
    model = Toy()
    step = CompiledStep(model.forward)
    tag = object()
    with torch.inference_mode():
        def run(rows: int, expect_direct: bool):
            x, scale = torch.randn(rows, 8), torch.randn(11)
            before = step.direct_calls
            got = step(x, scale, tag)
            want = reference(model, x, scale, tag)
            assert isinstance(got, tuple) and len(got) == 2
            assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
            assert step.direct_calls == before + int(expect_direct), rows
        run(3, False)    # first call of this signature: through Dynamo, recorded
        run(3, True)     # the same signature: direct
        run(2, True)     # other rows, the same graph (its guard rows <= 4 holds)
        run(6, False)    # the guard fails: back through Dynamo, which compiles the other branch
        run(7, True)     # now recorded too
        run(4, True)
        run(1, False)    # one row is a signature of its own (Dynamo specialises it)
        run(1, True)
        run(8, False)    # 8 rows equal the 8 columns: another signature (duck sizing)
        run(8, True)
        # A non-contiguous input is another signature, recorded in its turn.
        for expect_direct in (False, True):
            x, scale = torch.randn(8, 5).t(), torch.randn(11)
            before = step.direct_calls
            got = step(x, scale, tag)
            assert torch.allclose(got[0], reference(model, x, scale, tag)[0], atol=1e-5)
            assert step.direct_calls == before + int(expect_direct)
        assert signature((torch.randn(8, 5).t(),)) != signature((torch.randn(5, 8),))
        assert signature((torch.randn(5, 8), tag)) != signature((torch.randn(5, 8), object()))


def test_direct_calls_can_be_turned_off_and_keyword_calls_go_through_dynamo():
    torch.manual_seed(0)
    model = Toy()
    off = CompiledStep(model.forward, direct=False)
    on = CompiledStep(model.forward)
    tag = object()
    with torch.inference_mode():
        x, scale = torch.randn(3, 8), torch.randn(11)
        for _ in range(3):
            assert torch.equal(off(x, scale, tag)[0], on(x, scale, tag)[0])
            on(x, scale, tag=tag)
    assert off.direct_calls == 0 and on.direct_calls == 2


def test_a_number_argument_is_part_of_the_signature():
    assert signature((torch.zeros(3), 2)) != signature((torch.zeros(3), 3))
    assert signature((torch.zeros(3), 2)) == signature((torch.zeros(5), 2))


class Mixed(torch.nn.Module):
    """A step whose result is not made of its graph's outputs alone (a number Dynamo returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor):
        return x @ self.w, 7


def test_a_step_whose_result_is_not_its_graphs_outputs_stays_with_dynamo():
    model = Mixed()
    step = CompiledStep(model.forward)
    with torch.inference_mode():
        for _ in range(3):
            x = torch.randn(3, 4)
            y, n = step(x)
            assert n == 7 and torch.allclose(y, x @ model.w)
    assert step.direct_calls == 0
