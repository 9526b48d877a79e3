"""An engine whose open session ends (it died, or stopped) is routed around by the
Coordinator at once, before the Controller's view says anything (``engine_lost``): it
is suspect while its address stays in the view and its Health does not answer, and
routed to again once it answers. The Coordinator closing its own sessions marks nothing."""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.api.proto import engine_pb2_grpc as pb_grpc
from pdserve.coordinator.instances import EngineEndpoint, InstanceRegistry
from tests.stub_engine import StubEngine, start_stub
from tests.unit.coordinator.test_sessions import read_all, request, run, until

SUSPECT_S = 0.3  # far below how long the test watches the lost engine


def decode_ids(registry: InstanceRegistry) -> list[str]:
    return [i.instance_id for i in registry.pools().decode]


async def view_of_two(registry: InstanceRegistry):
    """Two decode engines on stubs (the view never changes after this); returns their servers."""
    servers, instances = [], []
    for name in ("d0", "d1"):
        server, address = await start_stub(StubEngine(num_tokens=2))
        servers.append(server)
        instances.append(EngineEndpoint(instance_id=name, address=address, role="decode"))
    registry.replace(instances)
    for inst in instances:  # a session open to each
        assert len(await read_all(registry.engine(inst.address).generate(request(inst.instance_id), 5.0))) == 2
    assert decode_ids(registry) == ["d0", "d1"]
    return servers, instances


def test_an_engine_that_ends_its_session_is_not_routed_to_until_it_answers_again():
    async def scenario():
        registry = InstanceRegistry(suspect_s=SUSPECT_S)
        (s0, s1), (d0, _) = await view_of_two(registry)
        await s0.stop(grace=None)  # d0 dies; the view still lists it as healthy
        await until(lambda: decode_ids(registry) == ["d1"], timeout_s=1.0)
        watched_until = time.monotonic() + 6 * SUSPECT_S
        while time.monotonic() < watched_until:  # suspect well past suspect_s: no Health
            assert decode_ids(registry) == ["d1"]
            await asyncio.sleep(0.05)
        # d0 is back on its address: routed to again once its Health answers
        server = grpc.aio.server()
        pb_grpc.add_EngineServicer_to_server(StubEngine(num_tokens=2), server)
        port = int(d0.address.rsplit(":", 1)[1])
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        await server.start()
        await until(lambda: decode_ids(registry) == ["d0", "d1"], timeout_s=5.0)
        assert not registry._lost  # the watch ended
        await registry.close()
        await server.stop(grace=None)
        await s1.stop(grace=None)

    run(scenario)


def test_an_engine_gone_from_the_view_is_no_longer_watched():
    async def scenario():
        registry = InstanceRegistry(suspect_s=SUSPECT_S)
        (s0, s1), (_, d1) = await view_of_two(registry)
        await s0.stop(grace=None)
        await until(lambda: bool(registry._lost), timeout_s=1.0)
        registry.replace([d1])  # the Controller's view drops it
        await until(lambda: not registry._lost, timeout_s=2.0)
        await registry.close()
        await s1.stop(grace=None)

    run(scenario)


def test_the_coordinator_closing_its_sessions_marks_no_engine():
    async def scenario():
        registry = InstanceRegistry(suspect_s=SUSPECT_S)
        servers, instances = await view_of_two(registry)
        await registry.close()
        assert all(i.suspect_until == 0.0 for i in instances) and not registry._lost
        for server in servers:
            await server.stop(grace=None)

    run(scenario)
