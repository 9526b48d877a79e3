"""Support for the control-plane tests (no tests here): a view poller and a steady
client load through the Coordinator (also used by ``benchmarks/failover.py``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import threading
import time

import grpc
import httpx

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc


class ViewReader:
    """GetView against whichever Controller replica leads (tries each address)."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    def get(self, timeout_s: float = 1.0) -> pb.ClusterView | None:
        for address in self.addresses:
            with grpc.insecure_channel(address) as channel:
                try:
                    return pb_grpc.ControllerStub(channel).GetView(pb.WatchViewRequest(), timeout=timeout_s)
                except grpc.RpcError:
                    continue
        return None

    def wait(self, predicate, timeout_s: float = 60.0, poll_s: float = 0.02) -> pb.ClusterView:
        deadline = time.monotonic() + timeout_s
        view = None
        while time.monotonic() < deadline:
            view = self.get()
            if view is not None and predicate(view):
                return view
            time.sleep(poll_s)
        raise TimeoutError(f"view condition not met; last view:\n{view}")


def roles(view: pb.ClusterView) -> dict[str, str]:
    return {i.instance_id: i.role for i in view.instances}


class CoordinatorLoad:
    """Closed-loop client load through the Coordinator's REST API, in a background thread.

    ``concurrency`` clients, each sending one request after the other, rotating
    through streaming and non-streaming ``/v1/completions`` and ``/v1/chat/completions``.
    A request counts as ok when it answered 200 and (streaming) ended with
    ``data: [DONE]`` and no error event; anything else is a client-visible error,
    kept in ``errors``. The client never retries: retrying is the Coordinator's job.
    """

    KINDS = (("completions", True), ("completions", False), ("chat/completions", True), ("chat/completions", False))

    def __init__(self, base_url: str, concurrency: int = 4, max_tokens: int = 16,
                 timeout_s: float = 60.0) -> None:
        self.base_url, self.concurrency = base_url, concurrency
        self.max_tokens, self.timeout_s = max_tokens, timeout_s
        self.num_ok = 0
        self.num_ok_by_kind: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.latencies_s: list[float] = []
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def __enter__(self) -> CoordinatorLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 10)
        assert not self._thread.is_alive(), "a client request did not end"

    def wait_ok(self, num: int, timeout_s: float = 60.0) -> None:
        """Block until ``num`` more requests succeeded."""
        target, deadline = self.num_ok + num, time.monotonic() + timeout_s
        while self.num_ok < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.num_ok}/{target} ok; errors: {self.errors[-3:]}")
            time.sleep(0.05)

    async def _main(self) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s) as client:
            await asyncio.gather(*(self._client(client) for _ in range(self.concurrency)))

    async def _client(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            n = next(self._ids)
            endpoint, stream = self.KINDS[n % len(self.KINDS)]
            text = f"Request {n}: count the colours of the sea, one by one."
            body: dict = {"model": "tiny", "max_tokens": self.max_tokens, "temperature": 0, "stream": stream}
            if endpoint.startswith("chat"):
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            started = time.monotonic()
            try:
                error = await (self._streamed if stream else self._whole)(client, f"/v1/{endpoint}", body)
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            kind = f"{endpoint}{' stream' if stream else ''}"
            if error:
                self.errors.append(f"request {n} ({kind}): {error}")
            else:
                self.num_ok += 1
                self.num_ok_by_kind[kind] += 1
                self.latencies_s.append(time.monotonic() - started)

    @staticmethod
    async def _whole(client: httpx.AsyncClient, path: str, body: dict) -> str | None:
        r = await client.post(path, json=body)
        if r.status_code != 200:
            return f"HTTP {r.status_code} {r.text[:300]}"
        return None if r.json()["choices"][0]["finish_reason"] else "no finish_reason"

    @staticmethod
    async def _streamed(client: httpx.AsyncClient, path: str, body: dict) -> str | None:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code} {(await r.aread()).decode()[:300]}"
            is_done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    is_done = True
                elif '"error"' in line and "error" in json.loads(line[6:]):
                    return f"error event {line[6:300]}"
            return None if is_done else "stream ended without [DONE]"
