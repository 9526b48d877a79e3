"""The Controller's gRPC server refuses peers without the cluster token, and says why."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.controller.core import Controller, ControllerSettings
from pdserve.controller.service import create_grpc_server
from pdserve.controller.store import MemoryStore
from pdserve.runtime.security import SecuritySettings


def test_token_is_required_and_refusals_are_logged(caplog):
    caplog.set_level(logging.WARNING)

    async def go():
        controller = Controller(ControllerSettings(identity="c0"), MemoryStore())
        await controller.start()
        server, port = await create_grpc_server(controller, "127.0.0.1:0", SecuritySettings(token="s3cret"))
        outcomes = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.ControllerStub(channel)
                for name, md in [("none", ()), ("wrong", (("x-pdserve-token", "nope"),)),
                                 ("right", (("x-pdserve-token", "s3cret"),))]:
                    try:
                        view = await stub.GetView(pb.WatchViewRequest(), metadata=md, timeout=5)
                        outcomes[name] = view.leader
                    except grpc.aio.AioRpcError as exc:
                        outcomes[name] = exc.code()
                    if name == "none":
                        with pytest.raises(grpc.aio.AioRpcError) as exc:
                            await stub.Heartbeat(pb.HeartbeatRequest(agent_id="x"), timeout=5)
                        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(0)
            await controller.stop()
        return outcomes

    outcomes = asyncio.run(go())
    assert outcomes == {"none": grpc.StatusCode.UNAUTHENTICATED,
                        "wrong": grpc.StatusCode.UNAUTHENTICATED, "right": "c0"}
    assert "no cluster token" in caplog.text and "wrong cluster token" in caplog.text
