"""The rank-0 command protocol: one table of codes and payload layouts, encode and decode.

A command is a fixed header of HEADER_WORDS u32 words, `(slot, code, p0, p1, p2, p3, p4, p5)`,
broadcast from rank 0, then, when the header announces one (`bulk_len`), one bulk array of u32
words in a second broadcast. No pickle. Codes live at the top of u32. Words travel as int32 bit
patterns (ep.comm). Decoding checks lengths and ranges and raises `ProtocolError` naming the
problem; the worker reports it and stays in step.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

PROTOCOL_VERSION = 2
HEADER_WORDS = 8
NO_SLOT = 0xFFFFFFFF
MAX_SLOT = 1 << 30

EP_CMD_SHUTDOWN = 0xFFFFFFFF      # no payload
EP_CMD_HANDSHAKE = 0xFFFFFFFE     # version, world_size, fingerprint_lo, fingerprint_hi, dtype_code
EP_CMD_FORWARD = 0xFFFFFFFD       # num_ops, num_chunks, num_tokens, bulk_len, num_obs, num_tree_words
#                                   | bulk: ops, chunks, tokens, obs, trees
# A tree (a chunk with a tree mask) travels as (chunk index, parent row of each of its rows), the
# root's parent NO_PARENT; the rows' mask and positions follow from the parents (speculative.tree_shape).
EP_CMD_LOGITS = 0xFFFFFFFC        # num_rows, bulk_len | bulk: row indices into the last forward's rows
# KV-cache slot operations; they travel as (code, slot, length) triples in a FORWARD's op list.
EP_CMD_SLOT_RESERVE = 0xFFFFFFFB  # grow slot to `length` tokens
EP_CMD_SLOT_REWIND = 0xFFFFFFFA   # shrink slot to `length` tokens
EP_CMD_SLOT_FREE = 0xFFFFFFF9     # release slot (length unused)
EP_CMD_SLOT_MOVE = 0xFFFFFFF8     # copy one row's keys/values back (length: runtime.kv_cache.pack_move(src, dst))
EP_CMD_MTP_PROPOSE = 0xFFFFFFF5   # last_token, position, num_drafts (exactly three words)
EP_CMD_MTP_PROPOSE_BATCH = 0xFFFFFFF4  # num_seqs, num_obs, bulk_len, num_ops, stop_bits | bulk: ops, obs,
#                                        then per sequence (slot, num_drafts, m, m feed tokens);
#                                        stop_bits: the confidence stop TAU as float32 bits, 0 for none
# An observation (slot, row, count, position) says: rows row..row+count-1 of the last target
# forward's hidden are the committed positions position.. of that slot (the drafter's input).

COMMANDS = {
    EP_CMD_SHUTDOWN: "SHUTDOWN", EP_CMD_HANDSHAKE: "HANDSHAKE", EP_CMD_FORWARD: "FORWARD",
    EP_CMD_LOGITS: "LOGITS", EP_CMD_SLOT_RESERVE: "SLOT_RESERVE", EP_CMD_SLOT_REWIND: "SLOT_REWIND",
    EP_CMD_SLOT_FREE: "SLOT_FREE", EP_CMD_SLOT_MOVE: "SLOT_MOVE", EP_CMD_MTP_PROPOSE: "MTP_PROPOSE",
    EP_CMD_MTP_PROPOSE_BATCH: "MTP_PROPOSE_BATCH",
}
SLOT_OPS = (EP_CMD_SLOT_RESERVE, EP_CMD_SLOT_REWIND, EP_CMD_SLOT_FREE, EP_CMD_SLOT_MOVE)
NO_PARENT = 0xFFFFFFFF
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float64": 3}


class ProtocolError(ValueError):
    """A command that cannot be executed; the message names the field and the value."""


@dataclass(frozen=True, slots=True)
class Command:
    code: int
    slot: int = NO_SLOT
    params: tuple[int, ...] = ()
    bulk: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return COMMANDS.get(self.code, hex(self.code))


Observation = tuple[int, int, int, int]      # (slot, row, count, position)


@dataclass(frozen=True, slots=True)
class ForwardPayload:
    ops: list[tuple[int, int, int]]          # (slot op code, slot, length)
    chunks: list[tuple[int, int, int]]       # (slot, start, num_tokens)
    tokens: list[int]
    obs: list[Observation]
    trees: dict[int, list[int]] = field(default_factory=dict)   # chunk index -> parent rows (root: -1)


@dataclass(frozen=True, slots=True)
class ProposePayload:
    stop: float | None
    ops: list[tuple[int, int, int]]
    obs: list[Observation]
    seqs: list[tuple[int, int, list[int]]]   # (slot, num_drafts, feed tokens)


def _u32(value: int, what: str) -> int:
    if not isinstance(value, int) or not 0 <= value <= 0xFFFFFFFF:
        raise ProtocolError(f"{what}={value!r} does not fit in u32")
    return value


def encode(cmd: Command) -> tuple[list[int], list[int]]:
    """Command -> (header words, bulk words); the header's last used param is bulk_len when bulk exists."""
    if len(cmd.params) > HEADER_WORDS - 2:
        raise ProtocolError(f"{cmd.name}: {len(cmd.params)} header params, at most {HEADER_WORDS - 2}")
    header = [_u32(cmd.slot, "slot"), _u32(cmd.code, "code")] + [_u32(p, "param") for p in cmd.params]
    header += [0] * (HEADER_WORDS - len(header))
    return header, [_u32(w, "bulk word") for w in cmd.bulk]


