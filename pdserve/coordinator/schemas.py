"""OpenAI-compatible request and response bodies (the subset pdserve serves).

Requests are validated here, before any routing: ``stop`` holds at most four
strings, token-id prompts are non-negative integers, and every text is valid
Unicode (a lone surrogate, which JSON's ``\\ud800`` escapes can carry, is a 400
naming the field, never an encoding error later).

No parameter is silently ignored. OpenAI parameters pdserve does not implement
(``NOT_SUPPORTED``: ``n > 1``, ``functions``, ...) are declared
and refused with 400 "not supported yet" naming the parameter when they ask for
anything but their default (``n: 1`` passes). Fields nobody declares are ignored, as vLLM does (OpenAI
refuses them): SDKs and proxies add fields of their own, and ``user``, ``store`` or
``metadata`` change nothing about the output.

Response models exist for the OpenAPI document (the contract schemathesis checks).
The hot path does not validate what it sends: ``ResponseBuilder`` builds the same
shapes as plain dicts (and the stream's chunks, which OpenAPI documents as text),
the one place they are written; a unit test checks them against these models and
OpenAI's SDK types.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from .deadlines import MIN_REQUEST_TIMEOUT_S
from .structured import ResponseFormat, ToolCall, ToolChoice, ToolDefinition

MAX_SEED = 2**53 - 1  # exact in a JSON number
MAX_CHOICES = 16  # n and best_of
MAX_TOP_LOGPROBS = 20  # alternatives per token: OpenAI's chat limit, vLLM's for both
MAX_BATCH_PROMPTS = 256  # prompts in one completion request (a list of prompts)
MAX_PROMPT_IDS = 1 << 20
MAX_STOPS = 4  # OpenAI's limit


def _valid_unicode(value):
    """After-validator of a field holding text (a string, a list of strings or of
    ``TextPart``): refuses a lone surrogate, which cannot be encoded as UTF-8."""
    texts = value if isinstance(value, list) else [value]
    for text in texts:
        text = text.text if isinstance(text, TextPart) else text
        if isinstance(text, str) and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"invalid Unicode: lone surrogate U+{ord(text[exc.start]):04X} "
                                 f"at character {exc.start}") from None
    return value


# Each unimplemented OpenAI parameter and the values of it that ask for nothing.
NOT_SUPPORTED: dict[str, tuple] = {
    "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}


_PROMPT_FORMS = ("a prompt is a string, a list of token ids, or a list of prompts (strings or "
                 "token-id lists)")


def _ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _one_prompt(value, where: str):
    """A text or token-id prompt, checked; ``where`` names it in errors."""
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{where} is empty")
        return _valid_unicode(value)
    if not _ids(value) or not value:
        raise ValueError(f"{where} must be a non-empty string or list of token ids; {_PROMPT_FORMS}")
    if len(value) > MAX_PROMPT_IDS:
        raise ValueError(f"{where} has more than {MAX_PROMPT_IDS} token ids")
    if any(t < 0 for t in value):
        raise ValueError(f"{where}: token ids must be non-negative")
    return value


def _prompt(value):
    """Before-validator of a completion's ``prompt``: one prompt, or a list of them (as
    vLLM and OpenAI take, and lm-eval sends even for one), with a message that says
    which form was meant (a union's first member's error would not)."""
    if isinstance(value, str) or _ids(value):
        return _one_prompt(value, "the prompt")
    if not isinstance(value, list) or not value:
        raise ValueError(_PROMPT_FORMS)
    if len(value) > MAX_BATCH_PROMPTS:
        raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts in one request, got {len(value)}")
    return [_one_prompt(p, f"prompt {i}") for i, p in enumerate(value)]


def _text_parts(value):
    """Before-validator of a message's ``content``: a string, or parts of type ``text``;
    any other part (an image, audio) is refused saying so."""
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"part {i} has type {kind!r}: this model takes text only "
                                 "(a string, or parts of type 'text')")
    elif value is not None and not isinstance(value, str):
        raise ValueError("content must be a string or a list of parts of type 'text'")
    return value


def _stop(value):
    """Before-validator of ``stop``: a string or at most ``MAX_STOPS`` of them."""
    if isinstance(value, list) and len(value) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(value)}")
    return value


_ID_LIST = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1,
            "maxItems": MAX_PROMPT_IDS}
PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1}, _ID_LIST,
    {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": 1}, _ID_LIST]},
     "minItems": 1, "maxItems": MAX_BATCH_PROMPTS}]}


def _refuse_non_default(value, info):
    """Field validator of ``NOT_SUPPORTED``: its defaults pass, anything else is a 400."""
    harmless = NOT_SUPPORTED[info.field_name]
    if any(value == d and type(value) is type(d) for d in harmless):  # 1 passes, True not
        return value
    raise PydanticCustomError("not_supported", "{name} is not supported yet (got {value})",
                              {"name": info.field_name, "value": repr(value)[:80]})


def _unsupported(description: str) -> Any:
    return Field(default=None, description=f"Not supported yet: {description}")


def _bias_keys(bias: dict[str, float] | None):
    """``logit_bias`` keys are token ids written as strings, as OpenAI's are."""
    for key in bias or ():
        if not key.isdigit() or len(key) > 9:
            raise ValueError(f"logit_bias keys must be token ids, got {key[:16]!r}")
    return bias


