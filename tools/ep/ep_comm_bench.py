"""MoE communication at EP 2 beside raw gloo collectives of the same bytes.

Two ranks on 127.0.0.1 build the embedded model's MoE layer shape (random weights), run it in
both dispatch modes at several token counts, and time (a) the layer's time inside collectives and
(b) the raw collective moving the same payload: an all_reduce of [T, H] for `allreduce`, and for
`alltoall` the same sequence of calls on dummy tensors of the layer's sizes. Prints a JSON line per
(mode, tokens) with the ratio layer-comm / raw.

    python tools/ep/ep_comm_bench.py --model models/tiny-glm-moe --iters 200
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rank_main(rank: int, port: int, model: str, iters: int, out) -> None:
    import torch
    from ep.comm import Communicator
    from ep.parallel import EPMoE
    from ep.topology import EPTopology
    from runtime.model.config import load_config
    from runtime.model.layers import MoE
    torch.manual_seed(0)
    cfg = load_config(model)
    comm = Communicator(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=60, device="cpu")
    topo = EPTopology.of(cfg, rank, 2)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
    rows = []
    for mode in ("allreduce", "alltoall"):
        layer = EPMoE(moe, topo, comm, mode)
        with torch.no_grad():
            layer.experts.gate_up_proj.normal_(0, 0.05)
            layer.experts.down_proj.normal_(0, 0.05)
        for t in (1, 16, 64):
            x = torch.randn(t, cfg.hidden_size)
            with torch.no_grad():
                for _ in range(10):
                    layer(x)
                comm.barrier()
                c0, w0 = comm.comm_seconds, time.perf_counter()
                for _ in range(iters):
                    layer(x)
                layer_comm = (comm.comm_seconds - c0) / iters
                layer_wall = (time.perf_counter() - w0) / iters
                comm.barrier()
                c0 = comm.comm_seconds
                if mode == "allreduce":
                    buf = torch.randn(t, cfg.hidden_size)
                    for _ in range(iters):
                        comm.all_reduce(buf)
                else:  # the layer's calls: counts gather, 3 all-to-alls, the output gather
                    share = t // 2 + (t % 2 if rank == 1 else 0)
                    k = cfg.num_experts_per_tok
                    counts = layer.last_counts
                    send = counts[rank].tolist()
                    recv = counts[:, rank].tolist()
                    for _ in range(iters):
                        comm.all_gather(torch.zeros(1, 2, dtype=torch.int32))
                        comm.all_to_all(torch.randn(sum(send), cfg.hidden_size), send, recv)
                        comm.all_to_all(torch.randn(sum(send), 2), send, recv)
                        comm.all_to_all(torch.randn(sum(recv), cfg.hidden_size), recv, send)
                        comm.all_gather(torch.randn(max(share, t - t // 2), cfg.hidden_size))
                    del k
                raw = (comm.comm_seconds - c0) / iters
            rows.append({"mode": mode, "tokens": t, "layer_ms": round(1000 * layer_wall, 3),
                         "layer_comm_ms": round(1000 * layer_comm, 3), "raw_comm_ms": round(1000 * raw, 3),
                         "ratio": round(layer_comm / raw, 2) if raw else None})
    if rank == 0:
        out.put(rows)
    comm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-glm-moe")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    from ep.comm import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, args.model, args.iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
