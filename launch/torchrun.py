"""The torchrun entry: `torchrun --nproc-per-node N -m launch generate ...`.

World size and rank come from torchrun's own variables (the only topology read from the
environment). Rank 0 runs the command; the other ranks serve it as EP workers and print nothing.
"""
from __future__ import annotations

import os
import sys

import torch

from ep.comm import Communicator
from ep.worker import ignore_interrupts, serve_rank
from runtime.platform.device import rank_device


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world_size) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def join(rank: int, world: int, timeout_s: float, device: torch.device | str = "cpu") -> Communicator:
    """Join torchrun's group. On CUDA this rank takes GPU LOCAL_RANK (torchrun's own variable) of
    its node, whatever index `device` names."""
    device = torch.device(device)
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = rank_device(torch.device("cuda", 0), local_rank)
    return Communicator(rank=rank, world_size=world, init_method="env://", timeout_s=timeout_s, device=device)


def run_worker(comm: Communicator, model_dir: str, dtype: str, moe_a2a: str, kv_cache_tokens: int,
               gpu_memory_utilization: float | None = None) -> int:
    ignore_interrupts()   # Ctrl-C is rank 0's (and torchrun's) to act on
    code, message = serve_rank(comm, model_dir, dtype, moe_a2a, kv_cache_tokens,
                               gpu_memory_utilization=gpu_memory_utilization)
    if message:
        print(message, file=sys.stderr, flush=True)
    return code
