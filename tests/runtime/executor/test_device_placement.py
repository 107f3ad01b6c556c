"""Device placement on the CPU: every tensor the runtime creates names its device (so the same code
puts it on a GPU), the device string is resolved in one place, and the flags that only make
sense on CUDA are refused elsewhere with one clear line."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from runtime.platform.device import check_local_gpus, rank_device, resolve_device
from runtime.sample.sampler import SamplingParams, position_uniforms
from serving.llm import LLM

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe"
PROMPTS = [[5, 17, 200, 3, 5, 17, 200], [9, 9, 9, 100, 250, 31, 7, 64], [300, 4]]

# Factories whose result lands on the default device unless told otherwise (the *_like ones
# follow their input and are fine).
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace,
             torch.empty_strided, torch.scalar_tensor}


class DevicelessFactories(TorchFunctionMode):
    """Records every tensor factory called without an explicit device. A `with torch.device(...)`
    block counts as explicit: its mode fills the keyword in before this one sees the call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            if not (func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)):
                import traceback
                frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
                self.calls.append(f"{func.__name__} at {Path(frame.filename).name}:{frame.lineno}")
        return func(*args, **kwargs)


def _generate_all(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3)
    penalised = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, seed=1, presence_penalty=0.5,
                               repetition_penalty=1.2, logit_bias={7: 2.0}, logprobs=2)
    outs = llm.generate(PROMPTS, [greedy, seeded, penalised])
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("spec", [dict(spec="none"), dict(spec="mtp", num_drafts=3),
                                  dict(spec="mtp", tree_shape="1,2,2")], ids=["none", "mtp-chain", "tree"])
def test_no_tensor_is_created_without_a_device(spec):
    """Loading, prefill, decode, drafting, verification and keyed sampling name their device
    in every factory call; the tokens are those of the run without the check."""
    want = _generate_all(LLM(MODEL, dtype="float32", kv_cache_tokens=1024, enforce_eager=True, device="cpu", **spec))
    mode = DevicelessFactories()
    with mode:
        llm = LLM(MODEL, dtype="float32", kv_cache_tokens=1024, enforce_eager=True, device="cpu", **spec)
        got = _generate_all(llm)
    assert mode.calls == []
    assert got == want
    cache = llm.engine.runner.cache
    assert cache.device == torch.device("cpu") and cache.k.device.type == "cpu"
    assert {p.device for p in llm.model.parameters()} == {torch.device("cpu")}


def test_the_check_sees_a_deviceless_factory():
    """The mode above would fail the test for a factory call without a device."""
    mode = DevicelessFactories()
    with mode:
        torch.zeros(3)
        torch.zeros(3, device="cpu")
        with torch.device("cpu"):
            torch.arange(4)
    assert len(mode.calls) == 1 and mode.calls[0].startswith("zeros at test_device_placement.py")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    for bad in ("gpu", "cuda:x", "tpu:0", ""):
        with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    assert rank_device(torch.device("cpu"), 3) == torch.device("cpu")
    check_local_gpus(torch.device("cpu"), 4)   # CPU ranks share the host


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_cuda_without_cuda_is_one_clear_error():
    with pytest.raises(ValueError, match="has no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="has no CUDA device"):
        LLM(MODEL, device="cuda:0")


def test_gpu_memory_utilization_is_refused_on_the_cpu():
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.5 sizes the KV cache from free GPU memory"):
        LLM(MODEL, device="cpu", gpu_memory_utilization=0.5)


def test_position_uniforms_live_on_the_device_asked_for():
    a = position_uniforms(7, 11, 4, torch.device("cpu"))
    assert a.device == torch.device("cpu") and a.dtype == torch.float64
    assert torch.equal(a, position_uniforms(7, 11, 4, "cpu"))


def test_rank_zero_of_an_ep_group_names_every_device(ckpt_mtp):
    """The EP path on rank 0 (handshake, shard, command words, drafter commands, MoE dispatch)
    names its device too; the workers run the same code in their own processes."""
    from launch.mp import MPGroup
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=5)
    mode = DevicelessFactories()
    with mode:
        llm = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=1024, device="cpu", spec="mtp", num_drafts=2,
                  ep=2, launcher=MPGroup, ep_timeout_s=60)
        try:
            got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        finally:
            llm.shutdown()
    assert mode.calls == []
    assert llm.deployment.comm is None or llm.deployment.comm.backend == "gloo"
    want = [o.token_ids for o in LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=1024, device="cpu").generate(
        PROMPTS, params)]
    assert got == want


def test_gloo_at_world_size_one_through_the_ep_code_path():
    """What the cuda suite checks with NCCL: a joined group of one rank drives the EP path
    (handshake, shard, command words, collectives) and gives the single-process tokens."""
    from ep.comm import Communicator, free_port
    comm = Communicator(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=60,
                        device="cpu", join_group=True)
    assert comm.backend == "gloo" and comm.joined
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=5)
    try:
        llm = LLM(MODEL, dtype="float64", kv_cache_tokens=1024, comm=comm, spec="mtp", num_drafts=2)
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        assert llm.engine.runner.sent["FORWARD"] > 0
    finally:
        comm.close()
    want = [o.token_ids for o in LLM(MODEL, dtype="float64", kv_cache_tokens=1024, device="cpu").generate(
        PROMPTS, params)]
    assert got == want


@pytest.mark.parametrize("argv, message", [
    (["--device", "gpu"], "device 'gpu': expected auto, cpu, cuda or cuda:N"),
    (["--device", "cpu", "--gpu-memory-utilization", "0.5"],
     "--gpu-memory-utilization sizes the KV cache from free GPU memory; on cpu use --kv-cache-tokens"),
    (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "has no CUDA device")]))
def test_cli_refuses_a_bad_device_in_one_line(capsys, argv, message):
    from launch.cli import main
    try:
        code = main(["generate", "--model", str(MODEL), "--prompt", "x", "--max-tokens", "2", *argv])
    except SystemExit as exc:   # argparse refuses a flag's value itself
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert message in err[-1] and len([line for line in err if "error" in line]) == 1
