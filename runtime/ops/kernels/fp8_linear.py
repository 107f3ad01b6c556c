"""A linear layer over a block-scaled FP8 weight (DeepSeek-V3 / GLM-5 checkpoints), in Triton:
y = x @ (W * scale_inv)^T (+ bias), the weight kept as its e4m3 bytes and one float32 scale per
[br, bc] block, dequantized tile by tile in the kernel.

The weight is read as uint8 and its e4m3 bits decoded arithmetically (exponent and mantissa moved
into a float32's bits; subnormals as mantissa * 2^-9): the Triton interpreter runs on numpy, which
has no FP8 type, so the same kernel is the one the CPU suite tests and the one CUDA compiles. Every
e4m3 value is exact in bfloat16 and float32, so the decoded tile is the stored weight exactly.

Each program owns a [BM, BN] output tile and walks the input features one scale column block at a
time: the block's products summed in float32 (float32 inputs in IEEE float32, bfloat16 inputs on
bfloat16 operands), then scaled by that block's scale of each output row and added to the float32
accumulator. A window of a larger stored weight (an EP rank's rows or columns) starts `offset`
rows and columns inside its first scale block; the scales handed in start at that block
(`runtime.model.quantization.scale_window`). Tiles depend on the weight's shape and the device
alone, never on the rows of `x`, so a row's result does not depend on its batch.

Shapes: x [M, K] (any leading dims), weight [N, K] e4m3, scale_inv [ceil((N + ro) / br),
ceil((K + co) / bc)] float32, bias [N] or None -> [M, N] in x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _e4m3_to_f32(bits):
    """uint8 e4m3fn bits (as int32) -> their float32 values (0x7f / 0xff, NaN, are never stored)."""
    e = (bits >> 3) & 15
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)   # 2^(e-7) * (1 + m/8)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)           # subnormal: m * 2^-9
    return tl.where((bits & 128) != 0, -mag, mag)


@triton.jit
def _round_bfloat16(v):
    """float32 `v` rounded to the nearest bfloat16 (ties to even), still float32. The interpreter's
    float32 -> bfloat16 cast truncates; rounded first, as the GPU's cast rounds, the cast is exact."""
    ib = v.to(tl.int32, bitcast=True)
    ib = (ib + 0x7FFF + ((ib >> 16) & 1)) & -65536
    return ib.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, r_off, c_off,
                       stride_xm, stride_wn, stride_wk, stride_sn, stride_sk, stride_om,
                       BR: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, SUB: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    mmask = m < M
    nmask = n < N
    s_row = (n + r_off) // BR                                              # [BN] scale row of each output
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, (K + c_off + BC - 1) // BC):                        # one scale column block at a time
        scale = tl.load(s_ptr + s_row * stride_sn + kb * stride_sk, mask=nmask, other=0.0)
        part = tl.zeros([BM, BN], tl.float32)
        for sub in range(SUB):
            j = sub * BK + tl.arange(0, BK)
            kk = kb * BC - c_off + j
            kmask = (j < BC) & (kk >= 0) & (kk < K)
            a = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0)                       # [BM, BK]
            bits = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk,
                           mask=nmask[None, :] & kmask[:, None], other=0).to(tl.int32)         # [BK, BN]
            w = _e4m3_to_f32(bits)
            if UPCAST:   # the interpreter's dot takes no bfloat16: the same (exact) products in float32
                a = a.to(tl.float32)
            else:
                w = w.to(a.dtype)
            if IEEE:
                part += tl.dot(a, w, input_precision="ieee")
            else:
                part += tl.dot(a, w)
        acc += part * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if UPCAST and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = _round_bfloat16(acc)
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _pow2(n: int, least: int, most: int) -> int:
    return min(most, max(least, 1 << (max(1, n) - 1).bit_length()))


def tiles(n: int, bc: int, device_type: str) -> tuple[int, int, int]:
    """(BM, BN, BK) for a weight of `n` rows and `bc`-column scale blocks: BK covers a scale block in
    as few steps as it can (up to 64); smaller tiles under the interpreter, where each is numpy work."""
    if device_type == "cpu":
        return 16, _pow2(n, 16, 32), _pow2(bc, 16, 32)
    return 64, _pow2(n, 16, 64), _pow2(bc, 16, 64)   # a decoded 64x64 float32 tile: 32 registers a thread


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None,
               block: tuple[int, int], offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """x [..., K] (float32 or bfloat16) times the block-scaled FP8 `weight` [N, K] (float8_e4m3fn, or
    its bytes as uint8) transposed, plus `bias`: [..., N] in x's dtype. `offset`: rows and columns
    the weight starts inside its first scale block."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, the weight {k}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp8_linear: x is {x.dtype}; float32 or bfloat16 expected")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    bits = weight.view(torch.uint8)
    m = x2.shape[0]
    out = x.new_empty(m, n)
    if m == 0:
        return out.view(*lead, n)
    br, bc = block
    bm, bn, bk = tiles(n, bc, x.device.type)
    b = bias if bias is not None else scale_inv   # never read without HAS_BIAS
    _fp8_linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x2, bits, scale_inv, b, out, m, n, k, offset[0], offset[1],
        x2.stride(0), bits.stride(0), bits.stride(1), scale_inv.stride(0), scale_inv.stride(1), out.stride(0),
        BR=br, BC=bc, BM=bm, BN=bn, BK=bk, SUB=triton.cdiv(bc, bk), HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, UPCAST=x.device.type == "cpu")
    return out.view(*lead, n)


# The op a compiled step calls (inductor does not trace into the launch); eager callers go through it too.
torch.library.define("metrale::fp8_linear", "(Tensor x, Tensor weight, Tensor scale_inv, Tensor? bias, "
                     "int[] block, int[] offset) -> Tensor")
torch.library.impl("metrale::fp8_linear", "CompositeExplicitAutograd")(
    lambda x, weight, scale_inv, bias, block, offset: fp8_linear(x, weight, scale_inv, bias, tuple(block), tuple(offset)))
torch.library.register_fake("metrale::fp8_linear")(
    lambda x, weight, scale_inv, bias, block, offset: x.new_empty(*x.shape[:-1], weight.shape[0]))
