"""Every attention and routed-experts backend the start-up can choose, on one step of the embedded
model, against the reference backends (SDPA attention, the float64 loop's order of experts); and
the runner's choice itself: made once at start, from the device, dtype and modes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.executor.attention import (INVARIANT, NATIVE, NATIVE_INVARIANT, SDPA, KernelAttention, PagedAttention,
                                        SeqChunk, choose_attention_backend, drafter_attention)
from runtime.executor.runner import ModelRunner
from runtime.executor.sampling import KERNEL, REFERENCE, choose_sampler
from runtime.model.experts import EXPERTS_BACKENDS, RoutedExperts, choose_experts_backends, experts_backend_name
from runtime.model.weights import load_model
from runtime.ops import cpu_ops, kernels

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe"
PROMPTS = {0: [5, 17, 200, 3, 9], 1: [9, 9, 9, 100, 250, 31, 7, 64, 12], 2: [300, 4, 41]}
# After the prompts: a decode row each, then a chain verify beside a tree verify.
STEPS = [([11, 12, 13], [SeqChunk(0, 5, 1), SeqChunk(1, 9, 1), SeqChunk(2, 3, 1)]),
         ([14, 15, 16, 17, 18, 19], [SeqChunk(0, 6, 2), SeqChunk(2, 4, 4, (-1, 0, 0, 2))])]


def combinations() -> list[tuple[str, str]]:
    """The (attention, experts) backends a runner's start-up chooses: on the CPU with and without
    the native library, batch-invariant, and an accelerator's (the Triton kernels under the
    interpreter, its SDPA with grouped matmuls, and its batch-invariant experts)."""
    combos = [("sdpa", "python"), ("invariant", "invariant"), ("invariant", "invariant-per-expert"),
              ("sdpa", "grouped")]
    if cpu_ops.load():
        combos += [("native", "native"), ("native-invariant", "native-invariant")]
    if kernels.available("cpu"):
        combos.append(("triton", "fused"))
    return combos


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, "float32", device="cpu")


def run_steps(model, attention: str, experts: str) -> list[torch.Tensor]:
    """The hidden states of the prompts' prefills and of `STEPS`, with every layer on the named
    backends."""
    runner = ModelRunner(model, kv_cache_tokens=1024, batch_invariant="invariant" in attention, attention_kernel=False)
    if attention == "invariant":   # the tiles, where the native library would take the rows in place
        runner.attention = runner.cache.attention = INVARIANT
    elif attention == "triton":
        from runtime.ops.kernels.paged_attention import paged_attention
        runner.attention = choose_attention_backend(runner.cache, kernel=paged_attention)
    elif attention == "sdpa":
        runner.attention = runner.cache.attention = SDPA
    assert runner.attention.name == attention
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            m.backend = EXPERTS_BACKENDS[experts]
    outs = []
    for s, p in PROMPTS.items():
        runner.cache.reserve(s, len(p))
        outs.append(runner.forward(p, [SeqChunk(s, 0, len(p))])[0])
    for toks, chunks in STEPS:
        for c in chunks:
            runner.cache.reserve(c.seq_id, c.end)
        outs.append(runner.forward(toks, chunks)[0])
    return outs


def test_every_backend_combination_matches_the_reference(model):
    """One step of each kind (prefills, decode rows, a chain and a tree verify) through every
    combination the start-up can choose equals the reference combination (SDPA, per-expert Python
    experts) within float32 rounding."""
    want = run_steps(model, "sdpa", "python")
    try:
        for attention, experts in combinations()[1:]:
            got = run_steps(model, attention, experts)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=2e-4, atol=2e-4, msg=lambda m: f"{attention} x {experts}: {m}")
    finally:
        choose_experts_backends(model)


def test_the_runner_chooses_once_from_the_device_dtype_and_modes(model):
    runner = ModelRunner(model, kv_cache_tokens=256, batch_invariant=False, attention_kernel=False)
    padded = NATIVE if cpu_ops.load() else SDPA
    assert runner.attention is padded and runner.cache.attention is padded
    count = sum(isinstance(m, RoutedExperts) for m in model.modules())
    assert count > 1 and runner.experts_backends == {"native" if cpu_ops.load() else "python": count}
    assert drafter_attention(runner.cache) is padded
    line = str(runner.choice)
    assert line.startswith("cpu float32: eager steps, static steps off, batch-invariant off") and \
        f"attention {padded.name}" in line and f"routed experts {padded.name if padded is NATIVE else 'python'} x{count}" in line
    # The CPU samples through the reference path unless asked (seeded outputs stay as they were).
    assert runner.sampler is REFERENCE and line.endswith(", sampler torch")
    invariant = ModelRunner(model, kv_cache_tokens=256, batch_invariant=True, attention_kernel=False)
    assert invariant.attention is (NATIVE_INVARIANT if cpu_ops.load() else INVARIANT)
    # The target's layers are batch-invariant; the drafter keeps the default kernels and plans on
    # the padded batch (its fed rows need separate query rows).
    assert {experts_backend_name(m) for m in model.layers.modules() if isinstance(m, RoutedExperts)} == \
        {"native-invariant" if cpu_ops.load() else "invariant"}
    assert drafter_attention(invariant.cache) is padded
    if kernels.available("cpu"):
        kernel = ModelRunner(model, kv_cache_tokens=256, batch_invariant=False, attention_kernel=True)
        assert isinstance(kernel.attention, KernelAttention) and kernel.attention.fallback is padded
        assert ModelRunner(model, kv_cache_tokens=256, batch_invariant=False, attention_kernel=False,
                           sampling_kernel=True).sampler is KERNEL
    ModelRunner(model, kv_cache_tokens=256, batch_invariant=False, attention_kernel=False)   # back to the default


def test_a_plan_attends_through_the_backend_that_planned_it(model):
    """A plan carries its backend: a batch-invariant plan on a cache whose backend is the padded
    batch still attends in tiles (and the padded plan beside it through the cache's)."""
    runner = ModelRunner(model, kv_cache_tokens=256, batch_invariant=False, attention_kernel=False)
    from runtime.executor.attention import build_plan
    runner.cache.reserve(0, 4)
    tiles = build_plan(runner.cache, [SeqChunk(0, 0, 4)], batch_invariant=True, native=False)
    padded = build_plan(runner.cache, [SeqChunk(0, 0, 4)])
    assert tiles.backend is INVARIANT and tiles.tiles is not None
    assert padded.backend is runner.attention and padded.tiles is None
    layout = model.cache_layout()
    q = torch.randn(4, model.config.num_attention_heads, layout["head_dim"])
    kv = torch.randn(4, layout["num_kv_heads"], layout["head_dim"])
    with torch.inference_mode():
        a = PagedAttention(runner.cache, tiles).attend(0, q, kv, kv, 0.25)
        b = PagedAttention(runner.cache, padded).attend(0, q, kv, kv, 0.25)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_an_experts_module_is_chosen_for_again_when_its_dtype_changes():
    m = RoutedExperts(4, 16, 8)
    assert m(torch.zeros(2, 16), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long)).shape == (2, 16)
    assert m.backend is not None and m.backend.name in ("native", "python")
    m.double()
    assert m.backend is None
    m(torch.zeros(2, 16, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.long))
    assert m.backend.name == "reference"


def test_the_sampler_is_chosen_once_from_the_device():
    """The reference sampler on the CPU; the Triton kernel where asked and triton can run it (a
    CUDA device; CPU tensors under the interpreter), a one-line error where it cannot."""
    assert choose_sampler(torch.device("cpu")) is REFERENCE
    assert choose_sampler(torch.device("cpu"), kernel=False) is REFERENCE
    if kernels.available("cpu"):
        assert choose_sampler(torch.device("cpu"), kernel=True) is KERNEL
    else:
        with pytest.raises(ValueError, match="Triton sampling kernel cannot run on cpu"):
            choose_sampler(torch.device("cpu"), kernel=True)
