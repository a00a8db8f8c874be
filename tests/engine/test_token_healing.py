"""Token healing on the random default model: the prompt's last token is backed up, the first
output token extends its text, and the text handed out continues the prompt exactly."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.default_model import random_model_path
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.grammar import GrammarSpec
from deltaserve.engine.healing import TokenHealer, bitmask_row
from drained import assert_drained

PROMPTS = [
    'def is_prime(n):\n    """Return True when n is a prime number."""\n',
    "import os\nimport sys\n\n\nclass Config:\n",
    "for i in range(10):\n    print(i)\n" * 6,  # > 64 tokens: a prefix-cache snapshot
]


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return random_model_path(tmp_path_factory.mktemp("dm"))


@pytest.fixture(scope="module")
def llm(path) -> LLM:
    return LLM(path, device="cpu", dtype="float32")


def test_the_prefix_table_gives_every_token_that_extends_a_newline(llm):
    tok, healer = llm.tokenizer, llm.engine.healer
    assert healer is llm.engine.healer  # built once per engine
    vocab = tok.get_vocab()
    for text in ("x = 1\n    return x  # ünï\n", "\n\n        pass"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(healer.token_bytes[i] for i in ids) == text.encode()
    extend = healer.extending(b"\n")
    assert extend == sorted(extend) and len(extend) > 10
    assert all(healer.token_bytes[i].startswith(b"\n") for i in extend)
    assert vocab["\u010a"] in extend and vocab["\u010a\u0120\u0120\u0120"] in extend  # "\n   "
    assert not any(healer.token_bytes[i] for i in (0, 1, 2))  # special tokens never extend


def test_heal_backs_up_only_a_last_token_that_longer_tokens_extend(llm):
    tok, healer = llm.tokenizer, llm.engine.healer
    ids = tok.encode(PROMPTS[0], add_special_tokens=False)
    assert tok.decode(ids[-1:]) == "\n"
    h = healer.heal(ids)
    assert h.prompt_ids == ids[:-1] and h.removed_text == "\n"
    assert torch.equal(h.allowed, bitmask_row(healer.extending(b"\n"), healer.vocab_size))
    assert healer.heal(ids[-1:]) is None  # nothing would be left to run
    lone = [t for t, data in enumerate(healer.token_bytes)
            if len(data) > 1 and healer.extending(data) == [t]]
    assert healer.heal(ids[:3] + lone[:1]) is None  # no longer token: nothing to heal
    quote = tok.encode('def f():\n    """Doc.\n    """', add_special_tokens=False)
    assert len(healer.extending(healer.token_bytes[quote[-1]])) > 1  # ' """' + ...
    assert healer.heal(quote) is None  # not whitespace: the docstring stays closed
    anything = TokenHealer(tok, healer.vocab_size, whitespace_only=False).heal(quote)
    assert anything.prompt_ids == quote[:-1]
    space = tok.encode("x =", add_special_tokens=False) + tok.encode(" ", add_special_tokens=False)
    assert healer.heal(space).removed_text == " "


