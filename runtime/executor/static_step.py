"""Static-shape steps: decode and verify steps padded to buckets, so one captured CUDA graph serves
every step of its bucket (and the CPU runs the very same padded forward, without the capture).

A step qualifies when each of its sequences has at most `ROW_BUCKETS[-1]` rows (a decode row, a
chain or tree verify, a short prefill) and there are at most `SEQ_BUCKETS[-1]` sequences. It is
laid out as [B, Q]: B sequences padded to a bucket, Q rows per sequence padded to a bucket, T = B*Q
step rows, sequence b's rows at b*Q .. b*Q + Q - 1. Each sequence's context is gathered over K
cells, K a power of two from `MIN_KEYS` covering the longest context. Padding rows write their
keys/values to the cache's scratch cell and see key 0 only (softmax never meets an all-masked
row); padding keys read the scratch cell and are masked. Nothing in the forward depends on a
value read back on the host, so the whole forward can be captured.

The bucket (B, Q, K) keys the graph. A verify step's (B, Q) follow from its verify key (the plan
of `engine.verify_plan` fixes the sequences and their row counts), so every arrangement that
shares a key shares the graph, and so do keys with the same bucket.

Shapes: B, Q, K, T as above; H hidden.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.executor.attention import (AttentionBackend, KernelAttention, KernelRows, PagedAttention, SeqChunk,
                                       StepPlan, own_row_bits, padded_backend, row_depths)
from runtime.ops import kernels
from runtime.platform.device import capture_refusal
from runtime.executor.kv_cache import PagedKVCache
from runtime.executor.step import EagerMode

log = logging.getLogger("metrale.static_step")

SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ROW_BUCKETS = (1, 2, 4, 8)   # a decode row, a verify of up to 7 drafts or tree nodes
MIN_KEYS = 256


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size that holds `n`, or None when none does."""
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True, slots=True)
class StaticShape:
    num_seqs: int   # B
    num_rows: int   # Q, rows per sequence
    num_keys: int   # K, context cells per sequence

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.num_rows


def static_shape(chunks: list[SeqChunk], max_keys: int) -> StaticShape | None:
    """The bucket of a step, or None when it does not fit one (a long prefill, too many
    sequences, a context past `max_keys`)."""
    b = bucket(len(chunks), SEQ_BUCKETS)
    q = bucket(max(c.num_tokens for c in chunks), ROW_BUCKETS)
    end = max(c.end for c in chunks)
    if b is None or q is None or end > max_keys:
        return None
    k = MIN_KEYS
    while k < end:
        k *= 2
    return StaticShape(b, q, min(k, max_keys))


