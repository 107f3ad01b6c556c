"""The auto depth controller on synthetic costs and acceptance: it finds the best depth per width
band, including no speculation, follows a change, does not flap, and stays lossless in the engine."""
from __future__ import annotations

import random

import pytest

from speculative.auto_depth import AutoDepthController, width_band


def simulate(ctrl: AutoDepthController, n_active: int, cost_of, accept: list[float], steps: int,
             seed: int = 0) -> list[int]:
    """`steps` decode steps: each costs cost_of(depth) seconds; each of the n sequences' chains
    keeps draft i with probability accept[i] while the earlier ones were kept."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        d = ctrl.depth_for(n_active)
        chosen.append(d)
        for _ in range(n_active if d else 0):
            na = 0
            while na < d and rng.random() < accept[na]:
                na += 1
            ctrl.observe_verify(d, na)
        ctrl.record(n_active, d, cost_of(d))
    return chosen


def test_width_bands():
    assert [width_band(n) for n in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_expected_tokens_from_acceptance():
    ctrl = AutoDepthController(3)
    for _ in range(8):
        ctrl.observe_verify(3, 3)
    for _ in range(2):
        ctrl.observe_verify(3, 0)
    a = ctrl.acceptance()                      # (8 + 1) / (10 + 2) at position 0, then 9 / 10
    assert a == pytest.approx([0.75, 0.9, 0.9])
    assert ctrl.expected_tokens(0) == 1.0
    assert ctrl.expected_tokens(2) == pytest.approx(1 + 0.75 + 0.75 * 0.9)


def test_finds_the_best_depth_and_stays():
    # tokens per second of step: d0 1/10, d1 1.8/12, d2 2.36/13 (best), d3 2.64/16
    costs = {0: 0.010, 1: 0.012, 2: 0.013, 3: 0.016}
    ctrl = AutoDepthController(3, probe_every=4)
    chosen = simulate(ctrl, 1, costs.get, [0.8, 0.7, 0.5], 600)
    assert ctrl.bands[1].current == 2
    assert chosen[-100:].count(2) >= 70  # mostly the best depth; the rest are probes


def test_turns_speculation_off_when_it_does_not_pay():
    costs = {0: 0.010, 1: 0.020, 2: 0.030, 3: 0.040}
    ctrl = AutoDepthController(3, probe_every=4)
    simulate(ctrl, 32, costs.get, [0.8, 0.7, 0.5], 400)
    assert ctrl.bands[32].current == 0


def test_follows_a_change_and_bands_are_independent():
    ctrl = AutoDepthController(3, probe_every=4)
    simulate(ctrl, 2, {0: 0.010, 1: 0.011, 2: 0.020, 3: 0.030}.get, [0.8, 0.7, 0.5], 300)
    assert ctrl.bands[2].current == 1
    simulate(ctrl, 2, {0: 0.010, 1: 0.011, 2: 0.012, 3: 0.030}.get, [0.8, 0.7, 0.5], 600, seed=1)
    assert ctrl.bands[2].current == 2
    simulate(ctrl, 16, {0: 0.010, 1: 0.030, 2: 0.040, 3: 0.050}.get, [0.8, 0.7, 0.5], 300, seed=2)
    assert ctrl.bands[16].current == 0 and ctrl.bands[2].current == 2


def test_a_new_band_starts_no_deeper_than_a_settled_narrower_one():
    """Width 1 learns that speculation does not pay; width 2, opened after, starts at depth 0, not
    at the static ladder's 3. A band opened before any narrower one settled starts at the ladder's,
    and a settled narrower band never raises a start above it."""
    costs = {0: 0.010, 1: 0.020, 2: 0.030, 3: 0.040}
    ctrl = AutoDepthController(3, start_depth=lambda n: 3 if n <= 4 else 1, probe_every=4)
    ctrl.depth_for(8)                            # opened first: the ladder's depth
    assert ctrl.bands[8].current == 1
    simulate(ctrl, 1, costs.get, [0.8, 0.7, 0.5], 300)
    assert ctrl.bands[1].current == 0
    assert ctrl.depth_for(2) == 0 and ctrl.bands[2].current == 0
    assert ctrl.bands[8].current == 1            # unchanged: it had started already
    deep = AutoDepthController(3, start_depth=lambda n: 3 if n <= 4 else 1, probe_every=4)
    simulate(deep, 1, {0: 0.010, 1: 0.0105, 2: 0.011, 3: 0.0115}.get, [0.9, 0.9, 0.9], 300)
    assert deep.bands[1].current == 3
    deep.depth_for(16)
    assert deep.bands[16].current == 1           # the ladder's 1, not the narrower band's 3


def test_hysteresis_keeps_a_near_tie():
    # Acceptance already well measured; every other depth earns 2% more per second than the
    # start depth: not worth a switch.
    ctrl = AutoDepthController(3, probe_every=4, hysteresis=0.05)
    for i in range(3):
        ctrl.reached[i], ctrl.accepted[i] = 100_000, 50_000
    start = ctrl._band(1).current
    cost = {d: ctrl.expected_tokens(d) / (100.0 * (1.02 if d != start else 1.0)) for d in range(4)}
    simulate(ctrl, 1, cost.get, [0.5, 0.5, 0.5], 300)
    assert ctrl.bands[1].current == start
    cost[0] = ctrl.expected_tokens(0) / 110.0   # 10% better: switch
    simulate(ctrl, 1, cost.get, [0.5, 0.5, 0.5], 300)
    assert ctrl.bands[1].current == 0


def test_a_drifting_host_and_a_compile_outlier_do_not_mislead_it():
    # d1 is best: 1.8 tokens for 7.5 ms against 1/10, 2.36/12 and 2.64/16. The host's speed swings
    # 1.6x over a few hundred steps, and each depth's first step costs 50x (it compiles a shape).
    import math
    base = {0: 0.010, 1: 0.0075, 2: 0.012, 3: 0.016}
    seen: set[int] = set()
    t = [0]

    def cost(d):
        t[0] += 1
        first = d not in seen
        seen.add(d)
        return base[d] * (1.3 + 0.3 * math.sin(t[0] / 60)) * (50 if first else 1)

    ctrl = AutoDepthController(3)   # starts at 3, the default probe interval
    chosen = simulate(ctrl, 1, cost, [0.8, 0.7, 0.5], 1500)
    assert ctrl.bands[1].current == 1
    assert chosen[-500:].count(1) >= 450
    # Its cost estimates are in seconds at the host's present speed, in the measured order.
    c = ctrl.bands[1].cost
    assert sorted(c, key=c.get) == [1, 0, 2, 3] and all(0.005 < v < 0.03 for v in c.values())


def test_a_settled_band_probes_less_and_less_until_it_switches():
    # d2 is best by far: the probes of the other depths (3 steps each) thin out to one in
    # 16 * 2**3 steps; when costs change so that d1 wins, it switches and probes at the shortest
    # interval again.
    costs = {0: 0.010, 1: 0.012, 2: 0.009, 3: 0.016}
    ctrl = AutoDepthController(3)
    chosen = simulate(ctrl, 1, costs.get, [0.8, 0.7, 0.5], 3000)
    assert ctrl.bands[1].current == 2
    assert sum(d != 2 for d in chosen[-1280:]) <= 3 * (1280 // 128 + 1)
    assert sum(d != 2 for d in chosen[:400]) >= 400 // 16 - 4     # probing at first
    costs[1] = 0.005
    chosen = simulate(ctrl, 1, costs.get, [0.8, 0.7, 0.5], 3000, seed=1)
    assert ctrl.bands[1].current == 1 and ctrl.bands[1].quiet > 0


def test_steps_just_after_a_change_of_depth_do_not_count():
    # Steady costs make no speculation the best (1 token for 0.85 ms against 2.6 for 2.5 ms), but
    # the first step after a change of depth costs 1.4x and the second 1.1x (caches the other
    # depth filled): one-step probes would see 1.2 ms for depth 0 and keep depth 3.
    steady = {0: 0.00085, 1: 0.0016, 2: 0.0021, 3: 0.0025}
    last, run = [None], [0]

    def cost(d):
        run[0] = run[0] + 1 if d == last[0] else 1
        last[0] = d
        return steady[d] * {1: 1.4, 2: 1.1}.get(run[0], 1.0)

    ctrl = AutoDepthController(3)
    chosen = simulate(ctrl, 1, cost, [0.7, 0.73, 0.73], 1500)
    assert ctrl.bands[1].current == 0
    assert chosen[-500:].count(0) >= 450
    one_step = AutoDepthController(3, probe_run=1, settle=0)   # as before: single-step probes
    last[0], run[0] = None, 0
    simulate(one_step, 1, cost, [0.7, 0.73, 0.73], 1500)
    assert one_step.bands[1].current == 3


def test_a_prefill_unsettles_the_run():
    ctrl = AutoDepthController(3)
    for _ in range(4):
        ctrl.record(1, 3, 0.002)
    assert len(ctrl.bands[1].recent) == 2           # the first two steps of the run were not measured
    ctrl.break_run(1)                               # a step with a prefill in it
    ctrl.record(1, 3, 0.009)
    ctrl.record(1, 3, 0.005)
    assert len(ctrl.bands[1].recent) == 2           # nor the two decode steps after it
    ctrl.record(1, 3, 0.002)
    assert len(ctrl.bands[1].recent) == 3


def test_engine_auto_policy_is_lossless(ckpt_mtp):
    from serving.llm import LLM
    from runtime.sample.sampler import SamplingParams
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[5, 17, 200, 3], [9, 9, 9, 100], [300, 4]]
    plain = [o.token_ids for o in LLM(ckpt_mtp, dtype="float64").generate(prompts, params)]
    llm = LLM(ckpt_mtp, dtype="float64", spec="mtp", num_drafts=3, draft_policy="auto")
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    auto = llm.engine.depth.auto
    assert auto is not None and sum(auto.reached) > 0                  # it measured acceptance
    costs = {w: b.cost for w, b in auto.bands.items()}
    # and step costs (a band whose steps never ran long at one depth has none: short runs are not measured)
    assert any(costs.values()) and all(s > 0 for c in costs.values() for s in c.values())


def test_past_a_clearly_worse_neighbour_nothing_is_probed():
    """A hill climb: from depth 1, the best, both neighbours are measured and found worse, so the
    costly depth 3 is never run; where a neighbour ties the current depth the next one past it is
    tried (a plateau is walked along), and a far better depth is found that way."""
    costs = {0: 0.010, 1: 0.0075, 2: 0.016, 3: 0.030}
    ctrl = AutoDepthController(3, start_depth=lambda n: 1, probe_every=4)
    chosen = simulate(ctrl, 8, costs.get, [0.8, 0.7, 0.5], 800)
    assert ctrl.bands[8].current == 1
    assert 3 not in chosen and chosen.count(0) > 0 and chosen.count(2) > 0
    # 1 and 2 tie (within the 5% hysteresis) and 3 is far better: walked to through 2.
    plateau = AutoDepthController(3, start_depth=lambda n: 1, probe_every=4)
    for i in range(3):
        plateau.reached[i], plateau.accepted[i] = 100_000, 50_000
    e = plateau.expected_tokens
    cost = {0: e(0) / 50.0, 1: e(1) / 100.0, 2: e(2) / 102.0, 3: e(3) / 150.0}
    chosen = simulate(plateau, 1, cost.get, [0.5, 0.5, 0.5], 600)
    assert plateau.bands[1].current == 3 and chosen[-100:].count(3) >= 80