def test_bitmask_rows_set_exactly_the_given_ids():
    row = bitmask_row([0, 31, 32, 63, 99], 100)
    assert row.dtype == torch.int32 and row.shape == (4,)
    bits = [(int(row[t // 32]) >> (t % 32)) & 1 for t in range(100)]
    assert [t for t, b in enumerate(bits) if b] == [0, 31, 32, 63, 99]


def test_the_first_token_extends_the_removed_text_and_the_text_continues_the_prompt(llm, path):
    from deltaserve.model.testing import transformers_torch_kernels
    from oracle import reference_model

    tok, healer = llm.tokenizer, llm.engine.healer
    outs = llm.generate(PROMPTS, greedy(token_healing=True))
    model = reference_model(path)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert healer.token_bytes[out.token_ids[0]].startswith(b"\n")
        # the visible text: exactly what follows the user's prompt
        assert tok.decode(ids[:-1] + out.token_ids) == prompt + out.text
        # the first token is the best of the allowed ones (transformers, fp32)
        with torch.inference_mode(), transformers_torch_kernels():
            logits = model(torch.tensor([ids[:-1]])).logits[0, -1]
        allowed = healer.extending(b"\n")
        assert out.token_ids[0] == allowed[int(torch.argmax(logits[allowed]))]
        # the rest is the plain greedy continuation of the healed prefix
        rest = llm.generate([ids[:-1] + out.token_ids[:1]], greedy(11))[0]
        assert rest.token_ids == out.token_ids[1:]
    assert_drained(llm.engine)


def test_off_keeps_the_prompt_and_the_tokens(llm):
    tok = llm.tokenizer
    off = llm.generate(PROMPTS, greedy(token_healing=False))
    plain = llm.generate([tok.encode(p, add_special_tokens=False) for p in PROMPTS], greedy())
    assert [o.token_ids for o in off] == [o.token_ids for o in plain]
    for prompt, o in zip(PROMPTS, off):
        assert tok.decode(tok.encode(prompt, add_special_tokens=False) + o.token_ids) == \
            prompt + o.text
    # a prompt whose last token nothing extends is not changed by healing either
    ids = tok.encode("x = 1\n", add_special_tokens=False)
    lone = next(t for t, data in enumerate(llm.engine.healer.token_bytes)
                if len(data) > 1 and llm.engine.healer.extending(data) == [t])
    a, b = llm.generate([ids + [lone]] * 2, [greedy(token_healing=True), greedy()])
    assert a.token_ids == b.token_ids and a.text == b.text


def test_stop_strings_are_searched_in_the_visible_text_only(llm):
    full = llm.generate(PROMPTS[:1], greedy(24, token_healing=True))[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = llm.generate(PROMPTS[:1], greedy(24, token_healing=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.find(stop)]
    # the removed "\n" is the prompt's, not output: a "\n" stop ends at the first output one
    nl = llm.generate(PROMPTS[:1], greedy(24, token_healing=True, stop=["\n"]))[0]
    assert nl.text == full.split("\n")[0]
    assert_drained(llm.engine)


def test_greedy_healing_is_the_same_with_the_prefix_cache_and_with_mtp(path):
    params = greedy(10, token_healing=True)
    cached = LLM(path, device="cpu", dtype="float32")
    first = [o.token_ids for o in cached.generate(PROMPTS, params)]
    again = cached.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == first
    assert again[2].cached_tokens >= 64  # the healed prompt hit the cache
    nocache = LLM(path, device="cpu", dtype="float32", enable_prefix_cache=False)
    assert [o.token_ids for o in nocache.generate(PROMPTS, params)] == first
    mtp = LLM(path, device="cpu", dtype="float32", speculative_algorithm="mtp",
              speculative_num_steps=3, speculative_policy="fixed")
    assert [o.token_ids for o in mtp.generate(PROMPTS, params)] == first
    assert_drained(cached.engine)
    assert_drained(mtp.engine)


def test_token_healing_with_structured_output_is_refused(llm):
    with pytest.raises(ValueError, match="token_healing cannot be combined"):
        llm.generate("x", greedy(token_healing=True, structured=GrammarSpec("json_object")))
    with pytest.raises(ValueError, match="token_healing must be true or false"):
        llm.generate("x", greedy(token_healing=1))


def test_the_detokenizer_skips_the_removed_text_once(llm):
    tok = llm.tokenizer
    ids = tok.encode("\n    return x\n", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], skip="\n")
    for t in ids:
        d.append(t)
    assert d.take_new_text(final=True) == "    return x\n"
    # text that does not start with the skipped text is kept whole
    d = IncrementalDetokenizer(tok, [], skip="#")
    for t in ids:
        d.append(t)
    assert d.take_new_text(final=True) == "\n    return x\n"
