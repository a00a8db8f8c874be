"""The speculation policy: the decision rule on measured costs, and exactness when a policy
mixes plain decode steps (k = 0) between verify steps (CPU, fp32)."""

from __future__ import annotations

import math

import pytest
from test_verify_contract import StubProposer, prompts

from deltaserve import LLM, SamplingParams
from deltaserve.engine.cuda_graph import GraphRunner
from deltaserve.model.testing import make_tiny_checkpoint
from deltaserve.spec.policy import AdaptivePolicy, FixedPolicy, batch_bucket, build_policy
from drained import assert_drained
from oracle import assert_same_runs, reference_greedy


class _R:
    def __init__(self, rid: int) -> None:
        self.rid, self.finished = rid, False


def fed(policy: AdaptivePolicy, n: int, verify_s: float, decode_s: float) -> None:
    """A run of verify steps, then one of decode steps, each a window long past its first."""
    for _ in range(policy.window + 1):
        policy.on_step(policy.k, n, verify_s)
    for _ in range(policy.window + 1):
        policy.on_step(0, n, decode_s)


def test_batch_buckets_are_the_next_power_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 31, 32, 33)] == [1, 2, 4, 4, 8, 32, 32, 64]


def test_the_policy_measures_each_kind_past_its_warm_up_step_before_it_decides():
    p = AdaptivePolicy(3, min_samples=2)
    reqs = [_R(0)]
    chosen = []
    for _ in range(6):
        k = p.choose(reqs)
        chosen.append(k)
        p.on_step(k, 1, 9.0 if len(chosen) in (1, 4) else (2.0 if k else 1.0))
    # a warm-up step (a graph capture: 9 s) is not counted, then two of each kind
    assert chosen == [3, 3, 3, 0, 0, 0]
    assert p.cost(3, 1) == 2.0 and p.cost(0, 1) == 1.0


@pytest.mark.parametrize("committed, want", [(3, 3), (4, 3), (1, 0), (2, 0)])
def test_it_speculates_iff_acceptance_beats_the_cost_ratio(committed, want):
    p = AdaptivePolicy(3, explore_every=10**9, smoothing=1.0)
    reqs = [_R(0), _R(1)]
    fed(p, 2, verify_s=2.5, decode_s=1.0)  # a verify must commit 2.5 tokens to pay
    p.on_verify(reqs, [committed, committed])
    assert p.acceptance(reqs[0]) == committed
    assert p.choose(reqs) == want


@pytest.mark.parametrize("running, accept, want", [
    (3, 1.94, 3), (3, 1.86, 0),  # verifying at 0.97x and 0.93x of the break-even
    (0, 2.06, 0), (0, 2.14, 3),  # decoding at 1.03x and 1.07x
])
def test_a_run_changes_kind_only_past_the_switch_margin(running, accept, want):
    """Verify 2 s, decode 1 s: the break-even is 2 tokens a verify. A run of either kind
    goes on while the other would make a token less than 5% cheaper."""
    p = AdaptivePolicy(3, explore_every=10**9, smoothing=1.0, switch_margin=0.05)
    reqs = [_R(0)]
    fed(p, 1, verify_s=2.0, decode_s=1.0)
    for _ in range(3):
        p.on_step(running, 1, 2.0 if running else 1.0)
    p.on_verify(reqs, [accept])
    assert p.choose(reqs) == want


def test_costs_are_medians_so_one_graph_capture_does_not_flip_the_choice():
    p = AdaptivePolicy(3, explore_every=10**9, smoothing=1.0)
    reqs = [_R(0)]
    fed(p, 1, verify_s=1.5, decode_s=1.0)
    p.on_verify(reqs, [3])
    p.on_step(3, 1, 500.0)  # a first step that captured a graph
    assert p.cost(3, 1) == 1.5
    assert p.choose(reqs) == 3


