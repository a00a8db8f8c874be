"""The adaptive policy's switches: what the first step of a run costs, how that weighs on
probes and on leaving a kind, buckets without costs of their own, the overlap scheduler's
two-step plain probes, the running mean acceptance and the step clock (synthetic streams of
costs and acceptance; no engine)."""

from __future__ import annotations

import math

import pytest
from test_policy import _R, fed

from deltaserve.spec.policy import AdaptivePolicy, StepClock


def switching(p: AdaptivePolicy, b: int, verify_s: float, decode_s: float,
              verify_entry_s: float, decode_entry_s: float, runs: int = 4) -> None:
    """`runs` runs of each kind in turn, each a window long; a run's first step costs the
    entry figure (a switch: catch-up, drained pipeline), the others the steady one."""
    for _ in range(runs):
        for k, first, steady in ((p.k, verify_entry_s, verify_s), (0, decode_entry_s, decode_s)):
            p.on_step(k, b, first)
            for _ in range(p.window):
                p.on_step(k, b, steady)


def test_the_switch_cost_is_what_first_steps_cost_past_steps_in_a_run():
    p = AdaptivePolicy(3)
    switching(p, 8, verify_s=2.0, decode_s=1.0, verify_entry_s=5.0, decode_entry_s=1.5)
    assert p.cost(3, 8) == 2.0 and p.cost(0, 8) == 1.0
    assert p.switch_cost(8) == (5.0 - 2.0) + (1.5 - 1.0)
    assert p.switches == 7  # v d v d v d v d: every run but the first starts with a switch
    assert p.switch_cost(4) is None  # nothing measured there


def test_one_graph_capture_among_two_first_steps_does_not_set_the_switch_cost():
    p = AdaptivePolicy(3)
    switching(p, 1, verify_s=2.0, decode_s=1.0, verify_entry_s=2.0, decode_entry_s=1.0,
              runs=1)
    p.on_step(3, 1, 400.0)  # a verify after plain steps whose first replay captured a graph
    p.on_step(0, 1, 1.0)
    p.on_step(3, 1, 2.5)
    assert p.switch_cost(1) == 0.5


@pytest.mark.parametrize("budget", [0.02, 0.05])
def test_dear_switches_make_probes_rarer(budget):
    """Verify 3 s, decode 1 s, 1 token a verify: a probe loses 2 s in the verify, plus what
    the switch there and back costs (the verify's catch-up 4 s, the plain step after it 2 s
    without overlap): 8 s, so the probes come 8 / budget decode steps apart or more."""
    p = AdaptivePolicy(3, smoothing=1.0, prior=1.0, probe_budget=budget)
    switching(p, 1, verify_s=3.0, decode_s=1.0, verify_entry_s=7.0, decode_entry_s=3.0)
    assert p.switch_cost(1) == 6.0
    assert p.budget_interval(1) == math.ceil(8 / budget)
    reqs = [_R(0)]
    chosen = []
    for _ in range(3000):
        k = p.choose(reqs)
        chosen.append(k)
        first = bool(chosen[:-1]) and chosen[-2] != k
        p.on_step(k, 1, (7.0 if first else 3.0) if k else (3.0 if first else 1.0))
        if k:
            p.on_verify(reqs, [1])
    at = [i for i, k in enumerate(chosen) if k]
    assert len(at) >= 3 and min(b - a for a, b in zip(at, at[1:])) >= 8 / budget


@pytest.mark.parametrize("accept, trip, want", [
    (2.2, 0.0, 3),  # a verify's token 9% cheaper, switches free: speculate
    (2.2, 8.0, 0),  # the same, a switch to verify costing 8 decode steps: 8 / 64 = 12.5%
    (3.5, 8.0, 3),  # a verify's token 43% cheaper: worth the switch
])
def test_a_run_of_plain_steps_ends_only_when_the_gain_repays_the_switch(accept, trip, want):
    """Verify 2 s, decode 1 s (break-even: 2 tokens a verify), probes 64 steps apart: the
    last step was plain, so a verify must make a token 5% cheaper and repay the measured
    cost of the switch to it within the 64 steps before the next probe."""
    p = AdaptivePolicy(3, smoothing=1.0, explore_every=64, probe_budget=0)
    switching(p, 1, verify_s=2.0, decode_s=1.0, verify_entry_s=2.0 + trip,
              decode_entry_s=1.0)
    assert p.switch_cost(1) == trip
    reqs = [_R(0)]
    p.on_verify(reqs, [accept])
    assert p.choose(reqs) == want


