"""Incremental detokenization and stop strings, shared by the engine and the Coordinator.

Text is released only once it can no longer change: a trailing replacement
character (an incomplete UTF-8 sequence) and any tail that could still grow into a
stop string are held back until the next token or the end.
"""

from __future__ import annotations


class Detokenizer:
    """Incremental text of one request's output tokens, with stop strings.

    Text is released once it cannot change: a trailing replacement character (an
    incomplete UTF-8 sequence) and a tail that could grow into a stop string wait.
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self._text = ""
        self._emitted = 0

    def append(self, new_token_ids: list[int]) -> tuple[str, bool]:
        """Add the newest output tokens; returns (newly released text, hit a stop string).

        Called by the engine after each sampled token and by the Coordinator for each
        engine message.
        """
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(self.token_ids)
        for stop in self.stop:
            idx = text.find(stop, max(0, self._emitted - len(stop)))
            if idx != -1:
                self._text = text[:idx]
                return self.flush(), True
        self._text = text
        hold = 1 if text.endswith("\ufffd") else 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        end = max(self._emitted, len(text) - hold)
        new = text[self._emitted:end]
        self._emitted = end
        return new, False

    def flush(self) -> str:
        """Everything held back; called when the request finishes."""
        new = self._text[self._emitted:]
        self._emitted = len(self._text)
        return new
