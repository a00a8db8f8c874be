"""Token healing on the random default model: the prompt's last token is backed up, the first
output token extends its text, and the text handed out continues the prompt exactly."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.core import Batch, Phase, Req
from deltaserve.default_model import random_model_path
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.grammar import GrammarSpec
from deltaserve.engine.healing import FOLLOWERS, TokenHealer, bitmask_row, mask_healing
from deltaserve.spec.proposer import Proposer
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


SPLIT = ["def f(x):\n    ", "def f(x):\n        "]


def test_the_allowed_tokens_extend_or_are_a_proper_prefix_the_tokenizer_puts_first(llm):
    healer, tok = llm.engine.healer, llm.tokenizer
    rest = b"\n    "
    allowed = healer.allowed(rest)
    assert allowed == sorted(set(allowed))
    firsts = {tok.encode("\n    " + c, add_special_tokens=False)[0] for c in FOLLOWERS}
    want = {t for t, data in enumerate(healer.token_bytes)
            if data and (data.startswith(rest) or (len(data) < len(rest)
                                                  and rest.startswith(data) and t in firsts))}
    assert set(allowed) == want
    # a lone "\n" is a proper prefix too, but the tokenizer never splits "\n" + spaces after
    # it: it would leave 4 spaces for one-space tokens (a fresh user's blank-line prompts)
    assert tok.get_vocab()["\u010a"] not in allowed
    three = llm.tokenizer.get_vocab()["\u010a\u0120\u0120\u0120"]  # "\n   "
    assert three in allowed and three not in healer.extending(rest)
    h = healer.heal(llm.tokenizer.encode(SPLIT[0], add_special_tokens=False))
    assert h.removed_text == "\n    " and torch.equal(h.allowed, h.mask(rest))
    space = healer.extending(b" ")[0]
    assert h.remaining([]) == rest
    assert h.remaining([three]) == b" "  # a proper prefix: one space is still to come
    assert h.remaining([three, space]) is None  # covered
    assert h.remaining([healer.extending(rest)[0]]) is None  # extended at once
    assert torch.equal(h.mask(b" "), bitmask_row(healer.allowed(b" "), healer.vocab_size))


def healed_greedy(path: str, healer: TokenHealer, ids: list[int], n: int) -> list[int]:
    """The oracle: transformers' greedy continuation of ids[:-1] where, until the text of the
    backed-up token ids[-1] is covered, each token is the best of those allowed (fp32)."""
    from deltaserve.model.testing import transformers_torch_kernels
    from oracle import reference_model

    model, seq, out = reference_model(path), list(ids[:-1]), []
    rest = healer.token_bytes[ids[-1]]
    for _ in range(n):
        with torch.inference_mode(), transformers_torch_kernels():
            logits = model(torch.tensor([seq])).logits[0, -1]
        if rest is None:
            t = int(torch.argmax(logits))
        else:
            allowed = healer.allowed(rest)
            t = allowed[int(torch.argmax(logits[allowed]))]
            data = healer.token_bytes[t]
            rest = rest[len(data):] if len(data) < len(rest) and rest.startswith(data) else None
        out.append(t)
        seq.append(t)
    return out


@pytest.mark.parametrize("algo", [None, "mtp", "ngram"])
def test_a_removed_text_split_over_two_tokens_continues_the_prompt(path, algo):
    kw = dict(speculative_algorithm=algo, speculative_num_steps=3,
              speculative_policy="fixed") if algo else {}
    eng_llm = LLM(path, device="cpu", dtype="float32", **kw)
    tok, healer = eng_llm.tokenizer, eng_llm.engine.healer
    outs = eng_llm.generate(SPLIT, greedy(10, token_healing=True))
    split = 0
    for prompt, out in zip(SPLIT, outs):
        ids = tok.encode(prompt, add_special_tokens=False)
        removed = healer.token_bytes[ids[-1]]
        first = healer.token_bytes[out.token_ids[0]]
        if len(first) < len(removed):  # the path under test: a proper prefix first
            split += 1
            assert removed.startswith(first)
            assert healer.token_bytes[out.token_ids[1]].startswith(removed[len(first):])
        else:
            assert first.startswith(removed)
        # 10 tokens of new text: a token inside the removed text comes on top
        silent = healer.heal(ids).silent(out.token_ids)
        assert out.token_ids == healed_greedy(path, healer, ids, 10 + silent)
        assert tok.decode(ids[:-1] + out.token_ids) == prompt + out.text
    assert split == 1  # the random model's pick for the first prompt: "\n   ", then " ..."
    assert_drained(eng_llm.engine)


def test_a_verify_step_masks_each_row_while_its_drafts_leave_text_to_come(llm):
    """Rows 0..j of a request are masked while the output and drafts 1..j leave some of the
    removed text to come (each with the mask of what is left), and no row after that."""
    healer, vocab = llm.engine.healer, llm.tokenizer.get_vocab()
    ids = llm.tokenizer.encode("x = [\n" + " " * 8, add_special_tokens=False)
    h = healer.heal(ids)
    assert h.removed_text == "\n" + " " * 8
    nl, one, two = vocab["\u010a"], vocab["\u0120"], vocab["\u0120\u0120"]  # "\n", " ", "  "
    req = Req(0, h.prompt_ids, greedy(token_healing=True), 64, output_ids=[nl], healing=h)
    other = Req(1, [5, 6], greedy(), 64, output_ids=[7])
    # left after the output and drafts 1..j: 8, 7, 5 spaces, then covered by a long draft
    drafts = [[one, two, healer.extending(b" " * 5)[0]], [one, one, one]]
    batch = Batch(Phase.VERIFY, [other, req], [4, 4], rows_per_req=4, draft_ids=drafts[::-1],
                  num_drafts=[3, 3])
    owners = [other] * 4 + [req] * 4
    logits = torch.zeros(8, healer.vocab_size)
    assert mask_healing(logits, batch, owners)
    for row, rest in zip(range(4, 7), (b" " * 8, b" " * 7, b" " * 5)):
        allowed = (logits[row] == 0).nonzero().flatten().tolist()
        assert allowed == healer.allowed(rest), row
    assert not torch.isinf(logits[:4]).any() and not torch.isinf(logits[7]).any()
    req.output_ids = [healer.extending(h.removed_text.encode())[0]]  # covered: nothing masked
    assert not mask_healing(logits.zero_(), batch, owners) and not torch.isinf(logits).any()


def test_tokens_that_only_regenerate_the_removed_text_do_not_count_against_max_tokens(llm):
    """A request for m tokens gets m tokens of new text: the healing tokens that re-generate
    only the removed prompt text come on top, and usage counts the user's prompt and the new
    tokens (max_tokens 1 once handed out "" when the one token was "\\n" + 3 spaces)."""
    tok, healer, eng = llm.tokenizer, llm.engine.healer, llm.engine
    silent_seen = 0
    for prompt in PROMPTS[:2] + SPLIT:
        ids = tok.encode(prompt, add_special_tokens=False)
        full = llm.generate([prompt], greedy(8, token_healing=True))[0]
        s = healer.heal(ids).silent(full.token_ids)
        silent_seen += s
        for m in (1, 2):
            out = llm.generate([prompt], greedy(m, token_healing=True))[0]
            assert out.token_ids == full.token_ids[:s + m]
            assert out.finish_reason == "length" and out.text and full.text.startswith(out.text)
            rid = eng.add_request(ids, greedy(m, token_healing=True))
            last = None
            while eng.has_unfinished():
                last = next((o for o in eng.step() if o.rid == rid), last)
            assert (last.prompt_tokens, last.completion_tokens) == (len(ids), m)
    assert silent_seen >= 1  # "\n" + 4 spaces: "\n" + 3 spaces first, a silent token
    assert_drained(eng)


def test_silent_counts_the_leading_tokens_inside_the_removed_text(llm):
    tok, healer = llm.tokenizer, llm.engine.healer
    h = healer.heal(tok.encode(SPLIT[0], add_special_tokens=False))
    assert h.removed == b"\n    "
    by_bytes = {data: t for t, data in enumerate(healer.token_bytes) if data}
    nl3, sp, nl4 = by_bytes[b"\n   "], by_bytes[b" "], by_bytes[b"\n    "]
    x = tok.encode(" x", add_special_tokens=False)[0]
    assert h.silent([]) == 0
    assert h.silent([nl3, x, sp]) == 1  # " x" goes past the removed text
    assert h.silent([nl3, sp, sp]) == 2  # all of it, then a token of new text
    assert h.silent([nl4, sp]) == 1 and h.silent([x]) == 0


class _Continuation(Proposer):
    """Drafts a known continuation of the one request running (every draft right)."""

    def __init__(self, k: int, tokens: list[int]) -> None:
        self.num_steps, self.tokens = k, tokens

    def propose(self, reqs):
        return [self.tokens[len(r.output_ids):][:self.num_steps] for r in reqs]


def test_verify_steps_that_commit_several_tokens_keep_the_healed_budget(path, llm):
    """Once healing is done a verify step's accepted rows go in at once; the length cut must
    still count max_tokens from the first token of new text (a silent token on top)."""
    healer = llm.engine.healer
    spec = LLM(path, device="cpu", dtype="float32", speculative_algorithm="ngram",
               speculative_num_steps=3, speculative_policy="fixed")
    sched, commits = spec.engine.scheduler, []
    commit = sched._commit_tokens
    sched._commit_tokens = lambda req, tokens: commits.append(len(tokens)) or commit(req, tokens)
    for prompt in SPLIT:
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        full = llm.generate([prompt], greedy(16, token_healing=True))[0].token_ids
        s = healer.heal(ids).silent(full)
        spec.engine.spec.proposer = _Continuation(3, full)
        for m in (1, 2, 4, 7, 16 - s):
            out = spec.generate([prompt], greedy(m, token_healing=True))[0]
            assert out.token_ids == full[:s + m] and out.finish_reason == "length"
    assert max(commits) == 4  # verify steps did commit k + 1 tokens at once
    assert_drained(spec.engine)
