"""Per-request sampling parameters: the one carrier of a request's sampling settings.

``SamplingParams`` is what the Coordinator builds from an OpenAI request
(``coordinator/serving.build_generation_params``), what crosses to the engine
(``to_proto`` / ``from_proto``: the wire's ``SamplingParams`` message, field for field
by name) and what the engine's sampler reads. One set of defaults, here. Adding a
sampling setting touches the OpenAI schema, this class and its proto field (same
name; a test keeps the two in step), and the sampler.

The wire's zeros: proto3 cannot tell an unset scalar from 0, so a message from
another producer that leaves ``max_tokens``, ``top_p`` or ``repetition_penalty`` at 0
gets the default (``WIRE_ZERO_IS_DEFAULT``); ``seed`` and ``guided`` have presence.
The wire's ``n`` is not a sampling setting of one request (the engine refuses n > 1).

Validated on arrival so that a bad value is refused with a message and never reaches
the step loop. The random stream is counter-based: the token at output index ``i``
is drawn with a generator seeded from ``(seed, i)``, so the sampler's whole random
state is ``seed`` plus the number of tokens generated. That makes a request's
sampling resumable on another engine with no opaque RNG blob.

Penalties follow vLLM and OpenAI: ``presence_penalty`` and ``frequency_penalty``
subtract from the logits of tokens already *generated* (once, and per occurrence);
``repetition_penalty`` divides positive and multiplies negative logits of every
token seen in the prompt or the output. Their state is the token history itself: a
stream continued on another engine sends prompt + generated tokens with
``sample_offset`` = the number generated, and those last ``sample_offset`` prompt
tokens count as generated (``Request.generated_token_ids``), so the continuation
penalizes exactly as the first engine would have.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields

from pdserve.api.proto import engine_pb2 as pb

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's chat and vLLM allow


class SamplingError(ValueError):
    """Bad sampling values; the message names the field."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    sample_offset: int = 0  # stream position of the first token (continued streams)
    min_p: float = 0.0  # 0 disables min-p
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 disables it
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Log probabilities (``logprobs.py``): of each sampled token with the ``top_logprobs``
    # likeliest alternatives, and of each prompt token after the first (``prompt_logprobs``).
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    # Grammar-constrained decoding (``guided.py``): ``(kind, spec)`` as on the wire.
    guided: tuple[str, str] | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0):
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise SamplingError(f"seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.sample_offset < 0:
            raise SamplingError(f"sample_offset must be >= 0, got {self.sample_offset}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must be non-empty")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise SamplingError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if vocab_size is not None:
            for name in ("stop_token_ids", "logit_bias"):
                bad = sorted(t for t in getattr(self, name) if not 0 <= t < vocab_size)
                if bad:
                    raise SamplingError(f"{name} out of vocabulary range [0, {vocab_size}): {bad[:8]}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """The sampler needs the request's token history (``sampler.TokenHistory``)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def with_seed(self) -> SamplingParams:
        """A copy with a concrete seed, so the request's random stream is reproducible."""
        if self.seed is not None or self.is_greedy:
            return self
        return SamplingParams(**{**self.__dict__, "seed": random.getrandbits(62)})

    def to_proto(self) -> pb.SamplingParams:
        """The wire's message: every field by its name."""
        msg = pb.SamplingParams(**{name: getattr(self, name) for name in _PLAIN})
        if self.seed is not None:
            msg.seed = self.seed
        if self.guided is not None:
            msg.guided.kind, msg.guided.spec = self.guided
        return msg

    @classmethod
    def from_proto(cls, msg: pb.SamplingParams) -> SamplingParams:
        """The settings a wire message carries; its zeros in ``WIRE_ZERO_IS_DEFAULT`` and
        its absent ``seed`` and ``guided`` are the defaults. Not validated (``validate``)."""
        values = {name: getattr(msg, name) for name in _PLAIN}
        for name in WIRE_ZERO_IS_DEFAULT:
            if not values[name]:
                del values[name]
        for name in _REPEATED:
            values[name] = list(values[name])
        values["logit_bias"] = dict(values["logit_bias"])
        if msg.HasField("seed"):
            values["seed"] = msg.seed
        if msg.HasField("guided"):
            values["guided"] = (msg.guided.kind, msg.guided.spec)
        return cls(**values)


WIRE_ZERO_IS_DEFAULT = ("max_tokens", "top_p", "repetition_penalty")
_PRESENCE = ("seed", "guided")  # fields whose absence on the wire is None
_PLAIN = tuple(f.name for f in fields(SamplingParams) if f.name not in _PRESENCE)
_REPEATED = ("stop", "stop_token_ids")
