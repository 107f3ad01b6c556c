"""The runner's settings in one object, resolved once against the model (runtime.executor.settings)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from runtime.executor.runner import ModelRunner
from runtime.executor.settings import StepSettings
from runtime.model.weights import load_model
from serving.deployment import DeploymentConfig

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe"


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, "float32", device="cpu")


def test_resolution_fills_every_default_for_the_model(model):
    got = StepSettings(kv_cache_tokens=512).resolve(model)
    assert got == StepSettings(kv_cache_tokens=512, compiled=False, batch_invariant=False, static_steps=False,
                               cuda_graphs=False, attention_kernel=False, sampling_kernel=False)
    assert None not in (got.batch_invariant, got.static_steps, got.cuda_graphs, got.attention_kernel,
                        got.sampling_kernel)
    # On the CPU a deployment's default (static steps None, graphs None) runs no static steps.
    deployed = DeploymentConfig(model_dir=MODEL, kv_cache_tokens=512).step_settings().resolve(model)
    assert deployed.compiled and not deployed.static_steps and not deployed.cuda_graphs
    # Batch-invariant steps run no static buckets, asked or not.
    assert not StepSettings(batch_invariant=True, static_steps=True).resolve(model).static_steps
    assert StepSettings(static_steps=True).resolve(model).static_steps


def test_float64_resolves_to_the_reference_mode():
    model64 = load_model(MODEL, "float64", device="cpu")
    got = StepSettings(compiled=True, cuda_graphs=True).resolve(model64)
    assert got.batch_invariant and not got.compiled and not got.cuda_graphs and not got.static_steps
    assert not StepSettings(compiled=True, batch_invariant=False, static_steps=True,
                            cuda_graphs=True).resolve(model64).cuda_graphs


def test_the_runner_keeps_the_resolved_object_and_refuses_what_cannot_run(model):
    settings = StepSettings(kv_cache_tokens=256, static_steps=True)
    runner = ModelRunner(model, settings)
    assert runner.settings == settings.resolve(model) and runner.graphs is not None
    assert "static steps padded" in str(runner.choice)
    assert ModelRunner(model, kv_cache_tokens=256).settings == StepSettings(kv_cache_tokens=256).resolve(model)
    with pytest.raises(TypeError, match="not both"):
        ModelRunner(model, settings, kv_cache_tokens=128)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not cpu"):
        ModelRunner(model, replace(settings, cuda_graphs=True))
    if not torch.cuda.is_available():
        from runtime.ops import kernels
        if not kernels.available("cpu"):
            with pytest.raises(ValueError, match="Triton attention kernel cannot run on cpu"):
                ModelRunner(model, replace(settings, attention_kernel=True))
