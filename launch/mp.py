"""The `mp` launcher: rank 0 in the calling process, workers spawned with multiprocessing.

The rendezvous port is chosen free at run time on 127.0.0.1, a new one for every group. Workers
are daemons: they end with the driver; a worker that dies is noticed by rank 0's next collective
(within the timeout), or earlier by `dead()`, which the deployment polls (serving.deployment).
`MPGroup` itself is a launcher: `LLM(..., ep=2, launcher=MPGroup)`.

Warm standby: besides the running workers, the group keeps one spawned process per worker rank
that has done its imports and loaded its rank's shard, and waits on a pipe for the address and
generation of the group to join. A restart hands each rank to its standby (no spawn, no imports,
no shard loading on the critical path) and spawns the next standbys in the background. Rank 0's
communicator is one object for the life of the group, so its shard is kept too
(serving.deployment reuses it). A rank from an older group (one SIGSTOPped past the timeout and
then continued) never reaches the new group: it only knows the old address, is killed on
`stop`, and the handshake checks the generation.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection

import torch

from ep.channel import load_shard_model
from ep.comm import START_TIMEOUT_S, Communicator
from ep.worker import ignore_interrupts, serve_rank
from runtime.platform.device import check_local_gpus, rank_device
from serving.deployment import GroupConfig, GroupStartError

__all__ = ["GroupConfig", "MPGroup"]


def _rank_settings(cfg: GroupConfig, overrides: dict) -> tuple[str, str]:
    return overrides.get("model_dir") or cfg.model_dir, overrides.get("dtype") or cfg.dtype


def worker_main(rank: int, cfg: GroupConfig, overrides: dict, conn: Connection) -> None:
    """A spawned worker: unless its group's address is waiting already (a cold start: join at
    once, load after the handshake), load its shard unjoined (a warm standby), then wait for the
    group's address and generation on `conn`, join, agree on the handshake and serve commands.
    The pipe closing first (the launcher went away, or retired this standby) ends it quietly.
    Ctrl-C is rank 0's to handle (ep.worker.ignore_interrupts)."""
    ignore_interrupts()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stderr)
    model_dir, dtype = _rank_settings(cfg, overrides)
    comm = Communicator(rank=rank, world_size=cfg.ep, init_method=None, timeout_s=cfg.timeout_s,
                        device=rank_device(torch.device(cfg.device), rank))
    model = failure = None
    if not conn.poll():
        try:
            model = load_shard_model(model_dir, dtype, comm, cfg.moe_a2a)
        except Exception as exc:   # reported once this process is asked to join; the group start fails then
            failure = f"metrale worker rank {rank}: {type(exc).__name__}: {exc}"
    try:
        init_method, generation = conn.recv()
    except (EOFError, OSError):
        sys.exit(0)
    if failure is not None:
        print(failure, file=sys.stderr, flush=True)
        sys.exit(2)
    conn.send("joining")
    comm.join(init_method)
    code, message = serve_rank(comm, model_dir, dtype, cfg.moe_a2a, cfg.kv_cache_tokens,
                               model=model, generation=generation, gpu_memory_utilization=cfg.gpu_memory_utilization)
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit, as the torchrun entry does: gloo's still-joinable threads can abort interpreter
    # teardown (SIGABRT) after a clean shutdown.
    os._exit(code)


def _script_hint() -> str:
    """When rank 0 runs a script: the rule a spawned rank's start needs (it imports the script
    again, so a group started at the script's top level would start in the rank too)."""
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) is None or getattr(main, "__spec__", None) is not None:
        return ""
    return (f" (a script that starts an mp group must do so under `if __name__ == \"__main__\":`: each spawned "
            f"rank imports {os.path.basename(main.__file__)} again)")


@dataclass(slots=True)
class _Proc:
    """A spawned worker process and the pipe that tells it which group to join."""
    process: mp.Process
    conn: Connection


