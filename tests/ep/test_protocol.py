"""The command protocol: round trips, refusals with named reasons, u32 on int32 wires."""
from __future__ import annotations

import pytest
import torch

from ep.comm import u32_to_words, words_to_u32
from ep.protocol import (COMMANDS, EP_CMD_FORWARD, EP_CMD_HANDSHAKE, EP_CMD_LOGITS, EP_CMD_MTP_PROPOSE,
                         EP_CMD_MTP_PROPOSE_BATCH, EP_CMD_SHUTDOWN, EP_CMD_SLOT_FREE, EP_CMD_SLOT_RESERVE,
                         EP_CMD_SLOT_REWIND, HEADER_WORDS, NO_SLOT, PROTOCOL_VERSION, Command, ForwardPayload,
                         ProposePayload, ProtocolError, bits_float, bulk_len, decode, derive_propose, encode,
                         float_bits, forward_command, mtp_propose_command, parse_forward, parse_propose,
                         parse_propose_batch, parse_stop, propose_command)


def roundtrip(cmd: Command) -> Command:
    header, bulk = encode(cmd)
    assert len(header) == HEADER_WORDS
    # through the wire format: int32 bit patterns
    header = words_to_u32(u32_to_words(header, device="cpu"))
    bulk = words_to_u32(u32_to_words(bulk, device="cpu")) if bulk else []
    return decode(header, bulk)


def test_codes_are_at_the_top_of_u32_and_unique():
    assert EP_CMD_SHUTDOWN == 0xFFFFFFFF and EP_CMD_MTP_PROPOSE == 0xFFFFFFF5
    assert len(set(COMMANDS)) == len(COMMANDS)
    assert all(code >= 0xFFFFFF00 for code in COMMANDS)


def test_u32_words_survive_int32_transport():
    values = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
    w = u32_to_words(values, device="cpu")
    assert w.dtype == torch.int32 and w.tolist()[3] == -(1 << 31)
    assert words_to_u32(w) == values
    with pytest.raises(ValueError, match="u32"):
        u32_to_words([1 << 32], device="cpu")


def test_every_command_round_trips():
    fwd = forward_command([(EP_CMD_SLOT_RESERVE, 3, 17), (EP_CMD_SLOT_REWIND, 3, 12), (EP_CMD_SLOT_FREE, 1, 0)],
                          [(3, 10, 2), (7, 0, 3)], [5, 6, 7, 8, 9])
    cmds = [Command(EP_CMD_SHUTDOWN), Command(EP_CMD_HANDSHAKE, NO_SLOT, (1, 2, 0xDEADBEEF, 0xFFFFFFFF, 3, 0)), fwd,
            Command(EP_CMD_LOGITS, NO_SLOT, (3, 3), [0, 4, 2]), mtp_propose_command(5, 4095, 1234, 3)]
    for cmd in cmds:
        got = roundtrip(cmd)
        assert (got.code, got.slot, got.params, got.bulk) == (cmd.code, cmd.slot, cmd.params, cmd.bulk)
    p = parse_forward(roundtrip(fwd), vocab_size=10)
    assert p.ops == [(EP_CMD_SLOT_RESERVE, 3, 17), (EP_CMD_SLOT_REWIND, 3, 12), (EP_CMD_SLOT_FREE, 1, 0)]
    assert p.chunks == [(3, 10, 2), (7, 0, 3)] and p.tokens == [5, 6, 7, 8, 9]
    mtp = roundtrip(mtp_propose_command(5, 4095, 1234, 3))
    assert mtp.params == (4095, 1234, 3) and mtp.slot == 5  # exactly three words after the code


def test_refusals_name_the_problem():
    header, bulk = encode(forward_command([], [(1, 0, 3)], [1, 2, 3]))
    with pytest.raises(ProtocolError, match="truncated payload, 5 of 6"):
        decode(header, bulk[:-1])
    with pytest.raises(ProtocolError, match="truncated header"):
        decode(header[:5], bulk)
    with pytest.raises(ProtocolError, match="unknown command code 0x12345678"):
        decode([0, 0x12345678] + [0] * 6, [])
    with pytest.raises(ProtocolError, match="slot 2147483648 out of range"):
        decode([1 << 31, EP_CMD_SHUTDOWN] + [0] * 6, [])
    with pytest.raises(ProtocolError, match="token 10 outside the vocabulary of 10"):
        parse_forward(decode(*encode(forward_command([], [(1, 0, 2)], [3, 10]))), vocab_size=10)
    with pytest.raises(ProtocolError, match="slot 1073741824 out of range"):
        parse_forward(decode(*encode(forward_command([(EP_CMD_SLOT_FREE, 1 << 30, 0)], [(1, 0, 1)], [3]))),
                      vocab_size=10)
    with pytest.raises(ProtocolError, match="do not add up"):
        parse_forward(decode(*encode(forward_command([], [(1, 0, 2)], [3]))), vocab_size=10)
    with pytest.raises(ProtocolError, match="unknown slot op"):
        parse_forward(decode(*encode(forward_command([(EP_CMD_LOGITS, 1, 0)], [(1, 0, 1)], [3]))), vocab_size=10)
    with pytest.raises(ProtocolError, match="u32"):
        encode(Command(EP_CMD_LOGITS, NO_SLOT, (1, 1), [-1]))


