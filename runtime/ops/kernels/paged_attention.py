"""Paged attention in Triton: each query row reads its keys and values in place from the cache
through its sequence's block table (no context copy, no padded mask).

One kernel serves decode rows, chain-verify rows and tree-verify rows. Row t belongs to sequence
`row_seq[t]`; it sees the committed context (positions 0 .. row_start[t]-1) and those of its own
step's rows (positions row_start[t] + j, j < row_end[t] - row_start[t] <= 64) whose bit j is set in
`row_anc[t]`: a decode row sets bit 0, chain row r bits 0..r, a tree row its ancestors and itself.
A padding row (row_end 0) sees nothing and gets zeros. Grouped-query heads: one program per
(row, kv head) computes the kv head's group of query heads from one read of each key. A latent
cache (MLA, absorbed) is one kv head whose values are a strided view of its keys' first channels.
Scores and the weighted values are two `tl.dot`s per key block
(query heads padded to 16 rows), float32 IEEE for a float32 cache, bfloat16 operands with float32
accumulation for bfloat16 (the probabilities rounded to bfloat16, as flash attention does).
Split-K (flash-decoding): the key range is cut into `num_splits` parts, each a program, merged
by their log-sum-exp; for long contexts at few rows, where rows x kv heads alone leave most of the
GPU idle.

Shapes: T rows, nh query heads, nkv kv heads, D key dim, Dv value dim, S cache cells, B sequences,
NB blocks per sequence, P splits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _paged_rows_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, table_ptr, row_seq_ptr, row_start_ptr, row_end_ptr,
                       row_anc_ptr, scale, stride_qt, stride_qh, stride_kc, stride_kh, stride_vc, stride_vh,
                       stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_tb, block_size, group,
                       head_dim, value_dim, keys_per_split,
                       GP: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
                       IEEE: tl.constexpr, UPCAST: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    b = tl.load(row_seq_ptr + t).to(tl.int64)
    start = tl.load(row_start_ptr + t).to(tl.int64)
    end = tl.load(row_end_ptr + t).to(tl.int64)
    anc = tl.load(row_anc_ptr + t).to(tl.int64)
    gi = tl.arange(0, GP)
    hmask = gi < group
    heads = g * group + gi
    d = tl.arange(0, BD)
    dmask = d < head_dim
    dv = tl.arange(0, BDV)
    dvmask = dv < value_dim
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)                             # [GP, BD]
    q = q.to(tl.float32) if UPCAST else q.to(k_ptr.dtype.element_ty)
    lo = s * keys_per_split
    hi = tl.minimum(end, lo + keys_per_split)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BDV], tl.float32)
    for n0 in range(lo, hi, BN):
        pos = n0 + tl.arange(0, BN).to(tl.int64)
        inside = pos < hi
        own = tl.minimum(tl.maximum(pos - start, 0), 63)
        vis = inside & ((pos < start) | (((anc >> own) & 1) == 1))
        blk = tl.load(table_ptr + b * stride_tb + pos // block_size, mask=inside, other=0).to(tl.int64)
        cell = blk * block_size + pos % block_size
        k = tl.load(k_ptr + cell[:, None] * stride_kc + g * stride_kh + d[None, :],
                    mask=vis[:, None] & dmask[None, :], other=0.0)                           # [BN, BD]
        if UPCAST:   # the interpreter's dot takes no bfloat16: the same products in float32
            k = k.to(tl.float32)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale                  # [GP, BN]
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(vis[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + cell[:, None] * stride_vc + g * stride_vh + dv[None, :],
                    mask=vis[:, None] & dvmask[None, :], other=0.0)                          # [BN, BDV]
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:   # the probabilities in the values' type, as flash attention does
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + s * stride_os + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dvmask[None, :])
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + t * stride_lt + heads * stride_lh + s, lse, mask=hmask)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(1, n) - 1).bit_length())


def split_count(num_rows: int, num_kv_heads: int, max_keys: int) -> int:
    """Key splits for a step of `num_rows` rows over contexts of up to `max_keys` keys: one
    unless the rows x kv heads leave most of a GPU's ~100 multiprocessors idle and each split
    keeps 512 keys or more; from the step's shape alone (a captured bucket keeps its count)."""
    programs = num_rows * num_kv_heads
    if programs >= 128 or max_keys < 1024:
        return 1
    return max(1, min(16, max_keys // 512, 128 // programs))


def paged_attention(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, block_table: torch.Tensor,
                    block_size: int, row_seq: torch.Tensor, row_start: torch.Tensor, row_end: torch.Tensor,
                    row_anc: torch.Tensor, scale: float, max_keys: int, num_splits: int | None = None) -> torch.Tensor:
    """q [T, nh, D], k_plane [S, nkv, D] and v_plane [S, nkv, Dv] (one layer of the cache; a view
    is fine where the last dim is contiguous), block_table [B, NB] (cells of a sequence's position
    p: block_table[b, p // block_size] * block_size + p % block_size), row_seq/row_start/row_end/
    row_anc [T] as the module says, `max_keys` at least every row_end -> [T, nh, Dv] in q's dtype.
    Launches kernels only: nothing is read back on the host."""
    t, nh, d = q.shape
    nkv, dv = k_plane.shape[1], v_plane.shape[2]
    if nh % nkv:
        raise ValueError(f"{nh} query heads do not split into {nkv} kv heads")
    for name, x in (("q", q), ("k_plane", k_plane), ("v_plane", v_plane), ("block_table", block_table)):
        if x.stride(-1) != 1:
            raise ValueError(f"paged_attention: {name}'s last dim must be contiguous")
    group = nh // nkv
    splits = num_splits or split_count(t, nkv, max_keys)
    bn = 32 if dv <= 128 else 16
    per_split = -(-max(1, max_keys) // splits)
    per_split = -(-per_split // bn) * bn
    # one split writes the output itself; several write float32 parts, merged below
    out = q.new_empty(t, nh, 1, dv) if splits == 1 else torch.empty(t, nh, splits, dv, dtype=torch.float32,
                                                                     device=q.device)
    lse = torch.empty(t, nh, splits, dtype=torch.float32, device=q.device)
    _paged_rows_kernel[(t, nkv, splits)](
        q, k_plane, v_plane, out, lse, block_table,
        row_seq, row_start, row_end, row_anc, float(scale),
        q.stride(0), q.stride(1), k_plane.stride(0), k_plane.stride(1), v_plane.stride(0), v_plane.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), block_table.stride(0),
        block_size, group, d, dv, per_split,
        GP=_pow2(group, 16), BD=_pow2(d, 16), BDV=_pow2(dv, 16), BN=bn,
        IEEE=k_plane.dtype == torch.float32, UPCAST=q.device.type == "cpu", num_warps=4 if d <= 128 else 8)
    if splits == 1:
        return out[:, :, 0]
    # Merge the splits: weights softmax(lse) over the splits (an empty split has lse -inf).
    top = lse.amax(dim=2, keepdim=True)
    w = torch.exp(lse - torch.where(torch.isinf(top), 0.0, top))                      # [T, nh, P]
    total = w.sum(dim=2, keepdim=True)
    w = w / torch.where(total > 0, total, 1.0)
    return (out * w[..., None]).sum(dim=2).to(q.dtype)


