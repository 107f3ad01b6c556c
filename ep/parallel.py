"""The one explicit step that makes the single-device model parallel across EP ranks.

Shapes: T tokens (every rank holds all T after each layer), H hidden, E experts, k experts per
token, N ranks, V vocab, Vr this rank's vocabulary slice.

- Attention: query and key/value heads split across ranks (column-parallel q/k/v), output
  projection row-parallel followed by an all-reduce. KV heads are replicated when there are
  fewer of them than ranks.
- Multi-head latent attention (runtime.model.mla): query heads split (q_proj or q_b_proj, and
  kv_b_proj, whose rows are per head, column-parallel; o_proj row-parallel). The latent path
  (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm) is replicated, and so is the latent
  cache: the latent is the one key/value "head" every query head reads, so splitting it would cost
  an all-gather per layer for C + Dr values per token, while replicating it costs only that much
  cache per rank (what an MQA model's single KV head costs under tensor parallelism too).
- LM head (and the MTP head when it has its own): vocabulary-parallel; logits are gathered.
- Routed experts: each rank owns a contiguous range; dispatch `alltoall` or `allreduce` (`auto`
  picks per layer: `EPMoE.dispatch_mode`).
- Embeddings, norms, routers and shared experts (and a shared expert's sigmoid gate): replicated.
- Gated DeltaNet linear attention (Qwen3.5): key and value heads split across ranks where both
  counts divide by the ranks (each rank's query, key and value channels of the projection and the
  conv, its value heads' gates and decays; out_proj row-parallel), with each rank's recurrent state
  of its own heads; replicated otherwise (docs/design.md §3).

`parallelize` runs on the meta device before weights exist and returns, for every sharded
parameter, which slice of the checkpoint tensor it holds, so each rank reads only that slice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ep.comm import Communicator, GroupComm, Pending
from ep.topology import EPTopology
from runtime.ops import batch_invariant as bi
from runtime.executor.step_context import step_model
from runtime.model.config import ModelConfig
from runtime.model.experts import RoutedExperts
from runtime.model.layers import ChosenGemm, Linear, MoE
from runtime.model.mla import MLAttention
from runtime.model.causal_lm import CausalLM

# param name -> (dim, start, stop) in the checkpoint tensor, or (dim, start0, stop0, start1, stop1, ...):
# several windows along dim, joined in order (runtime.model.weights.load_model)
ShardSpecs = dict[str, tuple[int, ...]]


# --- collectives inside a compiled step ----------------------------------------------------
# A compiled EP step calls its collectives through opaque ops (Dynamo cannot trace a process
# group, and a graph broken at every collective would fuse otherwise than one rank's graph). An
# op finds its layer by its index among the model's `ep_collectives`, through the forward
# context of the model running (runtime.executor.step_context.step_model): an index, unlike an object, is
# the same in every process and model instance, so one rank's graph hits inductor's disk cache
# when it restarts. The graph around the ops is the one a single rank compiles, so EP N runs the
# same generated kernels as EP 1 (batch-invariant mode relies on it: EP 2 equals EP 1).
MOE_MODES = ("auto", "alltoall", "allreduce")
# The layout of `--dp-attention` (docs/design.md §4.3), given where a `--moe-a2a` mode goes (the
# launchers pass it to every rank's shard loading): attention, dense layers and the LM head whole
# on every rank over its own rows, the target's routed experts exchanged by `EPMoE.dp_exchange`.
DP_MODE = "dp"


def dp_mode(attention_tp: int = 1) -> str:
    """The shard mode of `--dp-attention` with attention groups of `attention_tp` ranks."""
    return DP_MODE if attention_tp == 1 else f"{DP_MODE}{attention_tp}"


def parse_dp_mode(mode: str) -> int | None:
    """The attention group size of a `dp_mode` string; None for a `--moe-a2a` mode."""
    if mode == DP_MODE:
        return 1
    if mode.startswith(DP_MODE) and mode[len(DP_MODE):].isdigit() and int(mode[len(DP_MODE):]) > 1:
        return int(mode[len(DP_MODE):])
    return None


def _collective(handle: int) -> nn.Module:
    return step_model().ep_collectives[handle]


torch.library.define("metrale::ep_all_reduce", "(Tensor x, int layer) -> Tensor")
torch.library.impl("metrale::ep_all_reduce", "CompositeExplicitAutograd")(
    lambda x, layer: _collective(layer).comm.all_reduce(x.clone()))
torch.library.register_fake("metrale::ep_all_reduce")(lambda x, layer: x.new_empty(x.shape))

torch.library.define("metrale::ep_moe_exchange", "(Tensor x, Tensor weights, Tensor ids, int layer) -> Tensor")
torch.library.impl("metrale::ep_moe_exchange", "CompositeExplicitAutograd")(
    lambda x, weights, ids, layer: _collective(layer).exchange(x, weights, ids))
torch.library.register_fake("metrale::ep_moe_exchange")(lambda x, *_: x.new_empty(x.shape))


def all_reduce(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks, by `layer`'s communicator (a new tensor in a compiled step,
    `x` itself eager)."""
    if torch.compiler.is_compiling():
        return torch.ops.metrale.ep_all_reduce(x, layer.handle)
    return layer.comm.all_reduce(x)


