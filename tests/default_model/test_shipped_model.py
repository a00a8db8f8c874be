"""The shipped default model: what default_model_path() serves, equal to transformers, and its
MTP head's drafts are accepted (fp32, CPU)."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.default_model import FILES_DIR, default_model_path, shipped_model_path
from oracle import assert_same_greedy, reference_greedy

PROMPTS = (  # code in the style of the corpus, not copied from a training file
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n",
    "    def test_add(self):\n        self.assertEqual(add(1, 2), 3)\n",
    "x",
)
MAX_NEW = 24

pytestmark = pytest.mark.skipif(shipped_model_path() is None, reason="no trained weights shipped")


@pytest.fixture(scope="module")
def llm():
    return LLM(None, device="cpu", dtype="float32", chunk_size=64, page_size=16)


def test_the_default_model_is_the_shipped_trained_folder():
    assert default_model_path() == shipped_model_path() == str(FILES_DIR)


def test_greedy_tokens_equal_transformers_on_the_shipped_model(llm):
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params)  # one mixed batch
    for text, prompt, out in zip(PROMPTS, prompts, outs, strict=True):
        ref = reference_greedy(str(FILES_DIR), prompt, MAX_NEW)
        assert_same_greedy(out.token_ids, ref, f"prompt {text!r}")


def test_mtp_drafts_are_accepted_and_change_no_token():
    prompts = [PROMPTS[1], PROMPTS[2]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(None, device="cpu", dtype="float32").generate(prompts, params)
    spec = LLM(None, device="cpu", dtype="float32", speculative_algorithm="mtp",
               speculative_num_steps=3)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    # an untrained head gets ~1.0 (nothing accepted); the trained one ~3 on code
    assert spec.engine.acceptance_length >= 2.0


def test_generation_stops_at_end_of_text_and_at_the_chat_turns_end(llm):
    tok = llm.tokenizer
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    assert set(llm.engine.model.config.eos_token_ids) == eos
