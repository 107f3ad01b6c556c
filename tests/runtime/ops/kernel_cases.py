"""Shared by the Triton kernel tests: the skip line, and random paged caches with ragged block tables."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def kernel_device() -> torch.device:
    """Where the kernel tests run: CPU tensors under the Triton interpreter. Skips in one line
    without triton, or where the kernels are compiled for a GPU (the `cuda` tests run them there)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install -e '.[test]' brings it)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not 1 in this process: the cuda tests run the compiled kernels")
    return torch.device("cpu")


def ragged_cache(lengths: list[int], block_size: int, num_kv_heads: int, dims: tuple[int, int], dtype: torch.dtype,
                 device: torch.device, seed: int = 0, latent: bool = False):
    """Cache planes with every sequence's blocks scattered over a shuffled pool; returns (k_plane,
    v_plane, block_table [B, NB] int32 padded with 0). `latent`: one plane, values its first dims[1]
    channels (MLA's layout)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // block_size) for n in lengths]
    total = sum(nblocks) + 3
    order = torch.randperm(total, generator=g).tolist()
    width = max(1, max(nblocks))
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblocks):
        table[b, :n] = torch.tensor(order[used:used + n], dtype=torch.int32)
        used += n
    d, dv = dims
    k = torch.randn(total * block_size, num_kv_heads, d, generator=g).to(dtype)
    v = k[..., :dv] if latent else torch.randn(total * block_size, num_kv_heads, dv, generator=g).to(dtype)
    return k.to(device), v.to(device), table.to(device)
