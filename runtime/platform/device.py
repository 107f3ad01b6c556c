"""Where the runtime's tensors live: `--device auto|cpu|cuda[:N]`, resolved once.

Every tensor a step creates (weights, the KV cache, step plans, sampler draws, drafter inputs,
grammar masks) goes to the device resolved here; nothing falls back to the CPU silently. Only
host-side buffers that a library writes through a pointer (the grammar's bitmask) or control
words read back on the host stay on the CPU, and they say so with `device="cpu"`.
"""
from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(text: str | torch.device) -> torch.device:
    """`auto` (CUDA when present, else the CPU), `cpu`, `cuda` or `cuda:N` -> a torch.device.
    Raises ValueError in one line for anything else, or for CUDA on a host without it."""
    if isinstance(text, torch.device):
        text = str(text)
    name = text.strip().lower()
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    kind, _, index = name.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"device {text!r}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device {text!r}: this torch build or host has no CUDA device "
                         f"(torch {torch.__version__}, cuda {torch.version.cuda})")
    n = int(index or 0)
    count = torch.cuda.device_count()
    if n >= count:
        raise ValueError(f"device {text!r}: this host has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", n)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of local rank `local_rank` of a group whose rank 0 runs on `device`: the CPU for
    every rank on the CPU, else its own GPU, `device.index + local_rank`."""
    if device.type != "cuda":
        return device
    n = (device.index or 0) + local_rank
    count = torch.cuda.device_count()
    if n >= count:
        raise ValueError(f"local rank {local_rank} needs cuda:{n}, but this host has {count} CUDA device(s)")
    return torch.device("cuda", n)


def check_local_gpus(device: torch.device, num_ranks: int) -> None:
    """Refuse a group of `num_ranks` ranks on one host that has fewer GPUs than it needs."""
    if device.type != "cuda":
        return
    need = (device.index or 0) + num_ranks
    count = torch.cuda.device_count()
    if need > count:
        raise ValueError(f"--ep {num_ranks} on {device} needs {need} GPUs on this host "
                         f"(one per rank from {device}); it has {count}")


# Memory `--gpu-memory-utilization` keeps out of the KV cache for what a step allocates besides it:
# activations of the largest step, the CUDA graphs' pool, cuBLAS and attention workspaces. The larger
# of a floor and a share of the device; `make gpu-check` prints the pool the graphs really took.
KEEP_BACK_MIN_BYTES = 1 << 30
KEEP_BACK_SHARE = 0.05


def kv_tokens_for_memory(device: torch.device, utilization: float, bytes_per_token: int, reserved: int = 0) -> int:
    """KV cache tokens that fit in `utilization` of the GPU's total memory, counting what this
    process and others already hold (weights first: call after loading them), as vLLM's
    `--gpu-memory-utilization`, less `reserved` bytes (the running sequences' layer states,
    `LayerStates.bytes_reserved`). Raises ValueError when nothing is left for the cache."""
    if device.type != "cuda":
        raise ValueError(f"--gpu-memory-utilization sizes a CUDA cache; the {device} cache is sized by "
                         "--kv-cache-tokens")
    free, total = torch.cuda.mem_get_info(device)
    cached_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return kv_tokens_from(free, total, cached_free, utilization, bytes_per_token, str(device), reserved)


def kv_tokens_from(free: int, total: int, cached_free: int, utilization: float, bytes_per_token: int,
                   where: str = "cuda", reserved: int = 0) -> int:
    """`kv_tokens_for_memory` from the numbers: `free` and `total` as the driver reports them,
    `cached_free` what this process's allocator holds but does not use (free to the cache, though
    the driver counts it used), less a keep-back for activations, graph pools and workspaces
    (`KEEP_BACK_MIN_BYTES`, `KEEP_BACK_SHARE`) and the `reserved` bytes of layer states."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization {utilization} must be in (0, 1]")
    used = total - free - max(0, cached_free)
    keep = max(KEEP_BACK_MIN_BYTES, int(KEEP_BACK_SHARE * total))
    budget = int(total * utilization) - used - keep - reserved
    tokens = budget // max(1, bytes_per_token)
    if tokens < 1:
        states = f", {reserved / 2**30:.1f} GiB for the running sequences' layer states" if reserved else ""
        raise ValueError(f"--gpu-memory-utilization {utilization}: {used / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
                         f"on {where} are in use and {keep / 2**30:.1f} GiB are kept for activations and graphs"
                         f"{states}; nothing is left for the KV cache")
    return int(tokens)


def use_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (kernels, streams and graph captures that
    name no device go to it); nothing on the CPU. Called once where a runtime is built on it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def capture_refusal(device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None = None,
                    sync_free_experts: bool = False) -> str | None:
    """Why a step on `device` in `dtype` cannot be captured as a CUDA graph, in one line, or None
    when it can. The routed experts' `torch._grouped_mm` is sync-free only in bfloat16 on sm90 and
    sm100; other types and GPUs fall back to a kernel that reads each group's offset on the host
    (illegal during capture, a sync per layer eagerly); float64 experts loop on the host.
    `sync_free_experts`: the experts run the fused Triton kernels (`runtime.model.experts.
    choose_fused_experts`), sync-free in float32 and bfloat16 on any GPU."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device}"
    if sync_free_experts and dtype in (torch.float32, torch.bfloat16):
        return None
    if dtype != torch.bfloat16:
        return (f"CUDA graphs are refused in {str(dtype).removeprefix('torch.')}: its routed experts read group "
                "offsets on the host (a sync-free path exists only in bfloat16); run bfloat16 or eager")
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if capability[0] not in (9, 10):
        return (f"CUDA graphs are refused on sm{capability[0]}{capability[1]}: torch's sync-free grouped GEMM needs "
                "sm90 or sm100; run eager")
    return None