class StreamOptions(BaseModel):
    include_usage: bool = False
    """A last chunk with the usage of the whole request, and no choices."""
    continuous_usage_stats: bool = False
    """Extension (as vLLM's): every chunk also carries the usage so far."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: Annotated[str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None,
                    BeforeValidator(_stop), AfterValidator(_valid_unicode)] = None
    top_k: int = Field(default=-1, ge=-1, le=1 << 20)
    """Extension (as vLLM's): sample from the k likeliest tokens; -1 or 0: all."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """Extension (as vLLM's): drop tokens below min_p times the likeliest one's probability."""
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    """Extension (as vLLM's): multiplicative, over prompt and output tokens; 1: off."""
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None,
                          Field(max_length=1024), AfterValidator(_bias_keys)] = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=64)
    """Extension (as vLLM's): token ids that end the output (kept in it)."""
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    """Choices, sampled from one prefill (the others reuse its cached prompt blocks)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    return_token_ids: bool = False
    """pdserve extension (as vLLM's): each choice also carries its output token ids."""
    ignore_eos: bool = False
    """Extension (as vLLM's and SGLang's): the model's EOS does not end the output."""
    min_tokens: int = Field(default=0, ge=0, le=1 << 20)
    """Extension (as vLLM's): no EOS or stop token before this many output tokens."""
    request_timeout: float | None = Field(default=None, ge=MIN_REQUEST_TIMEOUT_S,
                                          allow_inf_nan=False)
    """pdserve extension: the request's total in seconds, the whole generation included
    (as the ``x-request-timeout`` header; the smallest of these and the server's
    applies); past it the request ends with 504 ``deadline``."""
    # Structured output, enforced by the engines' grammar (structured.py).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    """Extension (as vLLM's): the output is JSON valid for this schema."""
    guided_regex: str | None = Field(default=None, min_length=1)
    """Extension (as vLLM's): the whole output matches this regex."""
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, max_length=1024)
    """Extension (as vLLM's): the output is one of these strings."""
    guided_grammar: str | None = Field(default=None, min_length=1)
    """Extension (as vLLM's): the output follows this Lark (llguidance) or GBNF grammar."""


    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]


