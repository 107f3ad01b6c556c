"""The auto depth controller on synthetic step costs: it finds the best depth per width band,
including no speculation, follows a change, and does not flap."""
from __future__ import annotations

from speculative.auto_depth import AutoDepthController, width_band


def simulate(ctrl: AutoDepthController, n_active: int, rate_of, steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        d = ctrl.depth_for(n_active)
        chosen.append(d)
        tokens = n_active * 10
        ctrl.record(n_active, d, tokens / rate_of(d), tokens)
    return chosen


def test_width_bands():
    assert [width_band(n) for n in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_finds_the_best_depth_and_stays():
    rates = {0: 100.0, 1: 130.0, 2: 150.0, 3: 120.0}
    ctrl = AutoDepthController(3, probe_every=4)
    chosen = simulate(ctrl, 1, rates.get, 400)
    assert ctrl.bands[1].current == 2
    tail = chosen[-100:]
    assert tail.count(2) >= 70  # mostly the best depth; the rest are probes


def test_turns_speculation_off_when_it_does_not_pay():
    rates = {0: 900.0, 1: 750.0, 2: 700.0, 3: 650.0}
    ctrl = AutoDepthController(3, probe_every=4)
    simulate(ctrl, 32, rates.get, 400)
    assert ctrl.bands[32].current == 0


def test_follows_a_change_and_bands_are_independent():
    ctrl = AutoDepthController(3, probe_every=4)
    simulate(ctrl, 2, {0: 100.0, 1: 200.0, 2: 120.0, 3: 110.0}.get, 300)
    assert ctrl.bands[2].current == 1
    simulate(ctrl, 2, {0: 100.0, 1: 120.0, 2: 220.0, 3: 130.0}.get, 600)
    assert ctrl.bands[2].current == 2
    simulate(ctrl, 16, {0: 500.0, 1: 400.0, 2: 300.0, 3: 200.0}.get, 300)
    assert ctrl.bands[16].current == 0 and ctrl.bands[2].current == 2


def test_hysteresis_keeps_a_near_tie():
    ctrl = AutoDepthController(3, probe_every=4, hysteresis=0.05)
    start = ctrl._band(1).current
    simulate(ctrl, 1, lambda d: 100.0 + (2.0 if d != start else 0.0), 200)
    assert ctrl.bands[1].current == start   # 2% better is not worth a switch


def test_engine_auto_policy_is_lossless(ckpt_mtp):
    from runtime.llm import LLM
    from runtime.sampler import SamplingParams
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[5, 17, 200, 3], [9, 9, 9, 100], [300, 4]]
    plain = [o.token_ids for o in LLM(ckpt_mtp, dtype="float64").generate(prompts, params)]
    llm = LLM(ckpt_mtp, dtype="float64", spec="mtp", num_drafts=3, draft_policy="auto")
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.auto is not None and llm.engine.auto.bands  # it measured something
