"""The rank-0 command protocol: one table of codes and payload layouts, encode and decode.

A command is a fixed header of HEADER_WORDS u32 words, `(slot, code, p0, p1, p2, p3, p4, p5)`,
broadcast from rank 0, then, when the header announces one (`bulk_len`), one bulk array of u32
words in a second broadcast. No pickle. Codes live at the top of u32. Words travel as int32 bit
patterns (ep.comm). A command's unused header words are 0. Decoding checks lengths and ranges and
raises `ProtocolError` naming the problem; the worker reports it and stays in step.

The propose has two forms. The batched one carries everything the workers' drafter mirror needs
(the cache ops and drafter inputs since the last command, each sequence's feed tokens). The seed's
three-word `MTP_PROPOSE` carries only `last_token, position, num_drafts` for one slot, and the
workers derive the rest from the last FORWARD with `derive_propose`; rank 0 sends it only when
that derivation equals what the batched form would carry (`propose_command`), so both forms
always execute the same payload.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from speculative.proposer import EP_CMD_MTP_PROPOSE
from speculative.settings import MAX_NUM_DRAFTS

PROTOCOL_VERSION = 10  # 7: COMPILED_BIT in the handshake; 8: EPLB (its field in dtype_mode, EP_CMD_EPLB);
#                        9: DP_ATTENTION_BIT, and a DP-attention FORWARD's owners and row budget;
#                        10: TWO_BATCH_BIT (two-batch overlap: the order of the exchanges' collectives)
HEADER_WORDS = 8
NO_SLOT = 0xFFFFFFFF
MAX_SLOT = 1 << 30

# --- the table: code, header params | bulk ---------------------------------------------------
EP_CMD_SHUTDOWN = 0xFFFFFFFF      # no payload
EP_CMD_HANDSHAKE = 0xFFFFFFFE     # version, world_size, fingerprint_lo, fingerprint_hi, dtype_mode, stop_bits
#                                   dtype_mode: the dtype code (bits 0-7, checked) | BATCH_INVARIANT_BIT
#                                   (adopted: every rank runs the batch-invariant kernels or none does)
#                                   | COMPILED_BIT (adopted: every rank compiles its step or none does)
#                                   | (R + 1) << EPLB_SHIFT (adopted: EPLB with R redundant experts; 0: off)
#                                   | DP_ATTENTION_BIT | log2(attention_tp) << ATTENTION_TP_SHIFT (checked:
#                                   data-parallel attention and its attention groups, docs/design.md §4.3)
#                                   | TWO_BATCH_BIT (adopted, with DP_ATTENTION_BIT only: every rank runs its
#                                   rows as two overlapped micro-batches, ep.overlap, or none does);
#                                   stop_bits: the group's confidence stop TAU as float32 bits, 0 for none;
#                                   workers adopt it (the three-word propose drafts with it)
EP_CMD_FORWARD = 0xFFFFFFFD       # num_ops, num_chunks, num_tokens, bulk_len, num_obs, num_tree_words
#                                   | bulk: ops, chunks (slot, start, num_tokens), tokens, obs, trees,
#                                   and with DP attention one word a chunk (the rank that runs it), then the
#                                   step's per-rank row budget (0: an exact-count exchange)
# A tree (a chunk with parents) travels as (chunk index, parent row of each of its rows), the root's
# parent NO_PARENT; the rows' positions and mask follow from the parents (runtime.executor.attention.SeqChunk).
EP_CMD_LOGITS = 0xFFFFFFFC        # num_rows, bulk_len | bulk: row indices into the last forward's rows
# KV-cache slot operations; they travel as (code, slot, length) triples in a FORWARD's or a propose's op list.
EP_CMD_SLOT_RESERVE = 0xFFFFFFFB  # grow slot to `length` tokens
EP_CMD_SLOT_REWIND = 0xFFFFFFFA   # shrink slot to `length` tokens
EP_CMD_SLOT_FREE = 0xFFFFFFF9     # release slot (length: how many leading blocks stay cached once unheld)
EP_CMD_SLOT_MOVE = 0xFFFFFFF8     # copy one row's keys/values back (length: runtime.executor.kv_cache.pack_move(src, dst))
EP_CMD_SLOT_ATTACH = 0xFFFFFFF7   # append the cached full block `length` to the slot's table (prefix cache)
# EP_CMD_MTP_PROPOSE = 0xFFFFFFF5 (speculative.proposer): header slot = the drafting sequence; params
#                                   last_token, position, num_drafts (exactly three words, no bulk).
#                                   The rest is derived from the last FORWARD (`derive_propose`).
EP_CMD_MTP_PROPOSE_BATCH = 0xFFFFFFF4  # num_seqs, num_obs, bulk_len, num_ops, stop_bits | bulk: ops, obs,
#                                        then per sequence (slot, num_drafts, m, m feed tokens);
#                                        num_drafts 0: feed only (the prefix cache needs its rows);
#                                        stop_bits: rank 0's TAU, checked against the handshake's
EP_CMD_EPLB = 0xFFFFFFF3          # num_layers, slots_per_layer, bulk_len | bulk: per MoE layer (model order),
#                                   the expert id in each slot, rank-major (ep.placement): every rank moves
#                                   its expert weights to that placement and routes by it from the next step
# An observation (slot, row, count, position) says: rows row..row+count-1 of the last target
# forward's hidden are the committed positions position.. of that slot (the drafter's input).

COMMANDS = {
    EP_CMD_SHUTDOWN: "SHUTDOWN", EP_CMD_HANDSHAKE: "HANDSHAKE", EP_CMD_FORWARD: "FORWARD",
    EP_CMD_LOGITS: "LOGITS", EP_CMD_SLOT_RESERVE: "SLOT_RESERVE", EP_CMD_SLOT_REWIND: "SLOT_REWIND",
    EP_CMD_SLOT_FREE: "SLOT_FREE", EP_CMD_SLOT_MOVE: "SLOT_MOVE", EP_CMD_SLOT_ATTACH: "SLOT_ATTACH",
    EP_CMD_MTP_PROPOSE: "MTP_PROPOSE",
    EP_CMD_MTP_PROPOSE_BATCH: "MTP_PROPOSE_BATCH", EP_CMD_EPLB: "EPLB",
}
# Header params of each command (the slot ops only travel inside op lists).
NUM_PARAMS = {EP_CMD_SHUTDOWN: 0, EP_CMD_HANDSHAKE: 6, EP_CMD_FORWARD: 6, EP_CMD_LOGITS: 2,
              EP_CMD_MTP_PROPOSE: 3, EP_CMD_MTP_PROPOSE_BATCH: 5, EP_CMD_EPLB: 3}
# Which header param is bulk_len, for the commands that have a bulk array.
BULK_LEN_PARAM = {EP_CMD_FORWARD: 3, EP_CMD_LOGITS: 1, EP_CMD_MTP_PROPOSE_BATCH: 2, EP_CMD_EPLB: 2}
SLOT_OPS = (EP_CMD_SLOT_RESERVE, EP_CMD_SLOT_REWIND, EP_CMD_SLOT_FREE, EP_CMD_SLOT_MOVE, EP_CMD_SLOT_ATTACH)
NO_PARENT = 0xFFFFFFFF
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float64": 3}
DTYPE_MASK = 0xFF
BATCH_INVARIANT_BIT = 1 << 8
COMPILED_BIT = 1 << 9
DP_ATTENTION_BIT = 1 << 10
ATTENTION_TP_SHIFT, ATTENTION_TP_MASK = 11, 0xF   # dtype_mode bits 11-14: log2 of `--attention-tp`
TWO_BATCH_BIT = 1 << 15   # `--two-batch-overlap` (with DP_ATTENTION_BIT)
EPLB_SHIFT = 16   # dtype_mode bits 16-31: 1 + the redundant experts of EPLB, 0 without it


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


Op = tuple[int, int, int]                    # (slot op code, slot, length)
Observation = tuple[int, int, int, int]      # (slot, row, count, position)
Feed = tuple[int, int, list[int]]            # (slot, num_drafts, feed tokens)


@dataclass(frozen=True, slots=True)
class ForwardPayload:
    ops: list[Op]
    chunks: list[tuple[int, int, int]]       # (slot, start, num_tokens)
    tokens: list[int]
    obs: list[Observation]
    trees: dict[int, list[int]] = field(default_factory=dict)   # chunk index -> parent rows (root: -1)
    owners: list[int] = field(default_factory=list)   # DP attention: the rank that runs each chunk ([]: all)
    budget: int = 0                                   # DP attention: the padded exchange's rows a rank (0: exact)


@dataclass(frozen=True, slots=True)
class ProposePayload:
    """What a propose executes on every rank, in this order: feed the observations (they index
    the last forward's hidden), apply the cache ops, then draft each sequence."""
    ops: list[Op]
    obs: list[Observation]
    seqs: list[Feed]


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
    param = BULK_LEN_PARAM.get(header[1])
    return 0 if param is None else header[2 + param]


def decode(header: list[int], bulk: list[int]) -> Command:
    if len(header) != HEADER_WORDS:
        raise ProtocolError(f"truncated header: {len(header)} of {HEADER_WORDS} words")
    slot, code = header[0], header[1]
    if code not in NUM_PARAMS:
        raise ProtocolError(f"unknown command code {code:#010x}")
    if slot != NO_SLOT and slot >= MAX_SLOT:
        raise ProtocolError(f"slot {slot} out of range (0..{MAX_SLOT - 1})")
    name, nparams = COMMANDS[code], NUM_PARAMS[code]
    if any(header[2 + nparams:]):
        raise ProtocolError(f"{name}: header words past its {nparams} params are {header[2 + nparams:]}, not 0")
    want = bulk_len(header)
    if len(bulk) < want:
        raise ProtocolError(f"{name}: truncated payload, {len(bulk)} of {want} bulk words")
    if len(bulk) > want:
        raise ProtocolError(f"{name}: {len(bulk)} bulk words, the header announces {want}")
    return Command(code=code, slot=slot, params=tuple(header[2:2 + nparams]), bulk=list(bulk))


# --- LOGITS ------------------------------------------------------------------------------------
def parse_logits(cmd: Command) -> list[int]:
    """The rows of a LOGITS; its row count must be its bulk length."""
    num_rows, n = cmd.params
    if num_rows != n:
        raise ProtocolError(f"LOGITS: {num_rows} rows announced, {n} bulk words")
    return list(cmd.bulk)


# --- FORWARD -----------------------------------------------------------------------------------
def forward_command(ops: list[Op], chunks: list[tuple[int, int, int]], tokens: list[int],
                    obs: list[Observation] = (), trees: dict[int, list[int]] | None = None,
                    owners: list[int] | None = None, budget: int = 0) -> Command:
    """`trees`: chunk index -> the parent row of each of its rows (-1 for the root); `owners`
    (DP attention): the rank that runs each chunk, then `budget`, the step's padded rows a rank."""
    tree_words = [w for i, parents in sorted((trees or {}).items())
                  for w in (i, *(NO_PARENT if p < 0 else p for p in parents))]
    bulk = [w for op in ops for w in op] + [w for c in chunks for w in c] + list(tokens) + [w for o in obs for w in o]
    bulk += tree_words
    if owners is not None:
        if len(owners) != len(chunks):
            raise ProtocolError(f"FORWARD: {len(owners)} owners for {len(chunks)} chunks")
        bulk += [*owners, budget]
        tree_words = [*tree_words, *owners, budget]   # counted with the trailing words of the layout
    return Command(EP_CMD_FORWARD, NO_SLOT, (len(ops), len(chunks), len(tokens), len(bulk), len(obs),
                                             len(tree_words)), bulk)


def _check_ops(ops: list[Op], what: str) -> None:
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


def _check_tokens(tokens: list[int], vocab_size: int, what: str) -> None:
    bad = next((t for t in tokens if t >= vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"{what}: token {bad} outside the vocabulary of {vocab_size}")


def parse_forward(cmd: Command, *, vocab_size: int, dp_size: int = 0) -> ForwardPayload:
    """Check and unpack a FORWARD: op codes, slots, chunk sizes and token ids must be valid.
    `dp_size` (DP attention: the ranks): the trailing words are each chunk's rank and the row
    budget, counted in the header's tree words."""
    num_ops, num_chunks, num_tokens, n, num_obs, num_tree_words = cmd.params
    dp_words = num_chunks + 1 if dp_size else 0
    if num_tree_words < dp_words:
        raise ProtocolError(f"FORWARD: {num_tree_words} trailing words, a DP-attention step needs {dp_words}")
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
    _check_obs(obs, "FORWARD")
    _check_ops(ops, "FORWARD")
    if sum(c[2] for c in chunks) != num_tokens or any(c[2] == 0 for c in chunks):
        raise ProtocolError(f"FORWARD: chunk sizes {[c[2] for c in chunks]} do not add up to {num_tokens} tokens")
    for slot, _, _ in chunks:
        if slot >= MAX_SLOT:
            raise ProtocolError(f"FORWARD: slot {slot} out of range (0..{MAX_SLOT - 1})")
    _check_tokens(tokens, vocab_size, "FORWARD")
    tail = b[off + 4 * num_obs:]
    trees = _parse_trees(tail[:len(tail) - dp_words], chunks)   # after the chunk checks: a tree needs a root row
    if not dp_size:
        return ForwardPayload(ops=ops, chunks=chunks, tokens=tokens, obs=obs, trees=trees)
    owners, budget = tail[len(tail) - dp_words:-1], tail[-1]
    bad = next((o for o in owners if o >= dp_size), None)
    if bad is not None:
        raise ProtocolError(f"FORWARD: chunk owner rank {bad} outside 0..{dp_size - 1}")
    rows = [sum(c[2] for c, o in zip(chunks, owners) if o == r) for r in range(dp_size)]
    if budget and max(rows) > budget:
        raise ProtocolError(f"FORWARD: a rank runs {max(rows)} rows, above the padded budget of {budget}")
    return ForwardPayload(ops=ops, chunks=chunks, tokens=tokens, obs=obs, trees=trees, owners=owners, budget=budget)


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


# --- EPLB ---------------------------------------------------------------------------------------
def eplb_command(tables: list[list[int]]) -> Command:
    """The placement of every MoE layer: `tables[layer]` the expert in each slot, rank-major."""
    per = len(tables[0]) if tables else 0
    if any(len(t) != per for t in tables):
        raise ProtocolError(f"EPLB: layers of {sorted({len(t) for t in tables})} slots, expected one count")
    bulk = [e for t in tables for e in t]
    return Command(EP_CMD_EPLB, NO_SLOT, (len(tables), per, len(bulk)), bulk)


def parse_eplb(cmd: Command, *, num_layers: int, num_slots: int, num_experts: int) -> list[list[int]]:
    """Check an EPLB against this rank's model: one table per MoE layer, each of `num_slots`
    expert ids below `num_experts` that places every expert at least once."""
    layers, per, n = cmd.params
    if layers != num_layers or per != num_slots:
        raise ProtocolError(f"EPLB: {layers} layers of {per} slots, this model has {num_layers} of {num_slots}")
    if n != layers * per:
        raise ProtocolError(f"EPLB: {n} bulk words for {layers} layers of {per} slots")
    tables = [list(cmd.bulk[i * per:(i + 1) * per]) for i in range(layers)]
    for i, t in enumerate(tables):
        bad = next((e for e in t if e >= num_experts), None)
        if bad is not None:
            raise ProtocolError(f"EPLB: layer {i} places expert {bad}, the model has {num_experts}")
        if len(set(t)) != num_experts:
            raise ProtocolError(f"EPLB: layer {i} places {len(set(t))} of the {num_experts} experts")
    return tables


# --- the confidence stop as one word -----------------------------------------------------------
def float_bits(x: float | None) -> int:
    """TAU as float32 bits; 0 for none."""
    return 0 if x is None else struct.unpack("<I", struct.pack("<f", x))[0]


def bits_float(bits: int) -> float | None:
    return None if bits == 0 else struct.unpack("<f", struct.pack("<I", bits))[0]


def parse_stop(bits: int, what: str) -> float | None:
    """A stop word -> TAU (None for 0); anything outside (0, 1) is refused."""
    stop = bits_float(bits)
    if stop is not None and not 0.0 < stop < 1.0:
        raise ProtocolError(f"{what}: confidence stop {stop} outside (0, 1)")
    return stop


# --- the batched propose -----------------------------------------------------------------------
def propose_batch_command(ops: list[Op], obs: list[Observation], seqs: list[Feed],
                          stop: float | None = None) -> Command:
    bulk = [w for op in ops for w in op] + [w for o in obs for w in o]
    for slot, num_drafts, feed in seqs:
        bulk += [slot, num_drafts, len(feed), *feed]
    return Command(EP_CMD_MTP_PROPOSE_BATCH, NO_SLOT, (len(seqs), len(obs), len(bulk), len(ops), float_bits(stop)),
                   bulk)


def parse_propose_batch(cmd: Command, *, vocab_size: int) -> tuple[ProposePayload, float | None]:
    """Check and unpack a batched propose: (its payload, the TAU rank 0 drafts with)."""
    num_seqs, num_obs, n, num_ops, stop_bits = cmd.params
    stop = parse_stop(stop_bits, "MTP_PROPOSE_BATCH")
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
        if slot >= MAX_SLOT or not 0 <= k <= MAX_NUM_DRAFTS:
            raise ProtocolError(f"MTP_PROPOSE_BATCH: slot {slot} / num_drafts {k} out of range")
        _check_tokens(feed, vocab_size, "MTP_PROPOSE_BATCH")
        seqs.append((slot, k, list(feed)))
        off += 3 + m
    if off != n:
        raise ProtocolError(f"MTP_PROPOSE_BATCH: {n - off} trailing bulk words")
    return ProposePayload(ops=ops, obs=obs, seqs=seqs), stop


# --- the seed's three-word propose -------------------------------------------------------------
def mtp_propose_command(slot: int, last_token: int, position: int, num_drafts: int) -> Command:
    return Command(EP_CMD_MTP_PROPOSE, slot, (last_token, position, num_drafts))


def parse_propose(cmd: Command, *, vocab_size: int) -> tuple[int, int, int]:
    """Check the three words of an MTP_PROPOSE: (last_token, position, num_drafts)."""
    last_token, position, num_drafts = cmd.params
    if cmd.slot == NO_SLOT:
        raise ProtocolError("MTP_PROPOSE: no slot in the header")
    _check_tokens([last_token], vocab_size, "MTP_PROPOSE")
    if not 1 <= num_drafts <= MAX_NUM_DRAFTS:
        raise ProtocolError(f"MTP_PROPOSE: num_drafts {num_drafts} out of range (1..{MAX_NUM_DRAFTS})")
    if position == 0:
        raise ProtocolError("MTP_PROPOSE: position 0 has no committed row before it to feed")
    return last_token, position, num_drafts


def derive_propose(last: ForwardPayload | None, slot: int, last_token: int, position: int,
                   num_drafts: int) -> ProposePayload | None:
    """What a three-word propose stands for, read off the last FORWARD; None when it stands for nothing.

    It applies when that forward verified a chain for `slot` (one causal chunk: the pending token
    at `start`, then drafts) and `position` is the committed length after the verify, so
    na = position - start - 1 drafts were accepted (0 <= na < chunk rows). Then, since that forward:
    the cache ops are the verify's rewind to `position` and the next step's reserve of the pending
    row plus `num_drafts` draft rows; the drafter's input is rows 0..na of that chunk at `start`; the
    feed tokens are the committed tokens at start+1..position: the accepted drafts, then
    `last_token`. Rank 0 and the workers call this with the same last forward; it is pure.
    """
    if last is None:
        return None
    mine = [i for i, c in enumerate(last.chunks) if c[0] == slot]
    if len(mine) != 1 or mine[0] in last.trees:
        return None
    i = mine[0]
    _, start, n = last.chunks[i]
    na = position - start - 1
    if not 0 <= na < n:
        return None
    row = sum(c[2] for c in last.chunks[:i])
    feed = list(last.tokens[row + 1:row + 1 + na]) + [last_token]
    return ProposePayload(ops=[(EP_CMD_SLOT_REWIND, slot, position),
                               (EP_CMD_SLOT_RESERVE, slot, position + 1 + num_drafts)],
                          obs=[(slot, row, na + 1, start)], seqs=[(slot, num_drafts, feed)])


def propose_command(last: ForwardPayload | None, payload: ProposePayload, stop: float | None,
                    pending: list[tuple[int, int]]) -> Command:
    """The command rank 0 sends for `payload`: the three words when exactly one sequence drafts and
    `derive_propose` gives back exactly `payload`, else the batched form. `pending[i]` is
    (last_token, position) of `payload.seqs[i]`: its pending token and where that token sits."""
    if len(payload.seqs) == 1 and len(pending) == 1 and payload.seqs[0][1] > 0:
        slot, num_drafts, _ = payload.seqs[0]
        last_token, position = pending[0]
        if derive_propose(last, slot, last_token, position, num_drafts) == payload:
            return mtp_propose_command(slot, last_token, position, num_drafts)
    return propose_batch_command(payload.ops, payload.obs, payload.seqs, stop)
