"""Speculative decoding reproduces plain greedy decoding token for token (CPU, fp32).

A stub proposer drafts the plain run's own continuation, wrong at a different place each step
(and sometimes proposes nothing), so every accept count 0..k occurs; the verify path must then
commit exactly what plain decoding commits.
"""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.cuda_graph import GraphRunner
from deltaserve.model.testing import make_tiny_checkpoint
from deltaserve.spec.proposer import Proposer
from drained import assert_drained
from oracle import assert_same_runs, reference_greedy

MAX_NEW = 24


class StubProposer(Proposer):
    """Drafts from a known greedy continuation; draft j of step s is corrupted where
    j == (s + rid) % (k + 2); at k+1 nothing is proposed; at k every draft is right."""

    def __init__(self, k: int, refs: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.num_steps, self.refs, self.vocab = k, refs, vocab
        self.steps = 0
        self.committed_counts: set[int] = set()
        self.saw_empty = False

    def propose(self, reqs):
        k, out = self.num_steps, []
        for req in reqs:
            want = self.refs[tuple(req.prompt_ids)][len(req.output_ids):][:k]
            wrong = (self.steps + req.rid) % (k + 2)
            if wrong == k + 1:
                drafts = []
                self.saw_empty = True
            else:
                drafts = list(want)
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % self.vocab
            out.append(drafts)
        self.steps += 1
        return out

    def on_commit(self, batch, committed):
        self.committed_counts.update(committed)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "m", "qwen3_5_text",
                                    seed=5))


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(n)] for n in (3, 40, 77, 130)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_speculative_greedy_equals_plain_greedy_for_every_accept_count(ckpt, k):
    batch = prompts(seed=k)
    plain = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16)
    plain_outs = [o.token_ids for o in plain.generate(batch, GREEDY)]
    spec = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16,
               speculative_algorithm="ngram", speculative_num_steps=k,
               speculative_policy="fixed")
    stub = StubProposer(k, {tuple(p): o for p, o in zip(batch, plain_outs)}, 512)
    spec.engine.spec.proposer = stub
    # requests at different positions: stagger them by different max_tokens and arrival
    outs = spec.generate(batch, GREEDY)
    for prompt, ours, ref_plain in zip(batch, outs, plain_outs):
        ref = reference_greedy(ckpt, prompt, MAX_NEW)
        assert_same_runs(ours.token_ids, ref_plain, ref, f"k={k} len {len(prompt)}")
    assert stub.committed_counts == set(range(1, k + 2))
    assert stub.saw_empty
    assert_drained(spec.engine)


def test_requests_joining_mid_run_stay_exact(ckpt):
    k = 3
    batch = prompts(seed=11)
    plain = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=4)
    plain_outs = [o.token_ids for o in plain.generate(batch, GREEDY)]
    spec = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=4,
               speculative_algorithm="ngram", speculative_num_steps=k,
               speculative_policy="fixed")
    spec.engine.spec.proposer = StubProposer(k, {tuple(p): o for p, o in zip(batch, plain_outs)},
                                             512)
    eng, got = spec.engine, {}
    rids = []
    for prompt in batch:  # each request joins after the previous one has run a few steps
        rids.append(eng.add_request(prompt, GREEDY))
        for _ in range(3):
            for out in eng.step():
                got.setdefault(out.rid, []).extend(out.new_token_ids)
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.rid, []).extend(out.new_token_ids)
    for rid, prompt, ref_plain in zip(rids, batch, plain_outs):
        ref = reference_greedy(ckpt, prompt, MAX_NEW)
        assert_same_runs(got[rid], ref_plain, ref, f"staggered len {len(prompt)}")


class DeviceStubProposer(StubProposer):
    """The stub's drafts as a device tensor [N, k] (as the MTP graph step hands them over):
    every request gets k drafts, so an empty proposal becomes k wrong ones."""

    def propose(self, reqs):
        rows = []
        for req, drafts in zip(reqs, super().propose(reqs)):
            want = self.refs[tuple(req.prompt_ids)][len(req.output_ids):]
            wrong = [(t + 1) % self.vocab for t in want[:self.num_steps]]
            rows.append((drafts or wrong) + [0] * (self.num_steps - len(drafts or wrong)))
        return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("static_target", [False, True])
def test_drafts_on_the_device_accept_on_the_device_for_every_accept_count(ckpt, static_target):
    k = 3
    batch = prompts(seed=13)
    plain = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16)
    plain_outs = [o.token_ids for o in plain.generate(batch, GREEDY)]
    spec = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16,
               speculative_algorithm="ngram", speculative_num_steps=k,
               speculative_policy="fixed")
    stub = DeviceStubProposer(k, {tuple(p): o for p, o in zip(batch, plain_outs)}, 512)
    spec.engine.spec.proposer = stub
    if static_target:  # the verify input takes the drafts on the device
        eng = spec.engine
        eng.graphs = GraphRunner(eng.runner, eng.cfg.max_running_reqs,
                                 eng.cfg.decode_rows_per_req, eng.max_model_len, capture=False)
    outs = spec.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == plain_outs
    assert stub.committed_counts == set(range(1, k + 2))
    if static_target:
        assert spec.engine.graphs.graph_steps > 0
    assert_drained(spec.engine)
