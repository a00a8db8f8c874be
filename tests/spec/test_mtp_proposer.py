"""The MTP proposer: its drafts are the checkpoint's MTP head on exact draft KV, and speculation
with it reproduces plain greedy decoding (CPU, fp32).

The oracle for the drafts is an independent implementation: transformers' own decoder layer
and norms wrapped as the MTP head (`default_model.mtp.MTPHead`, used for training), run over
the whole sequence with the target's final hidden states from transformers.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint, transformers_torch_kernels
from drained import assert_drained
from token_ids import random_tokens as tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "m", "qwen3_5_text",
                                    seed=8, with_mtp=True))


@torch.inference_mode()
def oracle_mtp_logits(path: str, seq: list[int]) -> torch.Tensor:
    """The MTP head's logits [len(seq) - 1, vocab] at every position of `seq`: position j
    reads (t_{j+1}, h_j) and predicts t_{j+2}."""
    from transformers import AutoModelForCausalLM

    from deltaserve.default_model.mtp import MTPHead

    with transformers_torch_kernels():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([seq])
        hidden = model.model(ids).last_hidden_state
        head = MTPHead(model.config).eval()
        weights = {k[len("mtp."):]: v for k, v in
                   load_file(os.path.join(path, "model.safetensors")).items()
                   if k.startswith("mtp.")}
        head.load_state_dict(weights)
        n = len(seq) - 1
        pos = torch.arange(n)[None]
        out = head(model.get_input_embeddings()(ids[:, 1:]), hidden[:, :n],
                   model.model.rotary_emb(hidden, pos))
        return model.lm_head(out)[0].float()


def test_mtp_drafts_equal_the_head_run_over_the_whole_sequence(ckpt):
    spec = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=4,
               speculative_algorithm="mtp", speculative_num_steps=2,
               speculative_policy="fixed")
    proposer = spec.engine.spec.proposer
    seen: list[tuple[list[int], int, torch.Tensor]] = []
    propose = proposer.propose

    def recording(reqs):
        drafts = propose(reqs)
        for req, d in zip(reqs, drafts):
            if d:  # the head's output at position device_len - 1, which gave draft 1
                hidden = proposer.states[req.rid].first[0]
                logits = spec.engine.model.compute_logits(hidden[None])[0]
                seen.append((req.all_ids[:req.device_len + 1], d[0], logits))
        return drafts

    proposer.propose = recording
    prompt = tokens(70, seed=1)
    spec.generate([prompt], GREEDY)
    # a second turn resumes from the cache: its draft KV for cached positions came from turn 1
    (turn1,) = spec.generate([prompt], GREEDY)
    spec.generate([prompt + turn1.token_ids + tokens(5, seed=2)], GREEDY)
    # a request that ends right after its prefill still leaves exact draft KV for its last
    # prompt position (128 = a snapshot depth, so the follow-up reuses all of it)
    p128 = tokens(128, seed=3)
    (one,) = spec.generate([p128], SamplingParams(temperature=0.0, max_tokens=1))
    (follow,) = spec.generate([p128 + one.token_ids + tokens(3, seed=4)], GREEDY)
    assert follow.cached_tokens == 128
    assert len(seen) > 10
    for seq, draft, logits in seen:
        want = oracle_mtp_logits(ckpt, seq)[-1]
        assert draft == int(logits.argmax())
        torch.testing.assert_close(logits, want, atol=2e-4, rtol=2e-4,
                                   msg=f"MTP logits at length {len(seq)}")


def test_speculation_with_mtp_equals_plain_greedy(ckpt):
    batch = [tokens(n, seed=n) for n in (5, 64, 90)]
    plain = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16)
    spec = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16,
               speculative_algorithm="mtp", speculative_num_steps=3)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    got = [o.token_ids for o in spec.generate(batch, GREEDY)]
    assert got == want
    assert spec.engine.acceptance_length is not None
    assert_drained(spec.engine)
