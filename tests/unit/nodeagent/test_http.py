"""The NodeAgent's side server (built by ``pdserve.api.http_runtime.create_side_app``):
/readyz names the engines that are not ready, /healthz always answers, /metrics renders."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer

from pdserve.nodeagent.http import create_http_app


def engine(instance_id: str, is_ready: bool) -> SimpleNamespace:
    return SimpleNamespace(instance_id=instance_id, role="decode", is_ready=is_ready,
                           process=SimpleNamespace(num_restarts=1))


def test_probes_and_metrics():
    agent = SimpleNamespace(instances={"d0": engine("d0", True), "d1": engine("d1", False)},
                            num_heartbeats_failed=0)

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
