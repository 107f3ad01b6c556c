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


def kv_tokens_for_memory(device: torch.device, utilization: float, bytes_per_token: int) -> int:
    """KV cache tokens that fit in `utilization` of the GPU's total memory, counting what this
    process and others already hold (weights first: call after loading them), as vLLM's
    `--gpu-memory-utilization`. Raises ValueError when nothing is left for the cache."""
    if device.type != "cuda":
        raise ValueError(f"--gpu-memory-utilization sizes a CUDA cache; the {device} cache is sized by "
                         "--kv-cache-tokens")
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization {utilization} must be in (0, 1]")
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - (total - free)
    tokens = budget // max(1, bytes_per_token)
    if tokens < 1:
        raise ValueError(f"--gpu-memory-utilization {utilization}: {(total - free) / 2**30:.1f} GiB of "
                         f"{total / 2**30:.1f} GiB on {device} are already in use; nothing is left for the KV cache")
    return int(tokens)
