"""The `mp` launcher: rank 0 in the calling process, workers spawned with multiprocessing.

The rendezvous port is chosen free at run time on 127.0.0.1. Workers are daemons: they end with
the driver; a worker that dies is noticed by rank 0's next collective (within the timeout).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import sys
from dataclasses import dataclass

from ep.comm import CommError, Communicator, free_port


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupConfig:
    model_dir: str
    dtype: str
    ep: int
    moe_a2a: str = "alltoall"
    kv_cache_tokens: int = 32768
    timeout_s: float = 60.0


def worker_main(rank: int, init_method: str, cfg: GroupConfig, model_dir_override: str | None = None,
                dtype_override: str | None = None) -> None:
    """A spawned worker: join the group, load its shard, agree on the handshake, serve commands."""
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stderr)
    from ep.shard import gather_rank_info, gather_weight_bytes, load_shard, worker_handshake, worker_loop
    model_dir = model_dir_override or cfg.model_dir
    dtype = dtype_override or cfg.dtype
    comm = Communicator(rank=rank, world_size=cfg.ep, init_method=init_method, timeout_s=cfg.timeout_s)
    code = 0
    try:
        worker_handshake(comm, model_dir, dtype)
        runner = load_shard(model_dir, dtype, comm, cfg.moe_a2a, cfg.kv_cache_tokens)
        gather_weight_bytes(comm, runner)
        gather_rank_info(comm)
        worker_loop(runner, comm)
    except CommError as exc:
        print(f"metrale worker rank {rank}: {exc}", file=sys.stderr, flush=True)
        code = 3
    except Exception as exc:
        print(f"metrale worker rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 2
    finally:
        comm.close()
    sys.exit(code)


class MPGroup:
    """Spawned workers plus rank 0's communicator."""

    def __init__(self, cfg: GroupConfig, worker_overrides: dict[int, dict] | None = None) -> None:
        if cfg.ep < 2:
            raise ValueError(f"an mp group needs ep >= 2, got {cfg.ep}")
        self.cfg = cfg
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = []
        for rank in range(1, cfg.ep):
            extra = (worker_overrides or {}).get(rank, {})
            p = ctx.Process(target=worker_main, args=(rank, init_method, cfg, extra.get("model_dir"),
                                                      extra.get("dtype")), daemon=True, name=f"metrale-rank{rank}")
            p.start()
            self.procs.append(p)
        self.comm = Communicator(rank=0, world_size=cfg.ep, init_method=init_method, timeout_s=cfg.timeout_s)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for the workers to leave (after SHUTDOWN), then kill the rest."""
        for p in self.procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.comm.close()
