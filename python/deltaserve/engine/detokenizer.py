"""Incremental detokenization and stop-string detection for one request."""

from __future__ import annotations

PREFIX_TOKENS = 6  # tokens decoded before the new ones, so a window decodes as in context


class DecodeWindow:
    """Output ids decoded in a short window of context: `_take` gives the text the pending ids
    (those not yet taken) add after the last few taken ones (PREFIX_TOKENS), so a token's text
    is what it adds in context (a leading space, a merged character), at the cost of two
    decodes of the window, not of the whole output. Shared by IncrementalDetokenizer and the
    logprobs' TextOffsets, so both cut the text at the same places."""

    def __init__(self, tokenizer) -> None:
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] is the context window already taken
        self._read = 0  # ids[_read:] are pending: their text is not taken yet
        self._decode = _decoder(tokenizer)

    def _take(self, final: bool) -> str | None:
        """The text of the pending ids, now taken; None (nothing taken) while it ends in an
        incomplete UTF-8 character (U+FFFD) unless `final`."""
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if not final and after != before and (len(after) < len(before)
                                               or after.endswith("\ufffd")):
            return None  # a character still incomplete: its tokens stay pending
        self._prefix = max(self._read, len(self.ids) - PREFIX_TOKENS)
        self._read = len(self.ids)
        return after[len(before):]


class IncrementalDetokenizer(DecodeWindow):
    """Turns a request's output token ids into text as they are committed.

    Each token costs two decodes of a short window (the last few tokens, then those plus the
    new ones), not a decode of the whole output: decoding everything every step was O(n^2)
    in the output length (an 8 k-token answer decoded 8 k tokens per step). A window's text
    is taken only once it no longer ends in an incomplete UTF-8 sequence (U+FFFD); until then
    its tokens stay pending. The same scheme as vLLM's and Hugging Face's TextStreamer: the
    text of ids[prefix:] minus the text of ids[prefix:read] is what the new tokens add.

    `append(token)` returns True when a stop string has appeared; the text is then cut just
    before it (OpenAI semantics: the stop string is not returned). Text that could still become
    the start of a stop string is held back from `take_new_text()` until resolved. Without stop
    strings `append` only records the id and `take_new_text` decodes every token since the
    last call in one window: a verify step that commits 4 tokens costs 2 decodes, not 8.

    `skip`: text the output starts with that is not handed out nor searched for stop strings
    (token healing, engine/healing.py: the prompt text the first token re-generates); `text`
    is what follows it.
    """

    def __init__(self, tokenizer, stop: list[str], skip: str = "") -> None:
        super().__init__(tokenizer)
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self._skip = skip  # what of `skip` is still to be dropped from the decoded text
        self.stopped = False
        self._emitted = 0

    def append(self, token: int) -> bool:
        if self.stopped:
            return True
        self.ids.append(token)
        if not self.watches_stops:
            return False  # nothing to look for: decoded when the text is taken
        return self._advance(final=False)

    @property
    def watches_stops(self) -> bool:
        """Whether `append` searches for stop strings (else it only records the id)."""
        return self.tokenizer is not None and bool(self.stop)

    def extend(self, tokens: list[int]) -> None:
        """`append` of each token, for a detokenizer that does not watch for stop strings."""
        assert not self.watches_stops, "stop strings are found one token at a time (append)"
        if not self.stopped:
            self.ids.extend(tokens)

    def _advance(self, final: bool) -> bool:
        """Move the pending tokens' text into `text` (if complete, or `final`); stop check."""
        new = self._take(final)
        if not new:  # nothing pending, a character incomplete, or tokens that print nothing
            return self.stopped
        searched_from = len(self.text)
        if self._skip:
            n = _common_prefix(new, self._skip)
            # a mismatch cannot happen under the healing mask; if it did, keep what differs
            self._skip = self._skip[n:] if n == len(new) else ""
            new = new[n:]
        self.text += new
        for s in self.stop:
            at = self.text.find(s, max(0, searched_from - len(s) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
        return self.stopped

    def take_new_text(self, final: bool = False) -> str:
        """Text not yet handed out that can no longer change (all of it when `final`)."""
        if self.tokenizer is not None and not self.stopped:
            self._advance(final=final)
        end = len(self.text)
        if not final and not self.stopped:
            for s in self.stop:
                end -= held_back(self.text, end, s)
        end = max(end, self._emitted)
        new = self.text[self._emitted:end]
        self._emitted = end
        return new


def held_back(text: str, end: int, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that text[:end] ends with (characters
    that may still become `stop`). Only the positions where stop[0] occurs in the last
    len(stop) - 1 characters are tried, earliest (longest) first: trying every length cost
    4.5 ms per token for 64 stop strings of 512 characters."""
    if len(stop) < 2:
        return 0
    i = text.find(stop[0], max(0, end - (len(stop) - 1)), end)
    while i != -1:
        if stop.startswith(text[i:end]):
            return end - i
        i = text.find(stop[0], i + 1, end)
    return 0


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _decoder(tokenizer):
    """ids -> text, special tokens skipped. A transformers fast tokenizer's Rust backend
    directly when the wrapper would add nothing (no clean-up of spaces): the wrapper's type
    checks of every id cost as much as the decode itself."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
