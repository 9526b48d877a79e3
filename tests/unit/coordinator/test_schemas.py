"""The response builders write exactly the shapes the response models document, and
OpenAI's SDK types accept them."""

from __future__ import annotations

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdserve.coordinator.schemas import (
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    ResponseBuilder,
    build_usage,
)


@pytest.mark.parametrize("is_chat", [False, True])
def test_whole_response_is_the_documented_model(is_chat):
    shape = ResponseBuilder("cmpl-1", "tiny", 1700000000, is_chat)
    for token_ids, timings in ((None, None), ([5, 6], {"request_id": "cmpl-1", "ttft_s": 0.1})):
        body = shape.response("hi", "length", build_usage(3, 2), token_ids, timings)
        model = ChatCompletionResponse if is_chat else CompletionResponse
        assert model.model_validate(body).model_dump(exclude_unset=True) == body  # no extra keys
        (ChatCompletion if is_chat else Completion).model_validate(body)
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                 "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("is_chat", [False, True])
def test_stream_chunks_are_openai_chunks(is_chat):
    shape = ResponseBuilder("cmpl-1", "tiny", 1700000000, is_chat)
    chunks = [shape.chunk("He", is_first=True, token_ids=[1]), shape.chunk("llo"),
              shape.chunk("", finish_reason="stop", timings={"e2e_s": 0.5}),
              shape.usage_chunk(build_usage(3, 2))]
    for chunk in chunks:
        assert chunk["object"] == ("chat.completion.chunk" if is_chat else "text_completion")
        if is_chat:
            ChatCompletionChunk.model_validate(chunk)
        else:  # the SDK's Completion type has no unfinished choice; ours documents it
            for choice in chunk["choices"]:
                CompletionChoice.model_validate(choice)
    if is_chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
        assert chunks[2]["choices"][0]["delta"] == {}
    assert chunks[0]["choices"][0]["token_ids"] == [1] and "token_ids" not in chunks[1]["choices"][0]
    assert chunks[2]["pdserve_timings"] == {"e2e_s": 0.5} and chunks[3]["choices"] == []