class RowParallelLinear(Linear):
    """A linear over this rank's slice of the input features; partial sums all-reduced, then the
    (replicated) bias added once. Batch-invariant at EP 2, each rank's slice is one of the two
    halves one rank sums (`runtime.ops.batch_invariant.split_linear`), so the all-reduce adds what
    EP 1 adds."""

    gemm_takes_bias = False   # the bias is added once, after the all-reduce
    packed_weights: dict[str, str] = {}   # F.linear on its slice: no packed copy

    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = False,
                 in_parts: int = 1) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.comm = comm
        self.in_parts = in_parts
        self.handle = -1   # its index in the model's ep_collectives (`parallelize`)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(F.linear(x, self.weight))

    def _invariant(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_parts > 1:
            return self._reduce(bi.split_linear(x, self.weight, self.in_parts, self.bi_rows))
        return self._reduce(bi.linear(x, self.weight, rows=self.bi_rows))

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:   # `keep_fp8`: this rank's window, bias after the sum
        return self._reduce(self._fp8_matmul(x, None))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        out = all_reduce(self, partial)
        return out if self.bias is None else out + self.bias


class VocabParallelHead(ChosenGemm, bi.InvariantSwitch, nn.Module):
    """This rank's rows of the output projection; `forward` gathers full logits on every rank."""

    switched = {"_local": "_local_invariant"}
    column_major_weights = True   # runtime.model.layers.pack_for_inference
    packed_weights = {"packed": "weight"}   # and packs it for the few-row kernel

    def __init__(self, hidden: int, topo: EPTopology, comm: Communicator) -> None:
        super().__init__()
        self.topo, self.comm = topo, comm
        self.weight = nn.Parameter(torch.empty(len(topo.vocab_range()), hidden))
        self.register_buffer("packed", None, persistent=False)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, self.weight, None, self.packed)

    def _local_invariant(self, x: torch.Tensor) -> torch.Tensor:
        return bi.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self._local(x)                                            # [T, Vr]
        pad = self.topo.max_vocab_shard - local.shape[1]
        if pad:
            local = F.pad(local, (0, pad))
        # Gather along the vocabulary: all_gather works on dim 0, so gather [Vr_max, T] slices.
        gathered = self.comm.all_gather(local.t().contiguous())           # [N * Vr_max, T]
        parts = [gathered[r * self.topo.max_vocab_shard:r * self.topo.max_vocab_shard + len(self.topo.vocab_range(r))]
                 for r in range(self.topo.ep_size)]
        return torch.cat(parts).t()                                        # [T, V]


@dataclass(slots=True)
class DPExchange:
    """One `EPMoE.dp_exchange` between its stages: the rows it routes (`rows` of the group's
    `full_rows`, k choices each) in destination `order`, the splits, the padded form's `place` of
    each choice in the padded buffer (None: exact counts), and the collectives in flight."""
    full_rows: int
    rows: int
    k: int
    order: torch.Tensor
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    place: torch.Tensor | None = None
    recv_x: Pending | None = None
    recv_meta: Pending | None = None
    back: Pending | None = None


