"""The `ray` launcher: one placement-group bundle per rank, one Ray actor per worker rank.

Rank 0 runs in the calling process (it owns the engine and the server); its bundle is pinned to
this process's node, so a placement strategy places the other ranks relative to it. Each worker
actor joins the process group at rank 0's address and then serves commands until SHUTDOWN; the
actor call that does so stays pending for the life of the rank, and a watchdog thread waits on
those calls: a call that ends (the actor died, or its rank failed) marks the group dead.
"""
from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, replace

import torch

from ep.channel import load_shard_model
from ep.comm import Communicator
from ep.worker import serve_rank
from serving.deployment import GroupConfig, GroupStartError

STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True, kw_only=True, slots=True)
class RayOptions:
    address: str | None = None        # a running cluster; None: RAY_ADDRESS, else a local Ray
    placement_strategy: str = "PACK"
    temp_dir: str | None = None       # a local Ray's logs and temp files (Ray's default /tmp/ray)
    usage_stats: bool = False
    start_timeout_s: float = 120.0    # placing the bundles and starting the actors

    def __post_init__(self) -> None:
        if self.placement_strategy not in STRATEGIES:
            raise ValueError(f"placement strategy {self.placement_strategy!r}: expected one of {', '.join(STRATEGIES)}")


def actor_device(cfg: GroupConfig) -> torch.device:
    """A worker actor's device: on CUDA it sees only its bundle's GPU (Ray sets
    CUDA_VISIBLE_DEVICES), so cuda:0; else the CPU."""
    return torch.device("cuda", 0) if torch.device(cfg.device).type == "cuda" else torch.device("cpu")


class RankActor:
    """A worker rank inside a Ray actor. A warm standby is asked to `preload` its rank's shard
    (unjoined) right away; its later `serve` (Ray runs an actor's calls in order) then only joins."""

    def __init__(self) -> None:
        self.preloaded: tuple[int, Communicator, object] | None = None

    def preload(self, rank: int, cfg: GroupConfig) -> None:
        comm = Communicator(rank=rank, world_size=cfg.ep, init_method=None, timeout_s=cfg.timeout_s,
                            device=actor_device(cfg))
        self.preloaded = rank, comm, load_shard_model(cfg.model_dir, cfg.dtype, comm, cfg.moe_a2a)

    def info(self) -> dict:
        import ray
        return {"pid": os.getpid(), "host": socket.gethostname(), "node": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def serve(self, rank: int, init_method: str, cfg: GroupConfig, generation: int = 0) -> tuple[int, str]:
        if self.preloaded is not None and self.preloaded[0] == rank:
            _, comm, model = self.preloaded
            comm.join(init_method)
        else:
            comm, model = Communicator(rank=rank, world_size=cfg.ep, init_method=init_method,
                                       timeout_s=cfg.timeout_s, device=actor_device(cfg)), None
        return serve_rank(comm, cfg.model_dir, cfg.dtype, cfg.moe_a2a, cfg.kv_cache_tokens,
                          model=model, generation=generation, gpu_memory_utilization=cfg.gpu_memory_utilization)


def connect(opts: RayOptions, min_cpus: int) -> bool:
    """Join `opts.address` (or RAY_ADDRESS), else start a local Ray; True when this call started
    or joined Ray (and so should shut it down), False when the process was already connected."""
    import ray
    if ray.is_initialized():
        return False
    if not opts.usage_stats:
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # read by Ray itself, before it starts
    address = opts.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False,
                 _temp_dir=opts.temp_dir, log_to_driver=True)
    return True


def _driver_node() -> tuple[str, str, str]:
    """(node id, ip, resource that pins a bundle to this node)."""
    import ray
    node_id = ray.get_runtime_context().get_node_id()
    ip = ray.util.get_node_ip_address()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            if "node:__internal_head__" in node["Resources"]:
                return node_id, ip, "node:__internal_head__"
            return node_id, ip, f"node:{node['NodeManagerAddress']}"
    return node_id, ip, f"node:{ip}"


