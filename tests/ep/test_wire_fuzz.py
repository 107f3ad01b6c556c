"""A fuzzed wire: random, truncated and out-of-range command words parse to a valid command or
raise `ProtocolError`, never anything else (property-based, hypothesis); rank 0 reads a garbage
status as a failed peer; a real worker process fed garbage refuses each command in one line and
stays in step."""
from __future__ import annotations

import multiprocessing as mp
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ep.channel import (REFUSED_COMMAND, CommandRefused, PeerGarbage, check_status, driver_handshake,
                        gather_rank_info, gather_weight_bytes, load_shard, report_status, send_command)
from ep.comm import Communicator, free_port, u32_to_words, words_to_u32
from ep.protocol import (BULK_LEN_PARAM, COMMANDS, EP_CMD_FORWARD, EP_CMD_LOGITS, EP_CMD_MTP_PROPOSE,
                         EP_CMD_MTP_PROPOSE_BATCH, EP_CMD_SHUTDOWN, HEADER_WORDS, NO_PARENT, NO_SLOT, NUM_PARAMS,
                         SLOT_OPS, Command, ForwardPayload, ProposePayload, ProtocolError, decode, encode,
                         forward_command, propose_batch_command)
from ep.worker import Worker, check_command

U32 = st.integers(0, 0xFFFFFFFF)
# Words a fuzzer should hit often: small counts, codes, sentinels, u32's edges.
WORD = st.one_of(st.integers(0, 12), U32, st.sampled_from([*COMMANDS, *SLOT_OPS, NO_SLOT, NO_PARENT, 0x7FFFFFFF,
                                                           0x80000000, (1 << 30) - 1, 1 << 30]))
CODES = st.sampled_from([*COMMANDS, *SLOT_OPS, 0, 12345])


SMALL = st.integers(0, 6)


@st.composite
def encoded_command(draw) -> tuple[list[int], list[int]]:
    """A FORWARD or batched propose built by rank 0's encoders from small random fields (so its
    layout holds), then often one word of it overwritten or the bulk cut short."""
    op = st.tuples(st.sampled_from(SLOT_OPS), SMALL, SMALL)
    obs = st.tuples(SMALL, SMALL, SMALL, SMALL)
    if draw(st.booleans()):
        chunks = draw(st.lists(st.tuples(SMALL, SMALL, st.integers(1, 3)), max_size=3))
        tokens = draw(st.lists(st.integers(0, 330), min_size=sum(c[2] for c in chunks),
                               max_size=sum(c[2] for c in chunks)))
        trees = {i: [-1] + [draw(st.integers(-1, r)) for r in range(c[2] - 1)]
                 for i, c in enumerate(chunks) if draw(st.booleans())}
        cmd = forward_command(draw(st.lists(op, max_size=3)), chunks, tokens, draw(st.lists(obs, max_size=2)), trees)
    else:
        seqs = draw(st.lists(st.tuples(SMALL, st.integers(0, 9), st.lists(st.integers(0, 330), max_size=3)),
                             max_size=3))
        cmd = propose_batch_command(draw(st.lists(op, max_size=2)), draw(st.lists(obs, max_size=2)), seqs,
                                    draw(st.sampled_from([None, 0.5, 0.25])))
    header, bulk = encode(cmd)
    how = draw(st.integers(0, 3))
    if how == 1 and bulk:
        bulk[draw(st.integers(0, len(bulk) - 1))] = draw(WORD)
    elif how == 2:
        header[draw(st.integers(2, HEADER_WORDS - 1))] = draw(WORD)
    elif how == 3 and bulk:
        bulk = bulk[:draw(st.integers(0, len(bulk) - 1))]
    return header, bulk


@st.composite
def wire_command(draw) -> tuple[list[int], list[int]]:
    """A header (often well-formed enough to pass `decode`'s layout checks, sometimes any length)
    and a bulk (often as long as the header announces, sometimes off by a few words), or an
    encoded command with a word changed."""
    if draw(st.integers(0, 2)) == 0:
        return draw(encoded_command())
    if draw(st.integers(0, 9)) == 0:
        return draw(st.lists(WORD, max_size=HEADER_WORDS + 2)), draw(st.lists(WORD, max_size=12))
    code = draw(CODES)
    nparams = NUM_PARAMS.get(code, draw(st.integers(0, HEADER_WORDS - 2)))
    params = draw(st.lists(WORD, min_size=nparams, max_size=nparams))
    slot = draw(st.one_of(st.integers(0, 4), st.just(NO_SLOT), U32))
    header = [slot, code, *params] + [0] * (HEADER_WORDS - 2 - nparams)
    if draw(st.integers(0, 9)) == 0:
        header[draw(st.integers(0, HEADER_WORDS - 1))] = draw(U32)
    if code in BULK_LEN_PARAM:   # a bulk length the fuzzer can fill
        header[2 + BULK_LEN_PARAM[code]] = draw(st.integers(0, 40))
    want = header[2 + BULK_LEN_PARAM[code]] if code in BULK_LEN_PARAM else 0
    n = max(0, want + draw(st.sampled_from([0, 0, 0, 0, -1, 1, -3])))
    return header, draw(st.lists(WORD, min_size=n, max_size=n))