def test_a_step_that_starts_a_run_is_not_a_cost_sample():
    """A plain step right after a verify runs without overlap (dearer than in a run of plain
    steps), and a verify after plain steps catches their rows up: steps of the two kinds in
    turn leave each kind's cost at what it costs in a run."""
    p = AdaptivePolicy(3, explore_every=10**9, smoothing=1.0)
    fed(p, 1, verify_s=2.0, decode_s=1.0)
    for _ in range(20):
        p.on_step(3, 1, 2.6)
        p.on_step(0, 1, 1.8)
    assert p.cost(3, 1) == 2.0 and p.cost(0, 1) == 1.0
    for _ in range(p.window // 2 + 1):  # the steps after the first of a run count
        p.on_step(0, 1, 1.2)
    assert p.cost(0, 1) == 1.2


def test_buckets_keep_their_own_costs():
    p = AdaptivePolicy(3, explore_every=10**9, smoothing=1.0)
    fed(p, 1, verify_s=1.2, decode_s=1.0)
    fed(p, 32, verify_s=4.0, decode_s=1.0)
    one, many = [_R(0)], [_R(i) for i in range(32)]
    p.on_verify(many, [2] * 32)
    assert p.choose(one) == 3 and p.choose(many) == 0


def run_policy(p: AdaptivePolicy, reqs, steps: int, committed) -> list[int]:
    """`steps` choose / on_step rounds (verify 3 s, decode 1 s); a verify commits
    committed(step) tokens per request. Returns the k chosen at each step."""
    chosen = []
    for i in range(steps):
        k = p.choose(reqs)
        chosen.append(k)
        p.on_step(k, len(reqs), 3.0 if k else 1.0)
        if k:
            p.on_verify(reqs, [committed(i)] * len(reqs))
    return chosen


def test_probes_that_confirm_the_choice_come_at_doubling_intervals():
    p = AdaptivePolicy(3, explore_every=4, max_explore_every=16, smoothing=1.0, probe_budget=0)
    reqs = [_R(0)]
    fed(p, 1, verify_s=3.0, decode_s=1.0)
    p.on_verify(reqs, [1])
    chosen = run_policy(p, reqs, 50, lambda i: 1)
    # fed() ends with a run of 9 decodes, past the interval of 4: a probe at once; then runs
    # of 8, 16, 16 decodes, each followed by one verify that confirms plain decoding
    assert [i for i, k in enumerate(chosen) if k] == [0, 9, 26, 43]


def test_a_probe_that_pays_is_kept_and_the_interval_starts_again():
    p = AdaptivePolicy(3, explore_every=4, max_explore_every=64, smoothing=1.0, probe_budget=0)
    reqs = [_R(0)]
    fed(p, 1, verify_s=3.0, decode_s=1.0)
    p.on_verify(reqs, [1])
    # verifies commit 1 token until step 20, then 4 (the workload turned repetitive)
    chosen = run_policy(p, reqs, 40, lambda i: 1 if i < 20 else 4)
    assert [i for i, k in enumerate(chosen) if k][:2] == [0, 9]  # probes back off
    first = next(i for i in range(20, 40) if chosen[i])  # the first probe after the change
    assert first == 26  # 16 decodes after the probe at 9
    # kept: the interval starts again at 4, so plain decoding is probed after 4 verify steps,
    # and that probe confirms speculation (the interval doubles: the next after 8)
    assert chosen[first:] == [3, 3, 3, 3, 0] + [3] * 8 + [0]
    assert p.interval(1) == 8


@pytest.mark.parametrize("budget", [0.02, 0.05])
def test_probes_of_a_losing_kind_cost_at_most_the_budget(budget):
    """Verify 3 s, decode 1 s, every verify commits 1 token: each probe loses 2 s against
    plain decoding (its first steps cost what steps in a run do: no switch cost); over 3,000
    steps the probes stay within the budget and still come."""
    p = AdaptivePolicy(3, explore_every=4, smoothing=1.0, prior=1.0, probe_budget=budget)
    reqs = [_R(0)]
    fed(p, 1, verify_s=3.0, decode_s=1.0)
    chosen = run_policy(p, reqs, 3000, lambda i: 1)
    probes = sum(1 for k in chosen if k)
    spent = sum(3.0 if k else 1.0 for k in chosen)
    assert probes >= 3
    assert probes * (3.0 - 1.0) <= budget * spent
    # the runs between probes: at least loss / (budget x decode) = 2 / budget steps
    at = [i for i, k in enumerate(chosen) if k]
    assert min(b - a for a, b in zip(at, at[1:])) >= 2 / budget
    assert p.switch_cost(1) == 0.0
    assert p.budget_interval(1) == math.ceil(2 / budget)


def test_a_new_request_starts_from_the_running_mean_and_release_forgets_it():
    p = AdaptivePolicy(3, prior=2.0, smoothing=0.5)
    r, other = _R(7), _R(8)
    assert p.acceptance(r) == 2.0
    p.on_verify([r], [4])
    assert p.acceptance(r) == 3.0 and p._global == 3.0
    p.on_verify([other], [1])  # other starts from the mean 3.0, and the mean moves to 2.0
    assert p.acceptance(other) == 2.0 and p._global == 2.0
    assert p.acceptance(r) == 3.0
    p.release(r)
    assert p.acceptance(r) == 2.0


def test_the_kept_mean_acceptance_follows_every_verify_release_and_batch():
    """mean_acceptance is kept between calls; each call must still equal the mean computed
    afresh, whatever changed in between."""
    p = AdaptivePolicy(3, prior=2.0, smoothing=0.5)
    a, b, c = _R(1), _R(2), _R(3)

    def fresh(reqs):
        return sum(p.acceptance(r) for r in reqs) / len(reqs)

    batch = [a, b]
    assert p.mean_acceptance(batch) == fresh(batch) == 2.0
    p.on_verify([a], [4])  # a's EMA and the running mean (b's prior) move
    assert p.mean_acceptance(batch) == fresh(batch) != 2.0
    batch.append(c)  # the same list object, one more request
    assert p.mean_acceptance(batch) == fresh(batch)
    assert p.mean_acceptance([b, c]) == fresh([b, c])
    p.on_verify([b], [1])
    p.release(a)  # a falls back to the running mean
    assert p.mean_acceptance([a, b]) == fresh([a, b])
    p.on_step(0, 2, 1.0)  # a step's cost leaves acceptance as it is
    assert p.mean_acceptance([a, b]) == fresh([a, b])


def test_policy_names():
    assert isinstance(build_policy("fixed", 3), FixedPolicy)
    assert build_policy("fixed", 3).choose([_R(0)]) == 3
    assert isinstance(build_policy("adaptive", 3), AdaptivePolicy)
    with pytest.raises(ValueError, match="fixed or adaptive"):
        build_policy("greedy", 3)
    with pytest.raises(ValueError, match="speculative_policy"):
        LLM(None, device="cpu", speculative_algorithm="ngram", speculative_policy="sometimes")


class PatternPolicy(FixedPolicy):
    """k or 0 by a fixed pattern over the steps run so far: runs of plain decode between verify
    steps. `choose` changes nothing (the count advances in on_step), as SpecPolicy requires."""

    def __init__(self, k: int, pattern: str) -> None:
        super().__init__(k)
        self.pattern, self.steps, self.seen = pattern, 0, []

    def choose(self, reqs):
        return self.k if self.pattern[self.steps % len(self.pattern)] == "v" else 0

    def on_step(self, k: int, batch_size: int, seconds: float) -> None:
        self.steps += 1
        self.seen.append(k)

    def install(self, eng) -> PatternPolicy:
        """Make this the engine's policy (what the scheduler and the overlap path ask)."""
        eng.policy, eng.scheduler.choose_drafts = self, self.choose
        return self


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("policy") / "m", "qwen3_5_text",
                                    seed=5))


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def pattern_run(ckpt: str, algo: str, pattern: str, seed: int, overlapped: bool):
    """A speculative engine whose policy follows `pattern`, on the prompts of `seed`; with
    `overlapped` its verify and plain decode steps take the fixed-shape (graph) path run
    eagerly, so plain steps go through the overlap scheduler. The n-gram proposer is the stub
    that drafts the plain run's tokens. Asserts greedy tokens equal plain decoding's; returns
    (engine, policy)."""
    batch = prompts(seed=seed)
    plain = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16)
    plain_outs = [o.token_ids for o in plain.generate(batch, GREEDY)]
    spec = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16,
               max_running_reqs=4, speculative_algorithm=algo, speculative_num_steps=3)
    eng = spec.engine
    policy = PatternPolicy(3, pattern).install(eng)
    n = eng.cfg.max_running_reqs
    if overlapped:
        eng.graphs = GraphRunner(eng.runner, n, 4, eng.max_model_len, capture=False)
        eng.decode_graphs = GraphRunner(eng.runner, n, 1, eng.max_model_len, capture=False)
        if algo == "mtp":
            eng.spec.use_graphs(n, eng.max_model_len, capture=False)
    if algo == "ngram":
        eng.spec.proposer = StubProposer(3, {tuple(p): o for p, o in zip(batch, plain_outs)},
                                         512)
    outs = spec.generate(batch, GREEDY)
    for prompt, ours, ref_plain in zip(batch, outs, plain_outs):
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_runs(ours.token_ids, ref_plain, ref, f"{algo} {pattern} len {len(prompt)}")
    assert 0 in policy.seen and 3 in policy.seen
    assert_drained(eng)
    return eng, policy


