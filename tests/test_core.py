"""The Req length bookkeeping."""

from __future__ import annotations

from deltaserve.core import Req, SamplingParams


def test_req_tokens_slices_prompt_and_output_like_all_ids():
    req = Req(0, [1, 2, 3], SamplingParams(), max_len=10, output_ids=[4, 5])
    for start in range(6):
        for end in range(start, 6):
            assert req.tokens(start, end) == req.all_ids[start:end]
    assert req.num_tokens == len(req.all_ids) == 5
