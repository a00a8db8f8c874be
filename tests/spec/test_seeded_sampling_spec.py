"""A seeded sampled request's tokens do not depend on speculation (drafts right or wrong) nor on
the other requests in its batch: its draw at each output position is a function of (seed,
position) and that position's logits only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from deltaserve.spec.proposer import Proposer
from token_ids import random_tokens as tokens

PARAMS = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=14, ignore_eos=True, seed=5),
          SamplingParams(temperature=1.2, top_k=8, presence_penalty=0.6, repetition_penalty=1.2,
                         max_tokens=14, ignore_eos=True, seed=2**64 - 3),
          SamplingParams(temperature=0.0, frequency_penalty=0.5, max_tokens=14, ignore_eos=True)]


class HalfRightProposer(Proposer):
    """Drafts the known continuation of each prompt, with every third position's draft wrong."""

    def __init__(self, k: int, refs: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.num_steps, self.refs, self.vocab = k, refs, vocab

    def propose(self, reqs):
        out = []
        for r in reqs:
            n = len(r.output_ids)
            ref = self.refs[tuple(r.prompt_ids)][n:n + self.num_steps]
            out.append([(t + 1) % self.vocab if (n + j) % 3 == 2 else t
                        for j, t in enumerate(ref)])
        return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("seeded") / "m", "qwen3_5_text",
                                    seed=3))


def llm(ckpt: str, **kw) -> LLM:
    if "speculative_algorithm" in kw:
        kw.setdefault("speculative_policy", "fixed")
    return LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16, **kw)


def test_seeded_tokens_are_the_same_with_speculation_and_in_any_batch(ckpt):
    prompts = [tokens(40 + 9 * i, seed=20 + i) for i in range(len(PARAMS))]
    plain = llm(ckpt)
    together = [o.token_ids for o in plain.generate(prompts, PARAMS)]
    alone = [plain.generate([p], [q])[0].token_ids for p, q in zip(prompts, PARAMS)]
    assert together == alone
    spec = llm(ckpt, speculative_algorithm="ngram", speculative_num_steps=3)
    vocab = spec.engine.model.config.vocab_size
    spec.engine.spec.proposer = HalfRightProposer(
        3, {tuple(p): t for p, t in zip(prompts, together)}, vocab)
    assert [o.token_ids for o in spec.generate(prompts, PARAMS)] == together
    assert spec.engine.acceptance_length < 3.5  # some drafts were rejected
    # and the seed matters: another seed changes a sampled request's tokens
    reseeded = plain.generate([prompts[0]], [replace(PARAMS[0], seed=6)])[0].token_ids
    assert reseeded != together[0]
