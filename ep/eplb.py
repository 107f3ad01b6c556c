"""Expert-parallel load balancing (EPLB): where each routed expert's copies live, from its load.

DeepSeek's published hierarchical policy (github.com/deepseek-ai/EPLB, written here from its
description): when the expert groups divide evenly over the nodes, pack groups to nodes by load,
replicate the hottest experts inside each node until the node's slots are full (a replica takes an
equal share of its expert's rows), then pack the physical experts to the node's ranks; otherwise
the same replicate-and-pack over all ranks at once (the "global" policy). Packing is greedy
longest-first into the least-loaded pack with a free slot.

A placement is a table of slots, `slots[rank][j]` = the expert in slot j of `rank`: every rank
holds S = (E + R) / N slots (E experts, R redundant copies, N ranks), each expert at least once.
The runtime (`ep.parallel.EPMoE`) numbers slot j of rank r as the physical expert r * S + j;
`tools/ep/ep_balance.py` judges placements on routing traces with the same functions.
"""
from __future__ import annotations

import numpy as np


def balanced_packing(weights: np.ndarray, num_packs: int, labels: np.ndarray | None = None) -> np.ndarray:
    """Pack index of each item: heaviest first into the lightest pack that still has room; every
    pack gets len(weights) / num_packs items. `labels` (an expert id per item): an item goes to a
    pack holding no item of its label while one with room is left (two copies of an expert on
    one rank would balance nothing)."""
    n = len(weights)
    if n % num_packs:
        raise ValueError(f"{n} items do not split evenly over {num_packs} packs")
    per = n // num_packs
    pack_of = np.empty(n, dtype=np.int64)
    load, count = np.zeros(num_packs), np.zeros(num_packs, dtype=np.int64)
    held: list[set] = [set() for _ in range(num_packs)]
    for item in np.argsort(-np.asarray(weights, dtype=np.float64), kind="stable"):
        open_packs = np.flatnonzero(count < per)
        if labels is not None:
            apart = [q for q in open_packs if labels[item] not in held[q]]
            open_packs = np.asarray(apart) if apart else open_packs
            held[open_packs[np.argmin(load[open_packs])]].add(labels[item])
        p = open_packs[np.argmin(load[open_packs])]
        pack_of[item], load[p], count[p] = p, load[p] + weights[item], count[p] + 1
    return pack_of


def replicate(weights: np.ndarray, num_slots: int) -> np.ndarray:
    """Replicas per expert (at least one each) filling `num_slots`: each extra slot goes to the
    expert with the highest load per replica (the lowest id on a tie)."""
    if num_slots < len(weights):
        raise ValueError(f"{num_slots} slots cannot hold {len(weights)} experts")
    weights = np.asarray(weights, dtype=np.float64)
    reps = np.ones(len(weights), dtype=np.int64)
    for _ in range(num_slots - len(weights)):
        reps[np.argmax(weights / reps)] += 1
    return reps


