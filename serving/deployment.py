"""The deployment of one model: its ranks, runner and drafter, and their supervision.

A `Deployment` owns everything below the engine that a restart must rebuild: starting the worker
ranks (through a launcher handed in from above: `launch.mp.MPGroup`, `launch.ray_group.RayGroup`,
or an already joined communicator under torchrun), the handshake, loading rank 0's shard, the
runner, and the proposer. `step(engine)` is the one supervised step the offline `LLM`, the server
and the benchmark all run: a rank that dies (its launcher says so, a collective fails or times
out) makes it stop every rank, start a fresh group, reload the weights and hand the engine the new
runner and proposer; the engine queues every unfinished request again from its prompt plus the
tokens it has committed, so nothing is lost. After `max_restarts` it raises `GroupFailed`.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from engine.engine import Engine
from ep.channel import (CommandRefused, driver_handshake, gather_rank_info, gather_weight_bytes, load_shard,
                        load_shard_model)
from ep.comm import CommError, Communicator
from ep.driver import DriverRunner, ShardedMTPProposer
from ep.dp import row_budget
from ep.overlap import NOT_EAGER, NOT_STATIC
from ep.parallel import dp_mode
from ep.protocol import MAX_SLOT
from ep.local_drafter import load_local_drafter
from runtime.model.causal_lm import CausalLM
from runtime.executor.attention import SeqChunk
from runtime.platform.heap import freeze_heap, thaw_heap
from runtime.executor.runner import ModelRunner
from runtime.executor.settings import StepSettings
from engine.sequence import Sequence
from runtime.executor.static_step import MIN_KEYS, ROW_BUCKETS, StaticShape, bucket
from runtime.model.weights import load_model
from speculative.ladder import ladder_drafts_from_steps
from speculative.mtp import MTPProposer
from speculative.ngram import NgramProposer
from speculative.proposer import DraftProposer
from speculative.settings import SpecSettings

log = logging.getLogger("metrale.deployment")

# The sequence id of the compile warm-up's scratch rows (`Deployment.warm_up`), the last one the EP
# wire carries: the engine numbers requests from 0, and the warm-up frees it before its step.
WARMUP_SEQ = MAX_SLOT - 1

DEFAULT_MAX_RESTARTS = 3


class GroupStartError(RuntimeError):
    """An EP group could not start: no room for its ranks, or a rank failed while joining."""


DEFAULT_KV_BLOCK = 16   # tokens per KV block of every rank (runtime.executor.kv_cache)


class GroupFailed(RuntimeError):
    """The group died more often than `--max-restarts` allows."""


class WrongThread(RuntimeError):
    """Torch work asked of a thread other than the one that built the deployment."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupConfig:
    """What a launcher needs to start the worker ranks of one EP group."""
    model_dir: str
    dtype: str
    ep: int
    moe_a2a: str = "auto"
    kv_cache_tokens: int = 32768
    timeout_s: float = 60.0
    warm_standby: bool = True   # keep a spare per worker rank, its shard loaded, for the next restart
    device: str = "cpu"    # rank 0's device; on CUDA each further rank takes its own local GPU
    gpu_memory_utilization: float | None = None


class WorkerGroup(Protocol):
    """The worker ranks of one EP group as a launcher started them; `comm` is rank 0's."""
    comm: Communicator | None

    def start(self) -> None: ...
    def nodes(self) -> list[str]: ...
    def ready(self) -> None: ...   # the group serves: prepare what a restart needs (warm standbys)
    def dead(self) -> str | None: ...
    def failure_report(self) -> str: ...
    def stop(self, timeout_s: float = 10.0) -> None: ...
    def close(self) -> None: ...


Launcher = Callable[[GroupConfig], WorkerGroup]


