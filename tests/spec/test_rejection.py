"""Rejection sampling for argmax drafts reproduces the target distribution; each verify row uses
its own request's parameters; penalties count the drafts before a row as generated; a verify
step commits what the decode steps it replaces would."""

from __future__ import annotations

import torch

from deltaserve.core import SamplingParams
from deltaserve.engine.sampling import SamplingRow, sample_rows
from deltaserve.engine.sampling_ref import sample_rows_ref
from deltaserve.spec.rejection import accept, verify_rows

# chi-square critical value, 5 degrees of freedom, p = 0.001
CHI2_CRIT_DF5 = 20.52


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def accept_drafts(logits: torch.Tensor, base: SamplingRow, drafts: list[int]) -> list[int]:
    """One request's verify step: all rows sampled in one batched call, then the prefix match."""
    rows = verify_rows(base, drafts, logits.shape[0])
    return accept(sample_rows(logits, rows), drafts)


def test_committed_tokens_follow_the_target_distribution_at_temperature_one():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 0.2, 0.8],
                           [0.0, 1.5, 0.3, 0.3, -1.0, 0.1],
                           [0.2, 0.2, 0.2, 0.9, 0.0, -0.3]])
    params = SamplingParams(temperature=1.0)
    drafts = [1, 3]  # the draft is not the most likely token at row 0
    trials = 20000  # one request per seed 0..trials-1, all verified in one batched call
    rows = [r for seed in range(trials)
            for r in verify_rows(SamplingRow(params, [7], [], seed), drafts, 3)]
    targets = sample_rows(logits.repeat(trials, 1), rows)
    first = torch.zeros(6)
    second_given_accept = torch.zeros(6)
    for t in range(trials):
        out = accept(targets[3 * t:3 * t + 3], drafts)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second_given_accept[out[1]] += 1
    p0 = torch.softmax(logits[0], -1)
    p1 = torch.softmax(logits[1], -1)
    assert chi_square(first, p0) < CHI2_CRIT_DF5
    assert chi_square(second_given_accept, p1) < CHI2_CRIT_DF5
    # the draft was accepted about as often as the target samples it
    assert abs(first[1] / trials - p0[1]) < 0.015


def test_greedy_drafts_are_accepted_by_prefix_match():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    greedy = SamplingRow(SamplingParams(temperature=0.0), [0], [], 0)
    assert accept_drafts(logits, greedy, [1, 2]) == [1, 2, 0]
    assert accept_drafts(logits, greedy, [1, 0]) == [1, 2]
    assert accept_drafts(logits, greedy, [2, 2]) == [1]
    assert accept_drafts(logits[:1], greedy, []) == [1]


def test_each_row_uses_its_own_requests_top_k():
    from deltaserve.core import Batch, Phase, Req
    from deltaserve.spec.proposer import Proposer
    from deltaserve.spec.runner import SpecRunner

    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]] * 4)
    greedy = Req(0, [1], SamplingParams(temperature=0.0), max_len=10)
    wide = Req(1, [1], SamplingParams(temperature=1.0, top_k=2), max_len=10)
    batch = Batch(Phase.VERIFY, [greedy, wide], [2, 2], rows_per_req=2,
                  draft_ids=[[2], [0]], num_drafts=[1, 1])
    runner = SpecRunner(Proposer(), 1)
    seen = set()
    for seed in range(40):
        wide.sample_seed = seed
        out = runner.accept(batch, logits)
        assert out[0] == [1]  # greedy: draft 2 rejected, argmax 1 committed
        assert out[1][0] in (1, 2)  # top-2 only: draft 0 can never be accepted
        seen.add(out[1][0])
    assert seen == {1, 2}


def test_penalties_count_the_drafts_before_a_row():
    # row 1 prefers token 2 unless token 2 (drafted at row 0) is penalised as generated
    logits = torch.tensor([[0.0, 0.0, 4.0, 0.0], [0.0, 0.0, 3.0, 2.5], [1.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    base = SamplingRow(params, [0], [], 0)
    assert accept_drafts(logits, base, [2, 2]) == [2, 3]
    plain = SamplingRow(SamplingParams(temperature=0.0), [0], [], 0)
    assert accept_drafts(logits, plain, [2, 2]) == [2, 2, 0]


def test_the_batched_verify_commits_what_row_by_row_reference_sampling_commits():
    gen = torch.Generator().manual_seed(3)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0,
                                                            repetition_penalty=1.3)]
    for trial in range(200):
        k = trial % 5
        params = kinds[trial % 2]
        logits = torch.randn(k + 1, 6, generator=gen)
        argmax = logits.argmax(-1).tolist()
        # drafts that agree with the argmax for a random prefix, then (maybe) disagree
        n_agree = int(torch.randint(k + 1, (1,), generator=gen))
        drafts = argmax[:n_agree] + [(t + 1) % 6 for t in argmax[n_agree:k]]
        base = SamplingRow(params, [1], [4], 0)
        reference = accept(sample_rows_ref(logits, verify_rows(base, drafts, k + 1)), drafts)
        assert accept_drafts(logits, base, drafts) == reference
        if trial % 2 == 0:
            assert len(reference) == n_agree + 1


def test_a_seeded_verify_step_commits_what_the_decode_steps_it_replaces_sample():
    # same logits per position: speculation must not change a seeded request's tokens
    gen = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.4)
    for seed in range(50):
        logits = torch.randn(4, 9, generator=gen)
        output: list[int] = [5]
        decoded = []
        for j in range(4):
            row = SamplingRow(params, [2, 3], output + decoded, seed)
            decoded.append(sample_rows(logits[j:j + 1], [row])[0])
        # drafts = the decoded tokens with one changed at a random place (or none)
        drafts = list(decoded[:3])
        bad = seed % 4
        if bad < 3:
            drafts[bad] = (drafts[bad] + 1) % 9
        committed = accept_drafts(logits, SamplingRow(params, [2, 3], output, seed), drafts)
        assert committed == decoded[:len(committed)]
        assert len(committed) == (bad + 1 if bad < 3 else 4)
