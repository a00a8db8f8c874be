"""Sampling rules: greedy, truncation, penalties, seeds; the incremental detokenizer."""

from __future__ import annotations

import random

import torch

from deltaserve.core import SamplingParams
from deltaserve.engine.detokenizer import IncrementalDetokenizer, held_back
from deltaserve.engine.sampling import SamplingRow, sample_rows
from deltaserve.engine.sampling_ref import apply_penalties_ref as apply_penalties
from deltaserve.engine.sampling_ref import truncated_probs_ref as truncated_probs


def row(params: SamplingParams, prompt=(), generated=(), seed=0) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(generated), seed)


def test_greedy_rows_take_the_argmax_and_top_k_1_is_greedy():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(top_k=1))]
    assert sample_rows(logits, rows) == [1, 0]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = truncated_probs(logits, SamplingParams(top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    probs = truncated_probs(logits, SamplingParams(top_p=0.81))
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_temperatures_below_the_sampling_eps_are_greedy_and_tiny_top_p_keeps_the_top_token():
    # 1e-40 used to divide logits to inf (NaN probabilities: the whole batch's step failed)
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]] * 3)
    rows = [row(SamplingParams(temperature=1e-40), seed=1),
            row(SamplingParams(temperature=5e-324, repetition_penalty=1.1), seed=2),
            row(SamplingParams(top_p=1e-50), seed=3)]  # rounds to 0 in fp32
    assert sample_rows(logits, rows) == [1, 1, 1]
    probs = truncated_probs(logits[0], SamplingParams(top_p=1e-50))
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert not SamplingParams(temperature=2e-5).greedy


def test_penalties_and_temperatures_that_overflow_fp32_keep_the_boosted_token_on_top():
    # a repetition_penalty of 1e-300 is 0 in fp32 and 1e-38 divides a logit of 2 past fp32's
    # range at temperature 0.5: both made inf logits, NaN probabilities, and failed the step
    # of every request in the batch (HTTP 500 for all of them)
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]] * 4)
    rows = [row(SamplingParams(repetition_penalty=1e-300), prompt=[1], seed=1),
            row(SamplingParams(repetition_penalty=1e-38, temperature=0.5), prompt=[3], seed=2),
            row(SamplingParams(repetition_penalty=1e-35, temperature=1.1e-5), prompt=[0], seed=3),
            row(SamplingParams(repetition_penalty=5e-324, temperature=0.0), prompt=[2, 3])]
    assert sample_rows(logits, rows) == [1, 3, 0, 3]
    probs = truncated_probs(apply_penalties(logits[0], rows[0]), rows[0].params)
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_top_k_and_min_p_truncate():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert torch.count_nonzero(truncated_probs(logits, SamplingParams(top_k=2))) == 2
    probs = truncated_probs(logits, SamplingParams(min_p=0.45))  # keep p >= 0.18
    assert torch.allclose(probs, torch.tensor([0.4, 0.3, 0.2, 0.0]) / 0.9)


def test_penalties_follow_the_openai_and_ctrl_rules():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(logits, row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1]))
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    pen = apply_penalties(logits, row(SamplingParams(presence_penalty=0.5,
                                                     frequency_penalty=0.25),
                                      generated=[2, 2, 3]))
    assert pen.tolist() == [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]


def test_a_seeded_request_samples_the_same_tokens_again_and_other_seeds_differ():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7)
    first = [sample_rows(logits[i:i + 1], [row(p, seed=7)])[0] for i in range(8)]
    again = [sample_rows(logits[i:i + 1], [row(p, seed=7)])[0] for i in range(8)]
    assert first == again
    others = [[sample_rows(logits[i:i + 1], [row(p, seed=s)])[0] for i in range(8)]
              for s in range(8, 12)]
    assert any(o != first for o in others)


class CharTokenizer:
    """Token id i decodes to chr(i); id 0 is a special token (skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def test_a_stop_string_cuts_the_text_and_prefixes_are_held_back():
    det = IncrementalDetokenizer(CharTokenizer(), stop=["END"])
    for ch in "abE":
        assert not det.append(ord(ch))
    assert det.take_new_text() == "ab"  # "E" may start "END"
    assert not det.append(ord("x"))
    assert det.take_new_text() == "Ex"
    for ch in "yEN":
        det.append(ord(ch))
    assert det.append(ord("D"))
    assert det.take_new_text(final=True) == "y"
    assert det.text == "abExy"


def test_held_back_is_the_longest_proper_prefix_of_the_stop_string_the_text_ends_with():
    def brute(text, end, stop):
        return next((n for n in range(min(len(stop) - 1, end), 0, -1)
                     if text[:end].endswith(stop[:n])), 0)

    rng = random.Random(0)
    for _ in range(3000):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        end = rng.randint(0, len(text))
        assert held_back(text, end, stop) == brute(text, end, stop), (text, end, stop)


def test_admission_keeps_a_given_seed_and_draws_a_distinct_one_otherwise():
    from deltaserve.engine.requests import new_req

    def admit(seed):
        return new_req([1, 2], SamplingParams(seed=seed), 0, vocab=10, max_model_len=100,
                       tokenizer=CharTokenizer(), grammar=None).sample_seed

    assert admit(2**64 - 1) == 2**64 - 1 and admit(-5) == -5
    drawn = {admit(None) for _ in range(50)}
    assert len(drawn) == 50
