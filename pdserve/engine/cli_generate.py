"""``pdserve generate``: one prompt through an in-process engine or a running server.

Prints the text, or with ``--json`` one JSON object with ``token_ids``, ``text`` and
``finish_reason``. Bad input exits with code 2 and a message on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.api.sampling import SamplingParams
from pdserve.engine.cli_args import add_engine_arguments, engine_config_from_args
from pdserve.engine.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--server", help="address of a running engine (host:port) instead of --model")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    src.add_argument("--prompt-token-ids", help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--max-tokens", type=int, default=16, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    parser.add_argument("--seed", type=int, default=None, help="sampler seed (default: random)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _parse_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-token-ids must be comma-separated integers, got {text!r}") from None


def _sampling(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def _run_local(args, ids):
    from pdserve.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    config.kv_transport = "none"  # one process, nothing to transfer
    engine = LLMEngine(config)
    request = engine.add_request("cli", ids, _sampling(args), args.prompt)
    while engine.has_unfinished:
        engine.step()
    return request.output_token_ids, request.output_text, request.finish_reason


def _run_remote(args, ids):
    import asyncio

    from pdserve.api.proto import engine_pb2 as pb
    from pdserve.runtime.engine_client import EngineClient

    async def go():
        async with EngineClient(args.server) as client:
            req = pb.GenerateRequest(prompt=args.prompt or "", prompt_token_ids=ids or [],
                                     sampling=_sampling(args).to_proto())
            token_ids, text, reason = [], [], None
            async for msg in client.generate(req, timeout_s=600):
                token_ids.extend(msg.token_ids)
                text.append(msg.text)
                reason = msg.finish_reason or reason
            return token_ids, "".join(text), reason

    return asyncio.run(go())


def run(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.engine.admission import EngineInputError

    try:
        ids = _parse_ids(args.prompt_token_ids)
        token_ids, text, reason = (_run_remote if args.server else _run_local)(args, ids)
    except (ConfigError, EngineInputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "finish_reason": reason}))
    else:
        print(text if text else " ".join(map(str, token_ids)))
    return 0