@dataclass(frozen=True, kw_only=True, slots=True)
class DeploymentConfig:
    model_dir: Path
    dtype: str = "float32"
    ep: int = 1
    moe_a2a: str = "auto"
    kv_cache_tokens: int = 32768
    ep_timeout_s: float = 60.0
    max_restarts: int = DEFAULT_MAX_RESTARTS
    enforce_eager: bool = False   # no torch.compile of the target step (on any rank)
    batch_invariant: bool | None = None   # batch-invariant kernels (runtime.ops.batch_invariant); None: float64 only
    warm_standby: bool = True    # spare worker ranks with their shards loaded (only when restarts are allowed)
    device: str = "cpu"                   # a resolved device (runtime.platform.device.resolve_device): cpu, cuda:N
    gpu_memory_utilization: float | None = None   # CUDA only: KV cache from free GPU memory
    kv_block_size: int = 16   # tokens per KV block; an EP group's ranks keep the default (checked in Deployment)
    # Decode/verify steps padded to buckets (runtime.executor.static_step), captured as CUDA graphs on CUDA
    # unless enforce_eager. None: on for CUDA, off on the CPU (there it only adds padding).
    static_steps: bool | None = None
    # EPLB (ep.placement): redundant expert slots (None: off) and the forwards between re-placements.
    eplb_redundant_experts: int | None = None
    eplb_interval_steps: int | None = None
    # The engine's running-sequence limit: a cache sized from free memory leaves their layer states room.
    max_num_seqs: int = 64
    # Data-parallel attention (ep.dp, docs/design.md §4.3): each rank attends over its own sequences
    # and the routed experts exchange rows (padded in decode to `ep.dp.row_budget` rows a rank).
    dp_attention: bool = False
    attention_tp: int = 1   # with dp_attention: ranks of an attention group, which split its heads
    # With dp_attention: each rank's rows as two micro-batches, one's exchange in flight while the
    # other computes (ep.overlap); eager steps only.
    two_batch_overlap: bool = False

    @property
    def shard_mode(self) -> str:
        """What every rank's shard is loaded and parallelised by: the MoE dispatch mode, or the
        data-parallel layout."""
        return dp_mode(self.attention_tp) if self.dp_attention else self.moe_a2a

    def step_settings(self, rows_per_seq: int = 1) -> StepSettings:
        """The settings rank 0's runner resolves against its model (runtime.executor.settings):
        compiled unless `enforce_eager`; static steps by default on CUDA for a compiled step, and
        captured there where the step can be (None: the resolution decides); a cache sized from
        free memory leaves room for `max_num_seqs` sequences' layer states at `rows_per_seq`
        rows a step (`Deployment.rows_per_seq`)."""
        return StepSettings(kv_cache_tokens=self.kv_cache_tokens, block_size=self.kv_block_size,
                            compiled=not self.enforce_eager, batch_invariant=self.batch_invariant,
                            gpu_memory_utilization=self.gpu_memory_utilization, max_num_seqs=self.max_num_seqs,
                            max_rows_per_seq=rows_per_seq, static_steps=self.static_steps,
                            cuda_graphs=None if not self.enforce_eager else False)

    def __post_init__(self) -> None:
        if torch.device(self.device).type != "cuda" and self.gpu_memory_utilization is not None:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization} sizes the KV cache from free "
                             f"GPU memory; on {self.device} size it with --kv-cache-tokens")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization} must be in (0, 1]")
        if self.ep < 1:
            raise ValueError(f"ep={self.ep} must be at least 1")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be at least 0")
        if self.moe_a2a not in ("auto", "alltoall", "allreduce"):
            raise ValueError(f"moe_a2a={self.moe_a2a!r}: expected auto, alltoall or allreduce")
        r, s = self.eplb_redundant_experts, self.eplb_interval_steps
        if r is not None and r < 0:
            raise ValueError(f"--eplb-redundant-experts {r}: must be at least 0")
        if r is not None and self.ep < 2:
            raise ValueError(f"--eplb-redundant-experts {r}: balances experts over EP ranks; needs --ep 2 or more")
        if s is not None and r is None:
            raise ValueError(f"--eplb-interval-steps {s}: needs --eplb-redundant-experts (0 for no copies)")
        if s is not None and s < 1:
            raise ValueError(f"--eplb-interval-steps {s}: must be at least 1")
        if self.dp_attention and self.ep < 2:
            raise ValueError("--dp-attention splits sequences over EP ranks; it needs --ep 2 or more")
        if self.attention_tp != 1 and not self.dp_attention:
            raise ValueError(f"--attention-tp {self.attention_tp} splits attention inside --dp-attention's groups; "
                             "add --dp-attention")
        if self.dp_attention and (self.attention_tp < 1 or self.ep % self.attention_tp
                                  or self.attention_tp & (self.attention_tp - 1)):
            raise ValueError(f"--attention-tp {self.attention_tp}: a power of two that divides --ep {self.ep}")
        if self.dp_attention and self.moe_a2a != "auto":
            raise ValueError(f"--dp-attention exchanges the routed experts' rows itself; drop --moe-a2a {self.moe_a2a}")
        if self.two_batch_overlap:
            self._check_two_batch()

    def _check_two_batch(self) -> None:
        """`--two-batch-overlap` refused in one line where it cannot overlap (ep.overlap.choose_dp_step
        checks the resolved step again on every rank)."""
        if not self.dp_attention:
            raise ValueError("--two-batch-overlap splits each rank's rows of --dp-attention into two micro-batches; "
                             "add --dp-attention (the all-reduce layout has no exchange to overlap)")
        if not self.enforce_eager and self.dtype != "float64":   # float64 runs eager (runtime.executor.settings)
            raise ValueError(NOT_EAGER)
        if self.static_steps:
            raise ValueError(NOT_STATIC)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    done: list[Sequence]     # sequences that got tokens or finished
    recovered: bool = False  # the group was restarted: every request may have moved on


