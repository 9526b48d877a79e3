"""Grammar-constrained decoding on the engine (llguidance).

``Grammars`` (one per engine, built by ``LLMEngine``) owns the bridge from the
engine's tokenizer to llguidance's and a cache of compiled grammars by ``(kind,
spec)``: a request's constraint is compiled once, the first time it is seen, and each
request gets its own copy of the compiled matcher (``GuidedMatcher``).

A request's matcher lives on the request (``Request.guided``) and follows it:
- ``LLMEngine.add_request`` starts it and replays the last ``sample_offset`` prompt
  tokens, which a continued stream carries (the tokens earlier engines generated), so
  a continuation on another engine stands exactly where the first one stopped. A D
  leg replays the same way, then takes P's first token like any other;
- the sampler masks the row of each constrained request (``apply_masks``) before any
  other adjustment: disallowed tokens get ``-inf``, and EOS is allowed only where the
  grammar may end;
- ``Scheduler._append_token`` advances it with every token the request gains (sampled
  here, or P's first token on D) and ends the request "stop" as soon as the grammar is
  complete, without waiting for an EOS.

Unconstrained requests cost nothing: their ``guided`` is None and no mask is built.
The vocabulary is the model's (its logits' width): tokens past the tokenizer's are
never allowed.
"""

from __future__ import annotations

from collections import OrderedDict

import llguidance
import torch

from pdserve.runtime.grammar import GrammarError, build_grammar, first_line
from pdserve.runtime.tokenizer import ByteTokenizer

MAX_CACHED_GRAMMARS = 64
_BIT = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


class GuidedError(ValueError):
    """A constraint this engine cannot apply; the message says why."""


class GuidedMatcher:
    """One request's grammar state: which tokens may come next, and whether it is done.
    Used on the step thread only (the sampler, then the scheduler)."""

    __slots__ = ("_matcher", "error")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self.error: str | None = None  # set once a token broke the grammar

    def bitmask(self) -> bytes:
        """One bit per vocabulary token (little-endian within each byte): may come next."""
        return self._matcher.compute_bitmask()

    def advance(self, token: int) -> None:
        """Take the request's newest token. A token the grammar refuses (which the mask
        prevents for sampled ones) latches ``error``."""
        if self.error is None and not self._matcher.consume_token(token):
            self.error = f"token {token} breaks the grammar: {first_line(self._matcher.get_error())}"

    @property
    def is_done(self) -> bool:
        """The grammar is complete: nothing but EOS could follow."""
        return self._matcher.is_stopped()


class Grammars:
    """The engine's compiled grammars. Called by ``LLMEngine.add_request`` (loop thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._source = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def start(self, kind: str, spec: str, prior_token_ids: list[int]) -> GuidedMatcher:
        """A fresh matcher for one request, advanced by ``prior_token_ids`` (the tokens
        its stream generated on earlier engines). Raises ``GuidedError``."""
        template = self._compiled.get((kind, spec))
        if template is None:
            template = self._compile(kind, spec)
        else:
            self._compiled.move_to_end((kind, spec))
        matcher = GuidedMatcher(template.deep_copy())
        for token in prior_token_ids:
            matcher.advance(token)
        if matcher.error is not None:
            raise GuidedError(f"the continued output does not match the constraint: {matcher.error}")
        return matcher

    def _compile(self, kind: str, spec: str) -> llguidance.LLMatcher:
        try:
            grammar = build_grammar(kind, spec)
        except GrammarError as exc:
            raise GuidedError(str(exc)) from None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GuidedError(f"{kind}: {first_line(matcher.get_error())}")
        self._compiled[(kind, spec)] = matcher
        if len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is not None:
            return self._tokenizer
        eos = self._eos or None
        if isinstance(self._source, ByteTokenizer):
            wrapper = llguidance.TokenizerWrapper(_ByteVocabulary(self._source, self._vocab_size))
            self._tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self._vocab_size, eos_token=eos)
        elif self._source is not None:
            self._tokenizer = llguidance.LLTokenizer(self._source.to_json(), n_vocab=self._vocab_size, eos_token=eos)
        else:
            raise GuidedError("guided decoding needs the model's tokenizer; this model has none")
        return self._tokenizer


class _ByteVocabulary:
    """The byte tokenizer seen as llguidance's ``TokenizerWrapper`` wants it: token
    ``i < 256`` is byte ``i``, the ids above are specials."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [
            f"<|special_{i}|>".encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def apply_masks(logits: torch.Tensor, rows: list[int], matchers: list[GuidedMatcher]) -> None:
    """Set the logits of every token the grammar forbids to ``-inf``, in place, for the
    constrained ``rows``. Called by the sampler before any other adjustment."""
    vocab = logits.shape[-1]
    packed = torch.frombuffer(bytearray(b"".join(m.bitmask() for m in matchers)),
                              dtype=torch.uint8).view(len(rows), -1)
    allowed = (packed.unsqueeze(-1) & _BIT).ne(0).view(len(rows), -1)[:, :vocab]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    forbidden = ~allowed.to(logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
