"""The command channel of an EP group: rank 0 broadcasts fixed-layout u32 commands, every rank
answers each with a status all-reduce, and the start-up handshake, shard loading and the
gathers every rank joins once at start.

Every command ends with a status all-reduce: a worker that cannot execute a command reports it
there, every rank skips it together, and rank 0 raises with the worker's rank and reason code.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Iterable
from pathlib import Path

import torch

from ep.comm import CommError, Communicator, u32_to_words, words_to_u32
from ep.overlap import choose_dp_step
from ep.parallel import parallelize, parse_dp_mode
from ep.protocol import (ATTENTION_TP_MASK, ATTENTION_TP_SHIFT, BATCH_INVARIANT_BIT, COMPILED_BIT, DP_ATTENTION_BIT,
                         DTYPE_CODES, DTYPE_MASK, EP_CMD_HANDSHAKE, EPLB_SHIFT, TWO_BATCH_BIT,
                         EP_CMD_SLOT_ATTACH, EP_CMD_SLOT_FREE, EP_CMD_SLOT_MOVE, EP_CMD_SLOT_RESERVE,
                         EP_CMD_SLOT_REWIND, HEADER_WORDS, PROTOCOL_VERSION, Command, ProtocolError,
                         bulk_len, encode, float_bits, parse_stop)
from ep.topology import EPTopology
from runtime.model.config import load_config
from runtime.platform.device import kv_tokens_for_memory
from runtime.model.causal_lm import CausalLM
from runtime.executor.settings import StepSettings
from runtime.executor.runner import ModelRunner, choose_layer_states, kv_bytes_per_token
from runtime.model.weights import checkpoint_files, load_model

MAX_BULK_WORDS = 1 << 24
OP_CODES = {"reserve": EP_CMD_SLOT_RESERVE, "rewind": EP_CMD_SLOT_REWIND, "free": EP_CMD_SLOT_FREE,
            "move": EP_CMD_SLOT_MOVE, "attach": EP_CMD_SLOT_ATTACH}
OP_NAMES = {v: k for k, v in OP_CODES.items()}
# Handshake words every rank must agree on -> the reason code a mismatch is reported with.
HANDSHAKE_FIELDS = {1: "protocol version", 2: "world size", 3: "model fingerprint", 4: "dtype",
                    5: "confidence stop", 6: "group generation", 7: "attention layout (--dp-attention)"}
# Reason codes a worker reports a refused command with (status word: reason << 16 | rank).
REFUSED_COMMAND = 1
HANDSHAKE_CHECKS = ((0, 1), (1, 2), (2, 3), (3, 3), (4, 4))   # (word, reason); word 5, the stop, is adopted


class CommandRefused(RuntimeError):
    """A worker refused a command; every rank skipped it. The deployment restarts the group: rank 0
    and its workers disagree about something, and nothing a refused step computed is kept."""


class PeerGarbage(CommError):
    """A worker answered with words that are no valid reply (a status naming no worker rank or no
    known reason, an impossible pid or size): the rank is treated as failed, never its words as data."""


class HandshakeError(RuntimeError):
    pass


def model_fingerprint(model_dir: str | Path) -> int:
    """64 bits over config.json (normalized) and the checkpoint's tensor names."""
    model_dir = Path(model_dir)
    cfg = json.dumps(json.loads((model_dir / "config.json").read_text()), sort_keys=True)
    names = "\n".join(sorted(checkpoint_files(model_dir)))
    return int.from_bytes(hashlib.sha256((cfg + "\n" + names).encode()).digest()[:8], "little")


def load_shard_model(model_dir: str | Path, dtype: str, comm: Communicator, moe_mode: str,
                     keep_fp8: bool | None = None) -> CausalLM:
    """This rank's model shard on the communicator's device, reading only its tensors. It runs no
    collective, so a warm standby loads it before joining a group; its parallel layers use `comm`
    once it has joined. `keep_fp8`: as `load_model`'s (None: chosen by the device)."""
    cfg = load_config(model_dir)
    k = parse_dp_mode(moe_mode)
    topo = EPTopology.of(cfg, comm.rank, comm.world_size, dp_attention=k is not None, attention_tp=k or 1)
    return load_model(model_dir, dtype, expert_range=topo.expert_range(),
                      transform=lambda m: parallelize(m, topo, comm, moe_mode), device=comm.device,
                      keep_fp8=keep_fp8)


