"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3.6-MoE) and the per-sequence state it keeps.

A linear-attention layer keeps no KV cache: each sequence carries, per such layer, the last
`K - 1` inputs of its causal depthwise conv1d ([C, K-1], C = 2 * key dim + value dim) and a
recurrent matrix per value head ([nv, dk, dv]). `RecurrentStates` holds them beside the paged KV
cache of the full-attention layers, allocated when a sequence's first chunk runs and dropped with
it (`PagedKVCache.free` and `rewind` call `free` and `rewind` here). A state cannot be taken
back, so a short chunk that continues a sequence (a verify step's rows) keeps the state after
each row, and a rewind to an accepted length takes that row's state without recomputing the rows;
other rewinds keep every token or none (prefix caching is off for these families). A draft tree's
rows (a chunk with parents) each continue their parent row's state, not the row before: a row's
conv window is the inputs along its own ancestors, and its recurrent state its parent's updated
by the row. A taken hedge's `move` to its depth's place (as its keys/values move) makes its
state the one a rewind to that length takes.

A step's chunks reach the layers through `StepStates` (the runner sets it on the step's
`PagedAttention` as `.states`): each chunk continues its sequence's state (start == the tokens it
holds) or starts one (start 0). Prefill chunks run the chunked gated delta rule (64-row chunks
with a triangular solve inside, a scan across), one-row decode steps the recurrent update. Each
sequence runs on its own: a row's result never depends on the other sequences of its step.

Shapes: T step rows, H hidden, nk / nv key / value heads, dk / dv their head dims.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.config import ModelConfig
from runtime.model.layers import Linear, stats_dtype

CHUNK = 64   # rows of one block of the chunked delta rule (as transformers and FLA use)
# A chunk continuing a sequence with at most this many rows (a verify step's drafts, a short
# prefill piece) runs the recurrent rule row by row and keeps the state after each row, so a
# rewind to any of its lengths takes that row's state instead of recomputing the rows.
SNAPSHOT_ROWS = 16


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, every: list[torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One row at a time. q, k [n, nv, dk] (l2-normed, q scaled), v [n, nv, dv], g, beta [n, nv],
    state [nv, dk, dv] -> (out [n, nv, dv], the state after the last row); `every` gets the state
    after each row appended."""
    out = torch.empty_like(v)
    for i in range(q.shape[0]):
        state = state * g[i].exp()[:, None, None]
        mem = (state * k[i][:, :, None]).sum(dim=-2)                      # [nv, dv]
        delta = (v[i] - mem) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        out[i] = (state * q[i][:, :, None]).sum(dim=-2)
        if every is not None:
            every.append(state)
    return out, state


def tree_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, parents: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`recurrent_delta_rule` over a draft tree's rows: row r continues the state after its parent
    row (the root, parent -1, `state`) -> (out [n, nv, dv], the state before the rows and after
    each row: entry r + 1 is row r's)."""
    out = torch.empty_like(v)
    every = [state]
    for i, p in enumerate(parents):
        o, after = recurrent_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], every[p + 1])
        out[i] = o[0]
        every.append(after)
    return out, every


