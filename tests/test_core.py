"""The Req length bookkeeping; SamplingParams normalisation and validation."""

from __future__ import annotations

import pytest

from deltaserve.core import MAX_STOP_CHARS, MAX_STOP_STRINGS, Req, SamplingParams


def test_req_tokens_slices_prompt_and_output_like_all_ids():
    req = Req(0, [1, 2, 3], SamplingParams(), max_len=10, output_ids=[4, 5])
    for start in range(6):
        for end in range(start, 6):
            assert req.tokens(start, end) == req.all_ids[start:end]
    assert req.num_tokens == len(req.all_ids) == 5


def test_sampling_params_take_one_stop_string_or_none_and_refuse_wrong_types():
    assert SamplingParams(stop="turn").stop == ["turn"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    bad = [dict(temperature="0"), dict(temperature=None), dict(max_tokens=True),
           dict(max_tokens=4.0), dict(top_k=True), dict(top_p="1"), dict(seed=1.5),
           dict(stop=[""]), dict(stop=[1]), dict(stop=["x"] * (MAX_STOP_STRINGS + 1)),
           dict(stop=["x" * (MAX_STOP_CHARS + 1)]), dict(stop_token_ids=[True]),
           dict(ignore_eos=1)]
    for kwargs in bad:
        with pytest.raises(ValueError):
            SamplingParams(**kwargs).validate()
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS, temperature=1, top_p=1).validate()


def test_bad_values_fail_where_the_params_are_built_and_again_when_changed_after():
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=-0.5)  # as vLLM: no request needed to see the mistake
    for t in (float("nan"), float("inf"), 1e308, 3.5e38):  # 1e308 would be inf in fp32
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            SamplingParams(temperature=t)
    assert SamplingParams(temperature=3.4e38).temperature == 3.4e38
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    params = SamplingParams()
    params.top_p = 0.0  # a mutable dataclass: a request's own check (validate) still sees it
    with pytest.raises(ValueError, match="top_p must be in"):
        params.validate()