class MPGroup:
    """Spawned workers plus rank 0's communicator; `start` again after `stop` for a fresh group."""

    kind = "mp"

    def __init__(self, cfg: GroupConfig, worker_overrides: dict[int, dict] | None = None) -> None:
        if cfg.ep < 2:
            raise ValueError(f"an mp group needs ep >= 2, got {cfg.ep}")
        check_local_gpus(torch.device(cfg.device), cfg.ep)   # one GPU per rank, all on this host
        self.cfg = cfg
        self.overrides = worker_overrides or {}
        self.generation = 0
        self.workers: list[_Proc] = []
        self.standby: dict[int, _Proc] = {}
        self._comm = Communicator(rank=0, world_size=cfg.ep, init_method=None, timeout_s=cfg.timeout_s,
                                  device=cfg.device)
        self.comm: Communicator | None = None
        self.start()

    def _spawn(self, rank: int) -> _Proc:
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=worker_main, args=(rank, self.cfg, self.overrides.get(rank, {}), theirs),
                        daemon=True, name=f"metrale-rank{rank}")
        # The child starts with SIGINT blocked (a signal mask survives fork and exec), so a Ctrl-C
        # while it imports cannot raise in it; worker_main then ignores SIGINT and unblocks it.
        # multiprocessing's resource tracker, started by the first spawn, unblocks SIGINT in this
        # thread after starting itself: start it before blocking.
        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        theirs.close()
        return _Proc(p, ours)

    def start(self) -> None:
        """A fresh group: the next generation at a new address, each rank from its standby when
        one is alive (else spawned cold)."""
        self.generation += 1
        init_method = self._comm.listen("127.0.0.1")
        self.workers = []
        for rank in range(1, self.cfg.ep):
            proc = self.standby.pop(rank, None)
            if proc is None or not proc.process.is_alive():
                proc = self._spawn(rank)
            proc.conn.send((init_method, self.generation))
            self.workers.append(proc)
        self._wait_joining()
        self._comm.join(init_method)
        self.comm = self._comm

    def ready(self) -> None:
        """The group serves: spawn the standbys the next restart takes (after the start, so their
        imports and loading do not compete with it)."""
        if self.cfg.warm_standby:
            for rank in range(1, self.cfg.ep):
                if rank not in self.standby or not self.standby[rank].process.is_alive():
                    self.standby[rank] = self._spawn(rank)

    def _wait_joining(self) -> None:
        """Wait until every worker is about to join (a cold one has imported everything by then);
        one that exits first fails the start at once instead of leaving rank 0 in the rendezvous."""
        limit = max(START_TIMEOUT_S, self.cfg.timeout_s)
        deadline = time.monotonic() + limit
        for rank, w in enumerate(self.workers, 1):
            try:
                while not w.conn.poll(0.05):
                    if not w.process.is_alive():
                        raise EOFError
                    if time.monotonic() > deadline:
                        raise GroupStartError(f"rank {rank} (pid {w.process.pid}) did not reach the rendezvous "
                                              f"within {limit:.0f} s")
                w.conn.recv()
            except (EOFError, OSError):
                w.process.join(timeout=1)
                raise GroupStartError(f"rank {rank} (pid {w.process.pid}) exited with code {w.process.exitcode} "
                                      f"before joining the group{_script_hint()}") from None

    @property
    def procs(self) -> list[mp.Process]:
        return [w.process for w in self.workers]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def standby_pids(self) -> list[int]:
        return [w.process.pid for w in self.standby.values()]

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
        """Wait up to `timeout_s` for the workers to leave (after SHUTDOWN), then kill the rest
        (a stopped process too: SIGKILL ends it). The standbys stay for the next `start`."""
        for w in self.workers:
            w.process.join(timeout=timeout_s)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=5)
            w.conn.close()
        if self.comm is not None:
            self.comm.close()
            self.comm = None

    def close(self) -> None:
        """End the standbys: they hold nothing but a loaded shard and have joined no group."""
        for w in self.standby.values():
            w.conn.close()
            w.process.kill()
            w.process.join(timeout=5)
        self.standby = {}
