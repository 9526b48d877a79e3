"""A Controller that stops ends its view streams itself, before its gRPC server stops:
the server has nothing to cancel (grpc logs a CancelledError traceback for each stream
it cancels), and a Coordinator sees its watch end and tries the next replica."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.controller.cluster import ClusterSettings
from pdserve.controller.core import Controller, ControllerSettings
from pdserve.controller.service import create_grpc_server
from pdserve.controller.store import MemoryStore
from pdserve.runtime.security import SecuritySettings, create_channel


def test_stop_ends_every_watch_stream_before_the_server_stops():
    async def go():
        # A long refresh: nothing but the stop itself can end the streams in time.
        settings = ControllerSettings(cluster_name="c", cluster=ClusterSettings(), view_refresh_s=60)
        controller = Controller(settings, MemoryStore())
        await controller.start()
        server, port = await create_grpc_server(controller, "127.0.0.1:0", SecuritySettings())
        try:
            async with create_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.ControllerStub(channel)
                calls = [stub.WatchView(pb.WatchViewRequest(coordinator_id=f"w{i}")) for i in range(2)]
                for call in calls:
                    assert (await call.read()).mode
                await controller.stop()
                ends = [await asyncio.wait_for(call.read(), 2.0) for call in calls]
                codes = [await call.code() for call in calls]
                late = stub.WatchView(pb.WatchViewRequest(coordinator_id="late"))
                late_end = await asyncio.wait_for(late.read(), 2.0)
        finally:
            await server.stop(1.0)
        return ends, codes, late_end

    ends, codes, late_end = asyncio.run(go())
    assert ends == [grpc.aio.EOF, grpc.aio.EOF] and codes == [grpc.StatusCode.OK] * 2
    assert late_end is grpc.aio.EOF  # a watch opened while stopping ends at once
