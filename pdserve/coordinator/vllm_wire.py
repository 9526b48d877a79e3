"""vLLM's HTTP answers and the engine API's messages, one into the other: pure functions.

Used by ``vllm_engine.VllmEngine`` for each leg: ``completion_body`` (a
``GenerateRequest`` as a ``/v1/completions`` body), ``answer_messages`` (a whole
answer as ``GenerateResponse`` messages), ``logprobs_of`` / ``prompt_logprobs_of``,
``error_of`` /
``http_error`` (vLLM's error answers as ``engine_errors``), ``BlockMap`` (vLLM's
prefix-cache events as pdserve's block hashes). docs/vllm.md says where in
vLLM each field is decided; tests/data/vllm/ holds real answers.
"""

from __future__ import annotations

import orjson

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.sampling import SamplingParams
from pdserve.runtime.block_hash import hash_block

from .engine_errors import EngineBusy, EngineCallError, EngineFailed, InputRefused

GUIDED_KEYS = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}

def completion_body(request: pb.GenerateRequest) -> dict:
    """The ``/v1/completions`` body of a leg's request (before the leg's own fields)."""
    s = SamplingParams.from_proto(request.sampling)
    if request.sampling.n > 1:
        raise InputRefused("INVALID_ARGUMENT", "the vLLM backend takes one choice per request")
    body = {
        "prompt": list(request.prompt_token_ids) or request.prompt, "stream": True,
        "return_token_ids": True, "max_tokens": s.max_tokens, "min_tokens": s.min_tokens,
        "temperature": s.temperature, "top_p": s.top_p, "ignore_eos": s.ignore_eos,
        "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
    }
    optional = {"top_k": s.top_k, "min_p": s.min_p, "stop": s.stop,
                "stop_token_ids": s.stop_token_ids, "seed": s.seed,
                "logit_bias": {str(k): v for k, v in s.logit_bias.items()}}
    body.update((k, v) for k, v in optional.items() if v or (k == "seed" and v is not None))
    if s.logprobs:
        body.update(logprobs=s.top_logprobs, return_tokens_as_token_ids=True)
    if s.prompt_logprobs:
        body["prompt_logprobs"] = max(1, s.top_logprobs)
    if s.guided is not None:
        kind, spec = s.guided
        if kind == "json_object":
            body["structured_outputs"] = {"json_object": True}
        else:
            value = orjson.loads(spec) if kind in ("json_schema", "choice") else spec
            body["structured_outputs"] = {GUIDED_KEYS[kind]: value}
    return body


def answer_messages(request: pb.GenerateRequest, answer: dict,
                    timings: pb.Timings) -> list[pb.GenerateResponse]:
    """A whole (non-streamed) answer as the messages a stream of it would have been: one
    with its tokens and ``timings``, ``finished`` as vLLM says (a prefill leg adds its
    handoff)."""
    choice = answer["choices"][0]
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    message = pb.GenerateResponse(
        request_id=request.request_id, token_ids=choice.get("token_ids") or (),
        num_prompt_tokens=usage.get("prompt_tokens", 0),
        num_output_tokens=usage.get("completion_tokens", 0),
        num_cached_tokens=details.get("cached_tokens") or 0, timings=timings)
    num_top = request.sampling.top_logprobs
    if choice.get("logprobs"):
        message.logprobs.extend(logprobs_of(message.token_ids, choice["logprobs"], num_top))
    if choice.get("prompt_logprobs"):
        message.prompt_logprobs.extend(prompt_logprobs_of(
            request.prompt_token_ids, choice["prompt_logprobs"], num_top))
    if request.kv_transfer.role != "prefill":
        message.finished = True
        message.finish_reason = choice.get("finish_reason") or ""
    return [message]


def logprobs_of(token_ids, logprobs: dict, num_top: int) -> list[pb.TokenLogprob]:
    """vLLM's completion logprobs (``return_tokens_as_token_ids``: keys "token_id:N"; each
    dict holds the sampled token and the likeliest) as ours: the sampled token's, and
    the ``num_top`` likeliest."""
    out = []
    for token_id, logprob, top in zip(token_ids, logprobs["token_logprobs"],
                                      logprobs["top_logprobs"], strict=False):
        entry = pb.TokenLogprob(token_id=token_id, logprob=logprob if logprob is not None else 0.0)
        likeliest = sorted((top or {}).items(), key=lambda kv: -kv[1])[:num_top]
        for key, value in likeliest:
            entry.top.add(token_id=int(key.rpartition(":")[2]), logprob=value)
        out.append(entry)
    return out


