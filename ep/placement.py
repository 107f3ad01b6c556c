"""EPLB in a running EP group: redundant expert slots, per-expert load counters, and the
re-placement every rank runs at the same command (docs/design.md §4.6).

With `--eplb-redundant-experts R` every rank of an EP N group holds S = (E + R) / N expert slots
of every MoE layer; slot j of rank r is the physical expert r * S + j. The table `slots[r][j]`
(the same on every rank) says which expert each slot holds. A token's choice of expert e goes to
copy (c mod n_e) of e's n_e copies, c the choice's index in the step (token * k + choice): every
rank picks the same copy, so each choice is computed once, by one rank, with the same weights.

Loading reads the contiguous split as without EPLB (`ep.channel.load_shard_model`); `enable`
then grows each layer to S slots and fills the new ones with the initial placement (contiguous
plus copies of experts 0..R-1, spread over the ranks with free slots) through `move`, the
all-to-all of expert weights that a live re-placement (the EPLB command rank 0 sends) also runs.
"""
from __future__ import annotations

import numpy as np
import torch

from ep.comm import Communicator
from ep.eplb import check_placeable, rebalance, replicate
from ep.parallel import EPMoE
from ep.topology import even_split
from runtime.ops import cpu_ops

EMPTY = -1   # a slot no expert has been moved into yet


def moe_layers(model: torch.nn.Module) -> list[EPMoE]:
    """The model's expert-parallel MoE layers in model order (the same on every rank)."""
    return [m for m in model.modules() if isinstance(m, EPMoE)]


def initial_slots(num_experts: int, num_redundant: int, num_ranks: int) -> np.ndarray:
    """[N, S]: rank r keeps its contiguous range (what it loaded) in its first slots; the R
    copies (`replicate` on equal loads: experts 0..R-1 first) fill the other slots, each on the
    rank with the most free slots that does not hold that expert yet (the lowest rank on a tie)."""
    per = check_placeable(num_experts, num_redundant, num_ranks)
    slots = np.full((num_ranks, per), EMPTY, dtype=np.int64)
    for r in range(num_ranks):
        mine = even_split(num_experts, num_ranks, r)
        slots[r, :len(mine)] = list(mine)
    reps = replicate(np.ones(num_experts), num_experts + num_redundant)
    for e in np.repeat(np.arange(num_experts), reps - 1):
        free = (slots == EMPTY).sum(axis=1)
        r = min((r for r in range(num_ranks) if free[r]), key=lambda r: (e in slots[r], -free[r], r))
        slots[r, np.flatnonzero(slots[r] == EMPTY)[0]] = e
    return slots


def _flat_rows(layer: EPMoE) -> tuple[int, int]:
    """(gate_up, down) numbers per expert slot of `layer`."""
    return layer.experts.gate_up_proj[0].numel(), layer.experts.down_proj[0].numel()


def _grow(param: torch.Tensor, slots: int) -> torch.nn.Parameter:
    """`param` [n, a, b] as [slots, a, b], its n rows first, laid out as it is (column-major stays)."""
    col_major = param.dim() == 3 and param[0].transpose(0, 1).is_contiguous() and not param[0].is_contiguous()
    shape = (slots, *param.shape[1:])
    if col_major:
        out = param.new_empty(slots, shape[2], shape[1]).transpose(1, 2)
    else:
        out = param.new_empty(shape)
    out[:param.shape[0]].copy_(param)
    out[param.shape[0]:].zero_()
    return torch.nn.Parameter(out, requires_grad=False)


def _repack(layer: EPMoE, fresh: bool) -> None:
    """The packed copies the CPU's few-row kernel reads (`runtime.model.layers.pack_for_inference`)
    made again from the moved weights: new tensors when `fresh` (the shapes changed), else in place
    (a compiled step holds the buffers it was traced with)."""
    ex = layer.experts
    for name, weight in ex.packed_weights.items():
        old = getattr(ex, name)
        if old is None:
            continue
        packed = cpu_ops.pack(getattr(ex, weight))
        if fresh:
            setattr(ex, name, packed)
        else:
            old.copy_(packed)


def _set_tables(layer: EPMoE, slots: np.ndarray) -> None:
    """Route by `slots` from now on: each expert's physical copies and their count, in place."""
    num_experts, max_copies = layer.eplb_copies.shape
    copies = np.zeros((num_experts, max_copies), dtype=np.int64)
    count = np.zeros(num_experts, dtype=np.int64)
    for phys, e in enumerate(slots.reshape(-1)):
        if e == EMPTY:
            raise ValueError(f"slot {phys} holds no expert")
        if count[e] >= max_copies:
            raise ValueError(f"expert {e} has more than {max_copies} copies")
        copies[e, count[e]] = phys
        count[e] += 1
    if (count == 0).any():
        raise ValueError(f"experts {np.flatnonzero(count == 0)[:4].tolist()} are in no slot")
    layer.eplb_copies.copy_(torch.from_numpy(copies))
    layer.eplb_num_copies.copy_(torch.from_numpy(count))
    layer.eplb_slots = slots.copy()


