"""A real etcd for tests: free loopback ports, a temp data dir, reaped on stop.

``EtcdServer(tmp_path).start()`` returns once etcd answers; ``restart()`` keeps the
data dir (the cluster's state survives, as with a real etcd restart); ``kill()`` is a
crash (SIGKILL), after which ``start()`` brings it back on the same data. With ``tls``
(a server certificate and its CA, ``tests/pki.py``) it serves HTTPS only and asks
clients for a certificate the CA signed. ``enable_auth`` turns on etcd's users:
a root user, and one user allowed a key prefix only. Skips the test when no
``etcd`` binary is installed (``make system-deps`` installs it).

``TcpProxy`` stands between a client and etcd so a test can partition that one
client: ``hang()`` (packets stop, calls wait for their deadline), ``heal()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from pdserve.runtime.ports import free_port
from pdserve.runtime.security import SecuritySettings


class EtcdServer:
    def __init__(self, data_dir: Path, tls: SecuritySettings | None = None) -> None:
        if shutil.which("etcd") is None:
            pytest.fail("etcd is not installed: `make test` installs the Debian package etcd-server")
        self.data_dir, self.tls = data_dir, tls
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> EtcdServer:
        scheme = "https" if self.tls else "http"
        client, peer = f"{scheme}://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        tls_flags = ["--cert-file", self.tls.tls_cert, "--key-file", self.tls.tls_key,
                     "--trusted-ca-file", self.tls.tls_ca, "--client-cert-auth"] if self.tls else []
        self.proc = subprocess.Popen(
            ["etcd", "--name", "test", "--data-dir", str(self.data_dir),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}", "--log-level", "error", *tls_flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=self.tls.tls_ca)
            context.load_cert_chain(self.tls.tls_cert, self.tls.tls_key)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1, context=context) as r:
                    if b"true" in r.read():
                        return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("etcd did not become healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL, as a crash (no clean shutdown); ``start()`` brings it back on its data dir."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def enable_auth(self, user: str, password: str, prefix: str) -> None:
        """Users on: ``root`` (password ``root-<password>``) and ``user``, who may read
        and write keys under ``prefix`` only."""
        async def go() -> None:
            if self.tls:
                creds = grpc.ssl_channel_credentials(
                    Path(self.tls.tls_ca).read_bytes(), Path(self.tls.tls_key).read_bytes(),
                    Path(self.tls.tls_cert).read_bytes())
                channel = grpc.aio.secure_channel(self.endpoint, creds)
            else:
                channel = grpc.aio.insecure_channel(self.endpoint)
            async with channel:
                auth = rpc.AuthStub(channel)
                await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=f"root-{password}"))
                await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
                await auth.RoleAdd(rpc.AuthRoleAddRequest(name=user))
                end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
                await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(
                    name=user, perm=rpc.Permission(permType=rpc.Permission.READWRITE,
                                                   key=prefix.encode(), range_end=end.encode())))
                await auth.UserAdd(rpc.AuthUserAddRequest(name=user, password=password))
                await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=user))
                await auth.AuthEnable(rpc.AuthEnableRequest())

        asyncio.run(go())


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<target_port>``, a thread per direction.

    ``hang()`` is a partition as a network makes one: every byte is dropped and new
    connections are accepted but go nowhere, so calls wait for their deadline.
    ``heal()`` closes what hung (clients reconnect) and forwards again."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.is_hung = False
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._is_closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._is_closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.add(client)
            if self.is_hung:
                continue  # held open, never answered
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:
                self._drop(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets.add(upstream)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self.is_hung:
                    dst.sendall(data)
        except OSError:
            pass
        self._drop(src)
        self._drop(dst)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def hang(self) -> None:
        self.is_hung = True

    def heal(self) -> None:
        with self._lock:
            hung = list(self._sockets)
        for sock in hung:
            self._drop(sock)
        self.is_hung = False

    def close(self) -> None:
        self._is_closed = True
        self._listener.close()
        self.heal()
