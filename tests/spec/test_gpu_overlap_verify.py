"""Overlapped verify steps on a CUDA device with captured graphs (engine/overlap_verify.py):
the embedded default model, MTP k = 3, verify steps chained behind unlanded ones give the
same greedy tokens as synchronous verify steps through the same graphs (the same kernels on
the same batches: equal token for token, no near-tie allowance), with stops inside accepted
runs, a second turn from the prefix cache, the adaptive policy's plain steps between chains,
and nothing leaked. The CPU tests (test_overlap_verify.py) check the same paths uncaptured.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.default_model import default_model_path
from drained import assert_drained
from oracle import assert_same_greedy, reference_greedy

pytestmark = pytest.mark.gpu

GPU_EPS = 0.05  # fp32 GPU kernels against the CPU reference (as test_gpu_mtp_graph.py)

OPENINGS = ["def is_prime(n):\n", "class Stack:\n    def push(self, item):\n",
            "import os\n\n\ndef walk(path):\n    \"\"\"Yield every file under path.\"\"\"\n",
            "def parse_args(argv):\n",
            "def merge(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
            "class Config:\n    def __init__(self, path):\n"]


def make(overlap_verify: bool, dtype: str, policy: str = "fixed") -> LLM:
    return LLM(None, device="cuda", dtype=dtype, num_pages=2048, page_size=16,
               max_running_reqs=8, speculative_algorithm="mtp", speculative_num_steps=3,
               speculative_policy=policy, overlap_verify=overlap_verify)


def stop_index(out: list[int], j: int) -> int:
    """An index of `out` whose token does not occur before it (a stop token there ends the
    request at exactly that output): the first at or after j, else the last before it (a
    greedy output that only repeats after j; index 0 always qualifies)."""
    new = [i for i in range(len(out)) if out[i] not in out[:i]]
    return next((i for i in new if i >= j), new[-1])


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_chained_verify_steps_give_the_synchronous_tokens(dtype):
    """Fixed k: both engines run the same kernels on the same batches, so the tokens are
    equal with no near-tie allowance."""
    sync = make(False, dtype)
    tok = sync.tokenizer
    prompts = [tok.encode(t) for t in OPENINGS]
    free = [o.token_ids for o in sync.generate(prompts, [greedy(48)] * len(prompts))]
    # half the requests stop at a new token inside their output, the rest run to max_tokens
    params = [greedy(48, stop_token_ids=[out[stop_index(out, 10 + 3 * i)]]) if i % 2 else
              greedy(30 + 3 * i) for i, out in enumerate(free)]
    llm = make(True, dtype)
    runs = []
    for eng in (sync, llm):
        first = [o.token_ids for o in eng.generate(prompts, params)]
        follow = [p + o + p[:4] for p, o in zip(prompts, first)]
        runs.append((first, [o.token_ids for o in eng.generate(follow, params)]))
    assert runs[1] == runs[0]
    verify = llm.engine.overlap.verify
    assert verify.chained_steps > 10, verify.chained_steps
    assert sync.engine.overlap.verify.launched_steps == 0
    assert llm.engine.graphs.eager_steps == 0
    torch.cuda.synchronize()
    assert_drained(llm.engine)


def test_gpu_adaptive_policy_with_chained_verify_steps_keeps_greedy_tokens():
    """The adaptive policy picks plain steps (overlapped) and verify steps (chained) by their
    measured costs, so the two engines' step sequences differ: each is checked against
    transformers (fp32, CPU) with the near-tie rule."""
    llm = make(True, "float32", policy="adaptive")
    prompts = [llm.tokenizer.encode(t) for t in OPENINGS]
    params = [greedy(40 + 2 * i) for i in range(len(prompts))]
    outs = [o.token_ids for o in llm.generate(prompts * 2, params * 2)]
    path = default_model_path()
    for i, (prompt, sp) in enumerate(zip(prompts * 2, params * 2)):
        ref = reference_greedy(path, prompt, sp.max_tokens)
        assert_same_greedy(outs[i], ref, f"prompt {i % len(prompts)}", eps=GPU_EPS)
    assert llm.engine.overlap.verify.launched_steps > 0
    torch.cuda.synchronize()
    assert_drained(llm.engine)
