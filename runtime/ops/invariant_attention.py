"""Batch-invariant attention over the paged cache: every query row's result independent of the
other rows of its step (why, and the GEMM side: `runtime.ops.batch_invariant`).

`attention_tiles` lays a step's rows out once per step (`AttentionTiles`: short causal chunks as
`ChainRows`, prefills as `SharedKeys`, tree rows as one-row tiles); `attention` runs them on SDPA
where `sdpa_is_invariant` holds, else `tiled_attention` on fixed-shape matmuls.

Shapes: T step rows, nh query heads, nkv kv heads, D head dim, Dv value dim, Kp keys padded to a
multiple of KEY_CHUNK.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

KEY_CHUNK = 64     # attention reduces over keys in chunks of this many, combined in order
QUERY_TILE = 1     # query rows of one sequence attended in one fixed-shape matmul (8 wasted 7/8 of a decode row)
SHARED_ROWS = 8    # a causal chunk of more rows than this shares one key list among its rows


@dataclass(frozen=True, slots=True)
class SharedKeys:
    """A causal chunk of more than SHARED_ROWS rows (a prefill): rows first..first+n-1, at positions
    start..start+n-1, read one key list, row r its first start+r+1 keys. `cells` [Kp]: the
    context's cells in position order, padded with cell 0 to a multiple of KEY_CHUNK; `lengths`
    [n]: the keys each row sees."""
    first: int
    start: int
    context: torch.Tensor   # [start + n] the context's cells
    cells: torch.Tensor     # [Kp]
    lengths: torch.Tensor   # [n]
    mask: torch.Tensor      # [n, 1, 1, Kp] `prefix_mask` of the lengths

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    def tiles(self) -> AttentionTiles:
        """The same rows as tiles of their own (for `tiled_attention`)."""
        return attention_tiles([self.context], [self.start], [self.num_rows], [None], [self.first], share=False)


@dataclass(frozen=True, slots=True)
class ChainRows:
    """Decode rows and short causal chunks (at most SHARED_ROWS rows, a chain verify): one key
    list per sequence, gathered once, its rows attended as extra query heads of one SDPA entry
    (`chain_attention`). B sequences, Qm the most rows of one, Kp keys (a multiple of KEY_CHUNK).

    cells [B, Kp] context cells in position order (padding 0); rows [B, Qm] step row of each row
    (padding: the chunk's first row); lengths [B, Qm] keys each row sees (padding 1); flat [R]
    the real rows' places in B x Qm and step_rows [R] their step rows; in_order: the real rows
    are every row of the step in step order with no padding (the output needs no reordering)."""
    cells: torch.Tensor
    rows: torch.Tensor
    lengths: torch.Tensor
    flat: torch.Tensor
    step_rows: torch.Tensor
    in_order: bool
    contexts: tuple[torch.Tensor, ...]     # for `tiles`
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    firsts: tuple[int, ...]
    masks: dict = field(default_factory=dict)   # (kv heads, group, dtype) -> [B, Hq, 1, Kp]

    def head_mask(self, nkv: int, g: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, nkv * Qm * g, 1, Kp] additive mask in `dtype` (0 or -inf; SDPA would convert a
        boolean one every layer): query head (kv head, row, group member) sees its row's keys."""
        mask = self.masks.get((nkv, g, dtype))
        if mask is None:
            b, qm = self.rows.shape
            kp = self.cells.shape[1]
            seen = torch.arange(kp, device=self.cells.device)[None, None, :] < self.lengths[..., None]   # [B, Qm, Kp]
            seen = seen[:, None, :, None].expand(b, nkv, qm, g, kp).reshape(b, -1, 1, kp)
            mask = self.masks[(nkv, g, dtype)] = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
                ~seen, float("-inf"))
        return mask

    def tiles(self) -> AttentionTiles:
        """The same rows as tiles of their own (for `tiled_attention`)."""
        return attention_tiles(self.contexts, self.starts, self.counts, [None] * len(self.counts), self.firsts,
                               share=False)


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    """A step's query rows: tiles of QUERY_TILE rows, each tile with one key list (tree rows, or
    every row when not `share`d), the long causal chunks whose rows share one (`shared`), and the
    short causal chunks whose rows share one per sequence (`chains`).

    cells [N, K] cache cells of the tile's keys in position order (padding 0), rows [N, QUERY_TILE]
    step row of each tile row, lengths [N, QUERY_TILE] keys each row sees (a prefix of the tile's
    list), real [N, QUERY_TILE] bool: a real row (padding rows repeat row 0 and see one key), mask
    [N, 1, 1, K] the keys of each tile's first row (`prefix_mask`: one-row tiles' SDPA mask).
    N may be 0 when every row is in a shared chunk.
    """
    cells: torch.Tensor
    rows: torch.Tensor
    lengths: torch.Tensor
    real: torch.Tensor
    mask: torch.Tensor
    shared: tuple[SharedKeys, ...] = ()
    chains: ChainRows | None = None


