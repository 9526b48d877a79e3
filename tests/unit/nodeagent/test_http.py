"""The NodeAgent's side server (built by ``pdserve.runtime.http.create_side_app``):
/readyz names the engines that are not ready, /healthz always answers, /metrics renders,
/status says why an engine died and whether it cannot start."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer

from pdserve.nodeagent.agent import HeartbeatStats
from pdserve.nodeagent.http import create_http_app


def engine(instance_id: str, is_ready: bool, last_exit: str = "") -> SimpleNamespace:
    return SimpleNamespace(instance_id=instance_id, pool="decode", role="decode", is_ready=is_ready,
                           process=SimpleNamespace(num_restarts=1, last_exit=last_exit))


def test_probes_and_metrics():
    agent = SimpleNamespace(instances={"d0": engine("d0", True), "d1": engine("d1", False)},
                            num_heartbeats_failed=0, stats=HeartbeatStats())

    async def go():
        async with TestClient(TestServer(create_http_app(agent))) as client:
            answers = {}
            for path in ("/healthz", "/readyz"):
                response = await client.get(path)
                answers[path] = (response.status, await response.text())
            agent.instances["d1"].is_ready = True
            response = await client.get("/readyz")
            answers["/readyz later"] = (response.status, await response.text())
            metrics = await (await client.get("/metrics")).text()
            return answers, metrics

    answers, metrics = asyncio.run(go())
    assert answers == {"/healthz": (200, "ok\n"), "/readyz": (503, "not ready: d1\n"),
                       "/readyz later": (200, "ready\n")}
    assert 'pdserve_nodeagent_engine_restarts_total{instance_id="d0"} 1.0' in metrics


def test_status_and_readyz_say_why_an_engine_does_not_start():
    error = "error: model 'nosuch' is neither a preset (tiny, small) nor a directory"
    failing = engine("d0", False, last_exit=f"engine exited with code 2: {error}")
    failing.process.__dict__.update(state="restarting", pid=42, last_exit_code=2, error_lines=[error],
                                    is_failing_to_start=True)
    agent = SimpleNamespace(instances={"d0": failing}, num_heartbeats_failed=0, stats=HeartbeatStats(),
                            settings=SimpleNamespace(agent_id="a0"))

    async def go():
        async with TestClient(TestServer(create_http_app(agent))) as client:
            status = await (await client.get("/status")).json()
            readyz = await (await client.get("/readyz")).text()
            return status, readyz

    status, readyz = asyncio.run(go())
    assert readyz == f"not ready: d0 (engine exited with code 2: {error})\n"
    assert status == {"agent_id": "a0", "engines": [{
        "instance_id": "d0", "pool": "decode", "role": "decode", "state": "restarting", "pid": 42,
        "is_ready": False, "num_restarts": 1, "last_exit": f"engine exited with code 2: {error}",
        "last_exit_code": 2, "error_lines": [error], "failing_to_start": True}]}
