"""The captured step forwards are device-clean: the embedded model, its KV cache and the drafter on
`device="meta"`, one padded target step and one drafter step (the forwards CUDA graphs capture) run
under a dispatch mode that fails on any CPU tensor, any host read (`.item()`, `.tolist()`,
`nonzero`, ...) and any random op. A CPU tensor in the forward would be a host-to-device copy (a
sync, and illegal in a capture), a host read a sync. About a second on the CPU."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from runtime.executor.kv_cache import PagedKVCache
from runtime.executor.runner import cache_layers
from runtime.executor.static_step import StaticShape, StepGraphs
from runtime.model.weights import load_model

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe"
HOST_READS = ("_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero", "allclose", "unique", "masked_select")
RANDOM = ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "exponential", "uniform",
          "geometric", "cauchy", "log_normal", "native_dropout")


class DeviceClean(TorchDispatchMode):
    """Fails on the first op that touches a CPU tensor, reads a value back on the host, or draws."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.__name__.split(".")[0].rstrip("_")
        if name in HOST_READS or name in RANDOM:
            raise AssertionError(f"{func.__name__}: a host read or a random op in a captured forward")
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                raise AssertionError(f"{func.__name__}: a CPU tensor {tuple(t.shape)} {t.dtype} in a captured forward")
        return out


def test_the_mode_catches_what_it_must():
    x = torch.ones(3, device="meta")
    for bad in (lambda: x + torch.ones(3), lambda: torch.rand(3, device="meta"), lambda: x.nonzero()):
        with pytest.raises(AssertionError), DeviceClean():
            bad()


def test_target_and_drafter_steps_touch_no_host():
    # bfloat16, the captured type (float32 capture is refused: runtime.platform.device.capture_refusal)
    model = load_model(MODEL, "bfloat16", device="meta")
    cache = PagedKVCache(num_layers=cache_layers(model), num_blocks=64, block_size=16, dtype=model.dtype,
                         device="meta", **model.cache_layout())
    target = StepGraphs(model.forward, cache, 512, capture=False)
    drafter = StepGraphs(model.mtp_forward, cache, 512, capture=False, hidden=(model.config.hidden_size, model.dtype))
    counts = []
    for graphs, shape in ((target, StaticShape(4, 4, 256)), (target, StaticShape(1, 1, 512)),
                          (drafter, StaticShape(4, 1, 256))):
        graphs.prepare([shape])
        mode = DeviceClean()
        with torch.inference_mode(), mode:
            out = graphs._forward(graphs.entries[shape].buffers)
        assert out.device.type == "meta" and out.shape == (shape.num_tokens, model.config.hidden_size)
        counts.append(mode.ops)
    assert min(counts) > 50   # the forwards did run through the mode