def tree_conv_columns(parents: tuple[int, ...], width: int) -> torch.Tensor:
    """The conv inputs of each tree row, oldest first, as columns of its window (the `width`
    columns of conv state, then one per row): row r's own column `width + r`, before it its
    parent's, ..., into the conv state past the root -> [n, width + 1] (long)."""
    cols = []
    for r in range(len(parents)):
        at, own = width + r, []
        for _ in range(width + 1):
            own.append(at)
            if at > width:
                p = parents[at - width]
                at = width - 1 if p < 0 else width + p
            else:
                at -= 1
        cols.append(own[::-1])
    return torch.tensor(cols, dtype=torch.long)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_delta_rule` by blocks of CHUNK rows: within a block the delta updates are one
    unit-triangular solve (the UT transform), across blocks a scan of the state."""
    n = q.shape[0]
    pad = (CHUNK - n % CHUNK) % CHUNK
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))         # [nv, n + pad, d]
    beta, g = (F.pad(x.transpose(0, 1), (0, pad)) for x in (beta, g))                 # [nv, n + pad]
    nv, blocks = q.shape[0], (n + pad) // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(nv, blocks, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(nv, blocks, CHUNK).cumsum(dim=-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    block_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(blocks):
        v_new = values[:, i] - k_decayed[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * block_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(nv, -1, out.shape[-1])[:, :n].transpose(0, 1), state


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's dv channels, then times silu(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype, dt = x.dtype, stats_dtype(x.dtype)
        xf = x.to(dt)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * F.silu(gate.to(dt))).to(dtype)


class RecurrentStates:
    """The conv and recurrent states of every linear-attention layer, one pair per sequence: the
    layer-state backend of a hybrid model's cache (runtime.executor.kv_cache.LayerStates)."""

    name = "recurrent"
    attachable = False   # the state at a block's end is not kept (prefix caching is off for the family)

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                 heads: tuple[int, int] | None = None) -> None:
        """`heads`: the (key, value) heads each layer holds where not the config's (an EP rank's
        share, `for_model`)."""
        nk, nv = heads if heads is not None else (cfg.linear_num_key_heads, cfg.linear_num_value_heads)
        self.layers = {layer: i for i, layer in enumerate(cfg.linear_layers)}   # model layer -> state row
        self.conv_shape = (len(self.layers), 2 * nk * cfg.linear_key_head_dim + nv * cfg.linear_value_head_dim,
                           cfg.linear_conv_kernel_dim - 1)
        self.rec_shape = (len(self.layers), nv, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.dtype, self.state_dtype = dtype, stats_dtype(dtype)
        self.device = torch.device(device)
        self.conv: dict[int, torch.Tensor] = {}
        self.rec: dict[int, torch.Tensor] = {}
        self.lengths: dict[int, int] = {}
        # The last step's snapshots of a sequence whose chunk kept them: (its start, per state row
        # the conv window [C, K-1+n], the columns of its conv state before and after each row
        # [n+1, K-1] and the recurrent state before and after each row; then which entry each
        # length takes: a moved hedge's).
        self.snapshots: dict[int, tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]],
                                        dict[int, int]]] = {}

    @classmethod
    def for_model(cls, model: nn.Module, *, dtype: torch.dtype, device: torch.device | str) -> RecurrentStates:
        """The states of `model`'s linear-attention layers, with the heads they hold (an EP rank's
        share where they are split, ep.parallel)."""
        la = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
        return cls(model.config, dtype=dtype, device=device, heads=(la.nk, la.nv))

    @property
    def bytes_per_sequence(self) -> int:
        conv, rec = self.conv_shape, self.rec_shape
        return (conv[0] * conv[1] * conv[2] * self.dtype.itemsize
                + rec[0] * rec[1] * rec[2] * rec[3] * self.state_dtype.itemsize)

    def bytes_reserved(self, sequences: int, rows: int) -> int:
        """`LayerStates.bytes_reserved`: each sequence's states, and the snapshots a step of `rows`
        rows keeps for a rewind (`StepStates`: the conv window and a recurrent state before and
        after each row, every state row)."""
        n = max(1, min(rows, SNAPSHOT_ROWS))
        conv, rec = self.conv_shape, self.rec_shape
        window = conv[0] * conv[1] * (conv[2] + n) * self.dtype.itemsize
        every = (n + 1) * rec[0] * rec[1] * rec[2] * rec[3] * self.state_dtype.itemsize
        return sequences * (self.bytes_per_sequence + window + every)

    def length(self, seq_id: int) -> int:
        """Tokens the states of `seq_id` have taken in (0 when it holds none)."""
        return self.lengths.get(seq_id, 0)

    def start(self, seq_id: int) -> None:
        """Fresh (zero) states for `seq_id`, replacing any it held."""
        self.conv[seq_id] = torch.zeros(self.conv_shape, dtype=self.dtype, device=self.device)
        self.rec[seq_id] = torch.zeros(self.rec_shape, dtype=self.state_dtype, device=self.device)
        self.lengths[seq_id] = 0

    def free(self, seq_id: int) -> None:
        for table in (self.conv, self.rec, self.lengths, self.snapshots):
            table.pop(seq_id, None)

    def rewind(self, seq_id: int, new_length: int) -> None:
        """Go back to the state after `new_length` tokens: every token (a no-op), none, or a length
        inside the last step's chunk when it kept snapshots (a verify step's accepted drafts: that
        row's state, nothing recomputed)."""
        if new_length == 0:
            self.free(seq_id)
            return
        if new_length == self.length(seq_id) or seq_id not in self.lengths:
            return
        start, rows, moved = self.snapshots.get(seq_id, (None, {}, {}))
        if start is None or not start <= new_length < self.length(seq_id):
            raise ValueError(f"cannot rewind the recurrent state of sequence {seq_id} from "
                             f"{self.length(seq_id)} to {new_length} tokens: it keeps no state there")
        at = moved.get(new_length - start, new_length - start)   # rows of the chunk kept (or a moved hedge's)
        with torch.inference_mode():   # the states are the steps' inference tensors (an EP worker replays outside)
            for slot, (window, cols, every) in rows.items():
                self.conv[seq_id][slot] = window[:, cols[at]]
                self.rec[seq_id][slot] = every[at]
        self.lengths[seq_id] = new_length
        del self.snapshots[seq_id]

    def move(self, seq_id: int, src: int, dst: int) -> None:
        """Position `dst` of `seq_id` now holds what `src` held (a taken hedge goes to its depth's
        place, `PagedKVCache.move`): a rewind to dst + 1 tokens takes the state after `src`."""
        if seq_id not in self.lengths:
            return
        start, _, moved = self.snapshots.get(seq_id, (None, {}, {}))
        if start is None or not start <= min(src, dst) or max(src, dst) >= self.length(seq_id):
            raise ValueError(f"cannot move position {src} of sequence {seq_id} to {dst}: its recurrent state "
                             "keeps no snapshot there")
        moved[dst + 1 - start] = moved.get(src + 1 - start, src + 1 - start)

    def step(self, chunks) -> StepStates:
        """The states of one step's chunks (runtime.executor.attention.SeqChunk, sequence-major rows)."""
        return StepStates(self, chunks)


class StepStates:
    """One step's view of `RecurrentStates`: which rows belong to which sequence's state."""

    def __init__(self, states: RecurrentStates, chunks) -> None:
        self.states = states
        self.spans: list[tuple[int, int, int]] = []   # (seq_id, first row, rows)
        self.keeps: set[int] = set()   # sequences whose chunk keeps a state per row
        self.parents: dict[int, tuple[int, ...]] = {}   # a tree chunk's parent rows
        row = 0
        for c in chunks:
            states.snapshots.pop(c.seq_id, None)
            if c.parents is not None and (c.start == 0 or c.num_tokens > SNAPSHOT_ROWS):
                raise ValueError(f"sequence {c.seq_id}: tree rows continue a recurrent state, at most "
                                 f"{SNAPSHOT_ROWS} of them (got {c.num_tokens} from position {c.start})")
            if c.start == 0:
                states.start(c.seq_id)
            elif c.start != states.length(c.seq_id) or c.seq_id not in states.lengths:
                raise ValueError(f"sequence {c.seq_id}: a chunk from position {c.start} does not continue its "
                                 f"recurrent state of {states.length(c.seq_id)} tokens")
            if c.start > 0 and c.num_tokens <= SNAPSHOT_ROWS:
                self.keeps.add(c.seq_id)
                states.snapshots[c.seq_id] = (c.start, {}, {})
            states.lengths[c.seq_id] = c.end
            self.spans.append((c.seq_id, row, c.num_tokens))
            if c.parents is not None:
                self.parents[c.seq_id] = tuple(c.parents)
            row += c.num_tokens


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer of Qwen3.5 (transformers' Qwen3_5MoeGatedDeltaNet).

    qkv = silu(causal depthwise conv1d(in_proj_qkv(x))); q, k l2-normed, q scaled by dk^-0.5;
    beta = sigmoid(in_proj_b(x)), g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias) (log decay);
    per value head S <- S * exp(g) + k (beta * (v - S^T k))^T, out = S^T q; then the gated norm
    with in_proj_z(x) as gate, and out_proj.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        h, conv_dim = cfg.hidden_size, cfg.linear_conv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False,
                                padding=cfg.linear_conv_kernel_dim - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)
        self.in_proj_qkv = Linear(h, conv_dim, bias=False)
        self.in_proj_z = Linear(h, self.value_dim, bias=False)
        self.in_proj_b = Linear(h, self.nv, bias=False)
        self.in_proj_a = Linear(h, self.nv, bias=False)

    def forward(self, x: torch.Tensor, rope, ctx, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; `ctx.states` (a `StepStates`) says whose rows are whose."""
        step: StepStates | None = getattr(ctx, "states", None)
        if step is None:
            raise RuntimeError("a linear-attention layer runs only in a step with recurrent states")
        if rows is not None:
            raise ValueError("a linear-attention layer computes every row (no query-row subset)")
        t = x.shape[0]
        qkv = self.in_proj_qkv(x)                                      # [T, C]
        z = self.in_proj_z(x)
        beta = self.in_proj_b(x).sigmoid()
        # As transformers computes it: A_log in float32 whatever the model dtype.
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        slot = step.states.layers[self.layer_idx]
        dt = stats_dtype(x.dtype)
        out = torch.empty(t, self.nv, self.dv, dtype=dt, device=x.device)
        weight = self.conv1d.weight                                    # [C, 1, K]
        for seq_id, first, n in step.spans:
            conv_state = step.states.conv[seq_id][slot]                # [C, K-1]
            width = conv_state.shape[1]
            window = torch.cat((conv_state, qkv[first:first + n].t().to(conv_state.dtype)), dim=1)
            parents = step.parents.get(seq_id)
            if parents is None:
                # The depthwise conv as K multiply-adds over a sliding view (F.conv1d is far slower in float64).
                taps = window.to(weight.dtype).unfold(1, weight.shape[2], 1)      # [C, n, K]
                conv_state.copy_(window[:, -width:])
            else:   # each row's inputs along its own ancestors
                along = tree_conv_columns(parents, width).to(window.device)       # [n, K]
                taps = window.to(weight.dtype)[:, along]
                # The conv state before the rows and after each row: columns of the window [n + 1, K-1].
                cols = torch.cat((torch.arange(width, device=window.device)[None], along[:, 1:]))
                conv_state.copy_(window[:, cols[-1]])
            mixed = F.silu((taps * weight).sum(-1)).t()
            q, k, v = mixed.to(dt).split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
            q, k = q.reshape(n, self.nk, self.dk), k.reshape(n, self.nk, self.dk)
            if self.nv != self.nk:
                q = q.repeat_interleave(self.nv // self.nk, dim=1)
                k = k.repeat_interleave(self.nv // self.nk, dim=1)
            q, k = _l2norm(q) * self.dk ** -0.5, _l2norm(k)
            args = (q, k, v.reshape(n, self.nv, self.dv), g[first:first + n].to(dt), beta[first:first + n].to(dt),
                    step.states.rec[seq_id][slot])
            if parents is not None:
                o, every = tree_delta_rule(*args, parents)
                state = every[-1]
                step.states.snapshots[seq_id][1][slot] = (window, cols, every)
            elif seq_id in step.keeps:   # the state before and after each row, for a rewind
                every = [args[-1]]
                o, state = recurrent_delta_rule(*args, every=every)
                cols = torch.arange(n + 1, device=window.device)[:, None] + torch.arange(width, device=window.device)
                step.states.snapshots[seq_id][1][slot] = (window, cols, every)
            else:
                o, state = (recurrent_delta_rule if n == 1 else chunked_delta_rule)(*args)
            step.states.rec[seq_id][slot] = state
            out[first:first + n] = o
        out = self.norm(out.to(x.dtype), z.view(t, self.nv, self.dv))
        return self.out_proj(out.reshape(t, -1))
