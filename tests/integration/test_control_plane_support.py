"""Support for the control-plane tests (no tests here): a view poller and a steady PD load driver.

The load driver plays the Coordinator's part (which is built separately): it reads
the routable view, pairs a prefill and a decode instance (or uses a hybrid one in
FALLBACK), and retries a failed request against a fresh view until its deadline.
A request that never succeeds is a client-visible error.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import grpc

from pdserve.api.engine_client import EngineClient, build_generate_request
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


class LoadDriver:
    """Closed-loop load (``concurrency`` streams) in a background thread."""

    def __init__(self, views: ViewReader, concurrency: int = 2, deadline_s: float = 30.0) -> None:
        self.views, self.concurrency, self.deadline_s = views, concurrency, deadline_s
        self.num_ok = self.num_errors = self.num_retries = 0
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> LoadDriver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    async def _main(self) -> None:
        await asyncio.gather(*(self._stream() for _ in range(self.concurrency)))

    async def _stream(self) -> None:
        while not self._stop.is_set():
            deadline = time.monotonic() + self.deadline_s
            while True:
                view = await asyncio.to_thread(self.views.get)
                try:
                    if view is not None and await self._one(view):
                        self.num_ok += 1
                        break
                except (grpc.aio.AioRpcError, RuntimeError):
                    pass
                if time.monotonic() > deadline:
                    self.num_errors += 1
                    break
                self.num_retries += 1
                await asyncio.sleep(0.05)

    async def _one(self, view: pb.ClusterView) -> bool:
        n = next(self._ids)
        request = {"prompt_token_ids": [1 + (n + k) % 90 for k in range(24)], "max_tokens": 8,
                   "ignore_eos": True}
        by_role = {r: [i for i in view.instances if i.role == r] for r in ("prefill", "decode", "hybrid")}
        if view.mode == "PD" and by_role["prefill"] and by_role["decode"]:
            p, d = by_role["prefill"][n % len(by_role["prefill"])], by_role["decode"][n % len(by_role["decode"])]
            xid = f"load-{n}"
            async with EngineClient(p.engine_address) as pc, EngineClient(d.engine_address) as dc:
                d_req = build_generate_request(f"d-{n}", **request, kv_transfer={
                    "role": "decode", "mode": "layerwise", "transfer_id": xid, "peer": p.kv_endpoint})
                p_req = build_generate_request(f"p-{n}", **request, kv_transfer={
                    "role": "prefill", "mode": "layerwise", "transfer_id": xid, "peer": d.kv_endpoint})
                results = await asyncio.gather(_drain(dc.generate(d_req, 20)), _drain(pc.generate(p_req, 20)))
            return results[0] > 0
        if by_role["hybrid"]:
            h = by_role["hybrid"][n % len(by_role["hybrid"])]
            async with EngineClient(h.engine_address) as hc:
                return await _drain(hc.generate(build_generate_request(f"h-{n}", **request), 20)) > 0
        return False


async def _drain(stream) -> int:
    num = 0
    async for out in stream:
        num += len(out.token_ids)
        if out.finished and out.finish_reason in ("error", "abort"):
            raise RuntimeError(out.error or out.finish_reason)
    return num