def load_shard(model_dir: str | Path, dtype: str, comm: Communicator, moe_mode: str,
               kv_cache_tokens: int, batch_invariant: bool, model: CausalLM | None = None,
               gpu_memory_utilization: float | None = None, compiled: bool = False,
               eplb_redundant: int | None = None, states_for: tuple[int, int] = (0, 1),
               two_batch: bool = False) -> ModelRunner:
    """This rank's model shard (`model` when loaded already, as loaded: contiguous experts) and a
    fresh KV cache, on the communicator's device; `compiled`: its step runs through
    `torch.compile` (every rank of a group alike: the handshake's COMPILED_BIT); `eplb_redundant`:
    EPLB with that many redundant experts (`ep.placement.enable`, collective; None: off).
    `states_for`: rank 0's (running sequences, rows a step) whose layer states a cache sized from
    free memory leaves room for; the workers learn them in the same collective (give (0, 1)).
    A DP-attention shard (`moe_mode` a `dp_mode`) runs its rows as `ep.overlap.choose_dp_step`
    picks for `two_batch` (two overlapped micro-batches, or one forward)."""
    if model is None:
        model = load_shard_model(model_dir, dtype, comm, moe_mode)
    if getattr(model, "attention_group", None) is not None:
        model.attention_group.bind()   # `--attention-tp`: every rank makes every group's process group
    if eplb_redundant is not None:
        from ep.placement import enable
        enable(model, comm, eplb_redundant)
    seqs, rows = states_for
    if gpu_memory_utilization is not None:
        # Rank 0's sequence limit and rows a step reach every rank; every rank replays rank 0's
        # allocator, so all ranks take the smallest cache any GPU holds.
        seqs, rows = (int(x) for x in comm.all_reduce(torch.tensor([seqs, rows], dtype=torch.int64,
                                                                   device=comm.device), "max"))
        reserved = choose_layer_states(model).bytes_reserved(seqs, rows)
        mine = kv_tokens_for_memory(comm.device, gpu_memory_utilization, kv_bytes_per_token(model), reserved)
        kv_cache_tokens = -int(comm.all_reduce(torch.tensor([-mine], dtype=torch.int64, device=comm.device),
                                               "max")[0])
    runner = ModelRunner(model, StepSettings(kv_cache_tokens=kv_cache_tokens, batch_invariant=batch_invariant,
                                             compiled=compiled, max_num_seqs=max(1, seqs), max_rows_per_seq=rows))
    if parse_dp_mode(moe_mode) is not None:
        model.dp_step = choose_dp_step(runner, two_batch)
    elif two_batch:
        raise ValueError("--two-batch-overlap splits the rows of --dp-attention; add --dp-attention")
    return runner


def weight_bytes(runner: ModelRunner) -> int:
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


# --- the command channel -------------------------------------------------------------------
def report_status(comm: Communicator, code: int) -> int:
    return int(comm.all_reduce(torch.tensor([code], dtype=torch.int64, device=comm.device), "max")[0])


def send_command(comm: Communicator, cmd: Command) -> None:
    header, bulk = encode(cmd)
    comm.broadcast(u32_to_words(header, comm.device))
    if bulk:
        comm.broadcast(u32_to_words(bulk, comm.device))
    status = report_status(comm, 0)
    if status:
        rank, reason = check_status(comm, status, cmd.name)
        raise CommandRefused(f"rank {rank} refused {cmd.name} (reason {reason}); see its log")


def check_status(comm: Communicator, status: int, what: str, reasons: Iterable[int] = (REFUSED_COMMAND,)
                 ) -> tuple[int, int]:
    """A non-zero status word -> (worker rank, reason); `PeerGarbage` when it names no worker rank
    or no reason in `reasons`."""
    rank, reason = status & 0xFFFF, status >> 16
    if not 1 <= rank < comm.world_size or reason not in reasons:
        raise PeerGarbage(f"rank 0: the status word {status:#x} after {what} names no worker rank "
                          f"(1..{comm.world_size - 1}) and known reason {sorted(reasons)}; a peer sent garbage")
    return rank, reason


