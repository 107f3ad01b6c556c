"""EP MoE dispatch and combine on 2 gloo ranks against hand-computed routing."""
from __future__ import annotations

import multiprocessing as mp
import traceback

import torch

from ep.comm import free_port

H, E = 8, 4


def make_moe(dtype=torch.float64):
    from runtime.model.config import ModelConfig
    from runtime.model.layers import MoE
    cfg = ModelConfig(vocab_size=16, hidden_size=H, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=4, moe_intermediate_size=6, num_experts_per_tok=1,
                      n_routed_experts=E, n_shared_experts=1)
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[:, :E] = 10 * torch.eye(E)   # a token that is one-hot on dim e picks expert e
        for p in (moe.experts.gate_up_proj, moe.experts.down_proj):
            p.normal_(0, 0.3)
    return cfg, moe.to(dtype)


def tokens_for(experts: list[int]) -> torch.Tensor:
    x = 0.01 * torch.arange(len(experts) * H, dtype=torch.float64).view(len(experts), H)
    for i, e in enumerate(experts):
        x[i, e] += 1.0
    return x


def _rank_main(rank: int, port: int, results, corrupt: bool) -> None:
    try:
        from ep.comm import Communicator
        from ep.parallel import EPMoE
        from ep.topology import EPTopology
        comm = Communicator(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=15, device="cpu")
        cfg, moe = make_moe()
        topo = EPTopology.of(cfg, rank, 2)
        ep = EPMoE(moe, topo, comm, "alltoall").double()
        with torch.no_grad():
            mine = topo.expert_range()
            ep.experts.gate_up_proj.copy_(moe.experts.gate_up_proj[mine.start:mine.stop])
            ep.experts.down_proj.copy_(moe.experts.down_proj[mine.start:mine.stop])
        if corrupt and rank == 1:
            real = comm.all_gather
            comm.all_gather = lambda t: real(t) + 1   # a stale or garbled count exchange
        out = {}
        for name, experts in (("six", [0, 1, 2, 3, 0, 1]), ("one", [0])):
            x = tokens_for(experts)
            with torch.no_grad():
                got = ep(x)
                want = moe(x)
            out[name] = (ep.last_counts.tolist(), float((got - want).abs().max()))
        for mode in ("allreduce",):
            ar = EPMoE(moe, topo, comm, mode).double()
            ar.experts.load_state_dict(ep.experts.state_dict())
            x = tokens_for([3, 2, 1, 0, 0])
            with torch.no_grad():
                out[mode] = float((ar(x) - moe(x)).abs().max())
        results.put((rank, "ok", out))
        comm.close()
    except Exception as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-300:]}"))


def run_pair(corrupt: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results, corrupt)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, status, payload = results.get(timeout=120)
        got[rank] = (status, payload)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return got


def test_dispatch_counts_and_combine_match_single_rank():
    got = run_pair()
    for rank in (0, 1):
        status, out = got[rank]
        assert status == "ok", out
        # Six tokens routed to experts [0,1,2,3,0,1]; rank 0 owns experts 0,1 and rank 1 owns 2,3.
        # Rank 0 routes tokens 0..2 (experts 0,1,2): 2 to itself, 1 to rank 1. Rank 1 routes
        # tokens 3..5 (experts 3,0,1): 2 to rank 0, 1 to itself.
        assert out["six"][0] == [[2, 1], [2, 1]]
        assert out["six"][1] < 1e-12
        # One token: rank 0's share is empty and it still takes part; the token goes to rank 0.
        assert out["one"][0] == [[0, 0], [1, 0]]
        assert out["one"][1] < 1e-12
        assert out["allreduce"] < 1e-12


def test_count_mismatch_is_detected():
    got = run_pair(corrupt=True)
    status, msg = got[1]
    assert status == "error" and "counts disagree" in msg
    assert got[0][0] == "error"  # the peer fails too (broken collective), it does not hang
