"""The `mp` launcher: rank 0 in the calling process, workers spawned with multiprocessing.

The rendezvous port is chosen free at run time on 127.0.0.1. Workers are daemons: they end with
the driver; a worker that dies is noticed by rank 0's next collective (within the timeout), or
earlier by `dead()`, which the deployment polls (serving.deployment). `MPGroup` itself is a
launcher: `LLM(..., ep=2, launcher=MPGroup)`.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import sys
import time

import torch

from ep.comm import Communicator, free_port
from ep.worker import serve_rank
from runtime.device import check_local_gpus, rank_device
from serving.deployment import GroupConfig

__all__ = ["GroupConfig", "MPGroup"]


def worker_main(rank: int, init_method: str, cfg: GroupConfig, model_dir_override: str | None = None,
                dtype_override: str | None = None) -> None:
    """A spawned worker: join the group, load its shard, agree on the handshake, serve commands."""
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stderr)
    comm = Communicator(rank=rank, world_size=cfg.ep, init_method=init_method, timeout_s=cfg.timeout_s,
                        device=rank_device(torch.device(cfg.device), rank))
    code, message = serve_rank(comm, model_dir_override or cfg.model_dir, dtype_override or cfg.dtype,
                               cfg.moe_a2a, cfg.kv_cache_tokens, cfg.gpu_memory_utilization)
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.exit(code)


class MPGroup:
    """Spawned workers plus rank 0's communicator; `start` again after `stop` for a fresh group."""

    kind = "mp"

    def __init__(self, cfg: GroupConfig, worker_overrides: dict[int, dict] | None = None) -> None:
        if cfg.ep < 2:
            raise ValueError(f"an mp group needs ep >= 2, got {cfg.ep}")
        check_local_gpus(torch.device(cfg.device), cfg.ep)   # one GPU per rank, all on this host
        self.cfg = cfg
        self.overrides = worker_overrides or {}
        self.procs: list = []
        self.comm: Communicator | None = None
        self.start()

    def start(self) -> None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = []
        for rank in range(1, self.cfg.ep):
            extra = self.overrides.get(rank, {})
            p = ctx.Process(target=worker_main, args=(rank, init_method, self.cfg, extra.get("model_dir"),
                                                      extra.get("dtype")), daemon=True, name=f"metrale-rank{rank}")
            p.start()
            self.procs.append(p)
        self.comm = Communicator(rank=0, world_size=self.cfg.ep, init_method=init_method,
                                 timeout_s=self.cfg.timeout_s, device=self.cfg.device)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def nodes(self) -> list[str]:
        return [socket.gethostname()] * self.cfg.ep

    def dead(self) -> str | None:
        """The first worker that has exited, as words; None while all run."""
        for rank, p in enumerate(self.procs, 1):
            if not p.is_alive():
                return f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def failure_report(self, wait_s: float = 1.0) -> str:
        """The dead worker, as words. A collective can fail a moment before the dead process is
        reaped, so this waits up to `wait_s` for one to show up."""
        deadline = time.monotonic() + wait_s
        while True:
            why = self.dead()
            if why is not None or time.monotonic() >= deadline:
                return why or ""
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for the workers to leave (after SHUTDOWN), then kill the rest."""
        for p in self.procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self.comm is not None:
            self.comm.close()
            self.comm = None

    def close(self) -> None:
        """Nothing outlives the workers of an mp group."""