def _padded(n: int) -> int:
    return -(-n // KEY_CHUNK) * KEY_CHUNK


def attention_tiles(contexts: Sequence[torch.Tensor], starts: Sequence[int], counts: Sequence[int],
                    parents: Sequence[Sequence[int] | None], first_rows: Sequence[int],
                    share: bool = True) -> AttentionTiles:
    """Tiles of one step: per sequence its context cells [end] (positions 0..end-1), the first
    position of its chunk, its row count, its tree parents (None: causal) and its first step row.
    `share`: causal chunks of more than SHARED_ROWS rows become `SharedKeys` and shorter ones
    `ChainRows` (their rows would otherwise each gather their own copy of the context)."""
    lists: list[torch.Tensor] = []
    rows: list[list[int]] = []
    lengths: list[list[int]] = []
    shared: list[SharedKeys] = []
    chain: list[tuple[torch.Tensor, int, int, int]] = []     # (context, start, rows, first row)
    device = contexts[0].device
    for ctx, start, n, tree, first in zip(contexts, starts, counts, parents, first_rows):
        if tree is None and share and n <= SHARED_ROWS:
            chain.append((ctx[:start + n], start, n, first))
            continue
        if tree is None and share:
            end = start + n
            seen = torch.arange(start + 1, end + 1, device=device)
            shared.append(SharedKeys(first=first, start=start, context=ctx[:end],
                                     cells=F.pad(ctx[:end], (0, _padded(end) - end)), lengths=seen,
                                     mask=prefix_mask(seen, _padded(end))))
            continue
        if tree is None:
            for r0 in range(0, n, QUERY_TILE):
                r1 = min(n, r0 + QUERY_TILE)
                lists.append(ctx[:start + r1])
                rows.append(list(range(first + r0, first + r1)))
                lengths.append([start + r + 1 for r in range(r0, r1)])
            continue
        for i in range(n):            # a tree row: the committed context, then its ancestors by depth
            path = []
            j = i
            while j >= 0:
                path.append(j)
                j = tree[j]
            lists.append(torch.cat((ctx[:start], ctx[start:][torch.tensor(path[::-1], device=ctx.device)])))
            rows.append([first + i])
            lengths.append([start + len(path)])
    chains = _chain_rows(chain, in_order=not lists and not shared) if chain else None
    if not lists:
        empty = torch.zeros(0, QUERY_TILE, dtype=torch.long, device=device)
        return AttentionTiles(cells=torch.zeros(0, KEY_CHUNK, dtype=torch.long, device=device), rows=empty,
                              lengths=empty, real=empty.bool(), mask=prefix_mask(empty[:, 0], KEY_CHUNK),
                              shared=tuple(shared), chains=chains)
    k_max = _padded(max(int(c.shape[0]) for c in lists))
    cells = torch.nn.utils.rnn.pad_sequence(lists, batch_first=True)            # padding: cell 0
    cells = F.pad(cells, (0, k_max - cells.shape[1]))
    pad = [QUERY_TILE - len(r) for r in rows]
    # Padding rows repeat row 0 and see one key; `real` drops them.
    row_t = torch.tensor([r + [0] * p for r, p in zip(rows, pad)], device=device)
    len_t = torch.tensor([ln + [1] * p for ln, p in zip(lengths, pad)], device=device)
    real = torch.tensor([[True] * len(r) + [False] * p for r, p in zip(rows, pad)], device=device)
    return AttentionTiles(cells=cells, rows=row_t, lengths=len_t, real=real, mask=prefix_mask(len_t[:, 0], k_max),
                          shared=tuple(shared), chains=chains)


def _chain_rows(chain: list[tuple[torch.Tensor, int, int, int]], in_order: bool) -> ChainRows:
    """`ChainRows` of (context [end], start, rows, first step row) per sequence, in step order;
    `in_order`: these are all of the step's rows."""
    qm = max(n for _, _, n, _ in chain)
    kp = _padded(max(int(ctx.shape[0]) for ctx, _, _, _ in chain))
    device = chain[0][0].device
    cells = torch.nn.utils.rnn.pad_sequence([ctx for ctx, _, _, _ in chain], batch_first=True)   # padding: cell 0
    cells = F.pad(cells, (0, kp - cells.shape[1]))
    rows = [[first + r if r < n else first for r in range(qm)] for _, _, n, first in chain]
    lengths = [[start + r + 1 if r < n else 1 for r in range(qm)] for _, start, n, _ in chain]
    flat = [b * qm + r for b, (_, _, n, _) in enumerate(chain) for r in range(n)]
    step_rows = [first + r for _, _, n, first in chain for r in range(n)]
    return ChainRows(cells=cells, rows=torch.tensor(rows, device=device), lengths=torch.tensor(lengths, device=device),
                     flat=torch.tensor(flat, device=device), step_rows=torch.tensor(step_rows, device=device),
                     in_order=in_order and len(flat) == len(chain) * qm,
                     contexts=tuple(ctx for ctx, _, _, _ in chain), starts=tuple(st for _, st, _, _ in chain),
                     counts=tuple(n for _, _, n, _ in chain), firsts=tuple(f for _, _, _, f in chain))


def chain_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chains: ChainRows,
                    scale: float) -> torch.Tensor:
    """The chain rows' attention [B * Qm, nh, Dv] (padding rows included): one SDPA call, one
    entry per sequence over its key list, each row's g query heads per kv head as query heads of
    their own (ordered kv head, row, group member), each with one query row and its own mask;
    `sdpa_is_invariant` checks this equals a batch entry per row."""
    b, kp = chains.cells.shape
    qm = chains.rows.shape[1]
    nh, nkv, d, dv = q.shape[1], k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    g = nh // nkv
    cells = chains.cells.reshape(-1)
    keys = k_cache.index_select(0, cells).view(b, kp, nkv, d).to(q.dtype).transpose(1, 2)
    values = v_cache.index_select(0, cells).view(b, kp, nkv, dv).to(q.dtype).transpose(1, 2)
    rows = q if chains.in_order else q.index_select(0, chains.rows.reshape(-1))   # in order: every row, no padding
    heads = rows.view(b, qm, nkv, g, d).permute(0, 2, 1, 3, 4)
    out = F.scaled_dot_product_attention(heads.reshape(b, nkv * qm * g, 1, d), keys, values,
                                         attn_mask=chains.head_mask(nkv, g, q.dtype), scale=scale, enable_gqa=qm * g > 1)
    return out.view(b, nkv, qm, g, dv).permute(0, 2, 1, 3, 4).reshape(b * qm, nh, dv)


