"""The routed experts as two Triton kernels, sync-free (so a CUDA graph captures them): the
choices sorted by local expert on the device, cut into blocks of `BLOCK_M` choices that each
belong to one expert, then per block gate/up GEMM + SiLU(gate) * up (kernel 1) and the down GEMM
scaled by the choice's routing weight (kernel 2). The grid is fixed by the shapes alone (an upper
bound on the blocks: T*k/BLOCK_M + E); programs past the real blocks return at once. The k choices
of a token are summed in a fixed order after, so a row's result does not depend on its batch.

float32 runs its GEMMs in IEEE float32 (no TF32), bfloat16 on bfloat16 inputs with float32
accumulation; intermediates are stored in the input type, as the reference path rounds them.

FP8 experts (an FP8 checkpoint's, kept on the device: `fused_fp8_experts`): the weights as e4m3
bytes beside float32 block scales (gate_up_scale [E, 2, ceil(I/br), ceil(H/bc)], gate and up each
blocked as the checkpoint stores them; down_scale [E, ceil(H/br), ceil(I/bc)]); each weight tile is
decoded (runtime/ops/kernels/fp8_linear.py), multiplied by its elements' block scales and rounded to
the input type, the very values dequantizing on load gives, then multiplied as above.

Shapes: T rows, k choices per row, E local experts, H hidden, I expert intermediate, C = T*k.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.kernels.fp8_linear import _e4m3_to_f32, _round_bfloat16

BLOCK_M = 16


@triton.jit
def _weight_tile(w_ptr, s_ptr, offs, rows, cols, mask, dtype: tl.constexpr, stride_sn, stride_sk,
                 BR: tl.constexpr, BC: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr):
    """A [BK, BN] weight tile at `offs`: as stored, or FP8 bytes decoded times the scale of each
    element's block (`rows`, `cols`: its row and column in the stored matrix), rounded to `dtype`."""
    if FP8:
        bits = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.int32)
        scale = tl.load(s_ptr + (rows // BR) * stride_sn + (cols // BC) * stride_sk, mask=mask, other=0.0)
        w = _e4m3_to_f32(bits) * scale
        if UPCAST and dtype == tl.bfloat16:   # the interpreter's cast truncates
            w = _round_bfloat16(w)
        return w.to(dtype)
    else:
        return tl.load(w_ptr + offs, mask=mask, other=0.0)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, order_ptr, block_expert_ptr, block_row_ptr, expert_end_ptr,
                    num_choices, hidden, inter, topk, stride_xt, stride_we, stride_wn, stride_wk, stride_hc,
                    s_ptr, stride_se, stride_sh, stride_sn, stride_sk,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                    UPCAST: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, FP8: tl.constexpr):
    pid = tl.program_id(0)
    nt = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid).to(tl.int64)
    if e >= 0:
        first = tl.load(block_row_ptr + pid).to(tl.int64)
        end = tl.load(expert_end_ptr + e).to(tl.int64)
        rows = first + tl.arange(0, BM)
        live = rows < end
        choice = tl.load(order_ptr + rows, mask=live, other=0).to(tl.int64)
        token = choice // topk
        n = nt * BN + tl.arange(0, BN)
        nmask = n < inter
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, hidden, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < hidden
            a = tl.load(x_ptr + token[:, None] * stride_xt + kk[None, :], mask=live[:, None] & kmask[None, :], other=0.0)
            wmask = nmask[None, :] & kmask[:, None]
            wg = _weight_tile(w_ptr, s_ptr + e * stride_se, e * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk,
                              n[None, :], kk[:, None], wmask, x_ptr.dtype.element_ty, stride_sn, stride_sk,
                              BR, BC, FP8, UPCAST)                                                    # [BK, BN]
            wu = _weight_tile(w_ptr, s_ptr + e * stride_se + stride_sh,
                              e * stride_we + (n[None, :] + inter) * stride_wn + kk[:, None] * stride_wk,
                              n[None, :], kk[:, None], wmask, x_ptr.dtype.element_ty, stride_sn, stride_sk,
                              BR, BC, FP8, UPCAST)
            if UPCAST:   # the interpreter's dot takes no bfloat16: the same products in float32
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            if IEEE:
                acc_g += tl.dot(a, wg, input_precision="ieee")
                acc_u += tl.dot(a, wu, input_precision="ieee")
            else:
                acc_g += tl.dot(a, wg)
                acc_u += tl.dot(a, wu)
        g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)   # rounded as the reference's GEMM output
        u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(h_ptr.dtype.element_ty).to(tl.float32)
        h = silu * u
        tl.store(h_ptr + rows[:, None] * stride_hc + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=live[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, order_ptr, weight_ptr, block_expert_ptr, block_row_ptr, expert_end_ptr,
                 hidden, inter, stride_hc, stride_we, stride_wn, stride_wk, stride_oc,
                 s_ptr, stride_se, stride_sn, stride_sk,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, FP8: tl.constexpr):
    pid = tl.program_id(0)
    nt = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid).to(tl.int64)
    if e >= 0:
        first = tl.load(block_row_ptr + pid).to(tl.int64)
        end = tl.load(expert_end_ptr + e).to(tl.int64)
        rows = first + tl.arange(0, BM)
        live = rows < end
        choice = tl.load(order_ptr + rows, mask=live, other=0).to(tl.int64)
        n = nt * BN + tl.arange(0, BN)
        nmask = n < hidden
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, inter, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < inter
            a = tl.load(h_ptr + rows[:, None] * stride_hc + kk[None, :], mask=live[:, None] & kmask[None, :], other=0.0)
            w = _weight_tile(w_ptr, s_ptr + e * stride_se, e * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk,
                             n[None, :], kk[:, None], nmask[None, :] & kmask[:, None], h_ptr.dtype.element_ty,
                             stride_sn, stride_sk, BR, BC, FP8, UPCAST)                               # [BK, BN]
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        rw = tl.load(weight_ptr + choice, mask=live, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + choice[:, None] * stride_oc + n[None, :], (y * rw[:, None]).to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & nmask[None, :])