def test_forward_layout_is_checked():
    cmd = forward_command([], [(1, 0, 2)], [3, 4])
    bad = Command(EP_CMD_FORWARD, NO_SLOT, (0, 1, 3, 5, 0, 0), cmd.bulk + [0, 0, 0])
    with pytest.raises(ProtocolError, match="does not match"):
        parse_forward(bad, vocab_size=10)


def test_propose_batch_round_trip_and_refusals():
    from ep.protocol import propose_batch_command
    cmd = propose_batch_command([(EP_CMD_SLOT_REWIND, 2, 9)], [(2, 0, 3, 7)], [(2, 3, [11, 12, 13]), (5, 1, [4])], 0.5)
    p, stop = parse_propose_batch(roundtrip(cmd), vocab_size=20)
    assert p.ops == [(EP_CMD_SLOT_REWIND, 2, 9)] and p.obs == [(2, 0, 3, 7)] and stop == 0.5
    assert p.seqs == [(2, 3, [11, 12, 13]), (5, 1, [4])]
    with pytest.raises(ProtocolError, match="token 13 outside the vocabulary of 13"):
        parse_propose_batch(roundtrip(cmd), vocab_size=13)
    feed_only = propose_batch_command([], [], [(2, 0, [1])])
    assert parse_propose_batch(roundtrip(feed_only), vocab_size=20)[0].seqs == [(2, 0, [1])]
    bad = propose_batch_command([], [], [(2, 17, [1])])
    with pytest.raises(ProtocolError, match="num_drafts 17 out of range"):
        parse_propose_batch(roundtrip(bad), vocab_size=20)
    good = propose_batch_command([], [], [(2, 1, [1])])
    short = Command(good.code, good.slot, (2, 0, 4, 0, 0), good.bulk)
    with pytest.raises(ProtocolError, match="truncated payload at sequence 1"):
        parse_propose_batch(short, vocab_size=20)


def test_forward_carries_tree_parents_and_row_moves():
    from ep.protocol import EP_CMD_SLOT_MOVE
    from runtime.executor.kv_cache import pack_move, unpack_move
    ops = [(EP_CMD_SLOT_MOVE, 3, pack_move(14, 11)), (EP_CMD_SLOT_REWIND, 3, 12)]
    cmd = forward_command(ops, [(3, 10, 6), (7, 0, 2)], [1, 2, 3, 4, 5, 6, 7, 8],
                          trees={0: [-1, 0, 1, 2, 1, 2]})
    assert cmd.params == (2, 2, 8, 6 + 6 + 8 + 7, 0, 7)
    p = parse_forward(roundtrip(cmd), vocab_size=10)
    assert p.ops == ops and p.trees == {0: [-1, 0, 1, 2, 1, 2]}
    assert unpack_move(p.ops[0][2]) == (14, 11) and pack_move(14, 11) == 11 << 3 | 3
    assert parse_forward(roundtrip(forward_command([], [(1, 0, 2)], [3, 4])), vocab_size=10).trees == {}
    for trees, match in (({0: [0, 0]}, "not a tree"), ({0: [-1, 1]}, "not a tree"), ({1: [-1, 0]}, "out of range")):
        with pytest.raises(ProtocolError, match=match):
            parse_forward(roundtrip(forward_command([], [(1, 0, 2)], [3, 4], trees=trees)), vocab_size=10)
    short = forward_command([], [(1, 0, 2)], [3, 4], trees={0: [-1, 0]})
    cut = Command(short.code, short.slot, (*short.params[:3], short.params[3] - 1, 0, 2), short.bulk[:-1])
    with pytest.raises(ProtocolError, match="truncated tree of chunk 0"):
        parse_forward(cut, vocab_size=10)
    with pytest.raises(ValueError, match="only 1..7 rows back"):
        pack_move(19, 11)