class EPMoE(nn.Module):
    """MoE with routed experts split across ranks; same result as the single-rank layer."""

    batch_invariant = False   # switched by set_batch_invariant: `auto` then keeps one rank's combine order

    def __init__(self, moe: MoE, topo: EPTopology, comm: Communicator, mode: str) -> None:
        super().__init__()
        if mode not in (*MOE_MODES, DP_MODE):
            raise ValueError(f"--moe-a2a {mode!r}: expected {', '.join(MOE_MODES)}")
        self.gate = moe.gate
        self.shared_experts = moe.shared_experts
        self.shared_expert_gate = moe.shared_expert_gate   # Qwen3.5's sigmoid gate on the shared expert
        mine = topo.expert_range()
        hidden = moe.experts.gate_up_proj.shape[2]
        inter = moe.experts.down_proj.shape[2]
        self.experts = RoutedExperts(len(mine), hidden, inter, expert_offset=mine.start)
        self.topo, self.comm, self.mode = topo, comm, mode
        owner = [r for r in range(topo.ep_size) for _ in topo.expert_range(r)]
        self.owner = torch.tensor(owner, dtype=torch.long, device=comm.device)      # expert id -> rank
        self.handle = -1   # its index in the model's ep_collectives (`parallelize`)
        # EPLB (ep.placement.enable): the slot table [N, S] numpy, and the buffers it registers:
        # eplb_copies [E, R+1] physical ids of each expert's copies, eplb_num_copies [E], and
        # expert_loads [E], the tokens routed to each expert since start (counted on the device).
        self.eplb_slots = None
        self.eplb_on = False   # what the forward reads (a bool: a compiled step guards on it, not on the table)
        self.slots_per_rank = 0
        # DP attention (`dp_exchange`), set before each step on every rank alike (`set_dp_step`): the
        # per-rank row budget of a padded exchange (0: exact counts) and this rank's first row in
        # the rank-major order of the step's rows (EPLB picks copies by it).
        self.dp_budget = 0
        self.dp_row_offset = 0
        self.dp_shapes: set[tuple[tuple[int, ...], ...]] = set()   # shapes of the padded exchanges run
        self.group: GroupComm | None = None   # `--attention-tp` K > 1: the attention group (its K ranks hold the same rows)

    def _group_share(self, t: int) -> tuple[int, int]:
        """Rows [start, stop) of the group's T rows that this rank routes (all of them without a group)."""
        if self.group is None:
            return 0, t
        k, r = self.group.world_size, self.group.rank
        return r * t // k, (r + 1) * t // k

    def physical(self, ids: torch.Tensor, first_row: int) -> torch.Tensor:
        """EPLB: the physical expert (rank * S + slot) of each choice in `ids` [T, k] whose first
        row is row `first_row` of the step: copy (c mod n_e) of expert e, c = row * k + choice, so
        every rank picks the same copy for a choice wherever it is routed."""
        k = ids.shape[1]
        c = torch.arange(ids.numel(), device=ids.device).view_as(ids) + first_row * k
        return self.eplb_copies[ids, c % self.eplb_num_copies[ids]]

    def count(self, ids: torch.Tensor) -> None:
        """Add the step's choices to `expert_loads` (on the device, no host sync)."""
        flat = ids.reshape(-1)
        self.expert_loads.index_add_(0, flat, torch.ones_like(flat))

    def dispatch_mode(self) -> str:
        """The mode this layer runs. `auto`: all-reduce (every rank holds the step's rows anyway,
        so one collective a layer replaces the exchange's five; docs/design.md §4 has the record),
        except batch-invariant with more than two choices a row. There the exchange, whose combine
        adds a row's choices in choice order on one rank as EP 1 does; an all-reduce adds each
        rank's partial sum, which for three or more choices is another order (for two, a + b on
        one rank equals (a + 0) + (0 + b) across two, bit for bit)."""
        if self.mode != "auto":
            return self.mode
        return "alltoall" if self.batch_invariant and self.gate.top_k > 2 else "allreduce"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dispatch_mode() == "allreduce":
            _, weights, ids = self.gate(x)
            if self.eplb_on:
                self.count(ids)
                ids = self.physical(ids, 0)
            out = all_reduce(self, self.experts(x, weights, ids))
        elif self.mode == DP_MODE:   # x: this rank's attention group's rows; it routes its share of them
            weights, ids = self.dp_route(x)
            if torch.compiler.is_compiling():
                out = torch.ops.metrale.ep_moe_exchange(x, weights, ids, self.handle)
            else:
                out = self.dp_exchange(x, weights, ids)
        else:
            # The router runs on this rank's share of the rows (in the step's graph when
            # compiled); the exchange, the experts and the combine run outside it.
            start, stop = self._share(x.shape[0], self.topo.ep_rank)
            _, weights, ids = self.gate(x[start:stop])                     # [Ts, k]
            if torch.compiler.is_compiling():
                out = torch.ops.metrale.ep_moe_exchange(x, weights, ids, self.handle)
            else:
                out = self.exchange(x, weights, ids)
        shared = self.shared_out(x)
        return out if shared is None else out + shared

    def shared_out(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output for x (gated where the model gates it), None without one."""
        if self.shared_expert_gate is not None:
            return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_experts(x)
        return None if self.shared_experts is None else self.shared_experts(x)

    def dp_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DP attention: the routing (weights, ids [Ts, k]) of this rank's share of its group's rows x."""
        start, stop = self._group_share(x.shape[0])
        _, weights, ids = self.gate(x[start:stop])
        return weights, ids

    def _share(self, t: int, rank: int) -> tuple[int, int]:
        """Rows [start, stop) of a T-row step whose routing rank `rank` runs."""
        n = self.topo.ep_size
        return rank * t // n, (rank + 1) * t // n

    def exchange(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The exchange of this layer's mode (the compiled step's opaque op calls it)."""
        if self.mode == DP_MODE:
            return self.dp_exchange(x, weights, ids)
        return self.share_exchange(x, weights, ids)

    def dp_exchange(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """DP attention: x [Tr, H] this rank's own rows, weights and ids [Tr, k] their routing ->
        the routed experts' output for those rows [Tr, H]. Every choice goes to the rank holding
        its expert (EPLB: its copy) and comes back weighted; a row's k choices are added in choice
        order here, as one rank adds them. Two forms, the same on every rank of a step:

        - exact (`dp_budget` 0, prefill): the per-destination counts are all-gathered and checked
          (gloo returns stale data on mismatched splits), then uneven all_to_alls of the rows,
          their (id, weight) and the results;
        - padded (`dp_budget` B: every rank's rows fit B, decode and verify steps): each rank
          sends every other rank a fixed B * k rows, its choices for that rank first and the rest
          expert id -1, weight 0 (which no rank holds: they add zero), so every collective and
          tensor has the same shape at every step (CUDA-graph capturable); no counts travel
          (with EPLB the loads do, a fixed [E] a rank).

        A rank with no rows of its own joins every collective with empty tensors. With attention
        groups (`--attention-tp` K), x holds the group's rows, the same on its K ranks: each routes
        and exchanges its K-th (`_group_share`, weights and ids are its share's) and the group
        all-gathers the results."""
        return self.dp_combine(self.dp_experts(self.dp_dispatch(x, weights, ids, self.dp_budget, self.dp_row_offset,
                                                               async_op=False), async_op=False))

    # The exchange in three stages (two-batch overlap, ep.overlap, runs another micro-batch's
    # compute between them while the collectives started in one are in flight): `dp_dispatch`
    # routes to ranks and starts sending the rows, `dp_experts` waits for this rank's rows, runs
    # its experts and starts sending the results back, `dp_combine` waits for them and adds each
    # row's choices. Every rank runs every stage of every exchange in the same order.
    def dp_dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, budget: int,
                    row_offset: int, async_op: bool) -> DPExchange:
        """The first stage: `budget` the per-rank padded rows of this exchange (0: exact counts),
        `row_offset` the first row of x among the step's rows rank-major (EPLB's copies); the
        counts (exact) and EPLB's loads travel here, blocking; the rows and their (id, weight)
        are started (left in flight with `async_op`)."""
        full = x
        start, stop = self._group_share(x.shape[0])
        x = x[start:stop]
        topo, comm = self.topo, self.comm
        n, t, h = topo.ep_size, x.shape[0], x.shape[1]
        k = ids.shape[1]
        loads = ids.new_zeros(0)
        if self.eplb_on:
            loads = torch.bincount(ids.reshape(-1), minlength=topo.num_experts)
            ids = self.physical(ids, row_offset + start)
            dest = ids.reshape(-1) // self.slots_per_rank
        else:
            dest = self.owner[ids.reshape(-1)]                             # [Tr*k] rank of each choice
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=n)                    # [N]
        meta_dtype = torch.float64 if weights.dtype == torch.float64 else torch.float32
        flat_ids, flat_w = ids.reshape(-1)[order].to(meta_dtype), weights.reshape(-1)[order].to(meta_dtype)
        budget = budget if self.group is None else -(-budget // self.group.world_size)
        ex = DPExchange(full_rows=full.shape[0], rows=t, k=k, order=order)
        if not budget:
            gathered = comm.all_gather(torch.cat((send_counts, loads)).to(torch.int32)[None])
            all_counts = gathered[:, :n].reshape(n, n)
            if self.eplb_on:
                self.expert_loads += gathered[:, n:].sum(dim=0)
            self.last_counts = all_counts
            if not torch.equal(all_counts[topo.ep_rank].long(), send_counts):
                raise RuntimeError(f"rank {topo.ep_rank}: MoE dispatch counts disagree after exchange "
                                   f"({all_counts[topo.ep_rank].tolist()} vs {send_counts.tolist()})")
            ex.send_splits, ex.recv_splits = send_counts.tolist(), all_counts[:, topo.ep_rank].tolist()
            send_x, send_meta = x[order // k], torch.stack((flat_ids, flat_w), 1)
        else:
            if t > budget:
                raise RuntimeError(f"rank {topo.ep_rank}: {t} rows exceed the padded exchange's budget of {budget}")
            cap = budget * k                                               # rows a rank sends each rank
            sorted_dest = dest[order]
            first = torch.cumsum(send_counts, 0) - send_counts
            ex.place = sorted_dest * cap + torch.arange(t * k, device=x.device) - first[sorted_dest]   # [Tr*k]
            send_x = x.new_zeros(n * cap, h)
            send_x[ex.place] = x[order // k]
            send_meta = torch.stack((torch.full((n * cap,), -1.0, dtype=meta_dtype, device=x.device),
                                     torch.zeros(n * cap, dtype=meta_dtype, device=x.device)), 1)
            send_meta[ex.place] = torch.stack((flat_ids, flat_w), 1)
            ex.send_splits = ex.recv_splits = [cap] * n
            self.dp_shapes.add(((n * cap, h), (n * cap, 2), (n * cap, h)))   # rows out, (id, weight) in, results back
            if self.eplb_on:
                self.expert_loads += comm.all_gather(loads.to(torch.int32)[None]).sum(dim=0)
        ex.recv_x = comm.all_to_all_start(send_x, ex.send_splits, ex.recv_splits, async_op)       # [R, H]
        ex.recv_meta = comm.all_to_all_start(send_meta, ex.send_splits, ex.recv_splits, async_op)  # [R, 2]
        return ex

    def dp_experts(self, ex: DPExchange, async_op: bool) -> DPExchange:
        """The second stage: wait for the rows this rank's experts get, run them, start the
        results back (left in flight with `async_op`)."""
        recv_x, recv_meta = ex.recv_x.wait(), ex.recv_meta.wait()
        y = self.experts(recv_x, recv_meta[:, 1:], recv_meta[:, :1].long())
        ex.back = self.comm.all_to_all_start(y, ex.recv_splits, ex.send_splits, async_op)
        return ex

    def dp_combine(self, ex: DPExchange) -> torch.Tensor:
        """The last stage: wait for the results and add each row's choices in choice order ->
        the routed experts' output for the rows x held [Tr, H] (the group's, gathered)."""
        back = ex.back.wait()                                              # exact: [Tr*k, H] in `order`
        if ex.place is not None:                                           # padded: [N*B*k, H]
            back = back[ex.place]
        t, h = ex.rows, back.shape[1]
        per_choice = torch.empty_like(back)
        per_choice[ex.order] = back
        out = per_choice.view(t, ex.k, h).sum(dim=1)
        if self.group is None or ex.full_rows == 0:   # a group's ranks hold the same rows: all skip alike
            return out
        g = self.group.world_size
        shares = [(r + 1) * ex.full_rows // g - r * ex.full_rows // g for r in range(g)]
        width = max(shares)
        gathered = self.group.all_gather(F.pad(out, (0, 0, 0, width - t)))          # [K * width, H]
        return torch.cat([gathered[r * width:r * width + shares[r]] for r in range(g)])

    def share_exchange(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, ids [Ts, k]: the routing of this rank's share of x -> the routed
        experts' output for all T rows, on every rank."""
        topo, comm = self.topo, self.comm
        n, rank, t = topo.ep_size, topo.ep_rank, x.shape[0]
        share = [stop - start for start, stop in (self._share(t, r) for r in range(n))]
        start = sum(share[:rank])
        xs = x[start:start + share[rank]]                                  # [Ts, H] my share of tokens
        k = ids.shape[1]
        if not self.eplb_on:
            dest = self.owner[ids.reshape(-1)]                             # [Ts*k] rank of each choice
            loads = ids.new_zeros(0)
        else:   # EPLB: the copy each choice goes to, and this share's loads, sent with the counts
            loads = torch.bincount(ids.reshape(-1), minlength=topo.num_experts)
            ids = self.physical(ids, start)
            dest = ids.reshape(-1) // self.slots_per_rank
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=n)                    # [N]
        # Exchange and check the counts first: gloo returns stale data on mismatched splits.
        gathered = comm.all_gather(torch.cat((send_counts, loads)).to(torch.int32)[None])
        all_counts = gathered[:, :n].reshape(n, n)
        if self.eplb_on:
            self.expert_loads += gathered[:, n:].sum(dim=0)
        self.last_counts = all_counts  # [N, N] sender x receiver, kept for inspection
        if not torch.equal(all_counts[rank].long(), send_counts):
            raise RuntimeError(f"rank {rank}: MoE dispatch counts disagree after exchange "
                               f"({all_counts[rank].tolist()} vs {send_counts.tolist()})")
        send_splits = send_counts.tolist()
        recv_splits = all_counts[:, rank].tolist()
        tok = (order // k)
        recv_x = comm.all_to_all(xs[tok], send_splits, recv_splits)        # [R, H]
        # Expert id and weight of each row travel together: ids < 2^24 are exact in float32/64.
        meta_dtype = torch.float64 if weights.dtype == torch.float64 else torch.float32
        meta = torch.stack((ids.reshape(-1)[order].to(meta_dtype), weights.reshape(-1)[order].to(meta_dtype)), 1)
        recv_meta = comm.all_to_all(meta, send_splits, recv_splits)        # [R, 2]
        y = self.experts(recv_x, recv_meta[:, 1:], recv_meta[:, :1].long())  # one choice per received row
        back = comm.all_to_all(y, recv_splits, send_splits)                # [Ts*k, H] in `order`
        per_choice = torch.empty_like(back)
        per_choice[order] = back
        local_out = per_choice.view(share[rank], k, x.shape[1]).sum(dim=1)         # weights applied by experts
        # Every rank needs every token again: gather the shares (padded to the largest).
        width = max(share)
        padded = F.pad(local_out, (0, 0, 0, width - share[rank]))
        gathered = comm.all_gather(padded)                                 # [N * width, H]
        return torch.cat([gathered[r * width:r * width + share[r]] for r in range(n)])


def parallelize(model: CausalLM, topo: EPTopology, comm: Communicator, moe_mode: str) -> ShardSpecs:
    """Swap the model's layers for their parallel versions (on the meta device, before loading)."""
    cfg = model.config
    if parse_dp_mode(moe_mode) is not None:
        return _data_parallel(model, topo, comm)
    if cfg.tie_word_embeddings:
        raise ValueError("tie_word_embeddings=true is not supported with ep_size > 1")
    specs: ShardSpecs = {}
    blocks = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    if model.mtp is not None:
        blocks.append(("mtp.block", model.mtp.block))
    for name, block in blocks:
        if hasattr(block, "linear_attn"):
            specs |= _split_linear_attention(block.linear_attn, f"{name}.linear_attn", cfg, topo, comm)
        elif isinstance(block.self_attn, MLAttention):
            specs |= _split_latent_attention(block.self_attn, f"{name}.self_attn", cfg, topo, comm)
        else:
            specs |= _split_attention(block.self_attn, f"{name}.self_attn", cfg, topo, comm)
        if isinstance(block.mlp, MoE):
            block.mlp = EPMoE(block.mlp, topo, comm, moe_mode)
    # The layers a compiled step's collective ops name by index (model order: the same on every rank).
    model.ep_collectives = [m for m in model.modules() if isinstance(m, (RowParallelLinear, EPMoE))]
    for i, m in enumerate(model.ep_collectives):
        m.handle = i
    vr = topo.vocab_range()
    model.lm_head = VocabParallelHead(cfg.hidden_size, topo, comm)
    specs["lm_head.weight"] = (0, vr.start, vr.stop)
    if model.mtp is not None and model.mtp.shared_head.head is not None:
        model.mtp.shared_head.head = VocabParallelHead(cfg.hidden_size, topo, comm)
        specs["mtp.shared_head.head.weight"] = (0, vr.start, vr.stop)
    return specs


def _data_parallel(model: CausalLM, topo: EPTopology, comm: Communicator) -> ShardSpecs:
    """`--dp-attention`: every layer but the routed experts stays whole (no head or vocabulary
    split, no collective outside the experts); the MoE layers, the MTP layer's too, exchange their
    rows (`EPMoE.dp_exchange`): each rank drafts its own sequences (`ep.dp.dp_draft`,
    docs/design.md §4.3)."""
    cfg = model.config
    if cfg.linear_layers or model.sparse is not None:
        raise ValueError(f"--dp-attention: {cfg.architecture}'s linear-attention or sparse layers are not "
                         "data-parallel yet; serve it without --dp-attention")
    k = topo.attention_tp
    group = GroupComm(comm, k) if k > 1 else None   # `ep.channel.load_shard` binds its process groups
    model.attention_group, model.attention_tp = group, k
    specs: ShardSpecs = {}
    blocks = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    if model.mtp is not None:   # the MTP layer's cache is a layer of the same cache: its heads split alike
        blocks.append(("mtp.block", model.mtp.block))
    for name, block in blocks if group is not None else ():
        # heads split inside the attention group, output projection all-reduced there
        split = _split_latent_attention if isinstance(block.self_attn, MLAttention) else _split_attention
        specs |= split(block.self_attn, f"{name}.self_attn", cfg, topo, group)
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp = EPMoE(layer.mlp, topo, comm, DP_MODE)
            layer.mlp.group = group
    if model.mtp is not None and isinstance(model.mtp.block.mlp, MoE):
        model.mtp.block.mlp = EPMoE(model.mtp.block.mlp, topo, comm, DP_MODE)
        model.mtp.block.mlp.group = group
    model.ep_collectives = [m for m in model.modules() if isinstance(m, (RowParallelLinear, EPMoE))]
    for i, m in enumerate(model.ep_collectives):
        m.handle = i
    return specs


def dp_layers(model: CausalLM, drafter: bool = False) -> list[EPMoE]:
    """The target's exchanging MoE layers in model order, or (`drafter`) the MTP layer's."""
    blocks = [model.mtp.block] if drafter else list(model.layers)
    if drafter and model.mtp is None:
        return []
    return [b.mlp for b in blocks if isinstance(b.mlp, EPMoE) and b.mlp.mode == DP_MODE]


def set_dp_step(model: CausalLM, budget: int, row_offset: int, drafter: bool = False) -> None:
    """Before a DP-attention forward (`drafter`: a draft step), on every rank alike: the padded
    exchange's per-rank row budget (0: exact counts) and this rank's first row in the step's
    rank-major rows."""
    for m in dp_layers(model, drafter):
        m.dp_budget, m.dp_row_offset = budget, row_offset


def dp_join_empty(model: CausalLM, drafter: bool = False) -> None:
    """A DP-attention rank with no rows this step: join every target MoE layer's exchange (or,
    `drafter`, the MTP layer's), in model order, with nothing to send (the other ranks' experts
    may still need its own)."""
    x = torch.zeros(0, model.config.hidden_size, dtype=model.dtype, device=model.device)
    for m in dp_layers(model, drafter):
        k = m.gate.top_k
        m.dp_exchange(x, x.new_zeros(0, k), torch.zeros(0, k, dtype=torch.long, device=x.device))


def _split_attention(attn: nn.Module, name: str, cfg: ModelConfig, topo: EPTopology, comm: Communicator) -> ShardSpecs:
    """Grouped-query attention: this rank's query heads and the key/value heads they read."""
    d, h = cfg.head_dim, cfg.hidden_size
    h0, h1 = topo.head_range.start, topo.head_range.stop
    k0, k1 = topo.kv_head_range.start, topo.kv_head_range.stop
    # With an output gate (Qwen3.5) each head's q rows are its query then its gate: 2 * d a head.
    qd = d * (2 if cfg.attn_output_gate else 1)
    attn.q_proj = Linear(h, (h1 - h0) * qd, bias=cfg.attention_bias)
    attn.k_proj = Linear(h, (k1 - k0) * d, bias=cfg.attention_bias)
    attn.v_proj = Linear(h, (k1 - k0) * d, bias=cfg.attention_bias)
    attn.o_proj = RowParallelLinear((h1 - h0) * d, h, comm, bias=cfg.o_proj_bias)
    attn.num_heads, attn.num_kv_heads = h1 - h0, k1 - k0
    specs: ShardSpecs = {}
    for proj, (a, b), w in (("q_proj", (h0, h1), qd), ("k_proj", (k0, k1), d), ("v_proj", (k0, k1), d)):
        specs[f"{name}.{proj}.weight"] = (0, a * w, b * w)
        if cfg.attention_bias:
            specs[f"{name}.{proj}.bias"] = (0, a * w, b * w)
    specs[f"{name}.o_proj.weight"] = (1, h0 * d, h1 * d)
    return specs


def _split_latent_attention(attn: MLAttention, name: str, cfg: ModelConfig, topo: EPTopology,
                            comm: Communicator) -> ShardSpecs:
    """Multi-head latent attention: this rank's query heads (their rows of the query projection
    and of kv_b_proj, their columns of o_proj); the latent projections stay whole."""
    h0, h1 = topo.head_range.start, topo.head_range.stop
    qk, kv = attn.nope + attn.rope, attn.nope + attn.v_dim
    q_name = "q_b_proj" if attn.has_q_lora else "q_proj"
    setattr(attn, q_name, Linear(cfg.q_lora_rank or cfg.hidden_size, (h1 - h0) * qk, bias=False))
    attn.kv_b_proj = Linear(attn.kv_lora_rank, (h1 - h0) * kv, bias=False)
    attn.o_proj = RowParallelLinear((h1 - h0) * attn.v_dim, cfg.hidden_size, comm, bias=cfg.o_proj_bias)
    attn.num_heads = h1 - h0
    return {f"{name}.{q_name}.weight": (0, h0 * qk, h1 * qk), f"{name}.kv_b_proj.weight": (0, h0 * kv, h1 * kv),
            f"{name}.o_proj.weight": (1, h0 * attn.v_dim, h1 * attn.v_dim)}


def _split_linear_attention(la: nn.Module, name: str, cfg: ModelConfig, topo: EPTopology,
                            comm: Communicator) -> ShardSpecs:
    """Gated DeltaNet: this rank's key heads and the value heads that read them, where both head
    counts divide by the ranks (each value head reads key head v // (nv / nk), so a rank's
    contiguous value heads read its contiguous key heads); else the layer stays whole."""
    n, r = topo.ep_size, topo.ep_rank
    if la.nk % n or la.nv % n:
        return {}
    nk, nv, dk, dv, h = la.nk // n, la.nv // n, la.dk, la.dv, cfg.hidden_size
    k0, v0 = r * nk, r * nv
    # in_proj_qkv's rows and the conv's channels: every query, then every key, then every value channel.
    qkv = (k0 * dk, (k0 + nk) * dk, la.key_dim + k0 * dk, la.key_dim + (k0 + nk) * dk,
           2 * la.key_dim + v0 * dv, 2 * la.key_dim + (v0 + nv) * dv)
    kernel = la.conv1d.kernel_size[0]
    la.nk, la.nv = nk, nv
    la.key_dim, la.value_dim = nk * dk, nv * dv
    conv = 2 * la.key_dim + la.value_dim
    la.conv1d = nn.Conv1d(conv, conv, kernel, groups=conv, bias=False, padding=kernel - 1)
    la.in_proj_qkv = Linear(h, conv, bias=False)
    la.in_proj_z = Linear(h, nv * dv, bias=False)
    la.in_proj_b, la.in_proj_a = Linear(h, nv, bias=False), Linear(h, nv, bias=False)
    la.dt_bias, la.A_log = nn.Parameter(torch.ones(nv)), nn.Parameter(torch.zeros(nv))
    la.out_proj = RowParallelLinear(nv * dv, h, comm)
    heads = (0, v0, v0 + nv)
    return {f"{name}.in_proj_qkv.weight": (0, *qkv), f"{name}.conv1d.weight": (0, *qkv),
            f"{name}.in_proj_z.weight": (0, v0 * dv, (v0 + nv) * dv), f"{name}.in_proj_b.weight": heads,
            f"{name}.in_proj_a.weight": heads, f"{name}.dt_bias": heads, f"{name}.A_log": heads,
            f"{name}.out_proj.weight": (1, v0 * dv, (v0 + nv) * dv)}
