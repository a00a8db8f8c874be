"""The batched sampler against the row-by-row reference: penalties equal, distributions equal
(chi-square), greedy and top-k 1 equal; seeds reproducible whatever the batch; the counter-based
uniforms equal their pure-Python oracle."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from sampling_cases import batched_probs, chi2_critical, chi_square, random_params, random_row

from deltaserve.core import SamplingParams
from deltaserve.engine.sampling import (
    SamplingRow,
    SamplingTensors,
    apply_penalties,
    sample,
    sample_rows,
)
from deltaserve.engine.sampling_ref import apply_penalties_ref, sample_rows_ref, truncated_probs_ref
from deltaserve.engine.sampling_rng import (
    row_uniforms,
    splitmix64,
    splitmix64_int,
    to_int64,
    uniform_int,
)


def test_splitmix64_matches_the_published_sequence_and_the_python_oracle():
    # SplitMix64 from state 0: the first outputs of Vigna's reference splitmix64.c
    assert splitmix64_int(0) == 0xE220A8397B1DCDAF
    assert splitmix64_int(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    rng = random.Random(1)
    xs = [0, 1, -1, 2**63 - 1, -2**63] + [rng.randrange(-2**63, 2**63) for _ in range(1000)]
    got = splitmix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [to_int64(splitmix64_int(x & (2**64 - 1))) for x in xs]


def test_row_uniforms_match_the_python_oracle_for_every_seed_range():
    rng = random.Random(2)
    seeds = [0, -1, 2**63, 2**64 - 1, -2**63] + [rng.randrange(-2**63, 2**64)
                                                  for _ in range(500)]
    positions = [rng.randrange(0, 1 << 20) for _ in seeds]
    u = row_uniforms(torch.tensor([to_int64(s) for s in seeds]), torch.tensor(positions))
    assert u.tolist() == [uniform_int(s, p) for s, p in zip(seeds, positions)]
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    # seeds s and s + 1 give unrelated streams: no shared value in the first 64 positions
    a = {uniform_int(5, p) for p in range(64)}
    assert len(a & {uniform_int(6, p) for p in range(64)}) < 3


def test_batched_penalties_equal_the_reference_exactly():
    rng = random.Random(3)
    vocab = 37
    rows = [random_row(rng, vocab) for _ in range(200)]
    rows = [r for r in rows if r.params.repetition_penalty != 1.0
            or r.params.presence_penalty or r.params.frequency_penalty]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(3)) * 3
    st = SamplingTensors.build(rows, vocab, logits.device)
    got = apply_penalties(logits[st.penalty_idx], st)
    want = torch.stack([apply_penalties_ref(logits[i], r) for i, r in enumerate(rows)])
    assert st.penalty_idx.tolist() == list(range(len(rows)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["sorted", "top_k_only", "min_p_only"])
def test_batched_truncated_probabilities_match_the_reference_for_mixed_rows(path):
    # "sorted": some row has top-p (one sort serves all); "top_k_only": no top-p in the batch
    # (torch.topk to the largest k, rows without top-k mixed in); "min_p_only": neither
    rng = random.Random(4)
    only = {"sorted": {}, "top_k_only": {"top_p": 1.0}, "min_p_only": {"top_p": 1.0, "top_k": -1}}
    for vocab in (7, 64, 1000):
        rows = [random_row(rng, vocab, replace(random_params(rng, vocab, greedy_share=0.0),
                                               **only[path])) for _ in range(60)]
        logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(vocab))
        want = torch.stack([truncated_probs_ref(apply_penalties_ref(logits[i], r), r.params)
                            for i, r in enumerate(rows)])
        got = batched_probs(logits, rows)
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_greedy_and_top_k_1_rows_equal_the_reference_argmax_in_a_mixed_batch():
    rng = random.Random(5)
    vocab = 300
    rows = [random_row(rng, vocab, random_params(rng, vocab, greedy_share=0.5))
            for _ in range(100)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(5))
    got = sample_rows(logits, rows)
    want = sample_rows_ref(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    assert len(greedy) > 20
    assert [got[i] for i in greedy] == [want[i] for i in greedy]
    # the graph's precomputed argmax serves the plain-greedy rows
    plain = [SamplingRow(SamplingParams(temperature=0.0), [1], [], 0)] * len(rows)
    fake = torch.arange(len(rows))  # not the argmax: proves it is used, not recomputed
    assert sample_rows(logits, plain, fake) == fake.tolist()
    assert sample_rows(logits, plain) == logits.argmax(-1).tolist()


def test_batched_draws_equal_the_reference_draws_away_from_cdf_steps():
    # both draw by inverse CDF with the same uniform: only a uniform within rounding of a CDF
    # step may pick a neighbour (counted, and they must be rare)
    rng = random.Random(6)
    vocab = 500
    rows = [random_row(rng, vocab, random_params(rng, vocab, greedy_share=0.0))
            for _ in range(400)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(6)) * 2
    got, want = sample_rows(logits, rows), sample_rows_ref(logits, rows)
    near_step = 0
    for i, r in enumerate(rows):
        probs = truncated_probs_ref(apply_penalties_ref(logits[i], r), r.params).double()
        gap = float((torch.cumsum(probs, 0) - uniform_int(r.seed, r.position)).abs().min())
        if gap < 1e-5:
            near_step += 1
        else:
            assert got[i] == want[i], (i, r)
    assert near_step <= 4


@pytest.mark.parametrize("case", range(6))
def test_batched_draws_follow_the_reference_distribution(case):
    rng = random.Random(100 + case)
    vocab = 12
    params = random_params(rng, vocab, greedy_share=0.0)
    base = random_row(rng, vocab, params)
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(case))
    want = truncated_probs_ref(apply_penalties_ref(logits, base), params)
    n = 20000  # one request per seed, every row in one call
    rows = [SamplingRow(params, base.prompt_ids, base.output_ids, seed, base.drafts)
            for seed in range(n)]
    tokens = torch.tensor(sample_rows(logits.repeat(n, 1), rows))
    counts = torch.bincount(tokens, minlength=vocab)
    assert int(counts[want == 0].sum()) == 0  # never a truncated token
    stat, df = chi_square(counts, want)
    if df == 0:
        return  # one token left: all n draws took it (checked above)
    assert float(want[want > 0].min()) * n >= 5, "expected counts too small for chi-square"
    assert stat < chi2_critical(df), (params, stat, df)


def test_one_seed_draws_the_sequence_of_its_positions_uniformly():
    # the same request over 20000 output positions (one seed): its own stream is uniform
    logits = torch.tensor([1.0, 0.0, 0.5, -0.5, 2.0, 0.2])
    params = SamplingParams(temperature=1.0)
    n = 20000
    rows = [SamplingRow(params, [1], range(pos), 42) for pos in range(n)]  # len: the position
    tokens = torch.tensor(sample_rows(logits.repeat(n, 1), rows))
    stat, df = chi_square(torch.bincount(tokens, minlength=6), torch.softmax(logits, -1))
    assert stat < chi2_critical(df)


def test_a_requests_tokens_do_not_depend_on_the_rest_of_its_batch():
    rng = random.Random(7)
    vocab = 800
    gen = torch.Generator().manual_seed(7)
    mine = [random_row(rng, vocab, random_params(rng, vocab, greedy_share=0.0))
            for _ in range(8)]
    my_logits = torch.randn(len(mine), vocab, generator=gen)
    alone = [sample_rows(my_logits[i:i + 1], [r])[0] for i, r in enumerate(mine)]
    for trial in range(5):
        others = [random_row(rng, vocab) for _ in range(rng.randint(1, 30))]
        rows = mine + others
        logits = torch.cat([my_logits, torch.randn(len(others), vocab, generator=gen)])
        order = list(range(len(rows)))
        rng.shuffle(order)
        got = sample_rows(logits[order], [rows[i] for i in order])
        where = {j: k for k, j in enumerate(order)}
        assert [got[where[i]] for i in range(len(mine))] == alone, trial


def test_sampling_does_not_write_the_logits_or_the_greedy_buffer():
    rng = random.Random(8)
    rows = [random_row(rng, 50) for _ in range(20)]
    logits = torch.randn(20, 50, generator=torch.Generator().manual_seed(8))
    greedy = logits.argmax(-1)
    keep_l, keep_g = logits.clone(), greedy.clone()
    st = SamplingTensors.build(rows, 50, logits.device)
    sample(logits, st, greedy)
    assert torch.equal(logits, keep_l) and torch.equal(greedy, keep_g)


def test_a_logits_batch_of_the_wrong_size_is_refused():
    st = SamplingTensors.build([SamplingRow(SamplingParams(), [1], [], 0)], 10, torch.device("cpu"))
    with pytest.raises(AssertionError):
        sample(torch.zeros(2, 10), st)