_sdpa_plans: dict[tuple, bool] = {}
PROBE_LENGTHS = (1, 2, 17, 63, 64, 65, 100, 300, 511, 512, 513, 1000)


def prefix_mask(lengths: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[N, 1, 1, num_keys] bool: entry i sees its first lengths[i] keys."""
    return (torch.arange(num_keys, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


def _sdpa_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    """SDPA of one query row per entry: q [N, nh, D], keys [N, K, nkv, D], values [N, K, nkv, Dv],
    mask [N, 1, 1, K] the keys each row sees (`prefix_mask`) -> [N, nh, Dv]."""
    out = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=keys.shape[2] != q.shape[1])
    return out[:, :, 0]


def sdpa_is_invariant(nh: int, nkv: int, d: int, dv: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether SDPA gives a query row, alone in its batch entry and seeing a prefix of its keys
    (the rest masked), one result whatever the padded key count (a multiple of KEY_CHUNK),
    whatever the other entries of the call, whether the entries' keys are copies or one list
    expanded, and when rows sharing a key list are query heads of one entry (`chain_attention`):
    then `attention` runs on SDPA.
    Measured once per head shape, dtype and thread count, on random rows and on rows whose
    scores (channel pairs +L/-L of equal keys) or weighted sums (equal scores over values of
    alternating sign +L/-L) depend on the order of summation far more than real data's. Only on
    the CPU (an accelerator's attention kernels split the keys by the batch's size) and for equal
    key and value widths (others, as latent attention's, take SDPA's unfused math path: a
    batched matmul of its own choosing, and slower than the tiles)."""
    key = (nh, nkv, d, dv, dtype, device.type, torch.get_num_threads())
    plan = _sdpa_plans.get(key)
    if plan is not None:
        return plan
    plan = device.type == "cpu" and d == dv
    if plan:
        gen = torch.Generator(device=device).manual_seed(0)
        lengths = torch.tensor(PROBE_LENGTHS, device=device)
        n, k_max = len(PROBE_LENGTHS), 1024 + 2 * KEY_CHUNK
        for mode in ("random", "scores", "sums"):
            q = torch.randn(n, nh, d, generator=gen, device=device)
            keys = torch.randn(k_max, nkv, d, generator=gen, device=device) * 0.3
            values = torch.randn(k_max, nkv, dv, generator=gen, device=device)
            if mode == "scores":
                h = d // 2
                q[..., :h] = 2.0 ** 10 * torch.sign(torch.randn(n, nh, h, generator=gen, device=device))
                q[..., h:2 * h] = -q[..., :h]
                keys[..., h:2 * h] = keys[..., :h]
            elif mode == "sums":
                keys[:] = keys[:1].clone()
                sign = (torch.arange(k_max, device=device) % 2 * 2 - 1).to(values.dtype)[:, None, None]
                values = values * 0.01 + 2.0 ** 12 * sign
            q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
            want: dict[int, torch.Tensor] = {}
            for kp in range(KEY_CHUNK, k_max + 1, KEY_CHUNK):
                fits = (lengths <= kp).nonzero().flatten()
                cells = torch.arange(kp, device=device).repeat(len(fits))
                mask = prefix_mask(lengths[fits], kp)
                batch = _sdpa_rows(q[fits], keys[cells].view(len(fits), kp, nkv, d),
                                   values[cells].view(len(fits), kp, nkv, dv), mask, 1 / d ** 0.5)
                alone = _sdpa_rows(q[fits[-1:]], keys[:kp][None], values[:kp][None], mask[-1:], 1 / d ** 0.5)
                shared = _sdpa_rows(q[fits], keys[:kp][None].expand(len(fits), kp, nkv, d),
                                    values[:kp][None].expand(len(fits), kp, nkv, dv), mask, 1 / d ** 0.5)
                chains = ChainRows(cells=torch.arange(kp, device=device)[None], rows=fits[None],
                                   lengths=lengths[fits][None], flat=fits, step_rows=fits, in_order=False,
                                   contexts=(), starts=(), counts=(), firsts=())
                as_heads = chain_attention(q, keys, values, chains, 1 / d ** 0.5)
                plan = (plan and torch.equal(alone[0], batch[-1]) and torch.equal(shared, batch)
                        and torch.equal(as_heads, batch))
                for row, i in enumerate(fits.tolist()):
                    got = want.setdefault(i, batch[row])
                    plan = plan and torch.equal(got, batch[row])
                if not plan:
                    break
            if not plan:
                break
    _sdpa_plans[key] = plan
    return plan


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: AttentionTiles,
              scale: float) -> torch.Tensor:
    """q [T, nh, D]; k_cache [S, nkv, D], v_cache [S, nkv, Dv] one layer's cells -> [T, nh, Dv].

    Where `sdpa_is_invariant` (the CPU), SDPA with one query row per (entry, head), keys padded
    to a multiple of KEY_CHUNK and masked: the chain rows as query heads of their sequence's
    entry (`chain_attention`), each tree row an entry over its own key list, each shared chunk's
    rows entries over one gathered list (expanded, not copied); else `tiled_attention`.
    """
    n, kp = tiles.cells.shape
    nkv, d, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    if QUERY_TILE != 1 or not sdpa_is_invariant(q.shape[1], nkv, d, dv, q.dtype, q.device):
        return tiled_attention(q, k_cache, v_cache, tiles, scale)
    chains = tiles.chains
    if chains is not None and chains.in_order:
        return chain_attention(q, k_cache, v_cache, chains, scale)
    out = None
    if n:
        cells = tiles.cells.reshape(-1)
        keys = k_cache.index_select(0, cells).view(n, kp, nkv, d).to(q.dtype)
        values = v_cache.index_select(0, cells).view(n, kp, nkv, dv).to(q.dtype)
        out = _sdpa_rows(q.index_select(0, tiles.rows[:, 0]), keys, values, tiles.mask, scale)
        if n == q.shape[0]:   # every row once, in step order (one-row tiles are built so)
            return out
    result = q.new_empty((*q.shape[:-1], dv))
    if out is not None:
        result.index_copy_(0, tiles.rows[:, 0], out)
    if chains is not None:
        result.index_copy_(0, chains.step_rows, chain_attention(q, k_cache, v_cache, chains, scale)[chains.flat])
    for chunk in tiles.shared:
        m, kp = chunk.num_rows, chunk.cells.shape[0]
        keys = k_cache.index_select(0, chunk.cells).to(q.dtype)[None].expand(m, kp, nkv, d)
        values = v_cache.index_select(0, chunk.cells).to(q.dtype)[None].expand(m, kp, nkv, dv)
        result[chunk.first:chunk.first + m] = _sdpa_rows(q[chunk.first:chunk.first + m], keys, values,
                                                         chunk.mask, scale)
    return result


