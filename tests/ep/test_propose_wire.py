"""Which propose goes on the wire at EP 2 (gloo, mp launcher, float64): the seed's three-word
MTP_PROPOSE whenever one sequence decodes a chain alone, the batched form otherwise, and the
same tokens, drafts and acceptance as one rank either way."""
from __future__ import annotations

from collections import Counter

import pytest

from launch.mp import MPGroup
from runtime.sample.sampler import SamplingParams
from engine.sequence import RequestOutput
from serving.llm import LLM

SHORT, BATCH = "MTP_PROPOSE", "MTP_PROPOSE_BATCH"
PROMPT = [5, 17, 200, 3]
PROMPTS = [[5, 17, 200, 3], [9, 9, 9, 100, 250, 31, 7, 64, 12]]


def record_drafts(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """Every chain rank 0's drafter returns from now on, as (tokens, top-1 probabilities). The
    probabilities see every rank's share of the drafter: a worker fed other inputs than rank 0
    changes them even where the arg-max survives."""
    proposer, got = llm.engine.proposer, []
    propose_batch = proposer.propose_batch

    def recording(reqs):
        out = propose_batch(reqs)
        got.extend((d.tokens, d.probs) for d in out)
        return out
    proposer.propose_batch = recording
    return got


def same_drafts(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]]) -> bool:
    """The same tokens; probabilities equal up to float32 rounding (the drafter's softmax runs in float32)."""
    return len(a) == len(b) and all(ta == tb and all(abs(x - y) <= 1e-5 * y for x, y in zip(pa, pb))
                                    for (ta, pa), (tb, pb) in zip(a, b))


def stepwise(llm: LLM, prompts: list[list[int]], params: SamplingParams
             ) -> tuple[list[RequestOutput], dict[int, Counter]]:
    """Serve `prompts` one engine step at a time; returns the outputs and the proposes rank 0 sent
    in steps that began with that many running sequences (width -> command name -> count)."""
    runner = llm.engine.runner
    seqs = [llm.engine.add_request(p, params) for p in prompts]
    by_width: dict[int, Counter] = {}
    while llm.engine.has_unfinished():
        width = len(llm.engine.scheduler.running)
        before = Counter(runner.sent)
        llm.step()
        sent = Counter(runner.sent)
        sent.subtract(before)
        by_width.setdefault(width, Counter()).update({k: n for k, n in sent.items() if k in (SHORT, BATCH) and n})
    return [RequestOutput.of(i, s) for i, s in enumerate(seqs)], by_width


def summary(outs: list[RequestOutput]) -> list[tuple]:
    return [(o.token_ids, o.drafted_tokens, o.accepted_tokens, o.num_verifies) for o in outs]


def one_rank(path, prompts, params, stop=None) -> tuple[list[tuple], list]:
    llm = LLM(path, dtype="float64", kv_cache_tokens=2048, spec="mtp", num_drafts=3, draft_confidence_stop=stop)
    try:
        drafts = record_drafts(llm)
        return summary(llm.generate(prompts, params)), drafts
    finally:
        llm.shutdown()


def two_ranks(path, prompts, params, stop=None) -> tuple[list[tuple], list, dict[int, Counter]]:
    llm = LLM(path, dtype="float64", kv_cache_tokens=2048, spec="mtp", num_drafts=3, draft_confidence_stop=stop,
              ep=2, launcher=MPGroup, ep_timeout_s=60)
    try:
        assert type(llm.engine.runner).__name__ == "DriverRunner"
        drafts = record_drafts(llm)
        outs, by_width = stepwise(llm, prompts, params)
        return summary(outs), drafts, by_width
    finally:
        llm.shutdown()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("params, stop", [(SamplingParams(max_tokens=24, ignore_eos=True), None),
                                          (SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3),
                                           0.3)],
                         ids=["greedy", "seeded-stop"])