def prompt_logprobs_of(prompt_ids, prompt_logprobs: list, num_top: int) -> list[pb.TokenLogprob]:
    """vLLM's prompt logprobs ({token id: {"logprob", "rank", ...}} per prompt token, None
    for the first) as ours: one entry per prompt token after the first."""
    out = []
    for token_id, scored in zip(prompt_ids[1:], prompt_logprobs[1:], strict=False):
        scored = {int(k): v["logprob"] for k, v in (scored or {}).items()}
        entry = pb.TokenLogprob(token_id=token_id, logprob=scored.get(token_id, 0.0))
        for other, value in sorted(scored.items(), key=lambda kv: -kv[1])[:num_top]:
            entry.top.add(token_id=other, logprob=value)
        out.append(entry)
    return out


def whole_timings(answer: dict, waited_s: float) -> pb.Timings:
    """A whole answer's stage times: vLLM's per-request metrics when it sends them
    (--enable-per-request-metrics), else the whole wait (``waited_s``) as the prefill."""
    metrics = answer.get("metrics") or {}
    if metrics.get("time_to_first_token_ms") is not None:
        return pb.Timings(queue_s=(metrics.get("queue_time_ms") or 0.0) / 1000,
                          prefill_s=metrics["time_to_first_token_ms"] / 1000)
    return pb.Timings(prefill_s=waited_s)


def http_error(role: str, status: int, payload: bytes) -> EngineCallError:
    """A non-200 answer of a leg's request (``role``: "single", "prefill", "decode") as ours."""
    try:
        error = orjson.loads(payload)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        error = {"message": payload[:200].decode(errors="replace")}
    return error_of(role, status, error)


def error_of(role: str, status: int, error: dict) -> EngineCallError:
    """vLLM's error (``ErrorResponse.error``: message, type, code; an HTTP status or, in a
    stream, its ``code``) as ours."""
    message = str(error.get("message", ""))
    if status == 400:
        return InputRefused("INVALID_ARGUMENT", message)
    if status == 503 and error.get("type") == "Service Unavailable":  # a GracefulHTTPError
        pool = "prefill" if role == "prefill" else "decode"
        return EngineBusy("RESOURCE_EXHAUSTED", f"{pool} full: {message}")
    return EngineFailed("UNAVAILABLE" if status >= 500 else "UNKNOWN", f"HTTP {status}: {message}")


class BlockMap:
    """vLLM's prefix-cache events (``vllm/distributed/kv_events.py``: ``BlockStored``,
    ``BlockRemoved``, ``AllBlocksCleared``, decoded from msgpack as dicts with their
    ``type``) as pdserve's block-hash chains at ``block_size`` (the Coordinator's, which
    must divide vLLM's): a vLLM block of 128 tokens is 8 chained hashes of 16.

    A stored block's chain continues its parent's; a block whose parent is not known
    (stored before the events were followed, or removed) is skipped, and so are its
    children: the index then holds less than the engine, never a prefix it lacks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._chains: dict[bytes | int, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._chains)

    def apply(self, events: list[dict]) -> tuple[list[bytes], list[bytes], bool]:
        """The hashes stored and removed by ``events``, and whether vLLM cleared its cache
        (everything known before is gone)."""
        stored: list[bytes] = []
        removed: list[bytes] = []
        cleared = False
        for event in events:
            kind = event.get("type")
            if kind == "BlockStored":
                stored += self._stored(event)
            elif kind == "BlockRemoved":
                for h in event.get("block_hashes") or ():
                    removed += self._chains.pop(_key(h), ())
            elif kind == "AllBlocksCleared":
                self._chains.clear()
                stored, removed, cleared = [], [], True
        return stored, removed, cleared

    def _stored(self, event: dict) -> list[bytes]:
        size, tokens = int(event["block_size"]), list(event["token_ids"])
        if size % self.block_size:
            raise ValueError(f"vLLM's {size}-token blocks are not made of {self.block_size}-token ones")
        parent = event.get("parent_block_hash")
        prev: bytes | None = None
        if parent is not None:
            chain = self._chains.get(_key(parent))
            if chain is None:
                return []
            prev = chain[-1]
        out: list[bytes] = []
        for i, h in enumerate(event["block_hashes"]):
            block = tokens[i * size:(i + 1) * size]
            if len(block) < size:
                break
            chain = []
            for start in range(0, size, self.block_size):
                prev = hash_block(prev, block[start:start + self.block_size])
                chain.append(prev)
            self._chains[_key(h)] = chain
            out += chain
        return out


def _key(block_hash) -> bytes | int:
    """vLLM's ``ExternalBlockHash`` (bytes, or an int in older versions) as a dict key."""
    return bytes(block_hash) if isinstance(block_hash, (bytes, bytearray, memoryview)) else block_hash
