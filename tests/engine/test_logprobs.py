"""Logprobs of committed tokens equal a log-softmax of the transformers reference logits
(fp32, CPU), sampled and greedy, with and without n-gram speculation."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.logprobs import row_logprobs
from deltaserve.model.testing import make_tiny_checkpoint, transformers_torch_kernels
from oracle import reference_model

N_TOP = 4
# deltaserve's fp32 forward (chunked prefill, decode, verify rows) and transformers' full forward
# round differently: on this checkpoint their log-softmaxes differ by up to 8.8e-6 on decode
# rows and 1.24e-5 on verify rows, so the bound sits just above that; the log-softmax itself
# is checked exactly against torch above
TOL = 2e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("lp") / "m", "qwen3_5_text",
                                    seed=3))


@torch.inference_mode()
def reference_logprobs(path: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: log-softmax of transformers' logits at each output position."""
    ids = torch.tensor([prompt + output])
    with transformers_torch_kernels():
        logits = reference_model(path)(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def test_row_logprobs_takes_the_chosen_token_and_the_top_n_in_order():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    got = row_logprobs(logits, [2, 1], 2)
    ref = torch.log_softmax(logits, -1)
    assert got[0].logprob == pytest.approx(float(ref[0, 2]))
    assert [t for t, _ in got[0].top] == [1, 2] and [t for t, _ in got[1].top] == [0, 1]
    assert got[1].top[0][1] == float(ref[1, 0]) and got[1].logprob == float(ref[1, 1])


@pytest.mark.parametrize("spec", [None, "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_the_reference_log_softmax(checkpoint, spec, temperature):
    cfg = dict(speculative_algorithm=spec, speculative_num_steps=3) if spec else {}
    llm = LLM(checkpoint, device="cpu", dtype="float32", num_pages=256, **cfg)
    # a repeating prompt: the n-gram proposer drafts and some drafts are accepted
    prompt = [5, 9, 11, 5, 9, 11, 5, 9, 11, 5, 9] * 3
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=12, ignore_eos=True,
                            logprobs=N_TOP)
    out = llm.generate([prompt], params)[0]
    assert len(out.logprobs) == len(out.token_ids) == 12
    ref = reference_logprobs(checkpoint, prompt, out.token_ids)
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry.token_id == tok
        assert abs(entry.logprob - float(ref[j, tok])) < TOL, j
        top = torch.topk(ref[j], N_TOP)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(entry.top, top.values.tolist())) < TOL


def test_logprobs_are_off_unless_asked_and_bounded(checkpoint):
    llm = LLM(checkpoint, device="cpu", dtype="float32", num_pages=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert out.logprobs is None
    with pytest.raises(ValueError, match="logprobs must be"):
        llm.generate([[1, 2, 3]], SamplingParams(logprobs=21))


def test_logprobs_of_accepted_drafts_come_from_their_own_verify_rows():
    """The embedded default model repeats a line after this prompt (the shipped model of
    2026-12-06 writes `#     print(f"    {i}")` three times), so n-gram drafts are accepted:
    tokens 1..k of a verify step take their logprobs from verify rows 1..k (within 1e-5 of the
    reference)."""
    from deltaserve.default_model import default_model_path

    llm = LLM(None, device="cpu", dtype="float32", speculative_algorithm="ngram",
              speculative_num_steps=3, speculative_policy="fixed", num_pages=256)
    prompt = llm.tokenizer.encode("for i in range(10):\n")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, logprobs=2,
                                                ignore_eos=True))[0]
    assert llm.engine.acceptance_length > 1.0  # some rows past the first were committed
    ref = reference_logprobs(str(default_model_path()), prompt, out.token_ids)
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(entry.logprob - float(ref[j, tok])) < 1e-5, j
        assert entry.top[0][0] == tok  # greedy: the committed token is its row's argmax


@pytest.mark.parametrize("text, skip", [
    ("x = 1\n    return 'é日本語 🐍'  # ünï\n", ""),
    ("\n    y = 2\n", "\n"),  # token healing removed the prompt's "\n"
])
def test_text_offsets_index_the_returned_text_one_token_at_a_time_or_in_steps(text, skip):
    """TextOffsets: token i starts where the output before it ends in the returned text (the
    whole decode, less the healing's removed text); a token that leaves a character incomplete
    starts where that character will; the offsets do not depend on how tokens are grouped."""
    from transformers import AutoTokenizer

    from deltaserve.default_model import default_model_path
    from deltaserve.engine.logprobs import TextOffsets, TokenLogprob

    tok = AutoTokenizer.from_pretrained(default_model_path())
    ids = tok.encode(text, add_special_tokens=False)
    returned = tok.decode(ids)[len(skip):]
    want, done = [], 0
    for i in range(len(ids)):
        head = tok.decode(ids[:i])
        if not head.endswith("\ufffd"):
            done = max(0, len(head) - len(skip))
        want.append(done)
    assert any("\ufffd" in tok.decode(ids[i:i + 1]) for i in range(len(ids))) or skip
    for group in (1, 3, len(ids)):
        offsets = TextOffsets(tok, skip)
        entries = [TokenLogprob(t, 0.0, []) for t in ids]
        for i in range(0, len(ids), group):
            offsets.assign(entries[i:i + group])
        got = [e.text_offset for e in entries]
        assert got == want
        assert got[0] == 0 and all(o <= len(returned) for o in got)
