"""Security between components: a cluster token on every internal gRPC call, and
optional mutual TLS.

Every server (engine, Controller) installs ``TokenInterceptor``; every client sends
the token as ``x-pdserve-token`` metadata. With TLS files configured, servers
require client certificates signed by the cluster CA (mTLS). Files come from a
Kubernetes Secret mounted into the pod, or any path locally.

Settings come from the environment (one place, the same for every component):
``PDSERVE_CLUSTER_TOKEN`` or ``PDSERVE_CLUSTER_TOKEN_FILE``, and
``PDSERVE_TLS_CERT``, ``PDSERVE_TLS_KEY``, ``PDSERVE_TLS_CA``.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.runtime.log_throttle import ThrottledLog

log = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "x-pdserve-token"
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "PDSERVE_CLUSTER_TOKEN_FILE"
"""The token's file: what ``pdserve up`` and the operator hand their processes, since
a value in the environment or on a command line is easier to see than a 0600 file."""


@dataclass(frozen=True)
class SecuritySettings:
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_cert and self.tls_key and self.tls_ca)

    @classmethod
    def from_env(cls, env: dict | None = None) -> SecuritySettings:
        env = os.environ if env is None else env
        token = env.get(TOKEN_ENV) or None
        token_file = env.get(TOKEN_FILE_ENV)
        if token is None and token_file:
            token = Path(token_file).read_text().strip() or None
        settings = cls(token, env.get("PDSERVE_TLS_CERT"), env.get("PDSERVE_TLS_KEY"),
                       env.get("PDSERVE_TLS_CA"))
        partial = [settings.tls_cert, settings.tls_key, settings.tls_ca]
        if any(partial) and not all(partial):
            raise ValueError("mTLS needs PDSERVE_TLS_CERT, PDSERVE_TLS_KEY and PDSERVE_TLS_CA together")
        return settings

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA_KEY, self.token),) if self.token else ()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not present the cluster token (UNAUTHENTICATED);
    each method and reason is logged at most once per ``ThrottledLog`` interval."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._refusals = ThrottledLog(log)

    async def intercept_service(self, continuation, handler_call_details):
        presented = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA_KEY)
        if presented is not None and hmac.compare_digest(str(presented).encode(), self._token):
            return await continuation(handler_call_details)
        reason = "no cluster token" if presented is None else "wrong cluster token"
        method = handler_call_details.method
        self._refusals.log(logging.WARNING, (method, reason), "refused %s: %s", method, reason)
        return _refusal(reason)


def _refusal(reason: str) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"refused: {reason}")

    # A unary handler serves streaming methods too: the call ends with the status
    # before any response message.
    return grpc.unary_unary_rpc_method_handler(deny)


def server_interceptors(settings: SecuritySettings) -> list[grpc.aio.ServerInterceptor]:
    return [TokenInterceptor(settings.token)] if settings.token else []


def add_port(server: grpc.aio.Server, address: str, settings: SecuritySettings) -> int:
    """Listen on ``address``, with mTLS when configured. Returns the bound port (0: failed)."""
    if not settings.uses_tls:
        return server.add_insecure_port(address)
    creds = grpc.ssl_server_credentials(
        [(Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())],
        root_certificates=Path(settings.tls_ca).read_bytes(),
        require_client_auth=True,
    )
    return server.add_secure_port(address, creds)


def create_channel(address: str, settings: SecuritySettings | None = None) -> grpc.aio.Channel:
    settings = settings or SecuritySettings()
    if not settings.uses_tls:
        return grpc.aio.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(settings.tls_ca).read_bytes(),
        private_key=Path(settings.tls_key).read_bytes(),
        certificate_chain=Path(settings.tls_cert).read_bytes(),
    )
    return grpc.aio.secure_channel(address, creds)
