"""One rank's piece of an EP group: its shard of the model, the driver (rank 0) and the worker loop.

Rank 0's `DriverRunner` has the same interface as `ModelRunner`: before each forward or logits
call it broadcasts the command, so the workers enter the same collectives in the same order.
Every command ends with a status all-reduce: a worker that cannot execute a command reports it
there, every rank skips it together, and rank 0 raises with the worker's rank and reason code.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from ep.comm import Communicator, u32_to_words, words_to_u32
from ep.parallel import parallelize
from ep.protocol import (DTYPE_CODES, EP_CMD_FORWARD, EP_CMD_HANDSHAKE, EP_CMD_LOGITS, EP_CMD_MTP_PROPOSE_BATCH,
                         EP_CMD_SHUTDOWN, EP_CMD_SLOT_FREE, EP_CMD_SLOT_MOVE, EP_CMD_SLOT_RESERVE,
                         EP_CMD_SLOT_REWIND, HEADER_WORDS,
                         NO_SLOT, PROTOCOL_VERSION, Command, Observation, ProtocolError, bulk_len, decode, encode,
                         forward_command, parse_forward, parse_propose_batch, propose_batch_command)
from ep.topology import EPTopology
from runtime.attention import SeqChunk
from runtime.model_runner import ModelRunner
from runtime.weights import checkpoint_files, load_model
from speculative.mtp import MTPProposer
from speculative.proposer import ProposerState, ProposeRequest
from speculative.tree_shape import ancestor_mask, parents_of_mask, row_depths, tree_mask

log = logging.getLogger("metrale.ep")

MAX_BULK_WORDS = 1 << 24
OP_CODES = {"reserve": EP_CMD_SLOT_RESERVE, "rewind": EP_CMD_SLOT_REWIND, "free": EP_CMD_SLOT_FREE,
            "move": EP_CMD_SLOT_MOVE}
OP_NAMES = {v: k for k, v in OP_CODES.items()}
HANDSHAKE_FIELDS = {1: "protocol version", 2: "world size", 3: "model fingerprint", 4: "dtype"}


class CommandRefused(RuntimeError):
    pass


class HandshakeError(RuntimeError):
    pass


def model_fingerprint(model_dir: str | Path) -> int:
    """64 bits over config.json (normalized) and the checkpoint's tensor names."""
    model_dir = Path(model_dir)
    cfg = json.dumps(json.loads((model_dir / "config.json").read_text()), sort_keys=True)
    names = "\n".join(sorted(checkpoint_files(model_dir)))
    return int.from_bytes(hashlib.sha256((cfg + "\n" + names).encode()).digest()[:8], "little")


def load_shard(model_dir: str | Path, dtype: str, comm: Communicator, moe_mode: str,
               kv_cache_tokens: int) -> ModelRunner:
    """This rank's model shard (reading only its tensors) and its KV cache."""
    from runtime.config import load_config
    cfg = load_config(model_dir)
    topo = EPTopology.of(cfg, comm.rank, comm.world_size)
    model = load_model(model_dir, dtype, expert_range=topo.expert_range(),
                       transform=lambda m: parallelize(m, topo, comm, moe_mode))
    return ModelRunner(model, kv_cache_tokens=kv_cache_tokens)


def weight_bytes(runner: ModelRunner) -> int:
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


# --- the command channel -------------------------------------------------------------------
def _status(comm: Communicator, code: int) -> int:
    return int(comm.all_reduce(torch.tensor([code], dtype=torch.int64), "max")[0])


def send_command(comm: Communicator, cmd: Command) -> None:
    header, bulk = encode(cmd)
    comm.broadcast(u32_to_words(header))
    if bulk:
        comm.broadcast(u32_to_words(bulk))
    status = _status(comm, 0)
    if status:
        raise CommandRefused(f"rank {status & 0xFFFF} refused {cmd.name} (reason {status >> 16}); see its log")


def recv_command(comm: Communicator) -> tuple[list[int], list[int]]:
    header_t = comm.broadcast(torch.empty(HEADER_WORDS, dtype=torch.int32))
    header = words_to_u32(header_t)
    n = bulk_len(header)
    if n > MAX_BULK_WORDS:
        raise ProtocolError(f"bulk of {n} words exceeds {MAX_BULK_WORDS}")
    bulk = words_to_u32(comm.broadcast(torch.empty(n, dtype=torch.int32))) if n else []
    return header, bulk


def handshake_words(model_dir: str | Path, world_size: int, dtype: str) -> tuple[int, ...]:
    fp = model_fingerprint(model_dir)
    return PROTOCOL_VERSION, world_size, fp & 0xFFFFFFFF, fp >> 32, DTYPE_CODES[dtype]