class StaticBuffers:
    """The inputs of one bucket's forward on the cache's device, overwritten in place by `fill`
    each step (a captured graph reads them at fixed addresses). Until the first fill every row
    is padding, so a warm-up or capture writes to the scratch cell only. `hidden_in` [T, H]: the
    previous hidden of each row, for the drafter's forward (None for the target's)."""

    def __init__(self, shape: StaticShape, cache: PagedKVCache, hidden: tuple[int, torch.dtype] | None = None,
                 backend: AttentionBackend | None = None) -> None:
        """`backend`: the attention backend the plan runs: the Triton kernel (`KernelAttention`,
        its `KernelRows` filled here), or the device's padded batch (the default)."""
        backend = backend or padded_backend(cache.device)
        kernel = backend.kernel if isinstance(backend, KernelAttention) else None
        b, q, k, t = shape.num_seqs, shape.num_rows, shape.num_keys, shape.num_tokens
        dev, scratch = cache.device, cache.scratch_cell
        self.shape = shape
        self.tokens = torch.zeros(t, dtype=torch.long, device=dev)                            # [T]
        self.positions = torch.zeros(t, dtype=torch.long, device=dev)                         # [T]
        self.cell_mapping = torch.full((t,), scratch, dtype=torch.long, device=dev)           # [T]
        self.gather = torch.full((b, k), scratch, dtype=torch.long, device=dev)               # [B, K]
        self.mask = torch.zeros(b, 1, q, k, dtype=torch.bool, device=dev)                     # [B, 1, Q, K]
        self.mask[..., 0] = True
        self.hidden_in = None if hidden is None else torch.zeros(t, hidden[0], dtype=hidden[1], device=dev)
        self._keys = torch.arange(k, device=dev)                                              # [K]
        nb = -(-k // cache.block_size)
        self.blocks = torch.zeros(b, nb, dtype=torch.long, device=dev)                         # [B, NB]
        self.row_meta = torch.zeros(4, t, dtype=torch.long, device=dev)   # [4, T] seq, start, end, own bits
        rows = None if kernel is None else KernelRows(
            block_table=self.blocks, block_size=cache.block_size, row_seq=self.row_meta[0], row_start=self.row_meta[1],
            row_end=self.row_meta[2], row_anc=self.row_meta[3], max_keys=k, kernel=kernel)
        self.plan = StepPlan(positions=self.positions, cell_mapping=self.cell_mapping, gather=self.gather,
                             q_index=torch.arange(t, device=dev).view(b, q),
                             valid=torch.ones(b, q, dtype=torch.bool, device=dev), mask=self.mask,
                             last_rows=torch.arange(q - 1, t, q, device=dev), mask_mode="padded", rows=rows,
                             backend=backend)

    def fill(self, tokens: list[int], chunks: list[SeqChunk], cache: PagedKVCache) -> torch.Tensor:
        """Write one step into the buffers; returns the step row of each real row [sum of chunk rows],
        in the order of `tokens`. Everything is staged on the host as one int64 tensor (tokens,
        positions, each sequence's start, rows and end, block table and own-row visibility) and
        reaches the device in one copy; the buffers follow in a fixed number of device ops
        whatever the number of sequences (no per-sequence copy)."""
        shape = self.shape
        b_max, q, k, t = shape.num_seqs, shape.num_rows, shape.num_keys, shape.num_tokens
        bs = cache.block_size
        nb = -(-k // bs)
        host_tokens, host_pos = [0] * t, [0] * t
        starts, counts, ends = [0] * b_max, [0] * b_max, [0] * b_max
        blocks = [0] * (b_max * nb)
        own = [0] * (b_max * q * q)          # [B, Q, Q]: row r of sequence b sees its row j
        meta = [0] * (4 * t)                 # the kernel's rows: seq, start, end, own-row bits
        rows: list[int] = []
        i = 0
        for b, c in enumerate(chunks):
            depths = row_depths(c.parents) if c.parents is not None else range(c.num_tokens)
            for r, d in enumerate(depths):
                host_tokens[b * q + r] = tokens[i]
                host_pos[b * q + r] = c.start + d
                rows.append(b * q + r)
                i += 1
            starts[b], counts[b], ends[b] = c.start, c.num_tokens, c.end
            table = cache.block_table(c.seq_id)[:-(-c.end // bs)]
            if c.end > cache.length(c.seq_id):
                raise ValueError(f"positions up to {c.end} of sequence {c.seq_id} are not reserved "
                                 f"(length {cache.length(c.seq_id)})")
            blocks[b * nb:b * nb + len(table)] = table
            base = b * q * q
            # A chain row sees its earlier rows, a tree row its ancestors: the kernel's bits, and the mask's.
            for r, bits in enumerate(own_row_bits(c.num_tokens, c.parents)):
                for j in range(r + 1):
                    own[base + r * q + j] = (bits >> j) & 1
                row = b * q + r
                meta[row], meta[t + row], meta[2 * t + row], meta[3 * t + row] = b, c.start, c.end, bits
        n = len(rows)
        host = torch.tensor(host_tokens + host_pos + rows + [0] * (t - n) + starts + counts + ends + blocks + own + meta,
                            dtype=torch.long, device="cpu")
        staged = host.to(cache.device, non_blocking=True)
        tok, pos, sel, start, count, end, blk, vis, row_meta = staged.split(
            [t, t, t, b_max, b_max, b_max, b_max * nb, b_max * q * q, 4 * t])
        if self.plan.rows is not None:
            self.blocks.copy_(blk.view(b_max, nb))
            self.row_meta.copy_(row_meta.view(4, t))
        self.tokens.copy_(tok)
        self.positions.copy_(pos)
        keys = self._keys                                                                    # [K]
        cells = (blk.view(b_max, nb, 1) * bs + torch.arange(bs, device=keys.device)).view(b_max, nb * bs)[:, :k]
        self.gather.copy_(torch.where(keys[None, :] < end[:, None], cells, cache.scratch_cell))   # [B, K]
        r = torch.arange(q, device=keys.device)
        valid = r[None, :] < count[:, None]                                                 # [B, Q]
        cache_row = (start[:, None] + r[None, :]).clamp(max=k - 1)
        mapped = self.gather.gather(1, cache_row)                                            # [B, Q]
        self.cell_mapping.copy_(torch.where(valid, mapped, cache.scratch_cell).view(t))
        # Row (b, r) sees the committed context (keys before start) and its own visible rows;
        # padding rows see key 0 only (softmax never meets an all-masked row).
        rel = keys[None, :] - start[:, None]                                                 # [B, K]
        inside = (rel >= 0) & (rel < count[:, None])
        own_vis = vis.view(b_max, q, q).gather(2, rel.clamp(0, q - 1)[:, None, :].expand(b_max, q, k)).bool()
        mask = (rel[:, None, :] < 0) | (inside[:, None, :] & own_vis)                       # [B, Q, K]
        mask = torch.where(valid[:, :, None], mask, keys[None, None, :] == 0)
        self.mask[:, 0].copy_(mask)
        return sel[:n]


@dataclass(slots=True)
class _Entry:
    buffers: StaticBuffers
    graph: object | None = None          # torch.cuda.CUDAGraph
    output: torch.Tensor | None = None   # [T, H] the captured forward's output


class StepGraphs:
    """Padded steps per bucket; on CUDA each bucket's forward is captured once and replayed.

    `mode` runs the forward (runtime.executor.step: eager or compiled, as the runner chose; a
    plain function `forward(tokens, positions, attention)` runs eager). Capture happens the first
    time a bucket is met (`pool_bytes` adds up what the graphs' memory pool took); on the CPU the
    same padded forward runs uncaptured."""

    def __init__(self, mode: EagerMode | Callable[..., torch.Tensor], cache: PagedKVCache, max_keys: int,
                 capture: bool, hidden: tuple[int, torch.dtype] | None = None,
                 attention_kernel: bool | None = None, sync_free_experts: bool = False) -> None:
        """`hidden` (size, dtype): the forward also takes a hidden state per row, as the MTP
        drafter's `MTPLayer.forward(tokens, prev_hidden, positions, attention)` does.
        `attention_kernel`: the steps' attention through the Triton paged-attention kernel
        (reading keys and values in place) instead of the context copy and padded SDPA; None:
        on CUDA where triton is installed. Chosen here, once. `sync_free_experts`: the model's
        experts run the fused kernels, so float32 captures too (`capture_refusal`)."""
        refusal = capture_refusal(cache.device, cache.k.dtype, sync_free_experts=sync_free_experts) if capture else None
        if refusal is not None:
            raise ValueError(refusal)
        if attention_kernel is None:
            attention_kernel = cache.device.type == "cuda" and kernels.available("cuda")
        if attention_kernel and not kernels.available(cache.device.type):
            raise ValueError(f"the Triton attention kernel cannot run on {cache.device} here (triton missing, "
                             "or TRITON_INTERPRET not 1 for CPU tensors)")
        self.attention = padded_backend(cache.device)
        if attention_kernel:
            from runtime.ops.kernels.paged_attention import paged_attention
            self.attention = KernelAttention(paged_attention, self.attention)
        self.mode = mode if isinstance(mode, EagerMode) else EagerMode(mode)
        kind = "captured" if capture else "padded"
        self.name = f"{kind}, {self.mode.name}" if self.mode.compiles else kind
        self.cache = cache
        self.max_keys = max_keys
        self.capture = capture
        self.hidden = hidden
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.entries: dict[StaticShape, _Entry] = {}
        self.pool_bytes = 0
        self.replays = 0

    def summary(self) -> dict:
        """Buckets met, graphs captured, their pool's memory and the replays so far."""
        return {"buckets": len(self.entries), "captured": sum(e.graph is not None for e in self.entries.values()),
                "pool_mib": round(self.pool_bytes / 2**20, 1), "replays": self.replays}

    def prepare(self, shapes: list[StaticShape]) -> None:
        """Make (on CUDA: capture) these buckets now, before any request: every row is padding,
        so only the scratch cell is written."""
        for shape in shapes:
            if shape not in self.entries:
                self.entries[shape] = self._prepare(shape)

    def shape_of(self, chunks: list[SeqChunk]) -> StaticShape | None:
        return static_shape(chunks, self.max_keys)

    def run(self, tokens: list[int], chunks: list[SeqChunk], shape: StaticShape,
            hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, StepPlan]:
        """The step's pre-norm hidden [sum of chunk rows, H] (a copy: the next replay overwrites
        the graph's output) and its padded plan. `hidden` [sum of chunk rows, H]: the drafter's
        input hidden of each row."""
        entry = self.entries.get(shape)
        if entry is None:
            entry = self.entries[shape] = self._prepare(shape)
        rows = entry.buffers.fill(tokens, chunks, self.cache)
        if self.hidden is not None:
            entry.buffers.hidden_in.zero_()
            entry.buffers.hidden_in.index_copy_(0, rows, hidden.to(entry.buffers.hidden_in.dtype))
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
            out = entry.output
        else:
            out = self._forward(entry.buffers)
        return out[rows], entry.buffers.plan

    def _forward(self, buffers: StaticBuffers) -> torch.Tensor:
        inputs = (buffers.tokens,) if buffers.hidden_in is None else (buffers.tokens, buffers.hidden_in)
        return self.mode(inputs, buffers.positions, PagedAttention(self.cache, buffers.plan))

    def _prepare(self, shape: StaticShape) -> _Entry:
        buffers = StaticBuffers(shape, self.cache, self.hidden, self.attention)
        if not self.capture:
            return _Entry(buffers)
        graph, output, taken = capture_cuda_graph(lambda: self._forward(buffers), self.pool, self.cache.device)
        self.pool_bytes += taken
        log.info("captured a CUDA graph for %d sequences x %d rows x %d keys (%d graphs, pool %.1f MiB)",
                 shape.num_seqs, shape.num_rows, shape.num_keys, len(self.entries) + 1, self.pool_bytes / 2**20)
        return _Entry(buffers, graph, output)


def capture_cuda_graph(fn: Callable[[], torch.Tensor], pool, device: torch.device) -> tuple[object, torch.Tensor, int]:
    """Capture `fn` (a forward over static buffers on `device`) into a CUDA graph sharing memory
    pool `pool`. Returns (graph, its output tensor, device memory the capture reserved). Warm-up
    runs first, on a side stream, as torch.cuda.graph asks (lazy initialisation, cuBLAS
    workspaces). Everything runs under `torch.cuda.device(device)`: the side stream, the capture
    stream and the kernels are that GPU's, whichever device is current (on cuda:1 with cuda:0
    current, a capture on cuda:0's stream replays stale output)."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        before = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = fn()
        torch.cuda.synchronize(device)
        return graph, output, torch.cuda.memory_reserved(device) - before