class CompletionRequest(_Request):
    prompt: Annotated[Any, BeforeValidator(_prompt), WithJsonSchema(PROMPT_SCHEMA)]
    """Text (tokenized by the Coordinator), one prompt as token ids, or a list of prompts
    (each answered with ``n`` choices, indexed prompt by prompt, as vLLM does)."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Each output token's logprob with this many likeliest alternatives (OpenAI allows 5)."""
    echo: bool = False
    """The prompt's text before the output; with ``logprobs``, its tokens' logprobs first."""
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    """Sample this many and return the ``n`` with the highest total logprob (not streamed)."""
    suffix: Any = _unsupported("suffix (insertion)")

    _refuse = field_validator("suffix")(_refuse_non_default)

    def batch(self) -> list | None:
        """The prompts of a list of prompts; None for one prompt."""
        prompt = self.prompt
        return prompt if isinstance(prompt, list) and isinstance(prompt[0], str | list) else None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts),
                       AfterValidator(_valid_unicode)] = None
    name: Annotated[str | None, AfterValidator(_valid_unicode)] = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)
    """An assistant turn's calls, for the chat template."""
    tool_call_id: str | None = Field(default=None, max_length=256)
    """A tool turn: the call it answers."""

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    logprobs: bool = False
    """Each output token's logprob, with ``top_logprobs`` likeliest alternatives."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    """With tools, "auto" by default (structured.py says what each choice constrains)."""
    parallel_tool_calls: bool = True
    functions: Any = _unsupported("function calling")
    function_call: Any = _unsupported("function calling")
    audio: Any = _unsupported("audio output")
    modalities: Any = _unsupported("modalities other than text")
    prediction: Any = _unsupported("predicted outputs")

    _refuse = field_validator(
        "functions", "function_call", "audio", "modalities", "prediction")(_refuse_non_default)


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens the prefilling engine found in its prefix cache (not recomputed)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class _Choice(BaseModel):
    index: int
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    token_ids: list[int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    """None for an echoed prompt's first token (nothing predicts it)."""
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = None
    pdserve_timings: dict[str, float | int | str | None] | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None
    """The longest request (prompt + output tokens) every engine serving it takes."""
    dtype: str | None = None
    """Extension: the dtype its engines run in (``auto`` resolved)."""


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthStatus(BaseModel):
    status: str
    detail: dict[str, int | str | bool] = Field(default_factory=dict)


class ResponseBuilder:
    """One response's bodies as dicts: the whole response (``CompletionResponse`` or
    ``ChatCompletionResponse``) or the chunks of its stream. Built once per request
    by serving; ``chunk`` runs per streamed message, so it only fills in dicts."""

    __slots__ = ("is_chat", "index", "_head", "_chunk_head")

    def __init__(self, request_id: str, model: str, created: int, is_chat: bool,
                 index: int = 0) -> None:
        self.is_chat = is_chat
        self.index = index  # the choice this builder's bodies are of
        self._head = {"id": request_id, "object": "chat.completion" if is_chat else "text_completion",
                      "created": created, "model": model}
        self._chunk_head = {**self._head, "object": "chat.completion.chunk" if is_chat
                            else "text_completion"}

    def response(self, text: str, finish_reason: str | None, usage: dict,
                 token_ids: list[int] | None = None, timings: dict | None = None,
                 logprobs: dict | None = None) -> dict:
        choice: dict = {"index": self.index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.is_chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = {**self._head, "choices": [choice], "usage": usage}
        if timings is not None:
            body["pdserve_timings"] = timings
        return body

    def chunk(self, text: str, is_first: bool = False, finish_reason: str | None = None,
              token_ids: list[int] | None = None, timings: dict | None = None,
              logprobs: dict | None = None) -> dict:
        """A chunk of new text (the first one names the chat role), or the last one
        (``finish_reason`` set, no text)."""
        choice: dict = {"index": self.index, "logprobs": logprobs, "finish_reason": finish_reason}
        if not self.is_chat:
            choice["text"] = text
        elif is_first:
            choice["delta"] = {"role": "assistant", "content": text}
        else:
            choice["delta"] = {"content": text} if text or finish_reason is None else {}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = {**self._chunk_head, "choices": [choice]}
        if timings is not None:
            body["pdserve_timings"] = timings
        return body

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._chunk_head, "choices": [], "usage": usage}


def build_usage(num_prompt_tokens: int, num_completion_tokens: int,
                num_cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
