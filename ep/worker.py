"""What every worker rank (above 0) runs once it has joined the group, whoever launched it (mp,
Ray, torchrun): the handshake, its shard, then rank 0's commands until SHUTDOWN.

Each command a worker executes has one entry in `HANDLERS`: a check that parses and validates
it against this rank's state (raising `ProtocolError`, so every rank skips it together) and a run
that executes it. Every rank reaches the same collectives because every rank runs the same
payload: a three-word propose is expanded by `derive_propose` from the same last forward rank 0
read it off.
"""
from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ep.channel import (OP_NAMES, REFUSED_COMMAND, gather_rank_info, gather_weight_bytes, load_shard, recv_command,
                        report_status, worker_handshake)
from ep.comm import CommError, Communicator
from ep.dp import dp_draft, dp_forward
from ep.parallel import parse_dp_mode
from ep.protocol import (EP_CMD_EPLB, EP_CMD_FORWARD, EP_CMD_LOGITS, EP_CMD_MTP_PROPOSE, EP_CMD_MTP_PROPOSE_BATCH,
                         EP_CMD_SHUTDOWN, EP_CMD_SLOT_FREE, Command, ForwardPayload, Observation, Op,
                         ProposePayload, ProtocolError, decode, derive_propose, float_bits, parse_eplb,
                         parse_forward, parse_logits, parse_propose, parse_propose_batch)
from ep import placement
from runtime.executor.attention import SeqChunk
from runtime.platform.heap import freeze_heap
from runtime.model.causal_lm import CausalLM
from runtime.executor.runner import ModelRunner
from speculative.mtp import MTPProposer
from speculative.proposer import ProposerState

log = logging.getLogger("metrale.ep")


class DrafterMirror:
    """A worker's copy of the drafter states, fed from the same target hiddens as rank 0's."""

    def __init__(self, runner: ModelRunner, comm: Communicator | None = None) -> None:
        """`comm`: DP attention, where each rank drafts its own sequences (`ep.dp.dp_draft`)."""
        self.drafter = MTPProposer(runner.model, runner.cache) if runner.model.mtp is not None else None
        self.cache = runner.cache
        self.comm = comm
        self.states: dict[int, ProposerState] = {}

    def state(self, slot: int) -> ProposerState:
        """The slot's drafter state; a new one resumes past the prefix the slot was attached,
        as rank 0's does (`DraftProposer.resume_at`)."""
        if slot not in self.states:
            self.states[slot] = ProposerState(seq_id=slot, fed_upto=self.cache.num_attached_tokens(slot))
        return self.states[slot]

    def observe(self, obs: list[Observation], hidden: torch.Tensor | None) -> None:
        for slot, row, count, position in obs:
            if hidden is None or row + count > hidden.shape[0] or self.drafter is None:
                raise RuntimeError(f"observation of slot {slot} rows {row}..{row + count} has no forward to read")
            self.drafter.observe_target(self.state(slot), hidden, range(row, row + count), position)

    def draft(self, seqs: list[tuple[int, int, list[int]]], stop: float | None) -> None:
        states = [self.states[slot] for slot, _, _ in seqs]
        if self.comm is not None:
            dp_draft(self.drafter, self.comm, states, [f for _, _, f in seqs], [k for _, k, _ in seqs], stop)
        else:
            self.drafter.draft(states, [f for _, _, f in seqs], [k for _, k, _ in seqs], stop)

    def pending_end(self, slot: int) -> int:
        """The position the slot's next observation must start at (past its attached prefix
        before its first)."""
        st = self.states.get(slot)
        if st is None:
            return self.cache.num_attached_tokens(slot)
        return st.pending_end


