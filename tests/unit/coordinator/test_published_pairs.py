"""Pair checks under a Controller: the prefill engines' agents probe their peers once
for the cluster and the Controller publishes the result; a Coordinator that watches
such a view routes on it and sends no ProbePeer of its own, except to recheck the
pairs of an engine one of its legs just failed on. A view without published checks
(and a static engine list) is still probed by the Coordinator itself."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx

from pdserve.api.proto import controller_pb2 as cpb
from pdserve.api.proto import controller_pb2_grpc as cpb_grpc
from pdserve.coordinator.app import create_app
from pdserve.coordinator.settings import CoordinatorSettings
from tests.unit.coordinator.harness import ALWAYS_PD, BODY, AppServer, serve_controller


class FakeController(cpb_grpc.ControllerServicer):
    """Streams ``self.view`` to every watcher, and again whenever ``publish`` changes it."""

    def __init__(self) -> None:
        self.view = cpb.ClusterView()
        self._changed = asyncio.Event()

    def publish(self, view: cpb.ClusterView) -> None:
        self.view = view
        self._changed.set()
        self._changed = asyncio.Event()

    async def WatchView(self, request, context):
        while True:
            changed = self._changed
            yield self.view
            await changed.wait()


def start_controller(loop) -> tuple[FakeController, grpc.aio.Server, str]:
    fake = FakeController()
    server, port = loop.run(serve_controller(fake))
    return fake, server, f"127.0.0.1:{port}"


def view(stubs, engines: dict[str, dict], unusable=(), publishes_pairs: bool = True,
         version: int = 1) -> cpb.ClusterView:
    """``engines``: stub address -> peer versions (``checked`` for P, ``listed`` for D)."""
    instances = []
    for address, versions in engines.items():
        stub = stubs.by_address[address]
        instances.append(cpb.InstanceView(
            instance_id=address, role=stub.role, health="READY", engine_address=address,
            kv_endpoint=stub.kv_endpoint, kv_compat_hash=stub.kv_compat_hash,
            peers_checked_version=versions.get("checked", 0), peers_listed_version=versions.get("listed", 0)))
    return cpb.ClusterView(version=version, mode="PD", instances=instances, publishes_pairs=publishes_pairs,
                           unusable_pairs=[cpb.UnusablePair(prefill_id=p, decode_id=d, reason=why)
                                           for p, d, why in unusable])


def coordinator(loop, address: str, **overrides) -> AppServer:
    settings = CoordinatorSettings(controller=address, decode_policy="round_robin",
                                   **{**ALWAYS_PD, **overrides})
    return AppServer(loop, create_app(settings))


def served_by(stubs, addresses) -> dict[str, int]:
    return {a: len(stubs.by_address[a].request_ids) for a in addresses}


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_coordinator_under_a_controller_routes_on_published_pairs_and_probes_none(loop, stubs):
    p = stubs(role="prefill")  # its probes would all pass: only the published verdicts keep d_bad out
    d_ok = stubs(role="decode", kv_endpoint="10.9.9.9:7001")
    d_bad = stubs(role="decode", kv_endpoint="10.9.9.9:7002")
    d_new = stubs(role="decode", kv_endpoint="10.9.9.9:7003")  # listed after p's agent last checked
    fake, server, address = start_controller(loop)
    engines = {p: {"checked": 2}, d_ok: {"listed": 1}, d_bad: {"listed": 2}, d_new: {"listed": 3}}
    fake.publish(view(stubs, engines, unusable=[(p, d_bad, "cannot reach KV endpoint: connection refused")]))
    try:
        with coordinator(loop, address) as app:
            for _ in range(4):
                r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
                assert r.status_code == 200, r.text
            assert served_by(stubs, [d_ok, d_bad, d_new]) == {d_ok: 4, d_bad: 0, d_new: 0}

            ready = httpx.get(app.url + "/ready", params={"verbose": 1}).json()
            rows = {row["decode"]: row for row in ready["pairs"]}
            assert rows[d_ok]["usable"] and rows[d_ok]["checked_by"] == "controller"
            assert "connection refused" in rows[d_bad]["reason"]
            assert "has not probed" in rows[d_new]["reason"]

            # p's agent reports the list d_new entered: its pair is routed from the next view
            engines[p] = {"checked": 3}
            fake.publish(view(stubs, engines, unusable=[(p, d_bad, "connection refused")], version=2))
            wait_until(lambda: app.deps.registry.get(p).peers_checked_version == 3)
            for _ in range(4):
                assert httpx.post(app.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
            assert served_by(stubs, [d_ok, d_bad, d_new]) == {d_ok: 6, d_bad: 0, d_new: 2}
            assert stubs.by_address[p].probed == []  # the Controller's checks, not ours
    finally:
        loop.run(server.stop(grace=None))


def test_a_view_without_published_pairs_is_probed_by_the_coordinator(loop, stubs):
    p = stubs(role="prefill", probe_failures={"10.9.9.9:7012": "connection refused"})
    d_ok = stubs(role="decode", kv_endpoint="10.9.9.9:7011")
    d_bad = stubs(role="decode", kv_endpoint="10.9.9.9:7012")
    fake, server, address = start_controller(loop)
    fake.publish(view(stubs, {p: {}, d_ok: {}, d_bad: {}}, publishes_pairs=False))
    try:
        with coordinator(loop, address) as app:
            for _ in range(4):
                assert httpx.post(app.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
            assert served_by(stubs, [d_ok, d_bad]) == {d_ok: 4, d_bad: 0}
            assert set(stubs.by_address[p].probed) == {"10.9.9.9:7011", "10.9.9.9:7012"}
    finally:
        loop.run(server.stop(grace=None))


def test_a_failed_leg_rechecks_that_engines_pairs_here_and_keeps_a_broken_one_out(loop, stubs):
    """The view says every pair is good; a decode leg on d_bad fails (its KV path broke
    after the agent's last probe). This Coordinator re-probes d_bad's pairs at once, and
    routes none over it while the re-probe fails, long after its suspect mark ran out."""
    p = stubs(role="prefill", probe_failures={"10.9.9.9:7022": "connection refused"})
    d_ok = stubs(role="decode", kv_endpoint="10.9.9.9:7021")
    d_bad = stubs(role="decode", kv_endpoint="10.9.9.9:7022", behavior="fail")
    fake, server, address = start_controller(loop)
    fake.publish(view(stubs, {p: {"checked": 1}, d_ok: {"listed": 1}, d_bad: {"listed": 1}}))
    try:
        with coordinator(loop, address, suspect_s=0.5, pair_probe_retry_s=0.2) as app:
            for _ in range(2):  # round robin: one of them goes to d_bad, fails, and is retried on d_ok
                assert httpx.post(app.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
            assert served_by(stubs, [d_bad]) == {d_bad: 1}
            wait_until(lambda: "10.9.9.9:7022" in stubs.by_address[p].probed)
            time.sleep(0.6)  # past the suspect mark: only the failed re-probe keeps d_bad out
            for _ in range(4):
                assert httpx.post(app.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
            assert served_by(stubs, [d_ok, d_bad]) == {d_ok: 6, d_bad: 1}
            assert "10.9.9.9:7021" not in stubs.by_address[p].probed  # only the failed engine's pairs

            stubs.by_address[p].probe_failures.clear()  # the path is mended: back to the view's verdict
            stubs.by_address[d_bad].behavior = "ok"
            wait_until(lambda: not app.deps.router.pairs.probes.results)
            for _ in range(4):
                assert httpx.post(app.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
            assert served_by(stubs, [d_bad])[d_bad] > 1
    finally:
        loop.run(server.stop(grace=None))
