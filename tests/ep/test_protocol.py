"""The command protocol: round trips, refusals with named reasons, u32 on int32 wires."""
from __future__ import annotations

import pytest
import torch

from ep.comm import u32_to_words, words_to_u32
from ep.protocol import (COMMANDS, EP_CMD_FORWARD, EP_CMD_HANDSHAKE, EP_CMD_LOGITS, EP_CMD_MTP_PROPOSE,
                         EP_CMD_SHUTDOWN, EP_CMD_SLOT_FREE, EP_CMD_SLOT_RESERVE, EP_CMD_SLOT_REWIND, HEADER_WORDS,
                         NO_SLOT, Command, ProtocolError, decode, encode, forward_command, mtp_propose_command,
                         parse_forward)


def roundtrip(cmd: Command) -> Command:
    header, bulk = encode(cmd)
    assert len(header) == HEADER_WORDS
    # through the wire format: int32 bit patterns
    header = words_to_u32(u32_to_words(header))
    bulk = words_to_u32(u32_to_words(bulk)) if bulk else []
    return decode(header, bulk)


def test_codes_are_at_the_top_of_u32_and_unique():
    assert EP_CMD_SHUTDOWN == 0xFFFFFFFF and EP_CMD_MTP_PROPOSE == 0xFFFFFFF5
    assert len(set(COMMANDS)) == len(COMMANDS)
    assert all(code >= 0xFFFFFF00 for code in COMMANDS)


def test_u32_words_survive_int32_transport():
    values = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
    w = u32_to_words(values)
    assert w.dtype == torch.int32 and w.tolist()[3] == -(1 << 31)
    assert words_to_u32(w) == values
    with pytest.raises(ValueError, match="u32"):
        u32_to_words([1 << 32])


def test_every_command_round_trips():
    fwd = forward_command([(EP_CMD_SLOT_RESERVE, 3, 17), (EP_CMD_SLOT_REWIND, 3, 12), (EP_CMD_SLOT_FREE, 1, 0)],
                          [(3, 10, 2), (7, 0, 3)], [5, 6, 7, 8, 9])
    cmds = [Command(EP_CMD_SHUTDOWN), Command(EP_CMD_HANDSHAKE, NO_SLOT, (1, 2, 0xDEADBEEF, 0xFFFFFFFF, 3)), fwd,
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
    from ep.protocol import parse_propose_batch, propose_batch_command
    cmd = propose_batch_command([(EP_CMD_SLOT_REWIND, 2, 9)], [(2, 0, 3, 7)], [(2, 3, [11, 12, 13]), (5, 1, [4])], 0.5)
    p = parse_propose_batch(roundtrip(cmd), vocab_size=20)
    assert p.ops == [(EP_CMD_SLOT_REWIND, 2, 9)] and p.obs == [(2, 0, 3, 7)] and p.stop == 0.5
    assert p.seqs == [(2, 3, [11, 12, 13]), (5, 1, [4])]
    with pytest.raises(ProtocolError, match="token 13 outside the vocabulary of 13"):
        parse_propose_batch(roundtrip(cmd), vocab_size=13)
    bad = propose_batch_command([], [], [(2, 0, [1])])
    with pytest.raises(ProtocolError, match="num_drafts 0 out of range"):
        parse_propose_batch(roundtrip(bad), vocab_size=20)
    good = propose_batch_command([], [], [(2, 1, [1])])
    short = Command(good.code, good.slot, (2, 0, 4, 0, 0), good.bulk)
    with pytest.raises(ProtocolError, match="truncated payload at sequence 1"):
        parse_propose_batch(short, vocab_size=20)


def test_forward_carries_tree_parents_and_row_moves():
    from ep.protocol import EP_CMD_SLOT_MOVE
    from runtime.kv_cache import pack_move, unpack_move
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