def driver_handshake(comm: Communicator, model_dir: str | Path, dtype: str) -> list[int]:
    """Rank 0: announce what this group must agree on; returns each rank's weight bytes afterwards."""
    header, _ = encode(Command(EP_CMD_HANDSHAKE, NO_SLOT, handshake_words(model_dir, comm.world_size, dtype)))
    comm.broadcast(u32_to_words(header))
    status = _status(comm, 0)
    if status:
        raise HandshakeError(f"EP handshake failed: rank {status & 0xFFFF} has another "
                             f"{HANDSHAKE_FIELDS.get(status >> 16, 'setting')} than rank 0")


def worker_handshake(comm: Communicator, model_dir: str | Path, dtype: str) -> None:
    header, _ = recv_command(comm)
    mine = handshake_words(model_dir, comm.world_size, dtype)
    theirs = tuple(header[2:7]) if header[1] == EP_CMD_HANDSHAKE else ()
    kind = 0
    if not theirs:
        kind = 1
    else:
        for i, field in ((0, 1), (1, 2), (2, 3), (3, 3), (4, 4)):
            if theirs[i] != mine[i]:
                kind = field
                break
    status = _status(comm, (kind << 16) | comm.rank if kind else 0)
    if status:
        raise HandshakeError(f"EP handshake failed: rank {status & 0xFFFF} has another "
                             f"{HANDSHAKE_FIELDS.get(status >> 16, 'setting')} than rank 0")


def gather_rank_info(comm: Communicator) -> list[dict]:
    """Every rank's pid and host name (for /health), gathered once at start-up."""
    import os
    import socket
    name = socket.gethostname().encode()[:64].ljust(64, b"\0")
    row = torch.tensor([os.getpid(), *name], dtype=torch.int64)
    rows = comm.all_gather(row[None])
    return [{"rank": r, "pid": int(rows[r, 0]), "host": bytes(rows[r, 1:].tolist()).rstrip(b"\0").decode()}
            for r in range(comm.world_size)]


def gather_weight_bytes(comm: Communicator, runner: ModelRunner) -> list[int]:
    out = comm.all_gather(torch.tensor([weight_bytes(runner)], dtype=torch.int64))
    return out.tolist()


class DriverRunner:
    """Rank 0's runner: broadcasts each step to the workers, then runs its own shard."""

    def __init__(self, local: ModelRunner, comm: Communicator) -> None:
        self.local = local
        self.comm = comm
        self.model = local.model
        self.config = local.config
        self.cache = local.cache
        self.cache.journal = []
        # Drafter inputs observed since the last command (they index the last forward's hidden).
        self.obs_journal: list[Observation] = []

    def take_obs(self) -> list[Observation]:
        obs, self.obs_journal = self.obs_journal, []
        return obs

    def take_ops(self) -> list[tuple[int, int, int]]:
        ops = [(OP_CODES[op], seq, n) for op, seq, n in self.cache.journal]
        self.cache.journal.clear()
        return ops

    def forward(self, tokens: list[int], chunks: list[SeqChunk]):
        trees = {i: tree_parents(c) for i, c in enumerate(chunks) if c.mask is not None}
        ops = self.take_ops()
        send_command(self.comm, forward_command(ops, [(c.seq_id, c.start, c.num_tokens) for c in chunks], tokens,
                                                self.take_obs(), trees))
        return self.local.forward(tokens, chunks)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        send_command(self.comm, Command(EP_CMD_LOGITS, NO_SLOT, (len(rows), len(rows)), list(rows)))
        return self.local.logits(hidden, rows)

    def shutdown(self) -> None:
        send_command(self.comm, Command(EP_CMD_SHUTDOWN))


def tree_parents(chunk: SeqChunk) -> list[int]:
    """The parent rows that carry a chunk's mask and positions to the workers; only tree masks
    (the committed context plus ancestors, each row at start + its depth) can travel."""
    parents = parents_of_mask(chunk.mask, chunk.start)
    if parents is None:
        raise ValueError(f"sequence {chunk.seq_id}: only tree attention masks are carried to EP workers")
    positions = chunk.positions if chunk.positions is not None else torch.arange(chunk.start, chunk.end)
    if positions.tolist() != [chunk.start + d for d in row_depths(parents)]:
        raise ValueError(f"sequence {chunk.seq_id}: tree rows must sit at start + depth, got {positions.tolist()}")
    return parents


def tree_chunk(slot: int, start: int, parents: list[int]) -> SeqChunk:
    """A worker's chunk rebuilt from the parent rows rank 0 sent."""
    positions = torch.tensor([start + d for d in row_depths(parents)], dtype=torch.long)
    return SeqChunk(slot, start, len(parents), tree_mask(start, ancestor_mask(parents)), positions)