class RayGroup:
    """Worker actors in a placement group plus rank 0's communicator; `stop` then `start` gives a
    fresh group (new actors, new port) in the same placement group."""

    kind = "ray"

    def __init__(self, cfg: GroupConfig, opts: RayOptions, worker_overrides: dict[int, dict] | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group
        if cfg.ep < 2:
            raise ValueError(f"a Ray group needs ep >= 2, got {cfg.ep}")
        self.cfg, self.opts = cfg, opts
        self.overrides = worker_overrides or {}
        self.generation = 0
        self.standby: dict[int, object] = {}   # rank -> an actor preloading that rank's shard
        self.owns_ray = connect(opts, cfg.ep)
        self.comm: Communicator | None = None
        self._rank0_comm: Communicator | None = None   # rank 0's, kept across restarts (its shard stays loaded)
        self.actors: list = []
        self.calls: list = []
        self.infos: list[dict] = []
        self._dead: str | None = None
        self._stopping = False
        self.driver_node, self.driver_ip, pin = _driver_node()
        self.gpu = torch.device(cfg.device).type == "cuda"   # one GPU per bundle, chosen by --device
        # A standby shares its rank's bundle without a CPU of its own; on GPU it would need a second
        # device for its shard, so GPU groups start cold.
        self.warm_standby = cfg.warm_standby and not self.gpu
        unit = {"GPU": 1.0, "CPU": 1.0} if self.gpu else {"CPU": 1.0}
        bundles = [{**unit, pin: 0.001}] + [dict(unit) for _ in range(cfg.ep - 1)]
        self.pg = placement_group(bundles, strategy=opts.placement_strategy, name="")
        ready, _ = ray.wait([self.pg.ready()], timeout=opts.start_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            self._disconnect()
            raise GroupStartError(f"Ray could not place {cfg.ep} bundles of {unit} with strategy "
                               f"{opts.placement_strategy} within {opts.start_timeout_s:.0f} s "
                               f"(cluster resources: {ray.cluster_resources()})")
        try:
            self.start()
        except BaseException:
            self.stop(timeout_s=0)
            self.close()
            raise

    def start(self) -> None:
        import ray
        self._dead, self._stopping = None, False
        self.generation += 1
        standby, self.standby = self.standby, {}
        self.actors = [standby.pop(rank, None) or self._new_actor(rank, 1) for rank in range(1, self.cfg.ep)]
        try:
            self.infos = ray.get([a.info.remote() for a in self.actors], timeout=self.opts.start_timeout_s)
        except Exception as exc:
            raise GroupStartError(f"Ray could not start the worker ranks: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        if self._rank0_comm is None:
            self._rank0_comm = Communicator(rank=0, world_size=self.cfg.ep, init_method=None,
                                            timeout_s=self.cfg.timeout_s, device=self.cfg.device)
        init_method = self._rank0_comm.listen(self.driver_ip)
        self.calls = [actor.serve.remote(rank, init_method, self._rank_cfg(rank), self.generation)
                      for rank, actor in enumerate(self.actors, 1)]
        threading.Thread(target=self._watch, args=(self.calls,), name="metrale-ray-watchdog",
                         daemon=True).start()
        self._rank0_comm.join(init_method)
        self.comm = self._rank0_comm

    def ready(self) -> None:
        """The group serves: start the standby actors the next restart takes, each preloading its shard."""
        if self.warm_standby:
            for rank in range(1, self.cfg.ep):
                if rank not in self.standby:
                    self.standby[rank] = self._new_actor(rank, 0)
                    self.standby[rank].preload.remote(rank, self._rank_cfg(rank))

    def _new_actor(self, rank: int, num_cpus: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return ray.remote(RankActor).options(
            num_cpus=num_cpus, num_gpus=1 if self.gpu else 0, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                 placement_group_bundle_index=rank)).remote()

    def _rank_cfg(self, rank: int) -> GroupConfig:
        extra = self.overrides.get(rank, {})
        return replace(self.cfg, model_dir=extra.get("model_dir", self.cfg.model_dir),
                       dtype=extra.get("dtype", self.cfg.dtype), warm_standby=False)

    def _watch(self, calls: list) -> None:
        """Wait for the first worker call to end; unless the group is being stopped, that rank died."""
        import ray
        try:
            done, _ = ray.wait(calls, num_returns=1, timeout=None)
        except Exception:  # Ray shut down under the watchdog
            return
        if not self._stopping and self.calls is calls:
            self._dead = self._describe(calls.index(done[0]) + 1, done[0])

    def _describe(self, rank: int, call) -> str:
        import ray
        try:
            code, message = ray.get(call, timeout=5)
            return message or f"rank {rank} left the group (exit code {code})"
        except Exception as exc:  # RayActorError: the process died
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"rank {rank} died ({type(exc).__name__}: {first})"

    @property
    def pids(self) -> list[int]:
        return [info["pid"] for info in self.infos]

    def nodes(self) -> list[str]:
        return [self.driver_node] + [info["node"] for info in self.infos]

    def dead(self) -> str | None:
        return self._dead

    def failure_report(self, wait_s: float = 3.0) -> str:
        """What the workers said about a failure: the message of every call that has ended."""
        import ray
        if not self.calls:
            return ""
        done, _ = ray.wait(self.calls, num_returns=len(self.calls), timeout=wait_s)
        return "; ".join(self._describe(self.calls.index(c) + 1, c) for c in done)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for the workers to leave (after SHUTDOWN), then kill the actors."""
        import ray
        self._stopping = True
        if self.calls and timeout_s > 0:
            ray.wait(self.calls, num_returns=len(self.calls), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self.calls = [], []
        if self.comm is not None:
            self.comm.close()
            self.comm = None

    def close(self) -> None:
        """End the standbys, release the placement group and leave Ray (shutting down a Ray this
        group started)."""
        import ray
        if ray.is_initialized():
            for actor in self.standby.values():
                ray.kill(actor, no_restart=True)
            self.standby = {}
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:  # already gone with a dead cluster
                pass
        self._disconnect()

    def _disconnect(self) -> None:
        import ray
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
            self.owns_ray = False
