"""A small asyncio client of the engine's gRPC service, shared by every component.

Callers: the CLI (``pdserve generate --server``), the doctor, the NodeAgent, and the
Coordinator's embedded-engine backend (``coordinator/sessions.py``, for everything
but the requests, which ride its session port).
Errors come back as ``grpc.aio.AioRpcError`` with the engine's status and message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.proto import engine_pb2_grpc as pb_grpc
from pdserve.api.sampling import SamplingParams
from pdserve.runtime.security import SecuritySettings, create_channel


class EngineClient:
    def __init__(self, address: str, security: SecuritySettings | None = None) -> None:
        self.address = address
        security = self.security = security or SecuritySettings.from_env()
        self._channel = create_channel(address, security)
        self._md = security.metadata()
        self._stub = pb_grpc.EngineStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def generate(
        self, request: pb.GenerateRequest, timeout_s: float | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        return self._stub.Generate(request, timeout=timeout_s, metadata=self._md)

    async def abort(self, request_id: str) -> bool:
        return (await self._stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._md)).aborted

    async def health(self, timeout_s: float = 2.0) -> pb.HealthResponse:
        return await self._stub.Health(pb.HealthRequest(), timeout=timeout_s, metadata=self._md)

    async def stats(self, timeout_s: float = 2.0) -> pb.StatsResponse:
        return await self._stub.Stats(pb.StatsRequest(), timeout=timeout_s, metadata=self._md)

    async def drain(self, resume: bool = False, timeout_s: float = 2.0) -> pb.DrainResponse:
        return await self._stub.Drain(pb.DrainRequest(resume=resume), timeout=timeout_s, metadata=self._md)

    async def probe_peer(self, endpoint: str, test_transfer: bool = False,
                         timeout_s: float = 5.0) -> pb.ProbePeerResponse:
        """Ask this engine to probe a peer's KV endpoint (the engine always answers
        within ``timeout_s``; the RPC deadline leaves it room)."""
        request = pb.ProbePeerRequest(endpoint=endpoint, test_transfer=test_transfer,
                                      timeout_s=timeout_s)
        return await self._stub.ProbePeer(request, timeout=timeout_s + 3.0, metadata=self._md)

    def kv_events(self, epoch: str = "", since_seq: int = 0) -> AsyncIterator[pb.KVEventBatch]:
        """The engine's prefix-cache events, resuming (``epoch``, ``since_seq``) if it can."""
        request = pb.KVEventsRequest(epoch=epoch, since_seq=since_seq)
        return self._stub.KVEvents(request, metadata=self._md)

    async def set_role(self, role: str, timeout_s: float = 2.0) -> pb.SetRoleResponse:
        return await self._stub.SetRole(pb.SetRoleRequest(role=role), timeout=timeout_s, metadata=self._md)


def build_generate_request(request_id: str = "", prompt: str = "",
                           prompt_token_ids: list[int] | None = None, *,
                           kv_transfer: dict | None = None, **sampling) -> pb.GenerateRequest:
    """A request from keyword arguments, for the CLI, tests and benchmarks (the Coordinator
    builds its legs' requests from its own parameters): ``sampling`` are
    ``SamplingParams``' fields. ``kv_transfer``: {"role", "mode", "transfer_id", "peer"}
    for one disaggregated leg."""
    request = pb.GenerateRequest(request_id=request_id, prompt=prompt,
                                 prompt_token_ids=prompt_token_ids or [],
                                 sampling=SamplingParams(**sampling).to_proto())
    if kv_transfer is not None:
        request.kv_transfer.CopyFrom(pb.KVTransferParams(**kv_transfer))
    return request
