"""Block-scaled FP8 checkpoints (DeepSeek-V3, GLM-5, Qwen3.5/3.6 releases): the scheme read from
config.json's `quantization_config`, and (de)quantization of one weight and its scales.

Such a checkpoint stores each converted linear weight `X.weight` as float8_e4m3fn beside
`X.weight_scale_inv` (float32, one value per `weight_block_size` block, rows then columns): the
real weight is `X.weight * scale_inv` block by block. Modules named in `modules_to_not_convert`
(norms, embeddings, the head, the routers) are stored in their own dtype. The loader
(`runtime.model.weights`) reads only the rows or columns (and their scale blocks) a rank owns, and
either keeps a linear's weight in FP8 with its scales (`choose_fp8_kept`: on CUDA with triton; the
Triton block-scaled kernel runs it) or dequantizes it to the serving dtype as it reads it (the CPU,
routed experts); docs/design.md §3 says why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.model.config import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True, slots=True)
class Fp8BlockScheme:
    """`quant_method: fp8` with dynamic activations: weights in FP8, one scale per block."""
    block: tuple[int, int]
    not_converted: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"fp8 blocks {self.block[0]}x{self.block[1]}"


def quantization_scheme(raw: dict[str, Any], source: str = "config.json") -> Fp8BlockScheme | None:
    """The scheme of a config.json dict (None for an unquantized checkpoint); anything this runtime
    cannot load is refused naming the field."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"{source}: quantization_config must be an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{source}: quantization_config.quant_method={method!r} is not supported "
                          "(expected 'fp8' with block scales)")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(f"{source}: quantization_config.activation_scheme={act!r} is not supported "
                          "(expected 'dynamic')")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{source}: quantization_config.fmt={fmt!r} is not supported (expected 'e4m3')")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{source}: quantization_config.weight_block_size={block!r}: expected two "
                          "positive whole numbers (per-tensor FP8 is not supported)")
    skip = q.get("modules_to_not_convert") or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
        raise ConfigError(f"{source}: quantization_config.modules_to_not_convert must be a list of names")
    return Fp8BlockScheme(block=(block[0], block[1]), not_converted=tuple(skip))


def choose_fp8_kept(scheme: Fp8BlockScheme | None, device: torch.device, dtype: torch.dtype,
                    on: bool | None = None) -> bool:
    """Whether an FP8 checkpoint's linear weights stay FP8 on `device` (run by the Triton block-scaled
    kernel, runtime/ops/kernels/fp8_linear.py) rather than being dequantized to `dtype` on load; chosen
    once, at load. `on` None keeps them on CUDA with triton installed, for float32 and bfloat16 serving
    (float64, the reference mode, and the CPU dequantize); True insists (the CPU under the Triton
    interpreter: the tests), refused in one line where the kernel cannot run."""
    if scheme is None:
        return False
    from runtime.ops import kernels
    fits = dtype in (torch.float32, torch.bfloat16)
    if on is None:
        return device.type == "cuda" and fits and kernels.available("cuda")
    if on and not (fits and kernels.available(device.type)):
        raise ValueError(f"FP8 weights cannot be kept here ({dtype} on {device}): the block-scaled kernel needs "
                         "triton (and TRITON_INTERPRET=1 for CPU tensors), float32 or bfloat16")
    return bool(on)


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Blocks along rows and columns of a weight of `shape` (partial blocks at the end count)."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               row0: int = 0, col0: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`weight` (FP8, a window of the stored tensor starting at row `row0`, column `col0`) times the
    scale of each element's block. `scale_inv` holds the blocks from the one containing (row0, col0)
    on, as sliced by `scale_window`. The product is formed in float32 (float64 when asked)."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"FP8 block dequantization needs 2-D tensors, got {tuple(weight.shape)} "
                         f"and {tuple(scale_inv.shape)}")
    br, bc = block
    r_off, c_off = row0 % br, col0 % bc
    rows, cols = weight.shape
    need = scale_shape((rows + r_off, cols + c_off), block)
    if scale_inv.shape[0] < need[0] or scale_inv.shape[1] < need[1]:
        raise ValueError(f"FP8 weight window {tuple(weight.shape)} at ({row0}, {col0}) needs "
                         f"{need} scale blocks, got {tuple(scale_inv.shape)}")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    s = scale_inv[:need[0], :need[1]].to(work)
    s = s.repeat_interleave(br, dim=0)[r_off:r_off + rows].repeat_interleave(bc, dim=1)[:, c_off:c_off + cols]
    return (weight.to(work) * s).to(dtype)


def scale_window(dim: int, start: int, stop: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scale blocks along `dim` that cover stored rows (dim 0) or columns (dim 1) start..stop."""
    b = block[dim]
    return start // b, -(-stop // b)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale_inv) of a 2-D weight: each block scaled so its largest magnitude
    is FP8's largest finite value (all-zero blocks get scale 1). Round trip error is FP8's rounding."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight, got {tuple(weight.shape)}")
    br, bc = block
    rows, cols = weight.shape
    nr, nc = scale_shape((rows, cols), block)
    w = weight.to(torch.float32)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = w
    amax = padded.view(nr, br, nc, bc).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (padded.view(nr, br, nc, bc) / scale_inv[:, None, :, None]).view(nr * br, nc * bc)
    return q[:rows, :cols].clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous(), scale_inv.contiguous()