def enable(model: torch.nn.Module, comm: Communicator, num_redundant: int) -> int:
    """Grow every EP MoE layer of this rank's freshly loaded (contiguous) shard to its EPLB slots,
    fill them with `initial_slots` (collective: every rank calls it at start) and count loads from
    now on. Returns the bytes this rank received."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("--eplb-redundant-experts: this model has no routed experts to balance")
    topo = layers[0].topo
    num_experts, n = topo.num_experts, topo.ep_size
    per = check_placeable(num_experts, num_redundant, n)
    moved = 0
    target = initial_slots(num_experts, num_redundant, n)
    for layer in layers:
        if layer.eplb_slots is not None:
            raise ValueError("EPLB is enabled on this shard already (a restart reloads it)")
        ex = layer.experts
        mine = topo.expert_range()
        if ex.num_local_experts != len(mine) or ex.expert_offset != mine.start:
            raise ValueError(f"rank {topo.ep_rank}: the shard holds experts {ex.expert_offset}.. "
                             f"({ex.num_local_experts}), not its contiguous range {mine}")
        dev = comm.device
        ex.gate_up_proj = _grow(ex.gate_up_proj, per)
        ex.down_proj = _grow(ex.down_proj, per)
        ex.expert_offset = topo.ep_rank * per
        layer.slots_per_rank = per
        layer.register_buffer("eplb_copies", torch.zeros(num_experts, num_redundant + 1, dtype=torch.long,
                                                         device=dev), persistent=False)
        layer.register_buffer("eplb_num_copies", torch.zeros(num_experts, dtype=torch.long, device=dev),
                              persistent=False)
        layer.register_buffer("expert_loads", torch.zeros(num_experts, dtype=torch.long, device=dev),
                              persistent=False)
        start = np.full((n, per), EMPTY, dtype=np.int64)
        for r in range(n):
            mine_r = even_split(num_experts, n, r)
            start[r, :len(mine_r)] = list(mine_r)
        layer.eplb_slots = start
        moved += move(layer, target, comm, fresh=True)
        layer.eplb_on = True
    return moved


def move(layer: EPMoE, new: np.ndarray, comm: Communicator, fresh: bool = False) -> int:
    """Give `layer` the slot table `new` [N, S] (the same on every rank): every slot whose expert
    changes gets its weights from this rank's own old slots where it held that expert, else from
    a rank that held it (one all-to-all of the flattened weights, every rank joining, possibly
    with nothing to send), then routes by `new`. Returns the bytes this rank received."""
    old = layer.eplb_slots
    n, per = old.shape
    if new.shape != old.shape:
        raise ValueError(f"placement of shape {new.shape}, the layer has {old.shape} slots")
    me = comm.rank
    ex = layer.experts
    # Every rank derives the same transfer list from (old, new): (src rank, src slot, dst rank, dst slot).
    local: list[tuple[int, int]] = []          # (src slot, dst slot) on this rank
    transfers: list[tuple[int, int, int, int]] = []
    for d in range(n):
        for j in range(per):
            e = new[d, j]
            if old[d, j] == e:
                continue
            held = np.flatnonzero(old[d] == e)
            if len(held):
                if d == me:
                    local.append((int(held[0]), j))
                continue
            holders = [r for r in range(n) if (old[r] == e).any()]
            if not holders:
                raise ValueError(f"expert {e} is held by no rank; it cannot be moved")
            s = holders[(d * per + j) % len(holders)]
            transfers.append((s, int(np.flatnonzero(old[s] == e)[0]), d, j))
    gu, dn = _flat_rows(layer)
    width = gu + dn

    def rows(slot_ids: list[int]) -> torch.Tensor:
        if not slot_ids:
            return ex.gate_up_proj.new_zeros(0, width)
        idx = torch.tensor(slot_ids, device=ex.gate_up_proj.device)
        return torch.cat([ex.gate_up_proj[idx].reshape(len(slot_ids), gu),
                          ex.down_proj[idx].reshape(len(slot_ids), dn)], dim=1)

    sends = [[t for t in transfers if t[0] == me and t[2] == d] for d in range(n)]
    recvs = [[t for t in transfers if t[0] == s and t[2] == me] for s in range(n)]
    send_buf = rows([t[1] for per_dst in sends for t in per_dst])
    local_buf = rows([src for src, _ in local])                   # read before anything is written
    received = comm.all_to_all(send_buf, [len(x) for x in sends], [len(x) for x in recvs]) \
        if comm.world_size > 1 else send_buf
    dst = [j for _, j in local] + [t[3] for per_src in recvs for t in per_src]
    data = torch.cat([local_buf, received]) if len(dst) else local_buf
    with torch.no_grad():
        for i, j in enumerate(dst):
            ex.gate_up_proj[j].copy_(data[i, :gu].view(ex.gate_up_proj.shape[1:]))
            ex.down_proj[j].copy_(data[i, gu:].view(ex.down_proj.shape[1:]))
    if dst or fresh:
        _repack(layer, fresh)
    _set_tables(layer, new)
    return received.numel() * received.element_size()


def replan(model: torch.nn.Module, since: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Rank 0: the new slot table of every EP MoE layer from the loads counted since `since`
    (the counters at the last placement; None: since start), each kept in place where it can be."""
    out = []
    for i, layer in enumerate(moe_layers(model)):
        loads = layer.expert_loads.cpu().numpy().astype(np.float64)
        if since is not None:
            loads = loads - since[i]
        out.append(rebalance(loads, layer.eplb_slots))
    return out


def apply(model: torch.nn.Module, tables: list[np.ndarray], comm: Communicator) -> int:
    """Every rank, at the same command: move each layer to its table; the bytes this rank received."""
    layers = moe_layers(model)
    if len(tables) != len(layers):
        raise ValueError(f"{len(tables)} placements for {len(layers)} MoE layers")
    return sum(move(layer, table, comm) for layer, table in zip(layers, tables))


def loads(model: torch.nn.Module) -> list[np.ndarray]:
    """Tokens routed to each expert of each EP MoE layer since start: [E] per layer (one host read)."""
    layers = [m for m in moe_layers(model) if m.eplb_slots is not None]
    if not layers:
        return []
    return [row.numpy() for row in torch.stack([m.expert_loads for m in layers]).cpu()]