def recv_command(comm: Communicator) -> tuple[list[int], list[int]]:
    header_t = comm.broadcast(torch.empty(HEADER_WORDS, dtype=torch.int32, device=comm.device))
    header = words_to_u32(header_t)
    n = bulk_len(header)
    if n > MAX_BULK_WORDS:
        raise ProtocolError(f"bulk of {n} words exceeds {MAX_BULK_WORDS}")
    bulk = words_to_u32(comm.broadcast(torch.empty(n, dtype=torch.int32, device=comm.device))) if n else []
    return header, bulk


def handshake_words(model_dir: str | Path, world_size: int, dtype: str) -> tuple[int, ...]:
    fp = model_fingerprint(model_dir)
    return PROTOCOL_VERSION, world_size, fp & 0xFFFFFFFF, fp >> 32, DTYPE_CODES[dtype]


def _handshake_failed(comm: Communicator, status: int) -> HandshakeError:
    rank, reason = check_status(comm, status, "HANDSHAKE", HANDSHAKE_FIELDS) if comm.rank == 0 \
        else (status & 0xFFFF, status >> 16)
    return HandshakeError(f"EP handshake failed: rank {rank} has another "
                          f"{HANDSHAKE_FIELDS.get(reason, 'setting')} than rank 0")


def driver_handshake(comm: Communicator, model_dir: str | Path, dtype: str,
                     confidence_stop: float | None = None, batch_invariant: bool = False,
                     generation: int = 0, compiled: bool = False, eplb_redundant: int | None = None,
                     dp_attention: bool = False, attention_tp: int = 1, two_batch: bool = False) -> None:
    """Rank 0: announce what this group must agree on (protocol version, world size, model
    fingerprint, dtype, and the group's generation, which travels in the header's slot word: the
    launcher counts its groups, so a rank started for an older group never joins a newer one),
    and what every rank adopts: the confidence stop TAU every rank drafts with (None: no stop)
    and whether every rank runs the batch-invariant kernels and compiles its step, and EPLB's
    redundant experts (None: no EPLB), and the attention layout (`dp_attention`: DP_ATTENTION_BIT,
    checked: a rank loaded its shard for one layout), and two-batch overlap (`two_batch`: TWO_BATCH_BIT,
    adopted; with `dp_attention` only).
    Raises `HandshakeError` naming the first rank that disagrees; every rank stops then."""
    if confidence_stop is not None and not 0.0 < confidence_stop < 1.0:
        raise ValueError(f"confidence_stop={confidence_stop} must be in (0, 1) or None")
    *words, dtype_word = handshake_words(model_dir, comm.world_size, dtype)
    if eplb_redundant is not None and not 0 <= eplb_redundant < (1 << (32 - EPLB_SHIFT)) - 1:
        raise ValueError(f"eplb_redundant={eplb_redundant} does not fit the handshake")
    mode = dtype_word | (BATCH_INVARIANT_BIT if batch_invariant else 0) | (COMPILED_BIT if compiled else 0)
    if two_batch and not dp_attention:
        raise ValueError("--two-batch-overlap splits the rows of --dp-attention; add --dp-attention")
    mode |= DP_ATTENTION_BIT | dp_tp_bits(attention_tp) if dp_attention else 0
    mode |= TWO_BATCH_BIT if two_batch else 0
    mode |= 0 if eplb_redundant is None else (eplb_redundant + 1) << EPLB_SHIFT
    words = (*words, mode, float_bits(confidence_stop))
    header, _ = encode(Command(EP_CMD_HANDSHAKE, generation, words))
    comm.broadcast(u32_to_words(header, comm.device))
    status = report_status(comm, 0)
    if status:
        raise _handshake_failed(comm, status)


def dp_tp_bits(attention_tp: int) -> int:
    """log2 of `--attention-tp` (a power of two) in the handshake's dtype_mode bits 11-14."""
    if attention_tp < 1 or attention_tp & (attention_tp - 1) or attention_tp.bit_length() - 1 > ATTENTION_TP_MASK:
        raise ValueError(f"--attention-tp {attention_tp}: a power of two up to {1 << ATTENTION_TP_MASK}")
    return (attention_tp.bit_length() - 1) << ATTENTION_TP_SHIFT


