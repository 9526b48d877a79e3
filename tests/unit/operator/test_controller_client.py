"""The operator's Controller client: every call ends by its deadline, whatever grpc does."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.api.proto import controller_pb2 as pb
from pdserve.operator import controller_client as cc


class _Stub:
    """A stub whose ForgetCluster never ends (its end lost before it reached the loop),
    and whose GetView fails the way grpc reports a refused call."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.timeouts: list[float] = []

    def ForgetCluster(self, request, timeout, metadata):
        self.num_calls += 1
        self.timeouts.append(timeout)
        return asyncio.get_running_loop().create_future()  # never set

    def GetView(self, request, timeout, metadata):
        async def refused():
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), details="connection refused")
        return refused()


@pytest.mark.asyncio
async def test_a_call_whose_end_never_arrives_fails_as_unavailable_after_its_deadline(monkeypatch):
    monkeypatch.setattr(cc, "CALL_TIMEOUT_S", 0.2)
    monkeypatch.setattr(cc, "CALL_GUARD_S", 0.1)
    stub = _Stub()
    client = cc.ControllerClient(stub, (("x-pdserve-token", "t"),), "tiny-controller:50050")
    started = time.monotonic()
    with pytest.raises(cc.ControllerUnavailable, match="ForgetCluster on tiny-controller:50050"):
        await client.forget()
    assert 0.25 <= time.monotonic() - started < 5.0
    assert stub.timeouts == [0.2]  # grpc's own deadline is still the first bound
    with pytest.raises(cc.ControllerUnavailable, match="UNAVAILABLE connection refused"):
        await client.view()


@pytest.mark.asyncio
async def test_a_call_that_ends_in_time_is_answered():
    class Answering:
        async def _forget(self):
            return pb.ForgetClusterResponse(num_keys_deleted=3)

        def ForgetCluster(self, request, timeout, metadata):
            return self._forget()

    client = cc.ControllerClient(Answering(), (), "tiny-controller:50050")
    assert await client.forget() == 3
