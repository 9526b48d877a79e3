"""``Store`` on etcd v3 through ``aetcd`` (asyncio gRPC client; see docs/etcd-client.md).

Owns one aetcd client at a time, connected to one of the configured endpoints
(members of one etcd cluster). Every call has one deadline (``timeout_s``) so an
etcd outage turns into ``StoreError`` quickly instead of stalling the Controller's
loops. A call that finds its endpoint unreachable moves to the next endpoint and
tries again within that deadline, each endpoint once; later calls stay on the one
that answered. With one endpoint the gRPC channel reconnects on its own when etcd
comes back.

``EtcdAccess`` says how to reach etcd securely: TLS (etcd's certificate checked
against a CA; a client certificate for ``--client-cert-auth``) and etcd's own
users. aetcd opens plain-text channels only, so ``_Client`` opens the channel
itself; the user's token is fetched on connect and fetched again once when etcd
rejects it (etcd forgets its tokens when it restarts, and expires idle ones).

Invariants: a leader's fenced write is one transaction (the compare on the leader
key and the write), so it is applied whole or not at all; a call is retried on
another endpoint only when its endpoint could not be reached (every operation
here can be applied twice without harm: puts and deletes are idempotent, a second
create fails its compare and the election reads the key back, a lease granted
twice leaves one to expire).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aetcd
import grpc
from aetcd import rpc
from aetcd.exceptions import ConnectionFailedError, ConnectionTimeoutError, UnauthenticatedError

from pdserve.controller.store import Entry, Fence, FencedError, Store, StoreError

UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class EtcdAccess:
    """The etcd client's credentials; all optional. ``ca_file`` turns TLS on (etcd's
    certificate must chain to it); ``cert_file`` and ``key_file`` are a client
    certificate (TLS too, checked against the system roots without a CA);
    ``user`` and ``password`` log in to etcd's auth."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("an etcd client certificate needs both the cert and the key file")
        if bool(self.user) != bool(self.password):
            raise ValueError("etcd auth needs both a user and a password file")

    @property
    def uses_tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    @classmethod
    def from_files(cls, ca_file: str | None = None, cert_file: str | None = None,
                   key_file: str | None = None, user: str | None = None,
                   password_file: str | None = None) -> EtcdAccess:
        """Called by the Controller CLI: the password is read from its file (one line)."""
        password = Path(password_file).read_text().strip() if password_file else None
        return cls(ca_file or None, cert_file or None, key_file or None, user or None, password or None)

    def credentials(self) -> grpc.ChannelCredentials:
        """Read at every connect, so renewed files are picked up by the next one."""
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file),
                                            private_key=read(self.key_file),
                                            certificate_chain=read(self.cert_file))


class _Client(aetcd.Client):
    """aetcd's client on a channel opened here: TLS when configured, the user's token
    fetched on connect. Connects on its first call (aetcd's ``_ensure_connected``)."""

    def __init__(self, endpoint: str, access: EtcdAccess) -> None:
        host, _, port = endpoint.rpartition(":")
        super().__init__(host=host, port=int(port), username=access.user, password=access.password)
        self.endpoint, self._access = endpoint, access
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> None:
        async with self._connect_lock:
            if self._connected.is_set():
                return
            if self._access.uses_tls:
                channel = grpc.aio.secure_channel(self.endpoint, self._access.credentials())
            else:
                channel = grpc.aio.insecure_channel(self.endpoint)
            try:
                metadata = None
                if self._access.user:
                    reply = await rpc.AuthStub(channel).Authenticate(rpc.AuthenticateRequest(
                        name=self._access.user, password=self._access.password))
                    metadata = (("token", reply.token),)
            except BaseException:
                await channel.close()
                raise
            self.channel, self.metadata = channel, metadata
            self.kvstub, self.leasestub = rpc.KVStub(channel), rpc.LeaseStub(channel)
            self._connected.set()


def _is_unreachable(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionFailedError, ConnectionTimeoutError, TimeoutError)):
        return True
    cause = exc.__cause__ if isinstance(exc.__cause__, grpc.aio.AioRpcError) else exc
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() in UNREACHABLE_CODES


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