def worker_handshake(comm: Communicator, model_dir: str | Path, dtype: str,
                     generation: int = 0, dp_attention: bool = False,
                     attention_tp: int = 1) -> tuple[float | None, bool, bool, int | None, bool]:
    """Ranks above 0: check rank 0's handshake against this rank's own words (and the generation
    of the group its launcher started it for); returns what the group adopts from rank 0: the
    confidence stop TAU (float32-exact; None for no stop), whether the batch-invariant kernels run,
    whether the step is compiled, EPLB's redundant experts (None: no EPLB) and whether the rows
    run as two overlapped micro-batches (TWO_BATCH_BIT, with DP attention only). `dp_attention`:
    the layout this rank loads (`--dp-attention`); rank 0's must be the same (reason 7)."""
    header, _ = recv_command(comm)
    mine = handshake_words(model_dir, comm.world_size, dtype)
    kind, stop, batch_invariant, compiled, eplb, two_batch = 0, None, False, False, None, False
    if header[1] != EP_CMD_HANDSHAKE:
        kind = 1
    else:
        theirs = list(header[2:2 + 6])
        batch_invariant = bool(theirs[4] & BATCH_INVARIANT_BIT)
        compiled = bool(theirs[4] & COMPILED_BIT)
        eplb = (theirs[4] >> EPLB_SHIFT) - 1 if theirs[4] >> EPLB_SHIFT else None
        layout = theirs[4] & (DP_ATTENTION_BIT | ATTENTION_TP_MASK << ATTENTION_TP_SHIFT)
        two_batch = bool(theirs[4] & TWO_BATCH_BIT) and bool(layout & DP_ATTENTION_BIT)
        known = DTYPE_MASK | BATCH_INVARIANT_BIT | COMPILED_BIT | layout | (TWO_BATCH_BIT if two_batch else 0)
        if theirs[4] & ~known & ((1 << EPLB_SHIFT) - 1):
            kind = 4
        mine_layout = DP_ATTENTION_BIT | dp_tp_bits(attention_tp) if dp_attention else 0
        kind = kind or (7 if layout != mine_layout else 0)
        theirs[4] &= DTYPE_MASK
        kind = kind or next((reason for i, reason in HANDSHAKE_CHECKS if theirs[i] != mine[i]), 0)
        kind = kind or (6 if header[0] != generation else 0)
        if not kind:
            try:
                stop = parse_stop(theirs[5], "HANDSHAKE")
            except ProtocolError:
                kind = 5
    status = report_status(comm, (kind << 16) | comm.rank if kind else 0)
    if status:
        raise _handshake_failed(comm, status)
    return stop, batch_invariant, compiled, eplb, two_batch


def gather_rank_info(comm: Communicator) -> list[dict]:
    """Every rank's pid and host name (for /health), gathered once at start-up."""
    name = socket.gethostname().encode()[:64].ljust(64, b"\0")
    row = torch.tensor([os.getpid(), *name], dtype=torch.int64, device=comm.device)
    rows = comm.all_gather(row[None])
    bad = next((r for r in range(comm.world_size)
                if not 0 < int(rows[r, 0]) < 1 << 31 or not all(0 <= b < 256 for b in rows[r, 1:].tolist())), None)
    if bad is not None:
        raise PeerGarbage(f"rank {comm.rank}: rank {bad} sent pid {int(rows[bad, 0])} and a host name that is "
                          "no bytes; a peer sent garbage")
    try:
        return [{"rank": r, "pid": int(rows[r, 0]), "host": bytes(rows[r, 1:].tolist()).rstrip(b"\0").decode()}
                for r in range(comm.world_size)]
    except UnicodeDecodeError as exc:
        raise PeerGarbage(f"rank {comm.rank}: a host name is not UTF-8 ({exc}); a peer sent garbage") from None


def gather_weight_bytes(comm: Communicator, runner: ModelRunner) -> list[int]:
    out = comm.all_gather(torch.tensor([weight_bytes(runner)], dtype=torch.int64, device=comm.device)).tolist()
    bad = next((r for r, n in enumerate(out) if n <= 0), None)
    if bad is not None:
        raise PeerGarbage(f"rank {comm.rank}: rank {bad} reports {out[bad]} weight bytes; a peer sent garbage")
    return out
