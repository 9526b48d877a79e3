"""Incremental detokenization and stop-string matching for one request.

Text is released only once it can no longer change: a trailing replacement
character (an incomplete UTF-8 sequence) and any tail that could still grow into a
stop string are held back until the next token or the end.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self._text = ""  # decoded text so far, stop-truncated
        self._emitted = 0  # characters already released

    def append(self, output_token_ids: list[int]) -> tuple[str, bool]:
        """Called after each new token; returns (newly released text, hit a stop string)."""
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(output_token_ids)
        for stop in self.stop:
            idx = text.find(stop, max(0, self._emitted - len(stop)))
            if idx != -1:
                self._text = text[:idx]
                return self.flush(), True
        self._text = text
        hold = 0
        if text.endswith("\ufffd"):
            hold = 1
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        end = max(self._emitted, len(text) - hold)
        new = text[self._emitted : end]
        self._emitted = end
        return new, False

    def flush(self) -> str:
        """Release everything held back; called when the request finishes."""
        new = self._text[self._emitted :]
        self._emitted = len(self._text)
        return new
