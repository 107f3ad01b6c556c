"""The GPU path's audit findings (issue 49), each checked on the CPU where it can be: which test
fixture forces engines eager, the transformers cache keyword, float32 capture refused, capture and
device selection on the model's GPU, KV cache sizing from free memory, weights allocated in their
serving dtype, the native CPU library kept off GPU runs, one host-to-device copy per static step,
and NCCL's error handling set before a group starts."""
from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.platform import device as rdevice
from runtime.executor import static_step
from runtime.executor.attention import SeqChunk
from runtime.executor.kv_cache import PagedKVCache
from tests.conftest import cache_kwargs, forces_eager, output_cache

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def _node(*markers: str):
    return types.SimpleNamespace(get_closest_marker=lambda name: object() if name in markers else None)


def test_cuda_tests_keep_the_engines_default():
    assert forces_eager(_node()) and forces_eager(_node("timeout"))
    assert not forces_eager(_node("cuda"))


def test_transformers_cache_keyword_is_read_off_the_signature():
    class Old:   # transformers 5.17
        def forward(self, input_ids, past_key_values=None, use_cache=None): ...

    class New:   # transformers 5.25
        def forward(self, input_ids, cache=None, use_cache=None): ...

    assert cache_kwargs(Old(), "c") == {"past_key_values": "c"}
    assert cache_kwargs(New(), "c") == {"cache": "c"}
    assert output_cache(types.SimpleNamespace(past_key_values="p")) == "p"
    assert output_cache(types.SimpleNamespace(cache="c", past_key_values="p")) == "c"


def test_capture_is_refused_in_one_line_where_the_experts_sync():
    assert rdevice.capture_refusal(CUDA0, torch.bfloat16, (9, 0)) is None
    assert rdevice.capture_refusal(CUDA1, torch.bfloat16, (10, 0)) is None
    for dtype in (torch.float32, torch.float64, torch.float16):
        msg = rdevice.capture_refusal(CUDA0, dtype, (9, 0))
        assert msg and "\n" not in msg and "refused in " + str(dtype).removeprefix("torch.") in msg
    assert "sm80" in rdevice.capture_refusal(CUDA0, torch.bfloat16, (8, 0))
    # the fused Triton experts are sync-free: float32 and bfloat16 capture on any GPU
    for dtype in (torch.float32, torch.bfloat16):
        assert rdevice.capture_refusal(CUDA0, dtype, (8, 0), sync_free_experts=True) is None
    assert "refused in float64" in rdevice.capture_refusal(CUDA0, torch.float64, (9, 0), sync_free_experts=True)
    assert "not cpu" in rdevice.capture_refusal(torch.device("cpu"), torch.bfloat16, (9, 0))


def test_the_model_device_is_made_current_and_captures_run_under_it(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    rdevice.use_device(torch.device("cpu"))
    rdevice.use_device(CUDA1)
    assert calls == [("set_device", CUDA1)]

    # capture_cuda_graph: every stream, capture and sync inside torch.cuda.device(the model's GPU).
    current = []
    calls.clear()

    @contextlib.contextmanager
    def device_ctx(d):
        current.append(d)
        yield
        current.pop()

    class FakeStream:
        def __init__(self, device=None):
            calls.append(("stream", device, list(current)))

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph_ctx(graph, pool=None):
        calls.append(("capture", list(current)))
        yield

    monkeypatch.setattr(torch.cuda, "device", device_ctx)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(device))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph_ctx)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device, list(current))))
    graph, out, taken = static_step.capture_cuda_graph(lambda: torch.ones(1), None, CUDA1)
    assert calls and all(c[-1] == [CUDA1] for c in calls)
    assert ("capture", [CUDA1]) in calls and all(c[1] == CUDA1 for c in calls if c[0] in ("stream", "sync"))


def test_kv_cache_sizing_counts_cached_free_memory_as_free_and_keeps_some_back():
    gib = 1 << 30
    total = 80 * gib
    # 20 GiB in use by the driver's count, 6 of them cached-free in this process's allocator.
    tokens = rdevice.kv_tokens_from(free=60 * gib, total=total, cached_free=6 * gib, utilization=0.9,
                                    bytes_per_token=1 << 20)
    keep = max(rdevice.KEEP_BACK_MIN_BYTES, int(rdevice.KEEP_BACK_SHARE * total))
    assert tokens == (int(0.9 * total) - 14 * gib - keep) >> 20
    with pytest.raises(ValueError, match=r"are in use and .* kept for activations"):
        rdevice.kv_tokens_from(free=2 * gib, total=total, cached_free=0, utilization=0.5, bytes_per_token=1024)
    with pytest.raises(ValueError, match="must be in"):
        rdevice.kv_tokens_from(free=total, total=total, cached_free=0, utilization=1.5, bytes_per_token=1)


