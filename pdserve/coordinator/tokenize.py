"""POST /tokenize and /detokenize (as vLLM's): the served model's tokenizer over HTTP.

Clients count tokens before they send a request (to fit ``max_tokens`` into what
the context leaves) and inspect what a chat template renders. Both answer from
the Coordinator's own tokenizer, the one that tokenizes every request, so the
counts are exactly what a completion would use; no engine is involved.
``max_model_len`` is the engines' smallest (``InstanceRegistry.max_model_len``),
null until one reports it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from .errors import ServeError
from .instances import InstanceRegistry
from .prompts import PromptBuilder
from .schemas import ChatMessage, ErrorResponse, _valid_unicode
from .settings import CoordinatorSettings


class TokenizeRequest(BaseModel):
    """Either ``prompt`` (tokenized as /v1/completions does, BOS as the checkpoint asks)
    or ``messages`` (rendered by the chat template as /v1/chat/completions does).
    ``add_special_tokens`` as vLLM's: whether the tokenizer adds BOS (by default yes
    for a prompt, no for messages, whose template has its own); clients such as
    ``vllm bench serve`` send it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=256)
    prompt: Annotated[str | None, AfterValidator(_valid_unicode)] = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=1024)
    return_token_strs: bool = False
    add_special_tokens: bool | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=256)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


def register_tokenize(app: FastAPI, prompts: PromptBuilder, registry: InstanceRegistry,
                      settings: CoordinatorSettings) -> None:
    """Called by ``create_app``."""
    errors = {code: {"model": ErrorResponse} for code in (400, 401, 404)}

    def check_model(model: str | None) -> None:
        if model is not None and model != settings.model_name:
            raise ServeError(404, f"model {model!r} does not exist; this server serves "
                             f"{settings.model_name!r}", code="model_not_found", param="model")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors)
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ServeError(400, "give exactly one of prompt and messages", param="prompt")
        add_bos = body.messages is None if body.add_special_tokens is None else body.add_special_tokens
        if body.messages is not None:
            text = prompts.render_chat([{"role": m.role, "content": m.text()} for m in body.messages])
            ids = prompts.encode_text(text, add_bos=add_bos)
        else:
            ids = prompts.encode_text(body.prompt, add_bos=add_bos)
        out = {"count": len(ids), "max_model_len": registry.max_model_len() or None, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [prompts.tokenizer.decode([t]) for t in ids]
        return out

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        if prompts.tokenizer is None:
            raise ServeError(400, "this model has no tokenizer", param="tokens")
        ids = prompts.check_ids(body.tokens)
        return {"prompt": prompts.tokenizer.decode(ids)}