@pytest.mark.parametrize("algo, pattern", [("ngram", "vdvvdd"), ("mtp", "dvvdv")])
def test_plain_decode_steps_between_verify_steps_keep_greedy_exact(ckpt, algo, pattern):
    pattern_run(ckpt, algo, pattern, seed=3, overlapped=False)


def test_the_adaptive_default_stays_exact_and_runs_both_kinds(ckpt):
    batch = prompts(seed=4)
    plain = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16)
    plain_outs = [o.token_ids for o in plain.generate(batch, GREEDY)]
    spec = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16,
               speculative_algorithm="ngram", speculative_num_steps=3)
    eng = spec.engine
    assert isinstance(eng.policy, AdaptivePolicy)
    seen = []
    choose = eng.policy.choose
    eng.scheduler.choose_drafts = lambda reqs: seen.append(choose(reqs)) or seen[-1]
    outs = spec.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == plain_outs
    assert 0 in seen and 3 in seen  # it measured both before deciding
    assert_drained(eng)


@pytest.mark.parametrize("algo, pattern", [("ngram", "vddvvddd"), ("mtp", "dddvdvvdddddd")])
def test_overlapped_plain_steps_between_verify_steps_keep_greedy_exact(ckpt, algo, pattern):
    """The policy's plain decode steps run through the overlap scheduler (decode graphs, the
    fixed-shape step run eagerly on the CPU); verify steps run synchronously between them.
    (test_mtp_graph.py checks the MTP drafts after overlapped steps against the oracle.)"""
    eng, _ = pattern_run(ckpt, algo, pattern, seed=6, overlapped=True)
    assert eng.overlap.overlapped_steps > 0
    assert eng.graphs.graph_steps > 0 and eng.spec_steps > 0


