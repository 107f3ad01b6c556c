"""Recovery of an mp EP group (gloo, EP 2): a killed worker is replaced by its warm standby, a
worker stopped past the timeout never rejoins, and a refused command restarts the group; in
each case the requests finish with an undisturbed run's tokens (float64: batch invariant)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ep.protocol import EP_CMD_LOGITS, NO_SLOT, Command
from launch.mp import MPGroup
from runtime.sample.sampler import SamplingParams
from serving.llm import LLM

PROMPTS = [[5, 17, 200, 3], [9, 9, 9, 100]]
PARAMS = [SamplingParams(max_tokens=40, ignore_eos=True),
          SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=5)]


@pytest.fixture(scope="module")
def want(ckpt_plain) -> list[list[int]]:
    one = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=1024)
    return [o.token_ids for o in one.generate(PROMPTS, PARAMS)]


def serve_in_background(llm: LLM) -> tuple[list, threading.Thread]:
    seqs = [llm.engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    runner = threading.Thread(target=lambda: [llm.step() for _ in iter(llm.engine.has_unfinished, False)])
    runner.start()
    while seqs[0].num_output < 5 and runner.is_alive():
        time.sleep(0.005)
    return seqs, runner


def wait_for_standby(group: MPGroup, timeout_s: float = 60) -> int:
    """The standby's pid once it has loaded its shard (its CPU time stops growing)."""
    [proc] = group.standby.values()
    deadline, last = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        ticks = sum(map(int, open(f"/proc/{proc.process.pid}/stat").read().rsplit(")", 1)[1].split()[11:13]))
        if ticks == last:
            return proc.process.pid
        last = ticks
        time.sleep(0.5)
    pytest.fail("the standby kept busy")


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(180)
def test_a_killed_worker_is_replaced_by_its_warm_standby(ckpt_plain, want):
    llm = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=1024, ep=2, launcher=MPGroup, ep_timeout_s=30,
              max_restarts=2)
    try:
        group = llm.deployment.group
        first, spare = group.pids[0], wait_for_standby(group)
        seqs, runner = serve_in_background(llm)
        os.kill(first, signal.SIGKILL)
        runner.join(timeout=120)
        assert not runner.is_alive()
        assert [s.output_ids for s in seqs] == want
        assert llm.deployment.restarts == 1
        assert group.pids == [spare] and llm.rank_info[1]["pid"] == spare   # the standby took rank 1
        assert group.generation == 2 and group.standby_pids and group.standby_pids[0] not in (first, spare)
    finally:
        llm.shutdown()
    assert not alive(spare) and not any(alive(p) for p in group.standby_pids)   # nothing outlives the group


@pytest.mark.timeout(180)
def test_a_worker_stopped_past_the_timeout_never_rejoins(ckpt_plain, want):
    llm = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=1024, ep=2, launcher=MPGroup, ep_timeout_s=6,
              max_restarts=2)
    try:
        group = llm.deployment.group
        stale = group.pids[0]
        seqs, runner = serve_in_background(llm)
        os.kill(stale, signal.SIGSTOP)
        while llm.deployment.restarts == 0 and runner.is_alive():
            time.sleep(0.05)
        try:
            os.kill(stale, signal.SIGCONT)
        except ProcessLookupError:   # already reaped: the restart killed it
            pass
        runner.join(timeout=120)
        assert not runner.is_alive()
        assert [s.output_ids for s in seqs] == want
        assert llm.deployment.restarts == 1 and stale not in group.pids and not alive(stale)
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == want   # the new group serves on
    finally:
        llm.shutdown()


@pytest.mark.timeout(180)
def test_a_refused_command_restarts_the_group_and_loses_nothing(ckpt_plain, want):
    """Rank 0 never reads a worker's refusal as data: the group restarts (here cold: no standby)
    and the requests go on."""
    llm = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=1024, ep=2, launcher=MPGroup, ep_timeout_s=30,
              max_restarts=1, warm_standby=False)
    try:
        assert llm.deployment.group.standby == {}
        driver = llm.engine.runner
        forward, sent = driver.forward, []

        def garbage_once(tokens, chunks):
            if not sent and llm.engine.scheduler.running and llm.engine.scheduler.running[0].num_output >= 3:
                sent.append(1)
                driver.send(Command(EP_CMD_LOGITS, NO_SLOT, (1, 1), [10 ** 6]))   # a row no forward has
            return forward(tokens, chunks)
        driver.forward = garbage_once
        got = llm.generate(PROMPTS, PARAMS)
        assert sent and llm.deployment.restarts == 1 and llm.deployment.group.standby == {}
        assert [o.token_ids for o in got] == want
    finally:
        llm.shutdown()
