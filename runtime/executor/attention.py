"""Attention contexts: one batched paged-KV forward over many sequences, and plain causal attention.

Shapes: T step tokens (sequence-major), B sequences, Q = longest chunk in the step, K = longest
context, nh query heads, nkv kv heads, D head dim, Dv value dim (D, or the latent of runtime.model.mla).

`StepPlan` is everything the attention of one step needs besides q/k/v: where to write this
step's keys, which cache cells each sequence reads, and which of them each row may see. It is
built once per step and shared by every layer (and by the MTP layer, on its own cache plane).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from runtime.ops import cpu_ops
from runtime.ops import invariant_attention as ia
from runtime.executor.kv_cache import PagedKVCache
from runtime.model.sparse_attention import SparseStep


NO_PARENT = -1


def row_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each row of a tree from its parent list (row 0 alone is the root, parent -1;
    every parent comes before its child). Raises ValueError on any other list."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if (i == 0) != (p == NO_PARENT) or p >= i:
            raise ValueError(f"parent list {list(parents)}: row {i} has parent {p}; row 0 alone is the root "
                             "and every parent comes before its child")
        depths.append(0 if p == NO_PARENT else depths[p] + 1)
    return depths


def ancestor_mask(parents: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """[n, n] bool on `device`: row i may see row j when j is i or one of its ancestors."""
    row_depths(parents)  # checks the list
    n = len(parents)
    rows = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j != NO_PARENT:
            rows[i][j] = True
            j = parents[j]
    return torch.tensor(rows, dtype=torch.bool, device=device)


MAX_OWN_ROWS = 64   # the paged-attention kernel's own-row visibility is one int64 bit mask


def own_row_bits(num_rows: int, parents: tuple[int, ...] | None) -> list[int]:
    """`row_anc` of a sequence's rows: a chain's row r sees rows 0..r, a tree row its ancestors
    (parents as `SeqChunk`'s) and itself; the static buckets' own-row mask reads the same bits."""
    if num_rows > MAX_OWN_ROWS:
        raise ValueError(f"{num_rows} rows of one sequence: the kernel takes at most {MAX_OWN_ROWS}")
    bits = []
    for r in range(num_rows):
        if parents is None:
            bits.append((1 << (r + 1)) - 1)
        else:
            word, j = 0, r
            while j != -1:
                word |= 1 << j
                j = parents[j]
            bits.append(word)
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]   # as int64


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's rows in a step: cache rows start..start+num_tokens-1.

    `parents`, when given, makes the rows a tree (tree verification): the parent row of each row
    (the root's -1). A tree row sits at position start + its depth and sees the committed context
    (positions 0..start-1) plus its ancestors, while its keys/values still go to cache row
    start + its index. None means a causal chunk at positions start..end-1.
    """
    seq_id: int
    start: int
    num_tokens: int
    parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.parents is not None and len(self.parents) != self.num_tokens:
            raise ValueError(f"sequence {self.seq_id}: {len(self.parents)} parents for {self.num_tokens} rows")

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[num_tokens] the rotary position of each row, on `device`."""
        if self.parents is None:
            return torch.arange(self.start, self.end, device=device)
        return torch.tensor([self.start + d for d in row_depths(self.parents)], dtype=torch.long, device=device)


@dataclass(frozen=True, slots=True)
class KernelRows:
    """What the paged-attention kernel reads besides q and the cache: each sequence's block table
    [B, NB], and per row [T] its sequence, its first own position (the committed context ends
    there), one past its sequence's last row, and the bits of the own rows it sees."""
    block_table: torch.Tensor
    block_size: int
    row_seq: torch.Tensor
    row_start: torch.Tensor
    row_end: torch.Tensor
    row_anc: torch.Tensor
    max_keys: int
    kernel: object   # runtime.ops.kernels.paged_attention.paged_attention, imported once


@dataclass(frozen=True, slots=True)
class StepPlan:
    positions: torch.Tensor      # [T] absolute positions
    cell_mapping: torch.Tensor   # [T] cache cell each row's k/v is written to
    # The padded batch's fields (None in a batch-invariant plan, whose `tiles` replace them; one
    # causal chunk has no q_index or valid, and a mask only in mode "explicit"):
    gather: torch.Tensor | None     # [B, K] cache cells of each sequence's context (padding: 0)
    q_index: torch.Tensor | None    # [B, Q] row of the step for each (sequence, query) (padding: 0)
    valid: torch.Tensor | None      # [B, Q] bool, real query rows
    mask: torch.Tensor | None       # [B, 1, Q, K] bool, True = may attend
    last_rows: torch.Tensor | None   # [B] index of each sequence's last row in the step (None: writes only)
    # One sequence with a plain causal mask: SDPA runs unmasked (one row) or with is_causal
    # (a chunk from position 0), the faster kernels, and the ones transformers itself picks.
    # "padded" (runtime.executor.static_step): every sequence has Q rows, row b*Q + q is (b, q), the mask
    # is explicit and nothing about the layout is read back on the host.
    # "invariant" (`_invariant_plan`): an explicit mask whose every row the native op attends in place.
    mask_mode: str = "explicit"  # "explicit" | "none" | "causal" | "padded" | "invariant" | "writes"
    # Batch-invariant attention (runtime.ops.invariant_attention): the step's rows in fixed tiles, each
    # with its own key list; None runs SDPA over the padded batch.
    tiles: ia.AttentionTiles | None = None
    # The paged-attention kernel's rows (runtime/ops/kernels/paged_attention.py), where the step runs
    # it: a static step's plan on CUDA (`runtime.executor.static_step`, chosen when its graphs are built).
    rows: KernelRows | None = None
    # The attention backend that planned this step and runs its attention (`AttentionBackend`).
    backend: AttentionBackend | None = None
    # A sparse-attention step's rows and selection (runtime.model.sparse_attention.SparseStep), built
    # with the plan by `SparseAttention`; None for every other backend.
    sparse: SparseStep | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


# Rows per sequence up to which a step's attention takes the paged kernel where the cache has one
# (a decode row, a chain or tree verify); longer chunks (prefills) keep SDPA's flash kernels.
KERNEL_MAX_ROWS = 8


def build_plan(cache: PagedKVCache, chunks: list[SeqChunk], *, batch_invariant: bool = False,
               native: bool | None = None, backend: AttentionBackend | None = None) -> StepPlan:
    """Plan one step through `backend`, by default the cache's (`attention_backend`, chosen once
    for the cache); every chunk's positions must already be reserved in `cache`.
    `batch_invariant`: through a batch-invariant backend instead: the native op in place where
    `native` (None: where `native_invariant(cache)` holds), else the tiles."""
    if batch_invariant:
        backend = invariant_backend(cache, native)
    return (backend or attention_backend(cache)).plan(cache, chunks)


def kernel_rows(cache: PagedKVCache, chunks: list[SeqChunk], kernel) -> KernelRows:
    """The kernel's rows of a step laid out as `build_plan` lays it (sequence-major), from the
    host's block tables: one host-to-device copy."""
    bs = cache.block_size
    nb = max(-(-c.end // bs) for c in chunks)
    b, t = len(chunks), sum(c.num_tokens for c in chunks)
    blocks = [0] * (b * nb)
    meta = [0] * (4 * t)
    row = 0
    for i, c in enumerate(chunks):
        table = cache.block_table(c.seq_id)[:-(-c.end // bs)]
        blocks[i * nb:i * nb + len(table)] = table
        for bits in own_row_bits(c.num_tokens, c.parents):
            meta[row], meta[t + row], meta[2 * t + row], meta[3 * t + row] = i, c.start, c.end, bits
            row += 1
    staged = torch.tensor(blocks + meta, dtype=torch.long, device="cpu").to(cache.device, non_blocking=True)
    table_t, meta_t = staged.split([b * nb, 4 * t])
    meta_t = meta_t.view(4, t)
    return KernelRows(block_table=table_t.view(b, nb), block_size=bs, row_seq=meta_t[0], row_start=meta_t[1],
                      row_end=meta_t[2], row_anc=meta_t[3], max_keys=max(c.end for c in chunks), kernel=kernel)


def _build_plan(cache: PagedKVCache, chunks: list[SeqChunk], backend: AttentionBackend, *,
                batch_invariant: bool = False, native: bool = False) -> StepPlan:
    if not chunks:
        raise ValueError("a step needs at least one sequence")
    b = len(chunks)
    q_max = max(c.num_tokens for c in chunks)
    k_max = max(c.end for c in chunks)
    if any(c.num_tokens < 1 for c in chunks):
        raise ValueError(f"sequence {next(c.seq_id for c in chunks if c.num_tokens < 1)} has an empty chunk")
    device = cache.device
    native = batch_invariant and native
    if native and all(c.parents is None for c in chunks):   # causal chunks in place: the default plan's fields
        if b > 1:
            gather = cache.context_cells([c.seq_id for c in chunks], [c.end for c in chunks])
            return replace(_causal_batch_plan(chunks, gather, q_max, k_max, device, backend), mask_mode="invariant")
        ctx = cache.cells(chunks[0].seq_id, 0, chunks[0].end)
        positions = chunks[0].positions(device)
        plan = _single_plan(chunks[0], positions, ctx[chunks[0].start:], ctx,
                            torch.tensor([chunks[0].num_tokens - 1], device=device), backend)
        mask = plan.mask
        if plan.mask_mode == "causal":   # row r sees keys 0 .. r
            mask = (torch.arange(chunks[0].end, device=device)[None, :] <= positions[:, None])[None, None]
        return replace(plan, mask=mask, mask_mode="invariant")   # one row: no mask, it sees every key
    if b > 1 and not batch_invariant and all(c.parents is None for c in chunks):
        # Several causal chunks: the padded batch's fields from host lists, a few tensor ops in all.
        gather = cache.context_cells([c.seq_id for c in chunks], [c.end for c in chunks])
        return _causal_batch_plan(chunks, gather, q_max, k_max, device, backend)
    ctxs = [cache.cells(c.seq_id, 0, c.end) for c in chunks]
    if b == 1:
        positions = chunks[0].positions(device)
        cell_mapping = ctxs[0][chunks[0].start:]
        last_rows = torch.tensor([chunks[0].num_tokens - 1], device=device)
    elif batch_invariant or any(c.parents is not None for c in chunks):
        positions = torch.cat([c.positions(device) for c in chunks])
        cell_mapping = torch.cat([ctx[c.start:] for ctx, c in zip(ctxs, chunks)])
        last_rows = torch.tensor(list(itertools.accumulate(c.num_tokens for c in chunks)), device=device) - 1
    if native:   # tree rows in place, an entry each
        return _invariant_plan(chunks, ctxs, positions, cell_mapping, last_rows, backend)
    if batch_invariant:   # the tiles replace the padded batch's fields
        firsts = [0]
        for c in chunks[:-1]:
            firsts.append(firsts[-1] + c.num_tokens)   # from the host lists: no device sync
        tiles = ia.attention_tiles(ctxs, [c.start for c in chunks], [c.num_tokens for c in chunks],
                                   [c.parents for c in chunks], firsts)
        return StepPlan(positions=positions, cell_mapping=cell_mapping, gather=None, q_index=None, valid=None,
                        mask=None, last_rows=last_rows, tiles=tiles, backend=backend)
    if b == 1 and chunks[0].parents is None:
        return _single_plan(chunks[0], positions, cell_mapping, ctxs[0], last_rows, backend)
    counts = torch.tensor([c.num_tokens for c in chunks], device=device)
    ends = torch.tensor([c.end for c in chunks], device=device)
    if b == 1:   # one tree
        gather = ctxs[0][None]
        q_index = torch.arange(q_max, device=device)[None]
        valid = torch.ones(1, q_max, dtype=torch.bool, device=device)
    else:
        gather = torch.nn.utils.rnn.pad_sequence(ctxs, batch_first=True)          # [B, K], padding 0
        offs = torch.arange(q_max, device=device)[None, :]
        valid = offs < counts[:, None]                                              # [B, Q]
        q_index = torch.where(valid, (last_rows - counts + 1)[:, None] + offs, 0)
    # Row r of a chunk sits at position start + r and sees keys at positions <= it (causal);
    # padding rows see key 0 only, so softmax never meets an all-masked row.
    starts = ends - counts
    row_pos = torch.where(valid, starts[:, None] + torch.arange(q_max, device=device)[None, :], 0)  # [B, Q]
    mask = (torch.arange(k_max, device=device)[None, None, :] <= row_pos[:, :, None])[:, None]      # [B, 1, Q, K]
    for i, c in enumerate(chunks):
        if c.parents is not None:  # the committed context stays visible; the rows see their ancestors only
            mask[i, 0, :c.num_tokens, c.start:c.end] = ancestor_mask(c.parents, device)
    return StepPlan(positions=positions, cell_mapping=cell_mapping, gather=gather, q_index=q_index, valid=valid,
                    mask=mask, last_rows=last_rows, backend=backend)


def native_invariant(cache: PagedKVCache) -> bool:
    """Whether a batch-invariant step over `cache` attends through the native op in place
    (`_invariant_plan`): a float32 or bfloat16 cache on the CPU, the native library loaded. float64,
    the reference mode, and accelerators keep the tiles (`runtime.ops.invariant_attention`)."""
    return (cache.device.type == "cpu" and cache.k.dtype in (torch.float32, torch.bfloat16)
            and bool(cpu_ops.LOADED if cpu_ops.LOADED is not None else cpu_ops.load()))


def _invariant_plan(chunks: list[SeqChunk], ctxs: list[torch.Tensor], positions: torch.Tensor,
                    cell_mapping: torch.Tensor, last_rows: torch.Tensor, backend: AttentionBackend) -> StepPlan:
    """A batch-invariant step's plan for the native op's in-place rows (mask mode "invariant":
    every row, whatever the chunk's length, reads the cache in place, `paged_rows` in
    runtime/ops/csrc/cpu_ops.cpp). There a row's scores, softmax and weighted sum run over its own key
    list alone, key j of the list always in the same lane and order, up to its last visible key:
    nothing of another row or of the padding enters. So the key list fixes the result: a causal
    chunk's rows share their sequence's context in position order (row r sees its first start + r
    + 1 keys), and a tree row gets an entry of its own over the committed context, then its
    ancestors by depth, then itself (exactly what the chain row at its depth reads). Entries are
    padded to the longest list and row count of the step and masked."""
    lists: list[torch.Tensor] = []
    rows: list[list[int]] = []
    ends: list[list[int]] = []
    first = 0
    for ctx, c in zip(ctxs, chunks):
        if c.parents is None:
            lists.append(ctx)
            rows.append(list(range(first, first + c.num_tokens)))
            ends.append(list(range(c.start + 1, c.end + 1)))
        else:
            for i in range(c.num_tokens):
                path = []
                j = i
                while j >= 0:
                    path.append(c.start + j)
                    j = c.parents[j]
                lists.append(torch.cat((ctx[:c.start], ctx[torch.tensor(path[::-1], device=ctx.device)])))
                rows.append([first + i])
                ends.append([c.start + len(path)])
        first += c.num_tokens
    device = ctxs[0].device
    q_max = max(len(r) for r in rows)
    gather = torch.nn.utils.rnn.pad_sequence(lists, batch_first=True)                  # [B, K], padding: cell 0
    q_index = torch.tensor([r + [0] * (q_max - len(r)) for r in rows], device=device)    # [B, Q]
    row_end = torch.tensor([e + [0] * (q_max - len(e)) for e in ends], device=device)    # [B, Q]
    valid = torch.tensor([[True] * len(r) + [False] * (q_max - len(r)) for r in rows], device=device)
    mask = (torch.arange(gather.shape[1], device=device)[None, None, :] < row_end[:, :, None])[:, None]
    return StepPlan(positions=positions, cell_mapping=cell_mapping, gather=gather, q_index=q_index, valid=valid,
                    mask=mask, last_rows=last_rows, mask_mode="invariant", backend=backend)


def _causal_batch_plan(chunks: list[SeqChunk], gather: torch.Tensor, q_max: int, k_max: int,
                       device: torch.device, backend: AttentionBackend) -> StepPlan:
    """`build_plan`'s padded batch for several causal chunks (no tree), its fields as the general
    path builds them: positions, first rows and last rows come from host lists, and each row's
    cell is read off the padded context (`gather[b, position]`), ~10 tensor ops whatever the
    number of sequences (the general path makes several per sequence)."""
    b = len(chunks)
    counts = [c.num_tokens for c in chunks]
    firsts = [0, *itertools.accumulate(counts)][:-1]
    if q_max == 1:   # one row a sequence (decode, or one draft each)
        pos = [c.start for c in chunks]
        positions = torch.tensor(pos, device=device)
        cell_mapping = gather[torch.arange(b, device=device), positions]
        q_index = torch.arange(b, device=device)[:, None]
        valid = torch.ones(b, 1, dtype=torch.bool, device=device)
        row_pos = positions[:, None]
        last_rows = q_index[:, 0]
    else:
        pos, seq = [], []
        for i, c in enumerate(chunks):
            pos.extend(range(c.start, c.end))
            seq.extend([i] * c.num_tokens)
        positions = torch.tensor(pos, device=device)
        cell_mapping = gather[torch.tensor(seq, device=device), positions]
        offs = torch.arange(q_max, device=device)[None, :]
        valid = offs < torch.tensor(counts, device=device)[:, None]                        # [B, Q]
        q_index = torch.where(valid, torch.tensor(firsts, device=device)[:, None] + offs, 0)
        # Padding rows see key 0 only, so softmax never meets an all-masked row.
        row_pos = torch.where(valid, torch.tensor([c.start for c in chunks], device=device)[:, None] + offs, 0)
        last_rows = torch.tensor([f + n - 1 for f, n in zip(firsts, counts)], device=device)
    mask = (torch.arange(k_max, device=device)[None, None, :] <= row_pos[:, :, None])[:, None]  # [B, 1, Q, K]
    return StepPlan(positions=positions, cell_mapping=cell_mapping, gather=gather, q_index=q_index, valid=valid,
                    mask=mask, last_rows=last_rows, backend=backend)


def _single_plan(chunk: SeqChunk, positions: torch.Tensor, cell_mapping: torch.Tensor, ctx: torch.Tensor,
                 last_rows: torch.Tensor, backend: AttentionBackend) -> StepPlan:
    """The plan of one causal chunk (a decode row, a chain verify, a prefill): no padded batch, so
    no query index or validity, and a mask only for rows that start past position 0 (a chunk from
    0 runs SDPA with is_causal, a single row unmasked). A decode step or a draft step builds this
    plan every time: each tensor op skipped is host time saved on the CPU."""
    mode = "none" if chunk.num_tokens == 1 else ("causal" if chunk.start == 0 else "explicit")
    mask = None
    if mode == "explicit":   # row r (position start + r) sees keys 0 .. start + r
        mask = (torch.arange(chunk.end, device=positions.device)[None, :] <= positions[:, None])[None, None]
    return StepPlan(positions=positions, cell_mapping=cell_mapping, gather=ctx[None], q_index=None, valid=None,
                    mask=mask, last_rows=last_rows, mask_mode=mode, backend=backend)


def last_row_plan(cache: PagedKVCache, chunks: list[SeqChunk], backend: AttentionBackend | None = None) -> StepPlan:
    """`backend.query_plan` (default: the cache's backend)."""
    return (backend or attention_backend(cache)).query_plan(cache, chunks)


def chain_plans(cache: PagedKVCache, seq_ids: list[int], positions: list[int], steps: int,
                backend: AttentionBackend | None = None) -> list[StepPlan]:
    """`backend.chain_plans` (default: the cache's backend)."""
    return (backend or attention_backend(cache)).chain_plans(cache, seq_ids, positions, steps)


def _chain_plans(cache: PagedKVCache, seq_ids: list[int], positions: list[int], steps: int,
                 backend: AttentionBackend) -> list[StepPlan]:
    """`AttentionBackend.chain_plans`: each step's plan laid out as `_build_plan` lays one-row causal
    chunks (`_single_plan`, `_causal_batch_plan`), over one read of the contexts at the last step."""
    device = cache.device
    last = [p + steps - 1 for p in positions]
    plans = []
    if len(seq_ids) == 1:
        ctx = cache.cells(seq_ids[0], 0, last[0] + 1)
        for s in range(1, steps):
            p = positions[0] + s
            plans.append(_single_plan(SeqChunk(seq_ids[0], p, 1), ctx.new_full((1,), p), ctx[p:p + 1], ctx[:p + 1],
                                      ctx.new_zeros(1), backend))
        return plans
    gather = cache.context_cells(seq_ids, [end + 1 for end in last])              # [B, K at the last step]
    for s in range(1, steps):
        chunks = [SeqChunk(sid, p + s, 1) for sid, p in zip(seq_ids, positions)]
        k_max = max(positions) + s + 1
        plans.append(_causal_batch_plan(chunks, gather[:, :k_max], 1, k_max, device, backend))
    return plans


def writes_plan(cache: PagedKVCache, chunks: list[SeqChunk]) -> StepPlan:
    """The plan of a forward that only writes keys and values (`MTPLayer.write`): the rows of
    `chunks` (causal, every position reserved) go to their cache cells, and nothing attends. Its
    fields are their positions and cells alone, without the padded batch a backend's plan builds;
    its backend (`WRITES_ONLY`) refuses to attend."""
    if not chunks or any(c.parents is not None or c.num_tokens < 1 for c in chunks):
        raise ValueError("key/value writes take causal, non-empty chunks")
    device = cache.device
    positions = torch.cat([c.positions(device) for c in chunks])
    cells = torch.cat([cache.cells(c.seq_id, 0, c.end)[c.start:] for c in chunks])
    return StepPlan(positions=positions, cell_mapping=cells, gather=None, q_index=None, valid=None, mask=None,
                    last_rows=None, mask_mode="writes", backend=WRITES_ONLY)


class PagedAttention:
    """`AttentionContext` over a paged cache: writes this step's k/v, then attends over the context.

    `queries`, when given, is the plan of the query rows (`last_row_plan`): the k/v of every row
    of `plan` are written, and q holds only those rows (the layer computes nothing else for the
    others: a drafter's fed rows need only their keys and values)."""

    def __init__(self, cache: PagedKVCache, plan: StepPlan, queries: StepPlan | None = None) -> None:
        if queries is not None and (plan.tiles is not None or queries.tiles is not None):
            raise ValueError("batch-invariant attention has no separate query rows")
        self.cache = cache
        self.plan = plan
        self.queries = queries
        # A hybrid model's step: its chunks' recurrent states (runtime.model.linear_attention.StepStates).
        self.states = None

    @property
    def positions(self) -> torch.Tensor:
        """[T] the positions of the rows whose keys and values this step writes."""
        return self.plan.positions

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, nkv, D] of every row of the plan into the cache layer `layer_idx`, and nothing
        else (a writes-only forward, `writes_plan`)."""
        self.cache.write(layer_idx, self.plan.cell_mapping, k, v)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Write this step's k/v of layer `layer_idx`, then attend for the query rows through the
        backend that planned them."""
        p = self.queries if self.queries is not None else self.plan
        return p.backend.attend(self.cache, self.plan, p, layer_idx, q, k, v, scale)

    def visible_keys(self, layer_idx: int, k: torch.Tensor) -> tuple[torch.Tensor, SparseStep]:
        """Sparse attention's view of this step (runtime.model.sparse_attention.SparseContext): write k
        [T, 1, W] (a latent cache's whole cell), then the layer's context keys per sequence
        [B, K, W] and the query plan's `SparseStep` (`SparseAttention` built it with the plan)."""
        writes = self.plan
        p = self.queries if self.queries is not None else writes
        if p.sparse is None:
            raise ValueError(f"sparse attention reads a plan of the sparse backend, not of {p.backend.name!r}")
        self.cache.write(layer_idx, writes.cell_mapping, k, k)       # a latent cache keeps k alone
        return self.cache.gather(self.cache.k[layer_idx], p.gather)[:, :, 0], p.sparse    # [B, K, W]


class AttentionBackend:
    """The reference backend: every step's context copied out of the cache and one masked SDPA
    over the padded batch (or, for one sequence, unmasked / causal SDPA). Every backend plans its
    steps and runs their attention (`attend(cache, writes, queries, layer, q, k, v, scale)`: the
    k/v of `writes`' rows into the cache, the attention of `queries`' rows out); the runner chooses
    one per cache at start (`choose_attention_backend`). Every `StepPlan` of a dynamic step comes
    from its backend: `plan` (a step's rows), `query_plan` (the query rows of a step whose other
    rows only write), `chain_plans` (a drafter's chained one-row steps); a writes-only step's
    from `WRITES_ONLY`; a static bucket fills its own in place (runtime.executor.static_step)."""

    name = "sdpa"

    def plan(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> StepPlan:
        """The plan of one step over `chunks` (every position reserved in `cache`)."""
        return _build_plan(cache, chunks, self)

    def query_plan(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> StepPlan:
        """The query plan of each chunk's last row alone (one row at position end - 1, seeing its
        whole context), for a step whose other rows only write their keys and values
        (`PagedAttention(queries=...)`)."""
        return self.plan(cache, [SeqChunk(c.seq_id, c.end - 1, 1) for c in chunks])

    def chain_plans(self, cache: PagedKVCache, seq_ids: list[int], positions: list[int],
                    steps: int) -> list[StepPlan]:
        """The plans of steps 1 .. steps-1 of a chain of one-row steps (a drafter's drafts): at step s
        sequence `seq_ids[b]` has one row at position `positions[b] + s` (every such position
        reserved), seeing its whole context, as `plan` plans `[SeqChunk(seq_ids[b], positions[b] + s,
        1)]` (the same cells, context and mask, so the same attention)."""
        return _chain_plans(cache, seq_ids, positions, steps, self)

    def attend(self, cache: PagedKVCache, writes: StepPlan, p: StepPlan, layer_idx: int, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        cache.write(layer_idx, writes.cell_mapping, k, v)
        keys = cache.gather(cache.k[layer_idx], p.gather).transpose(1, 2)    # [B, nkv, K, D]
        values = cache.gather(cache.v[layer_idx], p.gather).transpose(1, 2)
        if p.mask_mode == "padded":
            queries = q[p.q_index].transpose(1, 2)                  # [B, nh, Q, D]
            out = F.scaled_dot_product_attention(queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=p.mask,
                                                 scale=scale, enable_gqa=keys.shape[1] != queries.shape[1])
            return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], out.shape[-1])   # [T, nh, Dv]
        single = p.gather.shape[0] == 1
        queries = (q.transpose(0, 1)[None] if single else q[p.q_index].transpose(1, 2))  # [B, nh, Q, D]
        out = F.scaled_dot_product_attention(queries, keys.to(q.dtype), values.to(q.dtype),
                                             attn_mask=p.mask if p.mask_mode == "explicit" else None,
                                             is_causal=p.mask_mode == "causal", scale=scale,
                                             enable_gqa=keys.shape[1] != queries.shape[1])
        if single:
            return out[0].transpose(0, 1)                           # [T, nh, Dv]
        return out.transpose(1, 2)[p.valid]                          # [T, nh, Dv]


class NativeCpuAttention(AttentionBackend):
    """The CPU with the native library: the same plan, the write and the attention as one
    `metrale_cpu::paged_attention` call (the reference's calls, natively, without the context
    copy); a compiled forward hands the plan to the native ops once (`step_context`)."""

    name = "native"

    def attend(self, cache: PagedKVCache, writes: StepPlan, p: StepPlan, layer_idx: int, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.ops.metrale_cpu.paged_attention(
            q, k, v, cache.k[layer_idx], cache.v[layer_idx], cache.latent_dim is None, writes.cell_mapping,
            p.gather, p.q_index, p.valid, p.mask, p.mask_mode, scale)


class NativeInvariantAttention(NativeCpuAttention):
    """Batch-invariant attention through the native op in place (mask mode "invariant",
    `_invariant_plan`): each row over its own key list in a fixed order, the CPU's float32 and
    bfloat16 with the native library (`native_invariant`)."""

    name = "native-invariant"

    def plan(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> StepPlan:
        return _build_plan(cache, chunks, self, batch_invariant=True, native=True)


class InvariantAttention(AttentionBackend):
    """Batch-invariant attention (runtime.ops.invariant_attention): each row in fixed tiles over
    its own key list, so its result does not depend on the other rows of the step."""

    name = "invariant"

    def plan(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> StepPlan:
        return _build_plan(cache, chunks, self, batch_invariant=True)

    def attend(self, cache: PagedKVCache, writes: StepPlan, p: StepPlan, layer_idx: int, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        cache.write(layer_idx, writes.cell_mapping, k, v)
        return ia.attention(q, cache.k[layer_idx], cache.v[layer_idx], p.tiles, scale)


class KernelAttention(AttentionBackend):
    """The Triton paged-attention kernel (runtime/ops/kernels/paged_attention.py) for steps whose
    sequences have at most `KERNEL_MAX_ROWS` rows (decode, chain and tree verify), reading keys
    and values in place through the block table; longer chunks (prefills) take `fallback`."""

    name = "triton"

    def __init__(self, kernel, fallback: AttentionBackend) -> None:
        self.kernel, self.fallback = kernel, fallback

    def plan(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> StepPlan:
        if max(c.num_tokens for c in chunks) > KERNEL_MAX_ROWS:
            return self.fallback.plan(cache, chunks)
        return replace(_build_plan(cache, chunks, self), rows=kernel_rows(cache, chunks, self.kernel))

    def attend(self, cache: PagedKVCache, writes: StepPlan, p: StepPlan, layer_idx: int, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        cache.write(layer_idx, writes.cell_mapping, k, v)
        r = p.rows
        return r.kernel(q, cache.k[layer_idx], cache.v[layer_idx], r.block_table, r.block_size,
                        r.row_seq, r.row_start, r.row_end, r.row_anc, scale, r.max_keys)


def sparse_rows(plan: StepPlan, chunks: list[SeqChunk]) -> SparseStep:
    """A padded plan's `SparseStep`: each query row's sequence [R] and the keys it may see [R, K],
    read off the plan's mask in the step's row order (sequence-major), the rows from the host's
    chunks (no read back)."""
    device = plan.positions.device
    k_len = plan.gather.shape[1]
    if plan.q_index is None:     # one sequence: a single row, a causal chunk from 0, or an explicit mask
        rows = chunks[0].num_tokens
        seq = torch.zeros(rows, dtype=torch.long, device=device)
        if plan.mask_mode == "none":
            return SparseStep(seq, torch.ones(rows, k_len, dtype=torch.bool, device=device))
        if plan.mask_mode == "causal":
            return SparseStep(seq, torch.ones(rows, k_len, dtype=torch.bool, device=device).tril())
        return SparseStep(seq, plan.mask[0, 0])
    seqs = [i for i, c in enumerate(chunks) for _ in range(c.num_tokens)]
    cols = [j for c in chunks for j in range(c.num_tokens)]
    seq = torch.tensor(seqs, dtype=torch.long, device=device)
    return SparseStep(seq, plan.mask[seq, 0, torch.tensor(cols, dtype=torch.long, device=device)])


class SparseAttention(AttentionBackend):
    """DeepSeek sparse attention's steps (runtime.model.sparse_attention: GLM-5, DeepSeek-V3.2): the
    plans of a padded-batch backend `base`, each with its `SparseStep` built once a step (what
    the MLA layers' selections read, and where the step keeps them); the layers attend over
    their selected keys themselves, a write-only forward through `base`."""

    def __init__(self, base: AttentionBackend) -> None:
        if isinstance(base, (InvariantAttention, SparseAttention)):
            raise ValueError(f"sparse attention plans over a padded-batch backend, not {base.name!r}")
        self.base = base
        self.name = f"sparse over {base.name}"

    def plan(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> StepPlan:
        plan = self.base.plan(cache, chunks)
        return replace(plan, backend=self, sparse=sparse_rows(plan, chunks))

    def chain_plans(self, cache: PagedKVCache, seq_ids: list[int], positions: list[int],
                    steps: int) -> list[StepPlan]:
        plans = self.base.chain_plans(cache, seq_ids, positions, steps)
        return [replace(p, backend=self, sparse=sparse_rows(p, [SeqChunk(sid, pos + s, 1)
                                                             for sid, pos in zip(seq_ids, positions)]))
                for s, p in enumerate(plans, 1)]

    def attend(self, cache: PagedKVCache, writes: StepPlan, p: StepPlan, layer_idx: int, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return self.base.attend(cache, writes, p, layer_idx, q, k, v, scale)


class WritesOnly(AttentionBackend):
    """The backend of a writes-only plan (`writes_plan`): positions and cells, no attention."""

    name = "writes-only"

    def plan(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> StepPlan:
        return writes_plan(cache, chunks)

    def attend(self, cache: PagedKVCache, writes: StepPlan, p: StepPlan, layer_idx: int, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        raise RuntimeError("a writes-only plan writes keys and values; a forward that attends needs a backend's plan")


SDPA = AttentionBackend()
WRITES_ONLY = WritesOnly()
NATIVE = NativeCpuAttention()
INVARIANT = InvariantAttention()
NATIVE_INVARIANT = NativeInvariantAttention()


def invariant_backend(cache: PagedKVCache, native: bool | None = None) -> AttentionBackend:
    """The batch-invariant backend for `cache`: the native op in place where `native` (None:
    where `native_invariant(cache)` holds), else the tiles."""
    return NATIVE_INVARIANT if (native_invariant(cache) if native is None else native) else INVARIANT


def padded_backend(device: torch.device) -> AttentionBackend:
    """The padded-batch backend of a device: the native op on the CPU where it loads, else SDPA."""
    return NATIVE if device.type == "cpu" and cpu_ops.load() else SDPA


def choose_attention_backend(cache: PagedKVCache, *, batch_invariant: bool = False, kernel=None,
                             sparse: bool = False) -> AttentionBackend:
    """Choose the attention backend of every step planned on `cache`, once: batch-invariant
    tiles, else the Triton kernel `kernel` (decode and verify rows; prefills on the padded
    backend), else the device's padded-batch backend (`padded_backend`); `sparse` (a model with
    DeepSeek sparse attention) plans over the padded one with each step's sparse rows."""
    if sparse:
        if batch_invariant:
            raise ValueError("sparse attention has no batch-invariant tiles (it reads each row's visible keys)")
        backend = SparseAttention(padded_backend(cache.device))
    elif batch_invariant:
        backend = invariant_backend(cache)
    elif kernel is not None:
        backend = KernelAttention(kernel, padded_backend(cache.device))
    else:
        backend = padded_backend(cache.device)
    cache.attention = backend
    return backend


def drafter_attention(cache: PagedKVCache) -> AttentionBackend:
    """The backend a drafter plans its steps on `cache` with: the cache's, but padded-batch where
    the target's is batch-invariant (drafts decide which tokens are checked, never which are
    committed; a drafter's fed rows need a plan with separate query rows)."""
    backend = attention_backend(cache)
    return padded_backend(cache.device) if backend in (INVARIANT, NATIVE_INVARIANT) else backend


def attention_backend(cache: PagedKVCache) -> AttentionBackend:
    """The backend chosen for `cache` (`choose_attention_backend`; a cache nobody chose for gets
    its device's padded-batch backend, chosen now)."""
    return cache.attention if cache.attention is not None else choose_attention_backend(cache)


class CausalAttention:
    """`AttentionContext` for training: T = batch * seq_len rows, causal within each sequence, no cache."""

    def __init__(self, batch: int, seq_len: int) -> None:
        self.batch, self.seq_len = batch, seq_len

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        b, s = self.batch, self.seq_len
        qq = q.view(b, s, *q.shape[1:]).transpose(1, 2)
        kk = k.view(b, s, *k.shape[1:]).transpose(1, 2)
        vv = v.view(b, s, *v.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale,
                                             enable_gqa=kk.shape[1] != qq.shape[1])
        return out.transpose(1, 2).reshape(b * s, *q.shape[1:])
