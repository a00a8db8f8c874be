"""logprobs, n forks and structured output on a CUDA device, CUDA graphs on (the grammar mask
is applied to the graph's logits after the replay)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.grammar import GrammarSpec
from drained import assert_drained

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from live_server import make_tiny_model  # noqa: E402
from test_logprobs import reference_logprobs  # noqa: E402
from test_structured_output import SCHEMA  # noqa: E402

pytestmark = pytest.mark.gpu
# the test extra's schema checker; a GPU machine without the extras skips this module
jsonschema = pytest.importorskip("jsonschema")
# fla-core's prefill dots run in TF32 on the GPU: logprobs are close to the fp32 reference,
# not within the CPU bound
GPU_LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("gpu_features") / "tiny"))


def make(path: str, spec: str | None = None) -> LLM:
    cfg = (dict(speculative_algorithm=spec, speculative_num_steps=3, speculative_policy="fixed")
           if spec else {})
    return LLM(path, device="cuda", dtype="float32", num_pages=1024, page_size=16,
               max_running_reqs=16, max_model_len=512, **cfg)


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_gpu_json_schema_outputs_validate_over_fifty_seeds(tiny, spec):
    llm = make(tiny, spec)
    assert llm.engine.graphs is not None, "CUDA graphs should be on for this test"
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=96, structured=grammar)
              for s in range(50)]
    for out in llm.generate([[1, 2, 3, 4]] * 50, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert_drained(llm.engine)


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_gpu_logprobs_are_close_to_the_reference(tiny, spec):
    llm = make(tiny, spec)
    prompt = [5, 9, 11, 5, 9, 11, 5, 9] * 4
    out = llm.generate([prompt], SamplingParams(temperature=0.8, seed=2, max_tokens=10,
                                                ignore_eos=True, logprobs=2))[0]
    ref = reference_logprobs(tiny, prompt, out.token_ids)
    got = torch.tensor([e.logprob for e in out.logprobs])
    want = ref[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
    assert (got - want).abs().max() < GPU_LOGPROB_TOL


def test_gpu_three_forks_prefill_once_and_equal_single_requests(tiny):
    llm = make(tiny)
    engine = llm.engine
    prompt = [(7 * i) % 500 + 3 for i in range(130)]
    params = [SamplingParams(temperature=1.0, seed=9 + i, max_tokens=8, ignore_eos=True)
              for i in range(3)]
    rids = engine.add_forks(prompt, params)
    got = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.rid].extend(o.new_token_ids)
    assert engine.cache_status()["hit_tokens"] == 3 * 128
    engine.flush_cache()
    assert [got[r] for r in rids] == [llm.generate([prompt], p)[0].token_ids for p in params]
