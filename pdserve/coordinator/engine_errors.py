"""How an engine call ends other than well: pdserve's own exceptions, whatever the wire.

Every call on the engine interface (``engines.Engine``) ends badly with one of these.
The embedded engine's calls end with a status code (gRPC's numbers, which its
session frames carry too) and details: ``from_status`` is the one place such a
status becomes one of these, so that ``legs.Leg`` and everything above the
interface never see a wire's error type:

  EngineBusy         the engine has no room for the request now (RESOURCE_EXHAUSTED
                     with details starting "decode full" or "prefill full"): load,
                     not a failure; the request waits or goes to another engine
  InputRefused       the engine refused the input (INVALID_ARGUMENT): the client's
                     error, never retried
  DeadlinePassed     the call's deadline passed (the Coordinator's own timer)
  CallCancelled      the Coordinator cancelled the call (a leg given up, shutdown)
  Unsupported        the engine does not offer the call (UNIMPLEMENTED): a backend
                     without KV events or peer probes
  EngineFailed       anything else: the engine is gone, the session broke, the engine
                     failed the request; retryable on other engines

``status`` keeps the wire's status name ("UNAVAILABLE"...) for logs and metrics'
reasons; ``details`` is the engine's or the session's text, which may name addresses.
"""

from __future__ import annotations

import re

import grpc

# The engine's answer when it has no room for a request (KV blocks, queue). gRPC itself
# uses RESOURCE_EXHAUSTED for other things (a message too large): those stay failures.
FULL_DETAILS = re.compile(r"^(decode|prefill) full\b")


class EngineCallError(Exception):
    """A call that ended without finishing its request; see the module's list."""

    def __init__(self, status: str, details: str) -> None:
        super().__init__(f"{status}: {details}")
        self.status = status
        self.details = details


class EngineBusy(EngineCallError):
    pass


class InputRefused(EngineCallError):
    pass


class DeadlinePassed(EngineCallError):
    pass


class CallCancelled(EngineCallError):
    pass


class Unsupported(EngineCallError):
    pass


class EngineFailed(EngineCallError):
    pass


_BY_STATUS: dict[grpc.StatusCode, type[EngineCallError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InputRefused,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlinePassed,
    grpc.StatusCode.CANCELLED: CallCancelled,
    grpc.StatusCode.UNIMPLEMENTED: Unsupported,
}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def from_status(code: grpc.StatusCode | int, details: str) -> EngineCallError:
    """The exception for a call that ended with ``code`` (a gRPC status, or its number
    as the session frames carry it) and ``details``."""
    if isinstance(code, int):
        code = _CODES.get(code, grpc.StatusCode.UNKNOWN)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and FULL_DETAILS.match(details):
        return EngineBusy(code.name, details)
    return _BY_STATUS.get(code, EngineFailed)(code.name, details)


def from_rpc_error(exc: grpc.aio.AioRpcError) -> EngineCallError:
    return from_status(exc.code(), exc.details() or "")