# --- the seed's three-word MTP_PROPOSE ---------------------------------------------------------
def test_three_word_propose_is_exactly_three_params_and_no_bulk():
    header, bulk = encode(mtp_propose_command(4, 7, 13, 3))
    assert header == [4, 0xFFFFFFF5, 7, 13, 3, 0, 0, 0] and bulk == []
    assert bulk_len(header) == 0
    cmd = decode(header, [])
    assert parse_propose(cmd, vocab_size=8) == (7, 13, 3)
    with pytest.raises(ProtocolError, match=r"MTP_PROPOSE: header words past its 3 params are \[0, 9, 0\]"):
        decode(header[:6] + [9, 0], [])
    with pytest.raises(ProtocolError, match="MTP_PROPOSE: 1 bulk words, the header announces 0"):
        decode(header, [5])


def test_three_word_propose_ranges_are_checked():
    assert parse_propose(roundtrip(mtp_propose_command(0, 7, 1, 1)), vocab_size=8) == (7, 1, 1)
    assert parse_propose(roundtrip(mtp_propose_command(0, 0, 99, 16)), vocab_size=8) == (0, 99, 16)
    for cmd, match in ((mtp_propose_command(0, 8, 13, 3), "MTP_PROPOSE: token 8 outside the vocabulary of 8"),
                       (mtp_propose_command(0, 7, 13, 0), r"num_drafts 0 out of range \(1..16\)"),
                       (mtp_propose_command(0, 7, 13, 17), r"num_drafts 17 out of range \(1..16\)"),
                       (mtp_propose_command(0, 7, 0, 3), "position 0"),
                       (Command(EP_CMD_MTP_PROPOSE, NO_SLOT, (7, 13, 3)), "no slot")):
        with pytest.raises(ProtocolError, match=match):
            parse_propose(roundtrip(cmd), vocab_size=8)


def test_handshake_carries_the_confidence_stop_as_float32_bits():
    assert float_bits(None) == 0 and bits_float(0) is None
    assert float_bits(0.5) == 0x3F000000 and bits_float(0x3F000000) == 0.5
    cmd = roundtrip(Command(EP_CMD_HANDSHAKE, NO_SLOT, (PROTOCOL_VERSION, 2, 1, 2, 3, float_bits(0.3))))
    assert len(cmd.params) == 6 and cmd.params[5] == 0x3E99999A
    tau = parse_stop(cmd.params[5], "HANDSHAKE")
    assert tau == 0.30000001192092896 and tau != 0.3          # float32-exact: what every rank drafts with
    assert parse_stop(0, "HANDSHAKE") is None
    for bad in (1.0, 1.5, -0.25):
        with pytest.raises(ProtocolError, match="HANDSHAKE: confidence stop .* outside"):
            parse_stop(float_bits(bad), "HANDSHAKE")


# A verify forward of slot 4 at width 1: the pending token 100 at position 10, then drafts 101, 102, 103.
VERIFY = ForwardPayload(ops=[], chunks=[(4, 10, 4)], tokens=[100, 101, 102, 103], obs=[])


def test_derive_propose_after_a_chain_verify():
    # Two drafts accepted, the bonus 7 at position 13; the next step drafts 3.
    assert derive_propose(VERIFY, 4, 7, 13, 3) == ProposePayload(
        ops=[(EP_CMD_SLOT_REWIND, 4, 13), (EP_CMD_SLOT_RESERVE, 4, 17)],
        obs=[(4, 0, 3, 10)], seqs=[(4, 3, [101, 102, 7])])
    # None accepted: only the pending token's row is observed; the next step drafts 1.
    assert derive_propose(VERIFY, 4, 9, 11, 1) == ProposePayload(
        ops=[(EP_CMD_SLOT_REWIND, 4, 11), (EP_CMD_SLOT_RESERVE, 4, 13)], obs=[(4, 0, 1, 10)], seqs=[(4, 1, [9])])
    # All three accepted.
    assert derive_propose(VERIFY, 4, 5, 14, 2) == ProposePayload(
        ops=[(EP_CMD_SLOT_REWIND, 4, 14), (EP_CMD_SLOT_RESERVE, 4, 17)],
        obs=[(4, 0, 4, 10)], seqs=[(4, 2, [101, 102, 103, 5])])
    # The chunk's rows start after another sequence's chunk in the same forward.
    two = ForwardPayload(ops=[], chunks=[(2, 0, 5), (4, 10, 4)], tokens=[1, 2, 3, 4, 5, 100, 101, 102, 103], obs=[])
    assert derive_propose(two, 4, 7, 13, 3) == ProposePayload(
        ops=[(EP_CMD_SLOT_REWIND, 4, 13), (EP_CMD_SLOT_RESERVE, 4, 17)],
        obs=[(4, 5, 3, 10)], seqs=[(4, 3, [101, 102, 7])])


