"""Log probabilities in OpenAI's shapes, and the prompt ``echo`` of completions.

The engines send, per output token, its logprob and its likeliest alternatives
(``TokenLogprob``: the model's raw distribution, see the engine's ``logprobs.py``)
and, for ``echo`` with ``logprobs``, one entry per prompt token after the first.
``RequestRun`` keeps them in step with the tokens (``RequestRun.logprobs``,
``prompt_logprobs``); ``OutputLogprobs`` turns the entries not yet sent into:

- chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]}``, ``top_logprobs`` entries exactly;
- completions: ``{tokens, token_logprobs, top_logprobs: [{token: logprob}],
  text_offset}``, each ``top_logprobs`` dict holding the ``logprobs`` likeliest
  tokens and the sampled one (as vLLM); with ``echo`` the prompt's tokens come first,
  the first of them with ``null`` logprob and alternatives (nothing predicts it).

A token's text is what the tokenizer decodes it to alone (``TokenTexts``): a special
token decodes to "", a piece of a multi-byte character to U+FFFD, and ``bytes`` are
that text's UTF-8. ``text_offset`` counts characters of those texts from the start
of the choice's text (the echoed prompt included).
"""

from __future__ import annotations

from pdserve.api.proto import engine_pb2 as pb

from .lifecycle import RequestRun


class TokenTexts:
    """Token id -> text, decoded once per id; one per app (the vocabulary bounds it)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id]))
            self._texts[token_id] = text
        return text


class OutputLogprobs:
    """One request's logprobs as they go out: ``take`` returns the entries of the tokens
    streamed since the last call, in the endpoint's shape. Built by serving for a
    request that asked for logprobs; used once per response or per stream chunk."""

    def __init__(self, run: RequestRun, texts: TokenTexts, is_chat: bool,
                 num_top: int, echo_text: str | None = None) -> None:
        self.run = run
        self.texts = texts
        self.is_chat = is_chat
        self.num_top = num_top
        self.echo_text = echo_text  # the prompt's entries go first, once
        self._num_taken = 0
        self._offset = 0

    def take(self) -> dict:
        """The entries not yet sent: all of them for a whole response, the chunk's when
        streaming (a chunk's tokens are all in ``run.logprobs`` when it is sent)."""
        entries = self.run.logprobs[self._num_taken:]
        self._num_taken += len(entries)
        if self.is_chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        if self.echo_text is not None:
            prompt = self.run.prompt_ids
            self._add(out, prompt[0], None)
            for token_id, e in zip(prompt[1:], self.run.prompt_logprobs or [], strict=True):
                self._add(out, token_id, e)
            self._offset, self.echo_text = len(self.echo_text), None
        for e in entries:
            self._add(out, e.token_id, e)
        return out

    def _add(self, out: dict[str, list], token_id: int, e: pb.TokenLogprob | None) -> None:
        """One token of a completion's logprobs; ``e`` None for the prompt's first."""
        text = self.texts.text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(self._offset)
        self._offset += len(text)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            return
        top = {self.texts.text(t.token_id): t.logprob for t in e.top[:self.num_top]}
        top.setdefault(text, e.logprob)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append(top)

    def _chat_entry(self, e: pb.TokenLogprob) -> dict:
        text = self.texts.text(e.token_id)
        return {"token": text, "logprob": e.logprob, "bytes": list(text.encode("utf-8")),
                "top_logprobs": [self._chat_top(t) for t in e.top[:self.num_top]]}

    def _chat_top(self, t: pb.TopLogprob) -> dict:
        text = self.texts.text(t.token_id)
        return {"token": text, "logprob": t.logprob, "bytes": list(text.encode("utf-8"))}