def _replicate_and_pack(weights: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """[N, S] slot table (indices into `weights`) after replication and packing."""
    reps = replicate(weights, num_slots)
    experts = np.repeat(np.arange(len(weights)), reps)              # one entry per physical expert
    rank_of = balanced_packing(np.asarray(weights, dtype=np.float64)[experts] / reps[experts], num_ranks, experts)
    return np.stack([experts[rank_of == r] for r in range(num_ranks)])


def check_placeable(num_experts: int, num_redundant: int, num_ranks: int) -> int:
    """Slots per rank for E experts plus R redundant copies over N ranks; ValueError (one line,
    naming the flag) when they cannot be placed."""
    if num_redundant < 0:
        raise ValueError(f"--eplb-redundant-experts {num_redundant}: must be at least 0")
    slots = num_experts + num_redundant
    if slots % num_ranks:
        raise ValueError(f"--eplb-redundant-experts {num_redundant}: {num_experts} experts + {num_redundant} "
                         f"redundant = {slots} slots do not split evenly over --ep {num_ranks}")
    if num_redundant > num_experts * (num_ranks - 1):
        raise ValueError(f"--eplb-redundant-experts {num_redundant}: more copies than ranks for every one of "
                         f"the {num_experts} experts (at most {num_experts * (num_ranks - 1)})")
    return slots // num_ranks


def eplb_slots(weights: np.ndarray, *, num_redundant: int, num_ranks: int, ranks_per_node: int,
               num_groups: int) -> np.ndarray:
    """[N, S] expert id in each slot of each rank, from the hierarchical policy (or the global one
    when the groups or ranks do not split evenly over the nodes)."""
    weights = np.asarray(weights, dtype=np.float64)
    num_experts = len(weights)
    num_slots = num_experts + num_redundant
    if num_slots % num_ranks:
        raise ValueError(f"{num_experts} experts + {num_redundant} redundant = {num_slots} slots do not split "
                         f"evenly over EP {num_ranks}")
    num_nodes = num_ranks // ranks_per_node if num_ranks % ranks_per_node == 0 else 0
    if num_nodes < 2 or num_groups % num_nodes or num_experts % num_groups or num_slots % num_nodes:
        return _replicate_and_pack(weights, num_slots, num_ranks)
    group_size = num_experts // num_groups
    node_of_group = balanced_packing(weights.reshape(num_groups, group_size).sum(axis=1), num_nodes)
    slots = np.zeros((num_ranks, num_slots // num_ranks), dtype=np.int64)
    for node in range(num_nodes):
        experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                                  for g in np.flatnonzero(node_of_group == node)])
        local = _replicate_and_pack(weights[experts], num_slots // num_nodes, ranks_per_node)
        slots[node * ranks_per_node:(node + 1) * ranks_per_node] = experts[local]
    return slots


def slot_share(slots: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, E] fraction of each expert's rows each rank serves when a row goes to each of its
    expert's copies equally often."""
    reps = np.bincount(slots.reshape(-1), minlength=num_experts)
    share = np.zeros((slots.shape[0], num_experts))
    for r, row in enumerate(slots):
        np.add.at(share[r], row, 1.0 / reps[row])
    return share


def eplb_placement(weights: np.ndarray, *, num_redundant: int, num_gpus: int, gpus_per_node: int,
                   num_groups: int) -> np.ndarray:
    """[G, E] fraction of each expert's rows each GPU serves under `eplb_slots`."""
    return slot_share(eplb_slots(weights, num_redundant=num_redundant, num_ranks=num_gpus,
                                 ranks_per_node=gpus_per_node, num_groups=num_groups), len(weights))


def contiguous_placement(num_experts: int, num_gpus: int) -> np.ndarray:
    """[G, E]: the split without EPLB, rank r owns a contiguous range (the first E % G ranks one more)."""
    share = np.zeros((num_gpus, num_experts))
    base, extra = divmod(num_experts, num_gpus)
    start = 0
    for r in range(num_gpus):
        stop = start + base + (r < extra)
        share[r, start:stop] = 1.0
        start = stop
    return share


def imbalance(share: np.ndarray, loads: np.ndarray) -> float:
    """max / mean of the rows each GPU serves for expert loads `loads` ([E] or [S, E]; mean over S)."""
    per_gpu = np.atleast_2d(loads) @ share.T                        # [S, G]
    mean = per_gpu.mean(axis=1)
    return float(np.mean(per_gpu.max(axis=1) / np.where(mean > 0, mean, 1.0)))


def keep_in_place(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """`new` with each rank's slots reordered so that an expert the rank already holds stays in
    the slot it is in (those slots need no weights moved); the set of experts per rank is unchanged."""
    out = np.full_like(new, -1)
    for r in range(new.shape[0]):
        todo = list(new[r])
        for j, e in enumerate(old[r]):
            if e in todo:
                out[r, j] = e
                todo.remove(e)
        free = [j for j in range(new.shape[1]) if out[r, j] < 0]
        out[r, free] = todo
    return out


def rebalance(loads: np.ndarray, old: np.ndarray) -> np.ndarray:
    """[N, S] new slot table for one layer from its per-expert loads [E] (the global policy over
    the ranks of one node), kept in place against the current table `old` where it can be; a
    layer that routed nothing keeps `old`."""
    num_ranks, per = old.shape
    if not np.asarray(loads).sum() > 0:
        return old.copy()
    new = eplb_slots(loads, num_redundant=num_ranks * per - len(loads), num_ranks=num_ranks,
                     ranks_per_node=num_ranks, num_groups=1)
    return keep_in_place(new, old)