def local_rank_info(rank: int) -> dict:
    host = socket.gethostname()
    return {"rank": rank, "pid": os.getpid(), "host": host, "node": host}


class Deployment:
    """One model's ranks, runner and proposer; see the module docstring."""

    def __init__(self, config: DeploymentConfig, spec: SpecSettings, launcher: Launcher | None = None,
                 comm: Communicator | None = None) -> None:
        """`ep` > 1 needs `launcher` (it starts ranks 1..ep-1) or `comm` (rank 0 of a group
        joined already, e.g. by torchrun; then there are no restarts)."""
        if not config.model_dir.is_dir():
            raise FileNotFoundError(f"model folder {str(config.model_dir)!r} does not exist")
        if config.eplb_redundant_experts is not None:
            from ep.eplb import check_placeable
            from runtime.model.config import load_config
            check_placeable(load_config(config.model_dir).n_routed_experts, config.eplb_redundant_experts, config.ep)
        if config.ep > 1 and launcher is None and comm is None:
            raise ValueError(f"ep={config.ep} needs a launcher (launch.mp.MPGroup, launch.ray_group.RayGroup) "
                             "or a joined communicator")
        self.config = config
        self.spec = spec
        self.launcher = launcher
        # The thread that loads, compiles and steps (serving.async_engine): one OpenMP team.
        self.thread_id = threading.get_ident()
        self._warned_thread = False
        self.group: WorkerGroup | None = None
        self.comm: Communicator | None = comm
        self.rank_info: list[dict] = [local_rank_info(0)]
        self.rank_weight_bytes: list[int] = []
        self.restarts = 0
        self.compile_report: str | None = None   # what `warm_up` compiled, and its seconds
        self.last_recovery_s: float | None = None
        # Rank 0's shard and the communicator its parallel layers use: a launcher that keeps that
        # object across restarts (it joins each fresh group) gets the shard back without a reload.
        self._shard: tuple[Communicator, CausalLM] | None = None
        if config.kv_block_size < 1:
            raise ValueError(f"kv_block_size={config.kv_block_size} must be at least 1")
        if config.kv_block_size != DEFAULT_KV_BLOCK and (config.ep > 1 or comm is not None):
            raise ValueError(f"kv_block_size={config.kv_block_size}: an EP group serves {DEFAULT_KV_BLOCK}-token "
                             "blocks only (its workers size their caches alike)")
        if config.ep > 1 and comm is None:
            self.group = launcher(GroupConfig(model_dir=str(config.model_dir), dtype=config.dtype, ep=config.ep,
                                              moe_a2a=config.shard_mode, kv_cache_tokens=config.kv_cache_tokens,
                                              timeout_s=config.ep_timeout_s, device=config.device,
                                              gpu_memory_utilization=config.gpu_memory_utilization,
                                              warm_standby=config.warm_standby and config.max_restarts > 0))
            self.comm = self.group.comm
        try:
            self.runner, self.proposer = self._build()
        except BaseException:
            self._stop_group()
            raise
        if self.group is not None:
            self.group.ready()

    @property
    def is_supervised(self) -> bool:
        return self.group is not None

    def check_thread(self, what: str) -> None:
        """Raise `WrongThread` unless the calling thread built this deployment: torch work on a
        second thread opens a second OpenMP thread team, and with more threads than CPUs every
        parallel region then waits on sleeping threads (serving.async_engine)."""
        if threading.get_ident() != self.thread_id:
            raise WrongThread(f"{what} runs on thread {threading.current_thread().name!r}, but the model was "
                              "built on another: run all torch work (load, warm-up, steps) on one thread")

    # --- construction ---------------------------------------------------------------------
    def _build(self) -> tuple[ModelRunner | DriverRunner, DraftProposer | None]:
        cfg = self.config
        if self.comm is None:
            model = load_model(cfg.model_dir, cfg.dtype, device=cfg.device)
            runner = ModelRunner(model, cfg.step_settings(self.rows_per_seq))
            log.info("step: %s", runner.choice)
        else:
            runner = self._join_group(self.comm)
            log.info("step (rank 0 of EP %d): %s", cfg.ep, runner.local.choice)
        try:
            proposer = self._make_proposer(runner)
        except BaseException:
            if isinstance(runner, DriverRunner):
                runner.shutdown()
            raise
        self._capture_at_start(runner, proposer)
        self.warm = False   # the compiled step's graphs are not built yet (`warm_up`)
        drafter = getattr(proposer, "model", None)
        if drafter is not None and drafter is not runner.model and self.rank_weight_bytes:  # rank 0's own drafter
            self.rank_weight_bytes[0] += sum(p.numel() * p.element_size() for p in drafter.parameters())
        return runner, proposer

    @property
    def rows_per_seq(self) -> int:
        """The most rows one sequence steps at once: a verify of its drafts (1 + the deepest chain,
        or a tree's nodes), else 1 (a decode; a prefill keeps no snapshots past `SNAPSHOT_ROWS`)."""
        spec = self.spec
        if not spec.is_speculating:
            return 1
        if spec.tree_shape is not None:
            return 1 + spec.tree_shape.num_nodes
        return 1 + spec.num_drafts

    def _capture_at_start(self, runner: ModelRunner | DriverRunner, proposer: DraftProposer | None) -> None:
        """With CUDA graphs, capture the buckets of one sequence's decode, verify and draft steps
        now and report the graph pool; other buckets are captured when first met."""
        graphs = getattr(runner, "graphs", None)
        if graphs is None or not graphs.capture:
            return
        rows = [1] + ([bucket(self.spec.num_drafts + 1, ROW_BUCKETS)] if self.spec.is_speculating else [])
        keys = min(MIN_KEYS, graphs.max_keys)
        graphs.prepare([StaticShape(1, q, keys) for q in rows if q is not None])
        drafter = getattr(proposer, "graphs", None)
        if drafter is not None and drafter.capture:
            drafter.prepare([StaticShape(1, 1, keys)])
        pool = graphs.pool_bytes + (drafter.pool_bytes if drafter is not None else 0)
        log.warning("CUDA graphs at start: %d captured, pool %.1f MiB (more buckets are captured when first met)",
                    len(graphs.entries) + (len(drafter.entries) if drafter is not None else 0), pool / 2**20)

    def warm_up(self) -> None:
        """With compiled steps, compile every graph the steps use, once per runner: the target's
        (one row, and several rows: prefill, verify, batched decode; dynamic shapes make those two
        graphs cover every row count) on every EP rank, and the drafter's when it compiles.
        Otherwise a request would wait for a compile the first time a step meets a new row count
        (a one-row step comes only when a speculative step drafts nothing): seconds with a warm
        inductor cache, far longer with a cold one. The server warms up before it listens;
        otherwise the first step does (after its requests were checked, so a bad one is refused
        without a compile), and a restarted group before it serves again. A progress bar shows on
        a terminal; `compile_report` says what compiled and in how many seconds. Inductor keeps
        its cache on disk (TORCHINDUCTOR_CACHE_DIR, by default under /tmp), so a restart or a
        restarted EP group compiles from it in seconds. Then, compiled or not, the heap built so
        far is frozen out of the garbage collector's reach (runtime.platform.heap): a full collection
        would otherwise stall some step (design §3, the warm heap)."""
        if self.warm:
            return
        runner, proposer = self.runner, self.proposer
        self.warm = True
        if not runner.compiled:
            freeze_heap()
            return
        drafter = proposer if isinstance(proposer, MTPProposer) and proposer.compiles else None
        seq = WARMUP_SEQ
        # (what, its chunks): the target's rows go to one graph whatever the sequences; the
        # drafter's step also takes each chunk's last row, so one chunk is a graph apart (two
        # chunks of the scratch sequence stand for two sequences: one block serves every shape).
        graphs = [("target", [SeqChunk(seq, 0, 2)]), ("target", [SeqChunk(seq, 0, 1)])]
        chains = sorted(self._chain_shapes()) if drafter is not None else []
        if drafter is not None:
            graphs += [("drafter", [SeqChunk(seq, 0, 2)]), ("drafter", [SeqChunk(seq, 0, 1)]),
                       ("drafter", [SeqChunk(seq, 0, 1), SeqChunk(seq, 1, 1)])]
            # One sequence's drafts of each depth it may draft alone, as one chained graph.
            graphs += [(f"drafter chain {d} {w}", [SeqChunk(seq, 0, rows)]) for d, w in chains for rows in (2, 1)]
        def name(what: str, chunks: list[SeqChunk]) -> str:
            if what.startswith("drafter chain"):
                depth, width = what.split()[2:]
                kind = f"{depth} drafts" if width == "1" else f"tree of {depth} depths"
                return f"drafter chain {kind} after {chunks[0].num_tokens} row{'s' if chunks[0].num_tokens > 1 else ''}"
            rows = sum(c.num_tokens for c in chunks)
            return f"{what} {rows} row{'s' if rows > 1 else ''}" + (f" of {len(chunks)} sequences" if len(chunks) > 1 else "")
        names = [name(what, chunks) for what, chunks in graphs]
        from torch._dynamo.utils import counters   # Dynamo's count of the graphs it compiled
        t0 = time.perf_counter()
        before = counters["stats"]["unique_graphs"]
        # DP attention: each rank compiles its own step, so each runs the scratch rows once (a rank
        # compiling later would keep the others waiting in the exchange), over a scratch sequence
        # of its own pool (reserved one a pool, they take the pools in order).
        dp = getattr(runner, "dp", None)
        scratch = [seq - r for r in range(dp.dp_size)] if dp is not None else [seq]
        for s in scratch:
            runner.cache.reserve(s, 2 + max((d for d, _ in chains), default=0))
        if [runner.cache.pool_of(s) for s in scratch] != list(range(len(scratch))):
            raise RuntimeError(f"the warm-up's scratch sequences took pools "
                               f"{[runner.cache.pool_of(s) for s in scratch]}, one a rank expected")
        try:
            with tqdm(graphs, desc="compiling the step", unit="graph", disable=None, leave=False) as bar:
                for (what, chunks), name in zip(bar, names):
                    bar.set_postfix_str(name)
                    if what == "target":
                        rows = chunks[0].num_tokens
                        for s in scratch:
                            hidden, _ = runner.forward([0] * rows, [SeqChunk(s, c.start, c.num_tokens) for c in chunks])
                            runner.logits(hidden, list(range(rows)))   # one row, or several: the head's graphs too
                    elif what.startswith("drafter chain"):
                        depth, width = map(int, what.split()[2:])
                        drafter.warm_up_chain(chunks, depth, width)
                    else:
                        drafter.warm_up(chunks)
        except BaseException:
            self.warm = False
            raise
        finally:
            for s in scratch:
                runner.cache.free(s)
            if isinstance(runner, DriverRunner) and runner.eplb:
                runner.eplb_reset()   # the scratch steps' routing is no load
        self.compile_report = (f"compiled the step in {time.perf_counter() - t0:.1f} s: {len(graphs)} steps "
                               f"({', '.join(names)}), {counters['stats']['unique_graphs'] - before} graphs")
        log.info("%s", self.compile_report)
        freeze_heap()

    def _chain_shapes(self) -> set[tuple[int, int]]:
        """The (depth, width) shapes a single running sequence may draft under these settings, as
        chained graphs: a tree's (its spine, its widest count); else chains of the deepest depth
        and the ladder's at width 1, from 2 drafts. (The auto policy's shallower depths draft step
        by step.)"""
        spec = self.spec
        if spec.tree_shape is not None:
            counts = spec.tree_shape.counts
            return {(len(counts), max(counts))} if len(counts) >= 2 else set()
        depths = {spec.num_drafts}
        if spec.depth_policy == "ladder" and not spec.ladder_disabled:
            depths.add(ladder_drafts_from_steps(list(spec.ladder), 1, spec.num_drafts))
        return {(d, 1) for d in depths if d >= 2}

    def _join_group(self, comm: Communicator) -> DriverRunner:
        """Rank 0's part of starting a group: handshake, its shard, every rank's pid and node."""
        cfg = self.config
        try:
            batch_invariant = cfg.dtype == "float64" if cfg.batch_invariant is None else cfg.batch_invariant
            compiled = not cfg.enforce_eager and cfg.dtype != "float64"
            driver_handshake(comm, cfg.model_dir, cfg.dtype, self.spec.confidence_stop, batch_invariant,
                             getattr(self.group, "generation", 0), compiled, cfg.eplb_redundant_experts,
                             cfg.dp_attention, cfg.attention_tp, cfg.two_batch_overlap)
            if comm.device != torch.device(cfg.device):
                raise ValueError(f"rank 0's communicator is on {comm.device}, the deployment on {cfg.device}")
            # EPLB moves experts between ranks: a restarted group starts again from the loaded split.
            if self._shard is None or self._shard[0] is not comm or cfg.eplb_redundant_experts is not None:
                self._shard = comm, load_shard_model(cfg.model_dir, cfg.dtype, comm, cfg.shard_mode)
            local = load_shard(cfg.model_dir, cfg.dtype, comm, cfg.shard_mode, cfg.kv_cache_tokens, batch_invariant,
                               self._shard[1], cfg.gpu_memory_utilization, compiled, cfg.eplb_redundant_experts,
                               (cfg.max_num_seqs, self.rows_per_seq), cfg.two_batch_overlap)
            self.rank_weight_bytes = gather_weight_bytes(comm, local)
            info = gather_rank_info(comm)
            comm.started()
        except BaseException as exc:
            report = self.group.failure_report() if self.group is not None else ""
            if report:
                raise GroupStartError(f"the EP group did not start: {report}") from exc
            raise
        nodes = self.group.nodes() if self.group is not None else [r["host"] for r in info]
        self.rank_info = [{**r, "node": node} for r, node in zip(info, nodes)]
        groups = comm.world_size // cfg.attention_tp
        budget = row_budget(cfg.max_num_seqs, groups, self.rows_per_seq) if cfg.dp_attention else None
        return DriverRunner(local, comm, cfg.eplb_interval_steps, budget, cfg.attention_tp)

    def _make_proposer(self, runner: ModelRunner | DriverRunner) -> DraftProposer | None:
        """The drafter the settings ask for: the checkpoint's MTP layer (sharded across the EP
        ranks, or rank 0's own when the sharded propose is off), prompt lookup, or none."""
        spec, cfg = self.spec, self.config
        if not spec.is_speculating:
            return None
        if spec.method == "ngram":
            return NgramProposer()
        if runner.model.mtp is None:
            raise ValueError(f"--spec mtp: this {runner.model.config.architecture} checkpoint has no MTP layer "
                             "(no model.layers.{num_hidden_layers}.* tensors); use --spec ngram")
        if isinstance(runner, ModelRunner):
            graphs = runner.graphs   # the drafter's steps go static (and captured) with the target's
            return MTPProposer(runner.model, runner.cache, spec.confidence_stop, spec.knobs,
                               static_steps=graphs is not None, cuda_graphs=graphs is not None and graphs.capture,
                               compiled=runner.compiled)
        if not spec.ep_propose:
            if cfg.dp_attention:
                raise ValueError("METRALE_NO_MTP_EP_PROPOSE=1 drafts every sequence on rank 0, whose KV pool holds "
                                 "only its own under --dp-attention; unset it")
            return load_local_drafter(cfg.model_dir, cfg.dtype, runner.comm.rank, runner.comm.world_size,
                                      runner.cache, spec.confidence_stop, spec.knobs)
        return ShardedMTPProposer(runner, spec.confidence_stop, spec.knobs)

    # --- supervision ----------------------------------------------------------------------
    def pending(self) -> str | None:
        """Why the group must be restarted now, or None while every rank is alive."""
        return self.group.dead() if self.group is not None else None

    def handles(self, exc: BaseException) -> bool:
        """Is `exc` a failure of the group (recoverable by a restart)?"""
        return self.group is not None and (isinstance(exc, (CommError, CommandRefused)) or self.pending() is not None)

    def reason(self, exc: BaseException) -> str:
        report = self.group.failure_report() if self.group is not None else ""
        return f"{exc}" + (f" ({report})" if report else "")

    def step(self, engine: Engine) -> StepOutcome:
        """One supervised engine step: restart a dead group first (also when idle), then step;
        a failure of the group restarts it and the step's requests continue from what they
        committed."""
        why = self.pending()
        if why is not None:
            self.recover(engine, why)
            return StepOutcome([], recovered=True)
        if not engine.has_unfinished():
            return StepOutcome([])
        if not self._warned_thread and threading.get_ident() != self.thread_id:
            self._warned_thread = True
            log.warning("stepping on thread %r, not the one that built the model: a second OpenMP thread team "
                        "can make every step several times slower; build and step on one thread",
                        threading.current_thread().name)
        try:
            self.warm_up()
            return StepOutcome(engine.step())
        except Exception as exc:
            if not self.handles(exc):
                raise
            self.recover(engine, self.reason(exc))
            return StepOutcome([], recovered=True)

    def recover(self, engine: Engine, reason: str) -> None:
        """Restart the group, retrying a failed restart, until `max_restarts` are spent; then
        raise `GroupFailed` naming the first reason."""
        t0 = time.perf_counter()
        why = reason
        while True:
            if self.restarts >= self.config.max_restarts:
                raise GroupFailed(f"the EP group failed ({why}); gave up after {self.restarts} "
                                  f"restart(s) (--max-restarts {self.config.max_restarts})")
            self.restarts += 1
            log.warning("EP group failed (%s): restart %d of at most %d", why, self.restarts,
                        self.config.max_restarts)
            try:
                self.group.stop(timeout_s=0)
                self.group.start()
                self.comm = self.group.comm
                self.runner, self.proposer = self._build()
                self.warm_up()
                break
            except Exception as exc:
                why = f"restart {self.restarts} failed: {type(exc).__name__}: {exc}"
        engine.reset(self.runner, self.proposer)
        self.last_recovery_s = time.perf_counter() - t0
        self.group.ready()
        log.warning("EP group serving again after %.2f s (%d ranks)", self.last_recovery_s, len(self.rank_info))

    # --- the end --------------------------------------------------------------------------
    def shutdown(self, graceful: bool = True) -> None:
        """End the worker ranks (if any). Graceful: send SHUTDOWN, then wait for them. After an
        error or an interrupt the group may be stuck inside a collective, so the workers are ended
        without a command. The heap frozen at warm-up is thawed, so what this deployment held
        can be collected."""
        thaw_heap()
        if graceful and isinstance(getattr(self, "runner", None), DriverRunner):
            try:
                self.runner.shutdown()
            except Exception:  # a broken group: fall through to ending the processes
                graceful = False
        self._stop_group(timeout_s=10.0 if graceful else 0.0)

    def _stop_group(self, timeout_s: float = 0.0) -> None:
        if self.group is not None:
            self.group.stop(timeout_s=timeout_s)
            self.group.close()
            self.group = None