def test_weights_are_allocated_in_the_serving_dtype(monkeypatch):
    from runtime.model.weights import load_model
    from tests.runtime.executor.test_cuda import MODEL
    seen = []
    to_empty = torch.nn.Module.to_empty

    def spy(self, *, device, recurse=True):
        seen.extend(p.dtype for n, p in self.named_parameters() if "experts" in n or "embed" in n)
        return to_empty(self, device=device, recurse=recurse)

    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    model = load_model(MODEL, "bfloat16", device="cpu")
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.dtype for n, p in model.named_parameters() if "experts" in n} == {torch.bfloat16}


def test_the_native_cpu_library_is_never_loaded_off_the_cpu(monkeypatch):
    from runtime.ops import cpu_ops
    from runtime.model.layers import linear
    monkeypatch.setattr(cpu_ops, "LOADED", None)

    def boom(*a, **k):
        raise AssertionError("cpu_ops.load called for a tensor off the CPU")

    monkeypatch.setattr(cpu_ops, "load", boom)
    x, w = torch.empty(3, 8, device="meta"), torch.empty(4, 8, device="meta")
    assert linear(x, w).shape == (3, 4)


class _Copies(TorchDispatchMode):
    """Counts the ops a call dispatches, and the copies among them."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.__name__.startswith(("_to_copy", "copy_", "index_put", "_index_put")):
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_static_fill_costs_the_same_ops_for_one_sequence_as_for_eight():
    cache = PagedKVCache(num_layers=1, num_blocks=64, block_size=16, num_kv_heads=1, head_dim=4,
                         dtype=torch.float32, device="cpu")
    for s in range(8):
        cache.reserve(s, 40 + s)
    shape = static_step.StaticShape(8, 4, 256)
    counts = []
    for n in (1, 8):
        buffers = static_step.StaticBuffers(shape, cache)
        chunks = [SeqChunk(s, 38 + s, 2) if s % 2 else SeqChunk(s, 37 + s, 3, (-1, 0, 0)) for s in range(n)]
        mode = _Copies()
        with mode:
            buffers.fill([1] * sum(c.num_tokens for c in chunks), chunks, cache)
        counts.append((mode.ops, mode.copies))
    assert counts[0] == counts[1], counts


def test_nccl_error_handling_is_set_before_a_group_starts():
    from ep.comm import NCCL_ERROR_ENV, nccl_error_env
    env = {"TORCH_NCCL_BLOCKING_WAIT": "0"}
    added = nccl_error_env(env)
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"   # what the user set is kept
    assert added == {k: v for k, v in NCCL_ERROR_ENV.items() if k != "TORCH_NCCL_BLOCKING_WAIT"}
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


def test_rejection_sampling_reads_no_scalar_per_draft():
    """A chain's acceptance tests and resamples are computed together on the device; the host
    reads the outcome once, not a float per draft (a GPU sync each)."""
    from engine.verify import rejection_tokens

    class Scalars(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Scalars.n += func.__name__.startswith("_local_scalar_dense")
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    p = [torch.softmax(torch.randn(40, generator=g, dtype=torch.float64), 0) for _ in range(5)]
    q = [torch.softmax(torch.randn(40, generator=g, dtype=torch.float64), 0) for _ in range(4)]
    drafts = [int(x.argmax()) for x in p[:4]]
    with Scalars():
        na, out = rejection_tokens(drafts, q, p, seed=3, first_position=10)
    assert Scalars.n == 0 and len(out) == na + 1 and out[:na] == drafts[:na]
    # the same (seed, position) keys give the same outcome again, with or without draft distributions
    assert rejection_tokens(drafts, q, p, seed=3, first_position=10) == (na, out)
    na1, out1 = rejection_tokens(drafts, None, p, seed=3, first_position=10)
    assert out1[:na1] == drafts[:na1] and len(out1) == na1 + 1