def test_derive_propose_stands_for_nothing_without_a_chain_of_that_slot():
    assert derive_propose(None, 4, 7, 13, 3) is None
    assert derive_propose(VERIFY, 5, 7, 13, 3) is None                       # another slot
    assert derive_propose(VERIFY, 4, 7, 10, 3) is None                       # before the pending token
    assert derive_propose(VERIFY, 4, 7, 15, 3) is None                       # past the chunk's rows
    tree = ForwardPayload(ops=[], chunks=[(4, 10, 4)], tokens=[100, 101, 102, 103], obs=[], trees={0: [-1, 0, 1, 1]})
    assert derive_propose(tree, 4, 7, 13, 3) is None
    twice = ForwardPayload(ops=[], chunks=[(4, 10, 2), (4, 12, 2)], tokens=[100, 101, 102, 103], obs=[])
    assert derive_propose(twice, 4, 7, 13, 3) is None


def propose_over_the_wire(last: ForwardPayload, payload: ProposePayload, pending: list[tuple[int, int]],
                          stop: float | None = None):
    """What rank 0 sends for `payload`, decoded and expanded as a worker does."""
    cmd = roundtrip(propose_command(last, payload, stop, pending))
    if cmd.code == EP_CMD_MTP_PROPOSE:
        return cmd, derive_propose(last, cmd.slot, *parse_propose(cmd, vocab_size=1000))
    return cmd, parse_propose_batch(cmd, vocab_size=1000)[0]


def test_rank0_sends_three_words_only_when_the_workers_derive_the_same_payload():
    chain = ProposePayload(ops=[(EP_CMD_SLOT_REWIND, 4, 13), (EP_CMD_SLOT_RESERVE, 4, 17)],
                           obs=[(4, 0, 3, 10)], seqs=[(4, 3, [101, 102, 7])])
    cmd, got = propose_over_the_wire(VERIFY, chain, [(7, 13)], stop=0.5)
    assert (cmd.code, cmd.slot, cmd.params, cmd.bulk) == (EP_CMD_MTP_PROPOSE, 4, (7, 13, 3), [])
    assert got == chain

    # Each of these is what rank 0 would really carry; none is what three words stand for.
    two_seqs = ProposePayload(ops=chain.ops + [(EP_CMD_SLOT_RESERVE, 6, 30)], obs=chain.obs + [(6, 4, 1, 25)],
                              seqs=chain.seqs + [(6, 2, [44])])
    verify_two = ForwardPayload(ops=[], chunks=[(4, 10, 4), (6, 25, 1)], tokens=[100, 101, 102, 103, 43], obs=[])
    a_free = ProposePayload(ops=chain.ops + [(EP_CMD_SLOT_FREE, 9, 0)], obs=chain.obs, seqs=chain.seqs)
    tree = ForwardPayload(ops=[], chunks=[(4, 10, 4)], tokens=[100, 101, 102, 103], obs=[], trees={0: [-1, 0, 1, 2]})
    # After a prefill of 6 prompt tokens and the sampled token 7 at position 6: no rewind.
    prefill = ForwardPayload(ops=[(EP_CMD_SLOT_RESERVE, 4, 6)], chunks=[(4, 0, 6)], tokens=[1, 2, 3, 4, 5, 6], obs=[])
    after_prefill = ProposePayload(ops=[(EP_CMD_SLOT_RESERVE, 4, 10)], obs=[(4, 0, 6, 0)],
                                   seqs=[(4, 3, [2, 3, 4, 5, 6, 7])])
    assert derive_propose(prefill, 4, 7, 6, 3) != after_prefill
    shifted = ProposePayload(ops=chain.ops, obs=chain.obs, seqs=[(4, 3, [102, 7, 7])])   # another feed
    for last, payload, pending in ((verify_two, two_seqs, [(7, 13), (44, 26)]), (VERIFY, a_free, [(7, 13)]),
                                   (tree, chain, [(7, 13)]), (prefill, after_prefill, [(7, 6)]),
                                   (VERIFY, shifted, [(7, 13)])):
        cmd, got = propose_over_the_wire(last, payload, pending, stop=0.5)
        assert cmd.code == EP_CMD_MTP_PROPOSE_BATCH and got == payload


def test_a_tree_over_an_empty_chunk_is_refused_not_a_crash():
    # Found by tests/ep/test_wire_fuzz.py: the tree's root was read before the chunk sizes were checked.
    header = [NO_SLOT, EP_CMD_FORWARD, 0, 2, 3, 12, 0, 3]
    bulk = [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0xFFFFFFFF, 0]
    with pytest.raises(ProtocolError, match=r"chunk sizes \[0, 1\] do not add up to 3 tokens"):
        parse_forward(decode(header, bulk), vocab_size=10)