def bulk_len(header: list[int]) -> int:
    """How many bulk words follow this header (0 for codes without a bulk array)."""
    code = header[1]
    if code == EP_CMD_FORWARD:
        return header[5]
    if code == EP_CMD_LOGITS:
        return header[3]
    if code == EP_CMD_MTP_PROPOSE_BATCH:
        return header[4]
    return 0


def decode(header: list[int], bulk: list[int]) -> Command:
    if len(header) != HEADER_WORDS:
        raise ProtocolError(f"truncated header: {len(header)} of {HEADER_WORDS} words")
    slot, code = header[0], header[1]
    if code not in COMMANDS or code in SLOT_OPS:
        raise ProtocolError(f"unknown command code {code:#010x}")
    if slot != NO_SLOT and slot >= MAX_SLOT:
        raise ProtocolError(f"slot {slot} out of range (0..{MAX_SLOT - 1})")
    want = bulk_len(header)
    if len(bulk) != want:
        raise ProtocolError(f"{COMMANDS[code]}: truncated payload, {len(bulk)} of {want} bulk words")
    nparams = {EP_CMD_SHUTDOWN: 0, EP_CMD_HANDSHAKE: 5, EP_CMD_FORWARD: 6, EP_CMD_LOGITS: 2,
               EP_CMD_MTP_PROPOSE: 3, EP_CMD_MTP_PROPOSE_BATCH: 5}[code]
    return Command(code=code, slot=slot, params=tuple(header[2:2 + nparams]), bulk=list(bulk))


def forward_command(ops: list[tuple[int, int, int]], chunks: list[tuple[int, int, int]],
                    tokens: list[int], obs: list[Observation] = (), trees: dict[int, list[int]] | None = None,
                    ) -> Command:
    """`trees`: chunk index -> the parent row of each of its rows (-1 for the root)."""
    tree_words = [w for i, parents in sorted((trees or {}).items())
                  for w in (i, *(NO_PARENT if p < 0 else p for p in parents))]
    bulk = [w for op in ops for w in op] + [w for c in chunks for w in c] + list(tokens) + [w for o in obs for w in o]
    bulk += tree_words
    return Command(EP_CMD_FORWARD, NO_SLOT, (len(ops), len(chunks), len(tokens), len(bulk), len(obs),
                                             len(tree_words)), bulk)


def _check_ops(ops: list[tuple[int, int, int]], what: str) -> None:
    for code, slot, _ in ops:
        if code not in SLOT_OPS:
            raise ProtocolError(f"{what}: unknown slot op {code:#010x}")
        if slot >= MAX_SLOT:
            raise ProtocolError(f"{what}: slot {slot} out of range (0..{MAX_SLOT - 1})")


def _check_obs(obs: list[Observation], what: str) -> None:
    for slot, _, count, _ in obs:
        if slot >= MAX_SLOT:
            raise ProtocolError(f"{what}: slot {slot} out of range (0..{MAX_SLOT - 1})")
        if count == 0:
            raise ProtocolError(f"{what}: an observation of zero rows for slot {slot}")