def tiled_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: AttentionTiles,
                    scale: float) -> torch.Tensor:
    """`attention` from fixed-shape matmuls, for where SDPA is not invariant: q [T, nh, D];
    k_cache [S, nkv, D], v_cache [S, nkv, Dv] one layer's cells -> [T, nh, Dv].

    Scores and the softmax run in float32 (float64 for a float64 model), like SDPA's CPU kernel.
    """
    if tiles.shared or tiles.chains is not None:
        result = (tiled_attention(q, k_cache, v_cache, replace(tiles, shared=(), chains=None), scale)
                  if tiles.cells.shape[0] else q.new_empty((*q.shape[:-1], v_cache.shape[2])))
        for chunk in tiles.shared:
            rows = slice(chunk.first, chunk.first + chunk.num_rows)
            result[rows] = tiled_attention(q, k_cache, v_cache, chunk.tiles(), scale)[rows]
        if tiles.chains is not None:
            rows = tiles.chains.step_rows
            result[rows] = tiled_attention(q, k_cache, v_cache, tiles.chains.tiles(), scale)[rows]
        return result
    n, kp = tiles.cells.shape
    nkv, d, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    nh = q.shape[1]
    g = nh // nkv
    nc = kp // KEY_CHUNK
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    m = QUERY_TILE * g
    # Per kv head, batches of (tile, key chunk): each matmul reads the gathered keys and values in
    # place, a strided [C, D] slice per batch (no copy of them).
    cells = tiles.cells.reshape(-1)
    keys = k_cache.index_select(0, cells).to(acc).view(n * nc, KEY_CHUNK, nkv, d)
    values = v_cache.index_select(0, cells).to(acc).view(n * nc, KEY_CHUNK, nkv, dv)
    # [nkv, N, 1, M, D]: tile rows x the g query heads of each kv head (row-major: row, then head)
    qt = q[tiles.rows].to(acc).view(n, QUERY_TILE, nkv, g, d).permute(2, 0, 1, 3, 4).reshape(nkv, n, 1, m, d)
    qt = qt.expand(nkv, n, nc, m, d).reshape(nkv, n * nc, m, d)
    s = torch.stack([torch.bmm(qt[h], keys[:, :, h].transpose(1, 2)) for h in range(nkv)])
    s = s.view(nkv, n, nc, m, KEY_CHUNK) * scale                                                # [nkv, N, nc, M, C]
    lengths = tiles.lengths.repeat_interleave(g, dim=1).view(1, n, 1, m, 1)                     # [1, N, 1, M, 1]
    pos = torch.arange(kp, device=q.device).view(1, 1, nc, 1, KEY_CHUNK)
    seen = pos < lengths                                                                        # [1, N, nc, M, C]
    s = s.masked_fill(~seen, float("-inf"))
    top = s.amax(dim=(2, 4), keepdim=True)                                                     # exact, any order
    # exp of a score far below its row's top: clamped at e^-80 (a weight below 2e-35 of the top's),
    # because exp's results below float32's normal range (and of -inf) take a much slower path
    # (design §3.4); masked keys are then exactly 0. A key's weight still depends on its own
    # score and the row's top only.
    p = torch.exp((s - top).clamp_min(-80.0)) * seen                                            # [nkv, N, nc, M, C]
    total = p.sum(dim=-1).cumsum(dim=2)[:, :, -1]                                              # [nkv, N, M]
    p = p.view(nkv, n * nc, m, KEY_CHUNK)
    pv = torch.stack([torch.bmm(p[h], values[:, :, h]) for h in range(nkv)]).view(nkv, n, nc, m, dv)
    out = pv.cumsum(dim=2)[:, :, -1] / total[..., None]                                         # [nkv, N, M, Dv]
    out = out.view(nkv, n, QUERY_TILE, g, dv).permute(1, 2, 0, 3, 4).reshape(n, QUERY_TILE, nh, dv)
    result = q.new_empty((*q.shape[:-1], dv))
    result[tiles.rows[tiles.real]] = out[tiles.real].to(q.dtype)
    return result
