"""Incremental detokenization and stop strings, shared by the engine and the Coordinator.

Text is released only once it can no longer change: a trailing replacement
character (an incomplete UTF-8 sequence) and any tail that could still grow into a
stop string are held back until the next token or the end.

Cost per token is O(1) in the output's length (vLLM's prefix/read offsets): each
step decodes only the window ``token_ids[prefix_offset:]``, where ``prefix_offset``
is the start of the last token(s) whose text was complete; the context tokens
before the new ones keep word-boundary spaces right. The window grows only while
tokens decode to an incomplete character, and shrinks back once it completes.
Only the unreleased text and the last ``len(longest stop) - 1`` released characters
are kept, so a stop string that straddles what was released is still found. The
released pieces join to exactly what decoding the whole output at once gives.
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
        self._prefix_offset = 0  # first token of the decode window (context)
        self._read_offset = 0  # first token whose text is not yet decoded into _pending
        self._pending = ""  # decoded, not yet released
        self._released_tail = ""  # last released characters a stop string may start in
        self._tail_len = max((len(s) for s in stop), default=1) - 1
        self._stopped = False

    def _decode_window(self, final: bool = False) -> str:
        """Text of the tokens from ``_read_offset`` on, or "" while it ends in an
        incomplete character (unless ``final``); moves the offsets past it."""
        ids = self.token_ids
        prefix_text = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        text = self.tokenizer.decode(ids[self._prefix_offset:])
        if len(text) <= len(prefix_text) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return text[len(prefix_text):]

    def append(self, new_token_ids: list[int]) -> tuple[str, bool]:
        """Add the newest output tokens; returns (newly released text, hit a stop string).

        Called by the engine after each sampled token and by the Coordinator for each
        engine message.
        """
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None or self._stopped:
            return "", False
        pending = self._pending + self._decode_window()
        text = self._released_tail + pending
        for stop in self.stop:
            idx = text.find(stop)
            if idx != -1:
                self._pending = pending[:max(0, idx - len(self._released_tail))]
                self._stopped = True
                return self._release(len(self._pending)), True
        hold = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        self._pending = pending
        return self._release(max(0, len(pending) - hold)), False

    def _release(self, num_chars: int) -> str:
        new, self._pending = self._pending[:num_chars], self._pending[num_chars:]
        if self._tail_len:
            self._released_tail = (self._released_tail + new)[-self._tail_len:]
        return new

    def flush(self) -> str:
        """Everything held back, incomplete characters included; called when the
        request finishes."""
        if self.tokenizer is not None and not self._stopped \
                and self._read_offset < len(self.token_ids):
            self._pending += self._decode_window(final=True)
        return self._release(len(self._pending))
