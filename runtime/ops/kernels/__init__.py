"""GPU kernels in Triton, each self-contained behind a small function (the executor's attention and
expert backends call them). They compile with triton 3.6 (the GPU image) and run on CPU tensors
under the Triton interpreter (`TRITON_INTERPRET=1` set before triton is imported), which is how
the CPU suite tests them against the reference paths."""
from __future__ import annotations

import importlib.util

from runtime.platform.env import triton_interpret


def available(device_type: str) -> bool:
    """Whether the Triton kernels can run on tensors of `device_type`: compiled on CUDA, or
    interpreted on the CPU when TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device_type == "cuda":
        return not triton_interpret()
    return device_type == "cpu" and triton_interpret()
