"""Helpers shared by the Coordinator's tests: an event loop thread, a real HTTP server
for a ``create_app`` app (``serve`` builds one on stub engines), and instance factories."""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import uvicorn

from pdserve.api.proto import controller_pb2_grpc as cpb_grpc
from pdserve.coordinator.app import create_app
from pdserve.coordinator.http_server import build_config
from pdserve.coordinator.instances import EngineEndpoint
from pdserve.coordinator.settings import CoordinatorSettings

# Tests of the PD path turn conditional disaggregation off, so short prompts still
# take both legs; tests of conditional disaggregation set it themselves.
ALWAYS_PD = {"local_prefill_max_tokens": 0, "load_aware_local_prefill": False}
ALWAYS_PD_ARGS = ["--local-prefill-max-tokens", "0", "--no-load-aware-local-prefill"]
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


async def serve_controller(servicer: cpb_grpc.ControllerServicer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """A gRPC server for a fake Controller (a ``ControllerServicer``) on 127.0.0.1;
    returns it started, with its port (``port``: the one to take again, after a stop)."""
    server = grpc.aio.server()
    cpb_grpc.add_ControllerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def inst(iid: str, role: str, h: str = "h", **load) -> EngineEndpoint:
    return EngineEndpoint(instance_id=iid, address=f"{iid}:1", role=role, kv_endpoint=f"{iid}:2",
                    kv_compat_hash=h, **load)


class LoopThread:
    """One asyncio loop in a thread: stub engines and the Coordinator live there, while
    the test drives them with blocking clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 60.0):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            raise TimeoutError(f"not done after {timeout_s:g}s; the loop's tasks:\n"
                               + self.describe_tasks()) from None

    def describe_tasks(self) -> str:
        """Each task of the loop and where it waits: what a stuck test names."""
        async def describe() -> str:
            lines = []
            for task in asyncio.all_tasks():
                frames = task.get_stack(limit=8)
                where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames))
                lines.append(f"{task.get_name()}: {where}")
            return "\n".join(sorted(lines))
        return asyncio.run_coroutine_threadsafe(describe(), self.loop).result(5)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class AppServer:
    """uvicorn serving ``app`` on a free port of 127.0.0.1, inside a ``LoopThread``."""

    def __init__(self, loop: LoopThread, app) -> None:
        self.loop, self.app = loop, app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
        sock.bind(("127.0.0.1", 0))
        self.sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # The Coordinator's own server config: the same HTTP limits as ``pdserve coordinator``.
        self.server = uvicorn.Server(build_config(app, app.state.deps.settings, "warning"))
        self._task = None

    def __enter__(self) -> AppServer:
        async def start():
            self._task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
            while not self.server.started:
                if self._task.done():
                    self._task.result()
                await asyncio.sleep(0.01)

        self.loop.run(start())
        return self

    def __exit__(self, *exc) -> None:
        async def stop():
            self.server.should_exit = True
            await self._task

        self.loop.run(stop())
        self.sock.close()

    @property
    def deps(self):
        return self.app.state.deps


def serve(loop: LoopThread, engines, **overrides) -> AppServer:
    """A Coordinator on static ``engines`` (always PD unless ``overrides`` say otherwise)."""
    settings = CoordinatorSettings(engines=tuple(engines), poll_interval_s=0.2,
                                   **{**ALWAYS_PD, **overrides})
    return AppServer(loop, create_app(settings))


def metric(app: AppServer, name: str, **labels) -> float:
    return app.deps.metrics.registry.get_sample_value(name, labels) or 0.0