class ShardedMTPProposer(MTPProposer):
    """Rank 0's sharded MTP drafter: its propose tells the workers first, so they enter the
    drafter's collectives with it; the hiddens it is fed are mirrored on every rank."""

    needs_comm = True

    def __init__(self, driver: DriverRunner, confidence_stop: float | None = None) -> None:
        super().__init__(driver.model, driver.cache, confidence_stop)
        self.driver = driver

    def observe_target(self, state: ProposerState, hidden: torch.Tensor, rows: range, start: int) -> None:
        super().observe_target(state, hidden, rows, start)
        self.driver.obs_journal.append((state.seq_id, rows.start, len(rows), start))

    def before_draft(self, live: list[ProposeRequest], feeds: list[list[int]]) -> None:
        obs = self.driver.take_obs()  # before the ops: they index the last forward, whose rows
        send_command(self.driver.comm, propose_batch_command(  # a FREE among the ops may drop
            self.driver.take_ops(), obs, [(r.state.seq_id, r.num_drafts, f) for r, f in zip(live, feeds)],
            self.confidence_stop))


class DrafterMirror:
    """A worker's copy of the drafter states, fed from the same target hiddens as rank 0's."""

    def __init__(self, runner: ModelRunner) -> None:
        self.drafter = MTPProposer(runner.model, runner.cache) if runner.model.mtp is not None else None
        self.states: dict[int, ProposerState] = {}

    def observe(self, obs: list[Observation], hidden: torch.Tensor | None) -> None:
        for slot, row, count, position in obs:
            if hidden is None or row + count > hidden.shape[0] or self.drafter is None:
                raise RuntimeError(f"observation of slot {slot} rows {row}..{row + count} has no forward to read")
            state = self.states.setdefault(slot, ProposerState(seq_id=slot))
            self.drafter.observe_target(state, hidden, range(row, row + count), position)

    def draft(self, seqs: list[tuple[int, int, list[int]]], stop: float | None) -> None:
        states = [self.states[slot] for slot, _, _ in seqs]
        self.drafter.draft(states, [f for _, _, f in seqs], [k for _, k, _ in seqs], stop)


def apply_slot_ops(runner: ModelRunner, mirror: DrafterMirror, ops: list[tuple[int, int, int]]) -> None:
    """Replay rank 0's cache operations; a freed slot also drops its drafter state."""
    for code, slot, length in ops:
        runner.cache.replay(OP_NAMES[code], slot, length)
        if code == EP_CMD_SLOT_FREE:
            mirror.states.pop(slot, None)


def worker_loop(runner: ModelRunner, comm: Communicator) -> None:
    """Ranks above 0: execute rank 0's commands until SHUTDOWN. A refused command is skipped by
    every rank together; a broken link raises `CommError` and ends the worker."""
    vocab = runner.config.vocab_size
    mirror = DrafterMirror(runner)
    last_hidden = None
    while True:
        header, bulk = recv_command(comm)
        reason = 0
        try:
            cmd = decode(header, bulk)
            if cmd.code not in (EP_CMD_SHUTDOWN, EP_CMD_FORWARD, EP_CMD_LOGITS, EP_CMD_MTP_PROPOSE_BATCH):
                raise ProtocolError(f"{cmd.name} is not executed by workers in this protocol version")
            payload = None
            if cmd.code == EP_CMD_FORWARD:
                payload = parse_forward(cmd, vocab_size=vocab)
            elif cmd.code == EP_CMD_MTP_PROPOSE_BATCH:
                payload = parse_propose_batch(cmd, vocab_size=vocab)
                if mirror.drafter is None:
                    raise ProtocolError("MTP_PROPOSE_BATCH: this checkpoint has no MTP layer")
                missing = [s for s, _, _ in payload.seqs if s not in mirror.states
                           and not any(o[0] == s for o in payload.obs)]
                if missing:
                    raise ProtocolError(f"MTP_PROPOSE_BATCH: no drafter state for slots {missing[:4]}")
            if cmd.code == EP_CMD_LOGITS and (last_hidden is None or
                                              any(r >= last_hidden.shape[0] for r in cmd.bulk)):
                raise ProtocolError(f"LOGITS: rows {cmd.bulk[:4]} outside the last forward")
        except ProtocolError as exc:
            log.error("rank %d: refused command: %s", comm.rank, exc)
            reason = 1
        if _status(comm, (reason << 16) | comm.rank if reason else 0):
            continue
        if cmd.code == EP_CMD_SHUTDOWN:
            return
        if cmd.code == EP_CMD_FORWARD:
            mirror.observe(payload.obs, last_hidden)   # they index the previous forward
            apply_slot_ops(runner, mirror, payload.ops)
            chunks = [tree_chunk(s, start, payload.trees[i]) if i in payload.trees else SeqChunk(s, start, n)
                      for i, (s, start, n) in enumerate(payload.chunks)]
            last_hidden, _ = runner.forward(payload.tokens, chunks)
        elif cmd.code == EP_CMD_MTP_PROPOSE_BATCH:
            mirror.observe(payload.obs, last_hidden)
            apply_slot_ops(runner, mirror, payload.ops)
            mirror.draft(payload.seqs, payload.stop)
        else:
            runner.logits(last_hidden, cmd.bulk)
