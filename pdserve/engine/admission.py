"""What the engine refuses before a request reaches the step loop, and why.

``LLMEngine.add_request`` runs these checks in order; each raises ``EngineInputError``
with a message that names the field, so bad input never reaches a step (where it
would fail the whole batch): the KV leg's parameters against this engine's role and
transport, the prompt's token ids against the vocabulary and the engine's capacity,
the sampling settings (``SamplingParams.validate``), and a constrained request's
grammar (compiled here, advanced past the tokens a continued stream generated).
``EngineUnavailable``: the engine is draining (not the input's fault).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from pdserve.api.sampling import SamplingError, SamplingParams
from pdserve.engine.kv_transfer.params import KVTransferError, KVTransferParams

if TYPE_CHECKING:
    from pdserve.engine.guided import Grammars


class EngineInputError(ValueError):
    """A request the engine refuses; the message says why."""


class EngineUnavailable(RuntimeError):
    """The engine admits no such request now: it is draining, or its role changed (a
    Coordinator's view a moment old); another engine may take it."""


def check_kv_transfer(kv: KVTransferParams, params: SamplingParams, role: str, connector,
                      old_role: str = "") -> None:
    """A disaggregated leg: valid parameters, a transport, a role that takes the leg
    (``role``, or ``old_role`` in the moments after a switch, while Coordinators' views
    still send it; else unavailable, not bad input, for another engine to take), an
    unused transfer id; a decode leg does not prefill, so it scores no prompt."""
    try:
        kv.validate()
    except KVTransferError as exc:
        raise EngineInputError(str(exc)) from None
    if connector is None:
        raise EngineInputError("this engine has no KV transport (kv_transport=none)")
    if role not in (kv.role, "hybrid") and old_role not in (kv.role, "hybrid"):
        raise EngineUnavailable(f"a {role} engine takes no {kv.role} leg (its role is {role} now)")
    if connector.has_transfer(kv.transfer_id):
        raise EngineInputError(f"transfer id {kv.transfer_id!r} is already in use")
    if kv.role == "decode" and params.prompt_logprobs:
        raise EngineInputError("prompt_logprobs: a decode leg does not prefill; ask the prefill leg")


def check_prompt(prompt_token_ids: list, vocab_size: int, token_capacity: int,
                 max_model_len: int, num_kv_tokens: int) -> list[int]:
    """The prompt as a list of ints in the vocabulary, shorter than the engine's
    capacity (``token_capacity``: the model's length and the whole KV cache)."""
    if not prompt_token_ids:
        raise EngineInputError("the prompt is empty")
    try:
        # A float or string id would pass the range check and crash the step for all.
        prompt_token_ids = [operator.index(t) for t in prompt_token_ids]
    except TypeError:
        raise EngineInputError("prompt token ids must be integers") from None
    if any(not (0 <= t < vocab_size) for t in prompt_token_ids):
        raise EngineInputError(f"prompt token ids must be in [0, {vocab_size})")
    if len(prompt_token_ids) >= token_capacity:
        raise EngineInputError(
            f"prompt has {len(prompt_token_ids)} tokens; this engine's limit is "
            f"{token_capacity - 1} (max model length {max_model_len}, KV capacity "
            f"{num_kv_tokens} tokens)")
    return prompt_token_ids


def check_sampling(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """Valid settings, with a concrete seed when sampled (``with_seed``)."""
    try:
        params.validate(vocab_size)
    except SamplingError as exc:
        raise EngineInputError(str(exc)) from None
    return params.with_seed()


def start_guided(grammars: Grammars | None, params: SamplingParams, prompt_token_ids: list[int]):
    """A constrained request's matcher, advanced past the tokens a continued stream
    generated on earlier engines (the prompt's last ``sample_offset``); else None."""
    if params.guided is None:
        return None
    if grammars is None:
        raise EngineInputError("guided: a simulated engine does not run constrained decoding")
    from pdserve.engine.guided import GuidedError  # torch: loaded by engines that guide

    num_prior = min(params.sample_offset, len(prompt_token_ids))
    try:
        return grammars.start(*params.guided, prompt_token_ids[len(prompt_token_ids) - num_prior:])
    except GuidedError as exc:
        raise EngineInputError(f"guided: {exc}") from None
