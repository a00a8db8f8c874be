"""Incremental detokenization and stop-string detection for one request."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they are committed.

    `append(token)` returns True when a stop string has appeared; the text is then cut just
    before it (OpenAI semantics: the stop string is not returned). Text that could still become
    the start of a stop string, and a trailing incomplete UTF-8 sequence (U+FFFD), are held back
    from `take_new_text()` until resolved.
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._emitted = 0

    def append(self, token: int) -> bool:
        if self.stopped:
            return True
        self.ids.append(token)
        if self.tokenizer is None:
            return False
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
        return self.stopped

    def take_new_text(self, final: bool = False) -> str:
        """Text not yet handed out that can no longer change (all of it when `final`)."""
        end = len(self.text)
        if not final and not self.stopped:
            if self.text.endswith("\ufffd"):
                end -= 1
            for s in self.stop:
                for n in range(min(len(s) - 1, end), 0, -1):
                    if self.text[:end].endswith(s[:n]):
                        end -= n
                        break
        end = max(end, self._emitted)
        new = self.text[self._emitted:end]
        self._emitted = end
        return new