def test_a_losing_run_of_verify_steps_ends_however_dear_the_way_back():
    """Verify 2 s, decode 1 s, 1.86 tokens a verify: plain decoding makes a token 7% cheaper.
    The switch to plain costs nothing extra here; coming back to verify would cost 8 s, but
    that is the next probe's price (the probe budget's), not this switch's."""
    p = AdaptivePolicy(3, smoothing=1.0, explore_every=64, probe_budget=0)
    switching(p, 1, verify_s=2.0, decode_s=1.0, verify_entry_s=10.0, decode_entry_s=1.0)
    for _ in range(3):  # the last steps verified
        p.on_step(3, 1, 2.0)
    reqs = [_R(0)]
    p.on_verify(reqs, [1.86])
    assert p.entry_cost(1, 0) == 0.0 and p.entry_cost(1, 3) == 8.0
    assert p.margin(1, 3, 64) == p.switch_margin
    assert p.choose(reqs) == 0


def test_a_bucket_without_costs_borrows_the_nearest_measured_one_instead_of_switching():
    """At the end of a run the batch shrinks through smaller buckets; a bucket with no costs
    of its own keeps the choice the nearest measured bucket makes (no forced verify and plain
    steps to measure it, each a switch)."""
    p = AdaptivePolicy(3, explore_every=10**9, smoothing=1.0, probe_budget=0)
    fed(p, 8, verify_s=3.0, decode_s=1.0)
    eight = [_R(i) for i in range(8)]
    p.on_verify(eight, [1] * 8)  # plain decoding wins in bucket 8
    assert p.choose(eight) == 0
    assert p.choose(eight[:3]) == 0 and p.choose(eight[:1]) == 0
    fresh = AdaptivePolicy(3)  # nothing measured anywhere: measure, verify first
    assert fresh.choose(eight[:3]) == 3


def test_a_plain_probe_that_ran_two_steps_then_back_confirms_the_choice():
    """Under overlap scheduling the step after a plain probe is asked for before the probe
    lands, so the probe runs two plain steps; going back to verify then still confirms it
    (the run before the next probe doubles) instead of looking like a kept plain run."""
    p = AdaptivePolicy(3, explore_every=4, smoothing=1.0, probe_budget=0)
    fed(p, 1, verify_s=1.0, decode_s=1.0)
    reqs = [_R(0)]
    p.on_verify(reqs, [4])
    for _ in range(4):
        assert p.choose(reqs) == 3
        p.on_step(3, 1, 1.0)
    assert p.choose(reqs) == 0  # the probe
    assert p.choose(reqs) == 0  # asked again before it lands
    p.on_step(0, 1, 1.0)
    p.on_step(0, 1, 1.0)
    assert p.choose(reqs) == 3
    p.on_step(3, 1, 1.0)
    assert p.interval(1) == 8


def test_the_running_mean_moves_once_per_verify_step_toward_its_mean():
    """Per step, not per request: a batch of 32 whose requests all end together (their last
    verify cut to 1 token) moves the prior of the next requests by one step's weight."""
    p = AdaptivePolicy(3, prior=3.0, smoothing=0.1)
    batch = [_R(i) for i in range(32)]
    p.on_verify(batch, [4] * 16 + [2] * 16)  # mean 3: the prior stays
    assert p._global == pytest.approx(3.0)
    p.on_verify(batch, [1] * 32)
    assert p._global == pytest.approx(0.9 * 3.0 + 0.1 * 1.0)
    p.on_verify(batch[:2], [0, 4])  # an aborted request's 0 is no count
    assert p._global == pytest.approx(0.9 * 2.8 + 0.1 * 4.0)


def test_the_step_clock_runs_from_landing_to_landing_and_restarts_after_a_prefill():
    t = iter([12.0, 15.0, 21.0, 22.5])
    clock = StepClock(now=lambda: next(t))
    assert clock.landed(10.0) == 2.0  # the first step: from its own start
    assert clock.landed(13.0) == 3.0  # the next: from the last landing, the gap included
    clock.reset()  # a prefill step
    assert clock.landed(20.0) == 1.0
    assert clock.landed(20.5) == 1.5  # launched before the last landing: from that landing