@given(wire_command())
@settings(max_examples=1500, deadline=None)
def test_decode_gives_a_command_or_a_protocol_error(words):
    header, bulk = words
    try:
        cmd = decode(header, bulk)
    except ProtocolError:
        return
    assert cmd.code in NUM_PARAMS and len(cmd.params) == NUM_PARAMS[cmd.code]
    assert encode(cmd) == (header, bulk)   # nothing was dropped or invented


@pytest.fixture(scope="module")
def worker(ckpt_mtp):
    """A worker's command checks over a real shard (one rank: a check runs no collective)."""
    from runtime.executor.runner import ModelRunner
    from runtime.model.weights import load_model
    runner = ModelRunner(load_model(ckpt_mtp, "float64", device="cpu"), kv_cache_tokens=256)
    w = Worker(runner, None, confidence_stop=None)
    # A last forward to read observations, logits rows and three-word proposes off.
    runner.cache.reserve(1, 4)
    w.run_forward(w.check_forward(decode(*encode(forward_command([], [(1, 0, 4)], [1, 2, 3, 4])))))
    return w


@given(wire_command())
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_worker_checks_any_words_into_a_payload_or_a_protocol_error(worker, words):
    header, bulk = words
    try:
        handler, payload = check_command(worker, header, bulk)
    except ProtocolError:
        return
    code = header[1]
    want = {EP_CMD_FORWARD: ForwardPayload, EP_CMD_MTP_PROPOSE_BATCH: ProposePayload,
            EP_CMD_MTP_PROPOSE: ProposePayload, EP_CMD_LOGITS: list, EP_CMD_SHUTDOWN: type(None)}[code]
    assert isinstance(payload, want), (COMMANDS[code], payload)
    if code == EP_CMD_FORWARD:   # what passed the checks is something the shard can run
        assert all(t < worker.vocab_size for t in payload.tokens)
        assert sum(c[2] for c in payload.chunks) == len(payload.tokens)
    if code == EP_CMD_LOGITS:
        assert len(payload) == header[2] and all(r < worker.last_hidden.shape[0] for r in payload)


class _World:
    def __init__(self, world_size: int, rank: int = 0) -> None:
        self.world_size, self.rank = world_size, rank


@given(st.integers(1, (1 << 63) - 1), st.integers(2, 8))
def test_rank0_reads_a_status_as_a_refusal_by_a_worker_or_as_garbage(status, world_size):
    rank, reason = status & 0xFFFF, status >> 16
    if 1 <= rank < world_size and reason == REFUSED_COMMAND:
        assert check_status(_World(world_size), status, "FORWARD") == (rank, REFUSED_COMMAND)
    else:
        with pytest.raises(PeerGarbage, match="names no worker rank"):
            check_status(_World(world_size), status, "FORWARD")


# --- a real worker process on gloo, fed garbage words by a hand-driven rank 0 -----------------------
def _worker(init_method: str, model_dir: str, conn) -> None:
    from launch.mp import worker_main
    from serving.deployment import GroupConfig
    worker_main(1, GroupConfig(model_dir=model_dir, dtype="float32", ep=2, kv_cache_tokens=256, timeout_s=30),
                {}, conn)


def _send_raw(comm: Communicator, header: list[int], bulk: list[int]) -> int:
    """Rank 0's half of one command, with whatever words: header, bulk, then the status word."""
    comm.broadcast(u32_to_words(header, device="cpu"))
    if bulk:
        comm.broadcast(u32_to_words(bulk, device="cpu"))
    return report_status(comm, 0)


GARBAGE = [  # (what, header, bulk): each one a worker must refuse and stay in step after
    ("unknown code", [NO_SLOT, 0x1234, 0, 0, 0, 0, 0, 0], []),
    ("handshake after the start", [0, 0xFFFFFFFE, 5, 2, 1, 2, 1, 0], []),
    ("row count that disagrees with the bulk", [NO_SLOT, EP_CMD_LOGITS, 3, 2, 0, 0, 0, 0], [0, 1]),
    ("layout that does not add up", [NO_SLOT, EP_CMD_FORWARD, 1, 1, 1, 4, 0, 0], [0, 0, 1, 0]),
    ("token outside the vocabulary", encode(forward_command([], [(0, 0, 1)], [0]))[0],
     [0, 0, 1, 0xFFFFFFF0]),
    ("out-of-range count", [3, EP_CMD_MTP_PROPOSE, 1, 1, 0xFFFFFFFF, 0, 0, 0], []),
    ("slot out of range", [0x7FFFFFFF, EP_CMD_MTP_PROPOSE, 1, 1, 1, 0, 0, 0], []),
    ("stray header words", [NO_SLOT, EP_CMD_SHUTDOWN, 0, 0, 0, 0, 0, 9], []),
]