def _pow2(n: int, least: int = 16, most: int = 64) -> int:
    return min(most, max(least, 1 << (max(1, n) - 1).bit_length()))


def block_layout(ids: torch.Tensor, expert_offset: int, num_local: int, block_m: int = BLOCK_M):
    """Device-side, no host read: (order [C] choice indices sorted by local expert, expert_end [E]
    one past each expert's last sorted choice, block_expert [NBmax] the expert of each block or -1,
    block_row [NBmax] its first sorted choice). NBmax = C // block_m + E, from the shapes alone."""
    c = ids.numel()
    dev = ids.device
    local = ids.reshape(-1) - expert_offset
    key = torch.where((local >= 0) & (local < num_local), local, num_local)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    experts = torch.arange(num_local, device=dev)
    end = torch.searchsorted(sorted_key, experts, right=True)                        # [E]
    start = torch.searchsorted(sorted_key, experts, right=False)
    blocks = (end - start + block_m - 1) // block_m                                 # [E]
    first_block = torch.cumsum(blocks, 0) - blocks
    nb_max = c // block_m + num_local
    b = torch.arange(nb_max, device=dev)
    e_of = torch.searchsorted(first_block + blocks, b, right=True)                   # [NBmax]
    real = e_of < num_local
    e_safe = e_of.clamp(max=num_local - 1)
    block_row = start[e_safe] + (b - first_block[e_safe]) * block_m
    return order, end, torch.where(real, e_safe, -1), torch.where(real, block_row, 0)


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor, expert_offset: int = 0, gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None, block: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """x [T, H], weights/ids [T, k] (global expert ids), gate_up_proj [E, 2I, H] (gate rows first),
    down_proj [E, H, I] -> [T, H]: sum over the k choices of weight * down(SiLU(gate) * up) for
    choices whose expert is local, zero for the others. No host synchronisation. With
    `gate_up_scale` and `down_scale` the weights are FP8 (float8_e4m3fn or their uint8 bytes) in
    `block` scale blocks (shapes in the module docstring)."""
    t, topk = ids.shape
    e_local, two_i, h = gate_up_proj.shape
    inter = two_i // 2
    if t == 0:
        return x.new_zeros(0, h)
    x = x.contiguous()   # expert matrices: any strides (the CPU keeps them column-major)
    order, end, block_expert, block_row = block_layout(ids, expert_offset, e_local)
    c = t * topk
    nb = block_expert.shape[0]
    hbuf = x.new_empty(c, inter)
    per_choice = x.new_zeros(c, h)
    w = weights.reshape(-1).contiguous()
    ieee = x.dtype == torch.float32
    upcast = x.device.type == "cpu"   # the interpreter
    bn_i, bn_h = _pow2(inter), _pow2(h)
    fp8 = gate_up_scale is not None
    if fp8:
        gate_up_proj, down_proj = gate_up_proj.view(torch.uint8), down_proj.view(torch.uint8)
        gs, ds = gate_up_scale, down_scale
    else:   # never read: any float32 tensor for the pointer, zero strides
        gs = ds = weights
    gs_strides = gs.stride() if fp8 else (0, 0, 0, 0)
    ds_strides = ds.stride() if fp8 else (0, 0, 0)
    _gate_up_kernel[(nb, triton.cdiv(inter, bn_i))](
        x, gate_up_proj, hbuf, order, block_expert, block_row, end, c, h, inter, topk,
        x.stride(0), *gate_up_proj.stride(), hbuf.stride(0), gs, *gs_strides,
        BM=BLOCK_M, BN=bn_i, BK=_pow2(h, 16, 32), IEEE=ieee, UPCAST=upcast, BR=block[0], BC=block[1], FP8=fp8)
    _down_kernel[(nb, triton.cdiv(h, bn_h))](
        hbuf, down_proj, per_choice, order, w, block_expert, block_row, end, h, inter,
        hbuf.stride(0), *down_proj.stride(), per_choice.stride(0), ds, *ds_strides,
        BM=BLOCK_M, BN=bn_h, BK=_pow2(inter, 16, 32), IEEE=ieee, UPCAST=upcast, BR=block[0], BC=block[1], FP8=fp8)
    return per_choice.view(t, topk, h).sum(dim=1)
