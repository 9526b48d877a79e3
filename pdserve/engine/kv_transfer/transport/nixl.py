"""NIXL transport: NVIDIA's transfer library (the one Dynamo and vLLM use), UCX backend.

Wraps one ``nixl_agent`` per engine (package ``nixl-cu12``; it runs on host memory
without a GPU). Each registered region is registered with the agent once, at engine
start; a batch is then one NIXL transfer request built from the batch's items against
the peer's registered memory, so nothing is registered or prepared per transfer. The
agent's metadata (its UCX worker address and the rkeys of its regions) travels in the
channel's WELCOME, so a peer learns it only after the cluster token was checked, and
notifications travel on the channel as for every transport.

UCX picks the wire per peer: on one host shared memory (``cma``, a single copy from
P's memory into D's), between hosts RDMA where a NIC exists, TCP otherwise. The usual
``UCX_TLS`` / ``UCX_NET_DEVICES`` environment variables narrow that choice.

A batch, on the peer's sender thread: load the peer's agent metadata (once per peer
agent), post the request, wait until NIXL reports it DONE (the wait sleeps between
checks; the agent's progress thread moves the bytes), then FENCE on the channel: D's
ACK finishes the batch, so a dead or stopped D FAILs it even where UCX's copy did not
need D to run, and a notify after it is ordered after the bytes.

Invariants: remote ranges are checked against the peer's advertised regions before a
request is built (NIXL checks them again against the peer's registrations); a request
past its deadline is released (NIXL cancels it) before the link resets; memory is
deregistered only after every batch in flight stopped. NIXL writes cannot be fenced
by D (``revoke`` is False), so D keeps an aborted transfer's blocks until P answers.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import socket
import threading
import uuid

import numpy as np

from pdserve.engine.kv_transfer.transport.base import (
    BatchHandle,
    TransportUnavailable,
    poll_while,
    rdma_devices,
)
from pdserve.engine.kv_transfer.transport.channel_transport import Batch, ChannelTransport
from pdserve.engine.kv_transfer.transport.limits import ChannelLimits
from pdserve.engine.kv_transfer.transport.link import PeerLink
from pdserve.runtime.extras import install_command

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 5.0


def _load_api():
    """NIXL's Python API. Importing it points a "nixl" logger at stdout (an engine's
    stdout is not a log) and sets ``logging.raiseExceptions``: both are undone, and
    NIXL's records go through our logging like any library's, warnings and up."""
    raise_exceptions = logging.raiseExceptions
    try:
        from nixl_cu12 import _api
    except ImportError as exc:
        raise TransportUnavailable(
            f"the nixl transport needs the nixl-cu12 package ({exc}): "
            f"{install_command('nixl')}, or choose transport tcp") from None
    finally:
        logging.raiseExceptions = raise_exceptions
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    nixl_log.setLevel(logging.WARNING)
    return _api


class NixlTransport(ChannelTransport):
    name = "nixl"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        backend: str = "UCX",
        auth_token: str | None = None,
        timeout_s: float = 10.0,
        limits: ChannelLimits | None = None,
    ) -> None:
        """Raises RuntimeError naming the reason when NIXL or its ``backend`` cannot start."""
        api = _load_api()
        if not rdma_devices():
            # UCX's InfiniBand module loads a libnl that crashes the process at exit
            # (SIGSEGV in rtnl_tc_unregister) on hosts without a NIC: it has nothing to
            # do there, so it is not loaded.
            os.environ.setdefault("UCX_MODULES", "^ib")
        self.agent_name = f"pdserve-{uuid.uuid4().hex}"
        config = api.nixl_agent_config(
            backends=[backend], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:  # one sender thread per peer calls the agent: STRICT makes it thread-safe
            self._agent = api.nixl_agent(self.agent_name, config)
        except Exception as exc:  # noqa: BLE001 - the bindings raise bare Exception types
            raise TransportUnavailable(f"NIXL agent could not start: {exc}") from exc
        if backend not in self._agent.backends:
            raise TransportUnavailable(
                f"NIXL backend {backend} could not start here (plugins found: "
                f"{', '.join(self._agent.get_plugin_list()) or 'none'})")
        self._registrations: list = []
        self._peer_agents: dict[str, str] = {}  # peer endpoint -> its NIXL agent, loaded
        self._lock = threading.Condition()
        self._num_moving = 0
        self._closed = False
        super().__init__(host=host, port=port, advertise_host=advertise_host,
                         auth_token=auth_token, timeout_s=timeout_s, limits=limits)

    def register_memory(self, ptr: int, length: int) -> None:
        try:
            descs = self._agent.register_memory([(ptr, length, 0, "")], "DRAM")
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"NIXL register_memory({ptr:#x}, {length}) failed: {exc}") from exc
        self._registrations.append(descs)
        super().register_memory(ptr, length)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        super().close()
        with self._lock:  # never deregister under a request still in flight
            self._lock.wait_for(lambda: self._num_moving == 0, _CLOSE_WAIT_S)
            registrations, self._registrations = self._registrations, []
            peers, self._peer_agents = list(self._peer_agents.values()), {}
        for peer_agent in peers:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer_agent)
        for descs in registrations:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(descs)

    def _welcome(self) -> dict:
        metadata = base64.b64encode(self._agent.get_agent_metadata()).decode()
        return {**super()._welcome(), "nixl_agent": self.agent_name, "nixl_metadata": metadata}

    def _check_peer(self, link: PeerLink) -> None:
        """Load the peer agent's metadata the first time we meet it (again after it
        restarted: a new agent has a new name)."""
        peer_agent, metadata = link.info.get("nixl_agent"), link.info.get("nixl_metadata")
        if not (isinstance(peer_agent, str) and isinstance(metadata, str)):
            raise RuntimeError(f"peer {link.peer} is not a nixl transport")
        with self._lock:
            old = self._peer_agents.get(link.peer)
            if old == peer_agent:
                return
            try:
                loaded = self._agent.add_remote_agent(base64.b64decode(metadata))
            except Exception as exc:  # noqa: BLE001
                raise RuntimeError(f"NIXL rejected the metadata of {link.peer}: {exc}") from exc
            if (loaded.decode() if isinstance(loaded, bytes) else loaded) != peer_agent:
                raise RuntimeError(f"peer {link.peer}'s NIXL metadata names another agent")
            self._peer_agents[link.peer] = peer_agent
        if old is not None:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(old)

    def _move(self, link: PeerLink, sock: socket.socket, handle: BatchHandle, batch: Batch) -> None:
        if not len(batch.lengths):
            handle.finish()  # the connect and the peer check were the point (a reach)
            return
        with self._lock:
            if self._closed:
                raise RuntimeError("transport is closed")
            self._num_moving += 1
            peer_agent = self._peer_agents[link.peer]
        try:
            state = self._transfer(peer_agent, handle, batch)
        finally:
            with self._lock:
                self._num_moving -= 1
                self._lock.notify_all()
        if state != "DONE":
            op = "write to" if batch.is_write else "read from"
            how = "failed" if state == "ERR" else "was cancelled unfinished"
            raise RuntimeError(f"NIXL {op} {link.peer} {how}")
        self._fence(link, sock, handle)

    def _transfer(self, peer_agent: str, handle: BatchHandle, batch: Batch) -> str:
        """Post one request for the whole batch and wait for it: DONE, ERR, or the state
        it had when the batch's deadline passed (the request is then cancelled)."""
        zeros = np.zeros_like(batch.lengths)  # device id 0: host memory
        local = np.stack([batch.local, batch.lengths, zeros], axis=1).astype(np.uint64)
        remote = np.stack([batch.remote, batch.lengths, zeros], axis=1).astype(np.uint64)
        agent = self._agent
        try:
            xfer = agent.initialize_xfer(
                "WRITE" if batch.is_write else "READ", agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "DRAM"), peer_agent)
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"NIXL refused the request: {exc}") from exc
        state = "PROC"

        def is_pending() -> bool:
            nonlocal state
            state = agent.check_xfer_state(xfer)
            return state == "PROC"

        try:
            state = agent.transfer(xfer)
            if state == "PROC":
                poll_while(is_pending, handle, lambda: self._closed)
        except Exception as exc:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError: peer gone
            raise RuntimeError(f"NIXL transfer failed: {type(exc).__name__}: {exc}") from exc
        finally:
            try:
                xfer.release()
            except Exception as exc:  # noqa: BLE001 - NIXL keeps it and retries at teardown
                log.warning("NIXL could not cancel a request in flight: %s", exc)
        return state
