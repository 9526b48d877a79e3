"""How the NodeAgent starts, recognises and probes one engine, per backend.

``EngineProcess`` calls ``command(role)`` at each launch (argv, and what the engine's
environment adds to the agent's) and ``serving_address(line)`` on each output line
until one says the engine serves; the agent's probe loop reads health and load
through ``prober(address)``; its commands (drain, switch role) run through the
embedded engine's control RPCs where ``has_control``; else a role switch is a new
address of the running engine (``address_in_role``) or a relaunch.

- ``EmbeddedLaunch``: ``pdserve engine`` on a free port (``--port 0``); it prints
  "serving model ... on HOST:PORT", its gRPC address; probes and commands are gRPC.
  Shared by several simulated instances, one process serves them all
  (``shared_command``: ``--roles``), one such line each.
- ``VllmLaunch``: vLLM's OpenAI server (``vllm_args``) on ports the agent picks at
  each launch (HTTP, the KV connector's side channel, its prefix-cache events); it
  serves once uvicorn says so; its address is
  ``vllm://HOST:PORT?role=...&kv=...&connector=...&events=...``
  (``runtime.vllm_server``), so the Controller and Coordinators know it for what it
  is; probes are HTTP (``/health``, ``/v1/models``, ``/metrics``). vLLM cannot drain;
  it takes the hybrid role, and goes back to the one it was launched in, in place
  (only its address's role changes), but switches between prefill and decode by a
  relaunch.

Probe errors of either backend are ``ProbeFailed``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import quote

import grpc

from pdserve.api import PDCluster
from pdserve.api.instance import Pool
from pdserve.nodeagent.engine_args import with_role
from pdserve.nodeagent.vllm_args import READY_LINE, build_vllm_argv, kv_transfer_config, vllm_env
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.ports import free_ports
from pdserve.runtime.security import SecuritySettings
from pdserve.runtime.vllm_server import SCHEME, VllmClient, VllmUnavailable

ADDRESS_RE = re.compile(r"serving model .* on (\S+:\d+)")
VLLM_PROBE_TIMEOUT_S = 5.0


class ProbeFailed(Exception):
    """A probe of an engine got no answer, or a bad one; the message says which."""


class Prober:
    """Health and load reads of one engine (``client``: the embedded engine's gRPC client
    or a ``VllmClient``), and its probe of a decode peer's KV path (``peers.py``), their
    errors (``errors``) as ``ProbeFailed``."""

    def __init__(self, client, errors: type[BaseException], describe: Callable[[BaseException], str],
                 min_timeout_s: float = 0.0, probe_peer=None) -> None:
        """``min_timeout_s``: the least a read waits, whatever the agent's probe timeout;
        ``probe_peer(endpoint, timeout_s)``: the engine probes a peer's KV endpoint."""
        self.client, self._errors, self._describe = client, errors, describe
        self.min_timeout_s = min_timeout_s
        self._probe_peer = probe_peer

    async def probe_peer(self, endpoint: str, timeout_s: float):
        """The engine's ``ProbePeerResponse`` for a decode peer's KV endpoint."""
        try:
            return await self._probe_peer(endpoint, timeout_s)
        except self._errors as exc:
            raise ProbeFailed(self._describe(exc)) from None

    async def health(self, timeout_s: float):
        return await self._call(self.client.health, timeout_s)

    async def stats(self, timeout_s: float):
        return await self._call(self.client.stats, timeout_s)

    async def _call(self, read, timeout_s: float):
        try:
            return await read(max(timeout_s, self.min_timeout_s))
        except self._errors as exc:
            raise ProbeFailed(self._describe(exc)) from None

    async def close(self) -> None:
        await self.client.close()


class EmbeddedLaunch:
    has_control = True

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    def command(self, role: str) -> tuple[list[str], dict[str, str]]:
        return with_role(self.argv, role), {}

    def shared_command(self, roles: list[str]) -> tuple[list[str], dict[str, str]]:
        """Several simulated engines in one process, one per role, in this order."""
        return [*self.argv, "--roles", ",".join(roles)], {}

    @staticmethod
    def serving_address(line: str) -> str | None:
        m = ADDRESS_RE.search(line)
        return m.group(1) if m else None

    @staticmethod
    def prober(address: str, security: SecuritySettings) -> Prober:
        client = EngineClient(address, security)
        return Prober(client, grpc.aio.AioRpcError, lambda exc: exc.code().name,
                      probe_peer=lambda endpoint, timeout_s: client.probe_peer(endpoint, False, timeout_s))


class VllmLaunch:
    """vLLM for one instance of ``pool``, listening on ``host`` (HTTP and side channel),
    pinned to ``cpus``."""

    has_control = False

    def __init__(self, cluster: PDCluster, pool: Pool, host: str, cpus: tuple[int, ...] = (),
                 extra: list[str] | None = None) -> None:
        """``extra``: vLLM flags after the spec's (the agent's ``--engine-arg``)."""
        self.cluster, self.pool, self.host, self.cpus = cluster, pool, host, cpus
        self.extra = list(extra or [])
        self.launched_role = ""
        self._http = self._address = self._events = ""

    def command(self, role: str) -> tuple[list[str], dict[str, str]]:
        port, side_port, events_port = free_ports(self.host, 3)
        config = kv_transfer_config(self.cluster, self.pool, role)
        query = f"role={role}"
        if config is not None:
            query += f"&kv={self.host}:{side_port}&connector={quote(config['kv_connector'])}"
        argv = build_vllm_argv(self.cluster, self.pool, role, self.host, port, events_port)
        self._events = f"&events={self.host}:{events_port}" if "--kv-events-config" in argv else ""
        self.launched_role = role
        self._http = f"{self.host}:{port}"
        self._address = f"{SCHEME}{self._http}?{query}{self._events}"
        return (argv + self.extra,
                vllm_env(self.cluster, self.pool, (self.host, side_port), self.cpus))

    def serving_address(self, line: str) -> str | None:
        return self._address if READY_LINE in line else None

    def address_in_role(self, role: str) -> str | None:
        """The address of the running vLLM taking ``role`` in place, or None when it
        must be relaunched: any vLLM serves whole requests (hybrid), and goes back to the
        role it was launched in; a producer cannot consume, nor a consumer produce."""
        if not self._address:
            return None
        if role == self.launched_role:
            return self._address
        if role == "hybrid":
            return f"{SCHEME}{self._http}?role=hybrid{self._events}"
        return None

    @staticmethod
    def prober(address: str, security: SecuritySettings) -> Prober:
        # vLLM answers from its API server's event loop, which a busy engine (its
        # OpenMP threads, NIXL's progress thread) can starve for a while: busy is not dead.
        # vLLM has no peer probe: P's side channel accepting a connection (D dials P)
        client = VllmClient(address)
        return Prober(client, VllmUnavailable, str, min_timeout_s=VLLM_PROBE_TIMEOUT_S,
                      probe_peer=lambda endpoint, timeout_s: client.probe_side_channel(timeout_s))