def test_the_adaptive_policy_switching_often_on_the_overlapped_mtp_path_stays_exact(ckpt):
    """Probes every 2 steps (so switches between overlapped plain steps and verify steps
    all the time, both kinds' first steps told to the policy): greedy tokens equal plain
    decoding's whatever the measured costs made it choose."""
    batch = prompts(seed=8)
    plain = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16)
    plain_outs = [o.token_ids for o in plain.generate(batch, GREEDY)]
    spec = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16,
               max_running_reqs=4, speculative_algorithm="mtp", speculative_num_steps=3)
    eng = spec.engine
    n = eng.cfg.max_running_reqs
    eng.graphs = GraphRunner(eng.runner, n, 4, eng.max_model_len, capture=False)
    eng.decode_graphs = GraphRunner(eng.runner, n, 1, eng.max_model_len, capture=False)
    eng.spec.use_graphs(n, eng.max_model_len, capture=False)
    policy = AdaptivePolicy(3, explore_every=2, max_explore_every=2, min_samples=1,
                            probe_budget=0)
    eng.policy, eng.scheduler.choose_drafts = policy, policy.choose
    outs = spec.generate(batch, GREEDY)
    for prompt, ours, ref_plain in zip(batch, outs, plain_outs):
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_runs(ours.token_ids, ref_plain, ref, f"adaptive mtp len {len(prompt)}")
    assert policy.switches >= 4 and eng.spec_steps > 0 and eng.overlap.overlapped_steps > 0
    assert_drained(eng)
