"""One engine leg of a request: the gRPC stream, its failure classes, and its abort.

A leg failure is either the client's fault (bad input: ``ServeError`` 400, never
retried), the deadline's (504), or the engine's (``LegFailure``: retryable on other
engines). ``abort_soon`` sends an Abort RPC in the background after a leg's call was
cancelled: the engine aborts a cancelled call by itself, the explicit Abort makes
sure its KV is freed even if the cancellation was lost on the way.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.api.proto import engine_pb2 as pb

from .errors import ServeError
from .instances import Instance, InstanceRegistry

log = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 2.0


class LegFailure(Exception):
    """An engine failed a leg; ``stage`` is when ("before_first_token", "before_handoff",
    "mid_stream"). Raised by the lifecycle's leg runners, handled by its retry loop."""

    def __init__(self, instance: Instance, leg: str, stage: str, message: str) -> None:
        super().__init__(f"{leg} engine {instance.address}: {message}")
        self.instance = instance
        self.leg = leg
        self.stage = stage


def classify_rpc_error(exc: grpc.aio.AioRpcError, inst: Instance, leg: str, stage: str) -> Exception:
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ServeError(400, exc.details() or "invalid request", code="invalid_request")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ServeError(504, "the request's deadline passed before it finished", code="deadline")
    return LegFailure(inst, leg, stage, f"{code.name}: {exc.details()}")


def finish_failure(msg: pb.GenerateResponse, inst: Instance, leg: str, stage: str) -> LegFailure:
    return LegFailure(inst, leg, stage, f"finished with {msg.finish_reason}: {msg.error}")


class Aborter:
    """Background Abort RPCs; one per app. ``close`` waits for those still running."""

    def __init__(self, registry: InstanceRegistry) -> None:
        self.registry = registry
        self._tasks: set[asyncio.Task] = set()

    def abort_soon(self, inst: Instance, request_id: str) -> None:
        """Called by the lifecycle when a leg ended without finishing."""
        task = asyncio.get_running_loop().create_task(self._abort(inst.address, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort(self, address: str, request_id: str) -> None:
        try:
            await asyncio.wait_for(self.registry.client(address).abort(request_id), ABORT_TIMEOUT_S)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            log.info("abort of %s on %s not confirmed: %s", request_id, address, type(exc).__name__)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
