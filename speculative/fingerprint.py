"""`hidden_fingerprint`: a 64-bit FNV-1a over a hidden row's bfloat16 values (docs/design.md §5.7)."""
from __future__ import annotations

import torch

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def hidden_fingerprint(row: torch.Tensor) -> int:
    """FNV-1a (64-bit) over the row's values as bfloat16, little-endian bytes; 0 when the row
    cannot be read (wrong kind of tensor, or a device copy that fails)."""
    try:
        data = row.detach().reshape(-1).to("cpu", torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    except (RuntimeError, TypeError, AttributeError):
        return 0
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK
    return h