def parse_forward(cmd: Command, *, vocab_size: int) -> ForwardPayload:
    """Check and unpack a FORWARD: op codes, slots, chunk sizes and token ids must be valid."""
    num_ops, num_chunks, num_tokens, n, num_obs, num_tree_words = cmd.params
    if n != 3 * num_ops + 3 * num_chunks + num_tokens + 4 * num_obs + num_tree_words:
        raise ProtocolError(f"FORWARD: layout {num_ops} ops, {num_chunks} chunks, {num_tokens} tokens, "
                            f"{num_obs} observations, {num_tree_words} tree words does not match {n} bulk words")
    b = cmd.bulk
    ops = [tuple(b[3 * i:3 * i + 3]) for i in range(num_ops)]
    off = 3 * num_ops
    chunks = [tuple(b[off + 3 * i:off + 3 * i + 3]) for i in range(num_chunks)]
    off += 3 * num_chunks
    tokens = b[off:off + num_tokens]
    off += num_tokens
    obs = [tuple(b[off + 4 * i:off + 4 * i + 4]) for i in range(num_obs)]
    trees = _parse_trees(b[off + 4 * num_obs:], chunks)
    _check_obs(obs, "FORWARD")
    _check_ops(ops, "FORWARD")
    if sum(c[2] for c in chunks) != num_tokens or any(c[2] == 0 for c in chunks):
        raise ProtocolError(f"FORWARD: chunk sizes {[c[2] for c in chunks]} do not add up to {num_tokens} tokens")
    for slot, _, _ in chunks:
        if slot >= MAX_SLOT:
            raise ProtocolError(f"FORWARD: slot {slot} out of range (0..{MAX_SLOT - 1})")
    bad = next((t for t in tokens if t >= vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"FORWARD: token {bad} outside the vocabulary of {vocab_size}")
    return ForwardPayload(ops=ops, chunks=chunks, tokens=tokens, obs=obs, trees=trees)


def _parse_trees(words: list[int], chunks: list[tuple[int, int, int]]) -> dict[int, list[int]]:
    """(chunk index, parents...) records -> {chunk index: parents}; row 0 alone is the root and
    every other row's parent comes before it."""
    trees: dict[int, list[int]] = {}
    off = 0
    while off < len(words):
        i = words[off]
        if i >= len(chunks) or i in trees:
            raise ProtocolError(f"FORWARD: tree for chunk {i} (of {len(chunks)}) is out of range or repeated")
        n = chunks[i][2]
        raw = words[off + 1:off + 1 + n]
        if len(raw) != n:
            raise ProtocolError(f"FORWARD: truncated tree of chunk {i} ({len(raw)} of {n} parents)")
        parents = [-1 if p == NO_PARENT else p for p in raw]
        if parents[0] != -1 or any(not 0 <= p < r for r, p in enumerate(parents) if r):
            raise ProtocolError(f"FORWARD: chunk {i} parents {parents[:8]} are not a tree rooted at row 0")
        trees[i] = parents
        off += 1 + n
    return trees


def float_bits(x: float | None) -> int:
    return 0 if x is None else struct.unpack("<I", struct.pack("<f", x))[0]


def bits_float(bits: int) -> float | None:
    return None if bits == 0 else struct.unpack("<f", struct.pack("<I", bits))[0]


def propose_batch_command(ops: list[tuple[int, int, int]], obs: list[Observation],
                          seqs: list[tuple[int, int, list[int]]], stop: float | None = None) -> Command:
    bulk = [w for op in ops for w in op] + [w for o in obs for w in o]
    for slot, num_drafts, feed in seqs:
        bulk += [slot, num_drafts, len(feed), *feed]
    return Command(EP_CMD_MTP_PROPOSE_BATCH, NO_SLOT, (len(seqs), len(obs), len(bulk), len(ops), float_bits(stop)),
                   bulk)


def parse_propose_batch(cmd: Command, *, vocab_size: int) -> ProposePayload:
    num_seqs, num_obs, n, num_ops, stop_bits = cmd.params
    stop = bits_float(stop_bits)
    if stop is not None and not 0.0 < stop < 1.0:
        raise ProtocolError(f"MTP_PROPOSE_BATCH: confidence stop {stop} outside (0, 1)")
    b = cmd.bulk
    if 3 * num_ops + 4 * num_obs > n:
        raise ProtocolError(f"MTP_PROPOSE_BATCH: {num_ops} ops and {num_obs} observations do not fit {n} bulk words")
    ops = [tuple(b[3 * i:3 * i + 3]) for i in range(num_ops)]
    _check_ops(ops, "MTP_PROPOSE_BATCH")
    off = 3 * num_ops
    obs = [tuple(b[off + 4 * i:off + 4 * i + 4]) for i in range(num_obs)]
    _check_obs(obs, "MTP_PROPOSE_BATCH")
    off, seqs = off + 4 * num_obs, []
    for _ in range(num_seqs):
        if off + 3 > n:
            raise ProtocolError(f"MTP_PROPOSE_BATCH: truncated payload at sequence {len(seqs)}")
        slot, k, m = b[off:off + 3]
        feed = b[off + 3:off + 3 + m]
        if len(feed) != m:
            raise ProtocolError(f"MTP_PROPOSE_BATCH: truncated feed of slot {slot} ({len(feed)} of {m} tokens)")
        if slot >= MAX_SLOT or not 1 <= k <= 16:
            raise ProtocolError(f"MTP_PROPOSE_BATCH: slot {slot} / num_drafts {k} out of range")
        bad = next((t for t in feed if t >= vocab_size), None)
        if bad is not None:
            raise ProtocolError(f"MTP_PROPOSE_BATCH: token {bad} outside the vocabulary of {vocab_size}")
        seqs.append((slot, k, list(feed)))
        off += 3 + m
    if off != n:
        raise ProtocolError(f"MTP_PROPOSE_BATCH: {n - off} trailing bulk words")
    return ProposePayload(stop=stop, ops=ops, obs=obs, seqs=seqs)


def mtp_propose_command(slot: int, last_token: int, position: int, num_drafts: int) -> Command:
    return Command(EP_CMD_MTP_PROPOSE, slot, (last_token, position, num_drafts))