class Worker:
    """One worker rank's state between commands: its shard, its drafter mirror, the last forward."""

    def __init__(self, runner: ModelRunner, comm: Communicator, confidence_stop: float | None,
                 attention_tp: int | None = None) -> None:
        """`attention_tp`: DP attention with attention groups of that many ranks (None: off)."""
        self.runner = runner
        # DP attention: FORWARDs carry each chunk's attention group
        self.dp_size = comm.world_size // attention_tp if attention_tp else 0
        self.comm = comm
        self.vocab_size = runner.config.vocab_size
        self.confidence_stop = confidence_stop      # the group's TAU, from the handshake
        if attention_tp:   # a pool a rank: every rank counts every pool's blocks, holds its own
            runner.cache.split_pools(self.dp_size, comm.rank // attention_tp)
        self.mirror = DrafterMirror(runner, comm if attention_tp else None)
        self.last_hidden: torch.Tensor | None = None   # [T, H] of the last forward
        self.last_forward: ForwardPayload | None = None

    # --- SHUTDOWN ---------------------------------------------------------------------------------
    def check_shutdown(self, cmd: Command) -> None:
        return None

    def run_shutdown(self, _: None) -> bool:
        return True

    # --- FORWARD ----------------------------------------------------------------------------------
    def check_forward(self, cmd: Command) -> ForwardPayload:
        return parse_forward(cmd, vocab_size=self.vocab_size, dp_size=self.dp_size)

    def run_forward(self, p: ForwardPayload) -> bool:
        self.mirror.observe(p.obs, self.last_hidden)   # they index the previous forward
        self.apply_slot_ops(p.ops)
        chunks = [SeqChunk(s, start, n, tuple(p.trees[i]) if i in p.trees else None)
                  for i, (s, start, n) in enumerate(p.chunks)]
        if self.dp_size:
            self.last_hidden = dp_forward(self.runner, self.comm, p.tokens, chunks, p.owners, p.budget)
        else:
            self.last_hidden, _ = self.runner.forward(p.tokens, chunks)
        self.last_forward = p
        return False

    # --- LOGITS -----------------------------------------------------------------------------------
    def check_logits(self, cmd: Command) -> list[int]:
        rows = parse_logits(cmd)
        if self.last_hidden is None or any(r >= self.last_hidden.shape[0] for r in rows):
            raise ProtocolError(f"LOGITS: rows {rows[:4]} outside the last forward")
        return rows

    def run_logits(self, rows: list[int]) -> bool:
        self.runner.logits(self.last_hidden, rows)
        return False

    # --- MTP_PROPOSE_BATCH and MTP_PROPOSE --------------------------------------------------------
    def check_propose_batch(self, cmd: Command) -> ProposePayload:
        payload, stop = parse_propose_batch(cmd, vocab_size=self.vocab_size)
        if float_bits(stop) != float_bits(self.confidence_stop):
            raise ProtocolError(f"MTP_PROPOSE_BATCH: confidence stop {stop}, but the group agreed on "
                                f"{self.confidence_stop} at the handshake")
        return self.check_propose_payload(payload, "MTP_PROPOSE_BATCH")

    def check_propose(self, cmd: Command) -> ProposePayload:
        last_token, position, num_drafts = parse_propose(cmd, vocab_size=self.vocab_size)
        payload = derive_propose(self.last_forward, cmd.slot, last_token, position, num_drafts)
        if payload is None:
            raise ProtocolError(f"MTP_PROPOSE: position {position} of slot {cmd.slot} does not follow a "
                                "verified chain of that slot in the last forward")
        start = payload.obs[0][3]
        if self.mirror.pending_end(cmd.slot) != start:
            raise ProtocolError(f"MTP_PROPOSE: slot {cmd.slot}'s drafter expects position "
                                f"{self.mirror.pending_end(cmd.slot)} next, the last forward verified from {start}")
        if self.runner.cache.length(cmd.slot) < position:
            raise ProtocolError(f"MTP_PROPOSE: slot {cmd.slot} holds {self.runner.cache.length(cmd.slot)} "
                                f"tokens, cannot rewind to {position}")
        return self.check_propose_payload(payload, "MTP_PROPOSE")

    def check_propose_payload(self, p: ProposePayload, what: str) -> ProposePayload:
        if self.mirror.drafter is None:
            raise ProtocolError(f"{what}: this checkpoint has no MTP layer")
        rows = 0 if self.last_hidden is None else self.last_hidden.shape[0]
        bad = next((o for o in p.obs if o[1] + o[2] > rows), None)
        if bad is not None:
            raise ProtocolError(f"{what}: observation of rows {bad[1]}..{bad[1] + bad[2] - 1} outside the "
                                f"last forward's {rows} rows")
        missing = [s for s, _, _ in p.seqs if s not in self.mirror.states and not any(o[0] == s for o in p.obs)]
        if missing:
            raise ProtocolError(f"{what}: no drafter state for slots {missing[:4]}")
        return p

    def run_propose(self, p: ProposePayload) -> bool:
        self.mirror.observe(p.obs, self.last_hidden)
        self.apply_slot_ops(p.ops)
        self.mirror.draft(p.seqs, self.confidence_stop)
        return False

    # --- EPLB -------------------------------------------------------------------------------------
    def check_eplb(self, cmd: Command) -> list:
        layers = placement.moe_layers(self.runner.model)
        if not layers or layers[0].eplb_slots is None:
            raise ProtocolError("EPLB: this group was started without --eplb-redundant-experts")
        n, per = layers[0].eplb_slots.shape
        tables = parse_eplb(cmd, num_layers=len(layers), num_slots=n * per, num_experts=layers[0].topo.num_experts)
        return [np.asarray(t, dtype=np.int64).reshape(n, per) for t in tables]

    def run_eplb(self, tables: list) -> bool:
        placement.apply(self.runner.model, tables, self.comm)
        return False

    def apply_slot_ops(self, ops: list[Op]) -> None:
        """Replay rank 0's cache operations; a freed slot also drops its drafter state."""
        for code, slot, length in ops:
            self.runner.cache.replay(OP_NAMES[code], slot, length)
            if code == EP_CMD_SLOT_FREE:
                self.mirror.states.pop(slot, None)


@dataclass(frozen=True, slots=True)
class Handler:
    check: Callable[[Worker, Command], Any]   # parse and validate; raises ProtocolError
    run: Callable[[Worker, Any], bool]        # execute the checked payload; True ends the loop


# Every command a worker executes, by code; any other code is refused.
HANDLERS: dict[int, Handler] = {
    EP_CMD_SHUTDOWN: Handler(Worker.check_shutdown, Worker.run_shutdown),
    EP_CMD_FORWARD: Handler(Worker.check_forward, Worker.run_forward),
    EP_CMD_LOGITS: Handler(Worker.check_logits, Worker.run_logits),
    EP_CMD_MTP_PROPOSE_BATCH: Handler(Worker.check_propose_batch, Worker.run_propose),
    EP_CMD_MTP_PROPOSE: Handler(Worker.check_propose, Worker.run_propose),
    EP_CMD_EPLB: Handler(Worker.check_eplb, Worker.run_eplb),
}


def check_command(worker: Worker, header: list[int], bulk: list[int]) -> tuple[Handler, Any]:
    """Decode one command's words and check them against this worker's state: (its handler, the
    checked payload), or `ProtocolError` naming why it cannot run. Any words at all give one of
    the two (tests/ep/test_wire_fuzz.py); nothing here changes the worker."""
    cmd = decode(header, bulk)
    handler = HANDLERS.get(cmd.code)
    if handler is None:
        raise ProtocolError(f"{cmd.name} is not a command workers execute")
    return handler, handler.check(worker, cmd)


def worker_loop(runner: ModelRunner, comm: Communicator, confidence_stop: float | None = None,
                attention_tp: int | None = None) -> None:
    """Ranks above 0: execute rank 0's commands until SHUTDOWN. A refused command is skipped by
    every rank together; a broken link raises `CommError` and ends the worker. After its first
    command and after each one that compiled graphs the rank freezes its heap (runtime.platform.heap)."""
    from torch._dynamo.utils import counters   # Dynamo's count of the graphs it compiled
    worker = Worker(runner, comm, confidence_stop, attention_tp)
    graphs = None
    while True:
        header, bulk = recv_command(comm)
        reason = 0
        try:
            handler, payload = check_command(worker, header, bulk)
        except ProtocolError as exc:
            log.error("rank %d: refused command: %s", comm.rank, exc)
            reason = REFUSED_COMMAND
        if report_status(comm, (reason << 16) | comm.rank if reason else 0):
            continue
        if handler.run(worker, payload):
            return
        if counters["stats"]["unique_graphs"] != graphs:
            # The first command, or one that compiled graphs (rank 0's warm-up): freeze the heap
            # built so far, as rank 0 does after its warm-up (runtime.platform.heap).
            graphs = counters["stats"]["unique_graphs"]
            freeze_heap()


def serve_rank(comm: Communicator, model_dir: str, dtype: str, moe_a2a: str, kv_cache_tokens: int, *,
               model: CausalLM | None = None, generation: int = 0,
               gpu_memory_utilization: float | None = None) -> tuple[int, str]:
    """Agree on the handshake, load this rank's shard on the communicator's device (`model`:
    loaded already, by a warm standby), then execute rank 0's commands until it shuts the group
    down. `generation`: the group the launcher started this rank for (checked at the handshake).
    Returns (exit code, message): (0, "") on a clean shutdown, 3 when the group broke, 2 for any
    other failure (a refused handshake, garbage the word stream cannot stay in step after); the
    group is always left."""
    _thread_lock_for_progress_bars()
    try:
        k = parse_dp_mode(moe_a2a)
        confidence_stop, batch_invariant, compiled, eplb, two_batch = worker_handshake(
            comm, model_dir, dtype, generation, k is not None, k or 1)
        runner = load_shard(model_dir, dtype, comm, moe_a2a, kv_cache_tokens, batch_invariant, model,
                            gpu_memory_utilization, compiled, eplb, two_batch=two_batch)
        gather_weight_bytes(comm, runner)
        gather_rank_info(comm)
        comm.started()
        worker_loop(runner, comm, confidence_stop, k)
        return 0, ""
    except CommError as exc:
        return 3, f"metrale worker rank {comm.rank}: {exc}"
    except Exception as exc:
        return 2, f"metrale worker rank {comm.rank}: {type(exc).__name__}: {exc}"
    finally:
        comm.close()


def ignore_interrupts() -> None:
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group, worker ranks too.
    A worker rank ignores it and leaves shutdown to rank 0, which drains (`metrale serve`, as on
    SIGTERM) or stops (`generate`) and then shuts the group down: a worker that died of the
    KeyboardInterrupt would break the collective of the step in flight. Clears the SIGINT the
    launcher blocked while it spawned this process (`launch.mp`), a pending one included."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # also discards a pending SIGINT
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _thread_lock_for_progress_bars() -> None:
    """A rank may be killed at any moment. tqdm (which torch.fx runs while compiling the step)
    would create a multiprocessing lock, whose semaphore the launcher's resource tracker then
    reports as leaked when the rank dies: a thread lock serves a rank's one process."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())