class EtcdStore(Store):
    def __init__(self, endpoints: Sequence[str], access: EtcdAccess | None = None,
                 timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = tuple(endpoints)
        self._access = access or EtcdAccess()
        self._timeout_s = timeout_s
        self._client = _Client(self.endpoints[0], self._access)
        self._retired: dict[asyncio.Task, _Client] = {}  # old clients, closed once their calls ended

    @property
    def address(self) -> str:
        """The endpoint calls go to now."""
        return self._client.endpoint

    def _replace(self, client: _Client, endpoint: str) -> None:
        """Use a new client on ``endpoint`` unless another call replaced ``client`` already.
        The old one is closed after ``timeout_s``: the calls still on it end by then."""
        if client is not self._client:
            return
        self._client = _Client(endpoint, self._access)

        async def retire() -> None:
            await asyncio.sleep(self._timeout_s)
            with contextlib.suppress(Exception):
                await client.close()
        task = asyncio.get_running_loop().create_task(retire())
        self._retired[task] = client
        task.add_done_callback(lambda done: self._retired.pop(done, None))

    async def _call(self, op: Callable[[aetcd.Client], Awaitable]):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        failures: list[str] = []
        has_logged_in_again = False
        has_reconnected = False
        num_left = len(self.endpoints)
        while True:
            client = self._client
            try:
                return await asyncio.wait_for(op(client), (deadline - loop.time()) / num_left)
            except UnauthenticatedError as exc:
                if has_logged_in_again or not self._access.user:
                    raise StoreError(f"etcd {client.endpoint}: {_describe(exc)}") from exc
                has_logged_in_again = True  # a token etcd forgot: log in again, once
                self._replace(client, client.endpoint)
            except Exception as exc:  # noqa: BLE001 - aetcd and grpc raise many types
                if not _is_unreachable(exc):
                    raise StoreError(f"etcd {client.endpoint}: {_describe(exc)}") from exc
                failures.append(f"{client.endpoint}: {_describe(exc)}")
                if len(self.endpoints) == 1 and not has_reconnected and loop.time() < deadline:
                    # A connection a partition broke fails its next call even once etcd
                    # answers again: one more try, on a new connection, within the deadline.
                    has_reconnected = True
                    self._replace(client, client.endpoint)
                    continue
                num_left -= 1
                if len(self.endpoints) > 1:
                    following = self.endpoints[(self.endpoints.index(client.endpoint) + 1) % len(self.endpoints)]
                    self._replace(client, following)
                if num_left == 0 or loop.time() >= deadline:
                    raise StoreError("etcd unreachable: " + "; ".join(failures)) from exc

    async def grant_lease(self, ttl_s: int) -> int:
        return (await self._call(lambda c: c.lease(int(ttl_s)))).id

    async def refresh_lease(self, lease_id: int) -> bool:
        reply = await self._call(lambda c: c.refresh_lease(lease_id))
        return reply is not None and reply.TTL > 0

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._call(lambda c: c.revoke_lease(lease_id))
        except StoreError as exc:
            if "not found" not in str(exc):
                raise

    async def put(self, key: str, value: str, lease: int | None = None, fence: Fence | None = None) -> None:
        if fence is None:
            await self._call(lambda c: c.put(key.encode(), value.encode(), lease=lease))
        else:
            await self._fenced(fence, lambda txn: txn.put(key.encode(), value.encode(), lease=lease))

    async def get(self, key: str) -> str | None:
        entry = await self.get_entry(key)
        return entry.value if entry else None

    async def get_entry(self, key: str) -> Entry | None:
        item = await self._call(lambda c: c.get(key.encode()))
        return Entry(item.value.decode(), item.create_revision, item.lease) if item is not None else None

    async def get_prefix(self, prefix: str) -> dict[str, str]:
        items = await self._call(lambda c: c.get_prefix(prefix.encode()))
        return {kv.key.decode(): kv.value.decode() for kv in items}

    async def delete(self, key: str, fence: Fence | None = None) -> None:
        if fence is None:
            await self._call(lambda c: c.delete(key.encode()))
        else:
            await self._fenced(fence, lambda txn: txn.delete(key.encode()))

    async def _fenced(self, fence: Fence, write) -> None:
        """``write(txn)`` applied only while the fence's key has the fence's create revision."""
        def transaction(c: aetcd.Client):
            txn = c.transactions
            return c.transaction(compare=[txn.create(fence.key.encode()) == fence.revision],
                                 success=[write(txn)], failure=[])
        is_applied, _ = await self._call(transaction)
        if not is_applied:
            raise FencedError(f"{fence.key} is no longer at revision {fence.revision}: write refused")

    async def create_if_absent(self, key: str, value: str, lease: int | None = None) -> bool:
        def transaction(c: aetcd.Client):
            txn = c.transactions
            return c.transaction(compare=[txn.version(key.encode()) == 0],
                                 success=[txn.put(key.encode(), value.encode(), lease=lease)], failure=[])
        is_created, _ = await self._call(transaction)
        return bool(is_created)

    async def close(self) -> None:
        retired, self._retired = self._retired, {}
        for task in retired:
            task.cancel()
        for client in (self._client, *retired.values()):
            with contextlib.suppress(Exception):  # closing a dead connection is not an error
                await asyncio.wait_for(client.close(), self._timeout_s)