def test_width_one_sends_three_words_and_equals_one_rank(ckpt_mtp, params, stop):
    """One sequence decoding MTP chains: after the first propose (it follows the prefill, so it is
    batched) every propose is the three words, and the workers, drafting with the handshake's
    TAU, reach the same drafts as rank 0 (else the group would hang or the acceptance differ)."""
    want, want_drafts = one_rank(ckpt_mtp, [PROMPT], params, stop)
    got, drafts, by_width = two_ranks(ckpt_mtp, [PROMPT], params, stop)
    assert got == want
    assert same_drafts(drafts, want_drafts)
    assert want[0][3] > 2                          # it verified often enough to matter
    sent = by_width[1]
    assert sent[SHORT] > sent[BATCH] and sent[BATCH] >= 1, by_width
    assert sent[SHORT] + sent[BATCH] >= want[0][3], by_width   # a propose before every verify


@pytest.mark.timeout(240)
def test_width_two_sends_only_the_batched_form_and_equals_one_rank(ckpt_mtp):
    """Two sequences drafting together: every propose of a width-2 step is the batched form; when
    one finishes first the other may go on with three words. Tokens and acceptance equal one rank."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want, want_drafts = one_rank(ckpt_mtp, PROMPTS, params)
    got, drafts, by_width = two_ranks(ckpt_mtp, PROMPTS, params)
    assert got == want
    assert same_drafts(drafts, want_drafts)
    assert by_width[2][BATCH] > 2 and by_width[2][SHORT] == 0, by_width


# --- a worker's checks, in process (no group needed: a refusal happens before any collective) ---
@pytest.fixture(scope="module")
def mtp_runner(ckpt_mtp):
    from runtime.executor.runner import ModelRunner
    from runtime.model.weights import load_model
    return ModelRunner(load_model(ckpt_mtp, "float64", device="cpu"), kv_cache_tokens=256)


def test_workers_dispatch_every_command_through_one_table():
    from ep.protocol import COMMANDS, EP_CMD_HANDSHAKE, SLOT_OPS
    from ep.worker import HANDLERS
    assert set(HANDLERS) == set(COMMANDS) - {EP_CMD_HANDSHAKE, *SLOT_OPS}


def test_worker_refuses_a_propose_it_cannot_run_as_rank_0_does(mtp_runner):
    from ep.protocol import (ProtocolError, decode, encode, forward_command, mtp_propose_command,
                             propose_batch_command)
    from ep.worker import Worker
    from speculative.proposer import ProposerState
    worker = Worker(mtp_runner, None, confidence_stop=0.5)
    batch = decode(*encode(propose_batch_command([], [], [(0, 3, [1])], stop=0.3)))
    with pytest.raises(ProtocolError, match="confidence stop 0.30000001192092896, but the group agreed on 0.5"):
        worker.check_propose_batch(batch)
    # Three words with no forward to read them off, then after a forward of another slot.
    short = decode(*encode(mtp_propose_command(2, 7, 13, 3)))
    with pytest.raises(ProtocolError, match="position 13 of slot 2 does not follow a verified chain"):
        worker.check_propose(short)
    mtp_runner.cache.reserve(1, 4)
    worker.run_forward(worker.check_forward(decode(*encode(forward_command([], [(1, 0, 4)], [1, 2, 3, 4])))))
    with pytest.raises(ProtocolError, match="does not follow a verified chain"):
        worker.check_propose(short)
    # Slot 1's chunk of the last forward: with position 3 it reads as a chain verified from 0 with two
    # drafts accepted; the checks refuse it when the worker's drafter or cache is not where rank 0's is.
    ok = decode(*encode(mtp_propose_command(1, 7, 3, 2)))
    assert worker.check_propose(ok).obs == [(1, 0, 3, 0)] and worker.check_propose(ok).seqs == [(1, 2, [2, 3, 7])]
    worker.mirror.states[1] = ProposerState(seq_id=1, fed_upto=1)
    with pytest.raises(ProtocolError, match="slot 1's drafter expects position 1 next"):
        worker.check_propose(ok)
    del worker.mirror.states[1]
    mtp_runner.cache.rewind(1, 2)
    with pytest.raises(ProtocolError, match="slot 1 holds 2 tokens, cannot rewind to 3"):
        worker.check_propose(ok)
    mtp_runner.cache.free(1)
