"""The incremental detokenizer against its definition: decode all output ids after every token.

The definition (`FullDecode`, the engine's detokenizer until it was made incremental) is
O(n^2) in the output length; the engine's decodes short windows. On the shipped byte-level
BPE tokenizer, for random token sequences (multi-byte characters split across tokens,
special tokens, stop strings taken from the text), both must stop at the same token and
hand out the same text.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.default_model import default_model_path
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.llm_engine import load_tokenizer


class FullDecode:
    """The definition: decode every output id after each token; stop at the first
    occurrence of any stop string in the whole text."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop, self.ids = tokenizer, stop, []
        self.text, self.stopped = "", False

    def append(self, token: int) -> bool:
        if self.stopped:
            return True
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s)
            if at != -1:
                self.text, self.stopped = self.text[:at], True
        return self.stopped


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def run(det, ids: list[int]) -> tuple[int, str]:
    """Tokens consumed until a stop (all when none), and all text handed out."""
    out = []
    for n, t in enumerate(ids, 1):
        stopped = det.append(t)
        if isinstance(det, IncrementalDetokenizer):
            out.append(det.take_new_text(final=stopped or n == len(ids)))
        if stopped:
            return n, "".join(out) if out else det.text
    return len(ids), "".join(out) if out else det.text


# ids: byte tokens that split multi-byte characters (the first ~260 ids of a byte-level
# vocabulary), ordinary tokens, and the special tokens at 0..2
token_ids = st.lists(st.one_of(st.integers(0, 300), st.integers(0, 8191),
                               st.sampled_from([0, 1, 2])), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ids=token_ids, data=st.data())
def test_incremental_text_and_stop_equal_a_full_decode_after_every_token(tokenizer, ids, data):
    text = tokenizer.decode(ids, skip_special_tokens=True)
    printable = text.replace("\ufffd", "")
    stop = []
    if printable and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(printable) - 1))
        stop = [printable[i:i + data.draw(st.integers(1, 4))]]
    ref_n, ref_text = run(FullDecode(tokenizer, stop), ids)
    n, got = run(IncrementalDetokenizer(tokenizer, stop), ids)
    assert (n, got) == (ref_n, ref_text)


def test_chinese_and_emoji_split_over_byte_tokens_come_out_whole(tokenizer):
    ids = tokenizer.encode("naïve 你好 🙂 done", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, [])
    pieces = []
    for i, t in enumerate(ids):
        det.append(t)
        pieces.append(det.take_new_text(final=i == len(ids) - 1))
    assert "".join(pieces) == "naïve 你好 🙂 done"
    assert all("\ufffd" not in p for p in pieces)


def test_each_step_decodes_a_window_not_the_whole_output(tokenizer):
    """Without stop strings the tokens a step commits (up to k+1 = 4 for a verify step) are
    decoded together when the step's text is taken: two decodes of a short window a step."""
    calls = []
    det = IncrementalDetokenizer(tokenizer, [])
    inner = det._decode
    det._decode = lambda ids: calls.append(len(ids)) or inner(ids)
    ids = tokenizer.encode("x = 1\n" * 200, add_special_tokens=False)
    pieces, steps = [], 0
    for i in range(0, len(ids), 4):
        for t in ids[i:i + 4]:
            det.append(t)
        pieces.append(det.take_new_text())
        steps += 1
    pieces.append(det.take_new_text(final=True))
    assert "".join(pieces) == "x = 1\n" * 200
    assert max(calls) <= 16 and len(calls) <= 2 * steps


def test_stop_strings_are_found_at_the_token_that_completes_them(tokenizer):
    """With a stop string each token is decoded as it is appended: append reports the stop
    at the token that completes it (the scheduler commits no token after it)."""
    ids = tokenizer.encode("a = 1\nb = 2\nc = 3\n", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, ["b = 2"])
    stopped_at = next(i for i, t in enumerate(ids) if det.append(t))
    text = tokenizer.decode(ids[:stopped_at + 1])
    assert "b = 2" in text and "b = 2" not in tokenizer.decode(ids[:stopped_at])
    assert det.take_new_text(final=True) == "a = 1\n"


def test_a_prompt_past_the_context_length_encodes_without_a_warning(tokenizer):
    """The engine refuses such a prompt with its own error (tests/server/test_cli.py); the
    tokenizer must not first log transformers' "longer than the specified maximum sequence
    length ... indexing errors" warning, which would only mislead."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        ids = tokenizer.encode("x = 1\n" * 20000)
    finally:
        transformers_logger.removeHandler(handler)
    assert len(ids) > 32768  # the default model's max_model_len
    assert not [r for r in records if "maximum sequence length" in r.getMessage()]