@pytest.mark.timeout(120)
def test_a_worker_process_refuses_garbage_in_one_line_each_and_stays_in_step(ckpt_plain, capfd):
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(init_method, str(ckpt_plain), theirs), daemon=True)
    proc.start()
    ours.send((init_method, 7))   # the generation the worker was started for
    comm = Communicator(rank=0, world_size=2, init_method=init_method, timeout_s=30, device="cpu")
    try:
        driver_handshake(comm, ckpt_plain, "float32", generation=7)
        local = load_shard(ckpt_plain, "float32", comm, "alltoall", 256, False)
        gather_weight_bytes(comm, local)
        gather_rank_info(comm)
        capfd.readouterr()
        for what, header, bulk in GARBAGE:
            status = _send_raw(comm, header, bulk)
            assert check_status(comm, status, what) == (1, REFUSED_COMMAND), what
        # Rank 0's own sending path reads a refusal as one (the deployment restarts the group on it).
        with pytest.raises(CommandRefused, match=r"rank 1 refused LOGITS \(reason 1\)"):
            send_command(comm, Command(EP_CMD_LOGITS, NO_SLOT, (1, 1), [99]))
        send_command(comm, Command(EP_CMD_SHUTDOWN))   # still in step: a valid command runs
        proc.join(timeout=30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        comm.close()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[rank 1]")]
    assert len(lines) == len(GARBAGE) + 1, lines
    assert all("refused command:" in line for line in lines), lines
    for line, want in zip(lines, ["unknown command code 0x00001234", "HANDSHAKE is not a command workers execute",
                                  "LOGITS: 3 rows announced, 2 bulk words", "does not match 4 bulk words",
                                  "outside the vocabulary", "num_drafts 4294967295 out of range",
                                  "slot 2147483647 out of range", "header words past its 0 params"]):
        assert want in line, (line, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("field", ["group generation", "protocol version"])
def test_a_handshake_of_another_generation_or_protocol_is_refused_in_one_line(ckpt_plain, capfd, field):
    """A rank started for an older group (one stopped past the timeout, then continued) never joins a
    newer one; a rank speaking another protocol version never joins at all."""
    from ep.channel import HANDSHAKE_FIELDS, HandshakeError, handshake_words
    from ep.protocol import EP_CMD_HANDSHAKE, PROTOCOL_VERSION
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(init_method, str(ckpt_plain), theirs), daemon=True)
    proc.start()
    ours.send((init_method, 1))
    comm = Communicator(rank=0, world_size=2, init_method=init_method, timeout_s=30, device="cpu")
    try:
        if field == "group generation":
            with pytest.raises(HandshakeError, match="rank 1 has another group generation than rank 0"):
                driver_handshake(comm, ckpt_plain, "float32", generation=2)
        else:   # rank 0's words, but a protocol version from the future
            words = [*handshake_words(ckpt_plain, 2, "float32"), 0]
            words[0] = PROTOCOL_VERSION + 1
            comm.broadcast(u32_to_words(encode(Command(EP_CMD_HANDSHAKE, 1, tuple(words)))[0], device="cpu"))
            reason = check_status(comm, report_status(comm, 0), "HANDSHAKE", HANDSHAKE_FIELDS)
            assert reason == (1, 1) and HANDSHAKE_FIELDS[1] == "protocol version"
        proc.join(timeout=30)
        assert proc.exitcode == 2
    finally:
        if proc.is_alive():
            proc.kill()
        comm.close()
    err = capfd.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("metrale worker rank 1")]
    assert line == f"metrale worker rank 1: HandshakeError: EP handshake failed: rank 1 has another {field} than rank 0"


def test_garbage_in_the_start_gathers_is_a_failed_peer():
    """The pid/host and weight-size gathers refuse impossible words (one rank: the gather is the row itself)."""
    one = Communicator(rank=0, world_size=1, init_method=None, device="cpu")
    runner = type("R", (), {"model": torch.nn.Linear(0, 0)})()
    with pytest.raises(PeerGarbage, match="reports 0 weight bytes"):
        gather_weight_bytes(one, runner)
    assert gather_rank_info(one)[0]["rank"] == 0
