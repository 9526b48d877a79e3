"""A stand-in engine for the Coordinator's tests and benchmark: the Engine gRPC service
answering at once, with no model behind it.

``behavior``: "ok" answers each Generate with ``num_tokens`` tokens, ``token_delay_s``
apart (a prefill leg: the first token, then "handoff"); "fail" ends every Generate with an engine error
after ``fail_after`` tokens (0: before any), as a crashing engine's leg would look
to the Coordinator. Health reports the given role, KV endpoint and compat hash, so
a stub can be paired with real engines.
"""

from __future__ import annotations

import asyncio

import grpc

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.proto import engine_pb2_grpc as pb_grpc


class StubEngine(pb_grpc.EngineServicer):
    def __init__(self, role: str = "hybrid", behavior: str = "ok", num_tokens: int = 1,
                 kv_compat_hash: str = "stub", kv_endpoint: str = "127.0.0.1:1",
                 fail_after: int = 0, token_delay_s: float = 0.0) -> None:
        self.role, self.behavior, self.num_tokens = role, behavior, num_tokens
        self.kv_compat_hash, self.kv_endpoint = kv_compat_hash, kv_endpoint
        self.fail_after = fail_after
        self.token_delay_s = token_delay_s
        self.request_ids: list[str] = []

    async def Generate(self, request: pb.GenerateRequest, context):
        self.request_ids.append(request.request_id)
        n_prompt = len(request.prompt_token_ids)
        leg = request.kv_transfer.role if request.HasField("kv_transfer") else ""
        if self.behavior == "fail":
            for i in range(self.fail_after):
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[65 + i % 26])
            yield pb.GenerateResponse(request_id=request.request_id, finished=True,
                                      finish_reason="error", error="stub engine fails on purpose")
            return
        timings = pb.Timings(queue_s=0.0, prefill_s=0.0)
        if leg == "prefill":
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[65],
                                      num_prompt_tokens=n_prompt, timings=timings)
            yield pb.GenerateResponse(request_id=request.request_id, finished=True,
                                      finish_reason="handoff", timings=pb.Timings())
            return
        n = max(1, min(self.num_tokens, request.sampling.max_tokens or 16))
        for i in range(n):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == n - 1
            yield pb.GenerateResponse(
                request_id=request.request_id, token_ids=[65 + i % 26], finished=last,
                finish_reason="length" if last else "", num_prompt_tokens=n_prompt,
                num_output_tokens=i + 1, timings=timings if i == 0 else None,
            )

    async def Abort(self, request, context) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=False)

    async def Health(self, request, context) -> pb.HealthResponse:
        return pb.HealthResponse(serving=True, role=self.role, model="tiny", device="cpu",
                                 kv_transport="tcp", kv_endpoint=self.kv_endpoint,
                                 kv_compat_hash=self.kv_compat_hash)

    async def Stats(self, request, context) -> pb.StatsResponse:
        return pb.StatsResponse(role=self.role, model="tiny", block_size=16,
                                num_kv_blocks_total=64, num_kv_blocks_free=64)


async def start_stub(stub: StubEngine, host: str = "127.0.0.1") -> tuple[grpc.aio.Server, str]:
    """Serve ``stub`` on a free port in the running event loop; returns (server, address)."""
    server = grpc.aio.server()
    pb_grpc.add_EngineServicer_to_server(stub, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, f"{host}:{port}"
