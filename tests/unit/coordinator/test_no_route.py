"""No PD pair and no hybrid engine: the request waits only while the view may still
give it a route (a Controller drives the view, or an engine of it is down and may come
back); otherwise it is answered 503 at once, with the reason."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pdserve.coordinator.errors import ServeError
from pdserve.coordinator.policies import RouteContext
from pdserve.coordinator.router import Plan
from tests.unit.coordinator.harness import BODY, inst, metric, serve
from tests.unit.coordinator.test_quiet_logs import wait_for
from tests.unit.coordinator.test_router import fallbacks, make_router, plan


def plan_across(router, change) -> Plan:
    """Plans a request that must wait; ``change()`` then changes the view: the plan."""
    async def go():
        task = asyncio.ensure_future(router.plan(RouteContext(list(range(32)), 8), set(),
                                                 time.monotonic() + 5))
        await asyncio.sleep(0.1)
        assert not task.done()
        change()
        return await asyncio.wait_for(task, 1)

    return asyncio.run(go())


def test_a_static_view_of_decode_engines_only_is_refused_at_once():
    router, _, metrics = make_router([inst("d1", "decode"), inst("d2", "decode")])
    t0 = time.monotonic()
    with pytest.raises(ServeError) as info:
        plan(router, timeout_s=5.0)
    assert time.monotonic() - t0 < 0.5
    err = info.value
    assert (err.status, err.code) == (503, "no_route")
    assert "no prefill engine" in err.message and "no hybrid engine" in err.message
    assert fallbacks(metrics, "hybrid", "no_prefill_engine") == 1


def test_an_engine_that_is_down_may_come_back_so_the_request_waits_for_it():
    down = inst("p1", "prefill", healthy=False)
    router, registry, _ = make_router([inst("d1", "decode"), down])
    # It answers again.
    p = plan_across(router, lambda: registry.replace([inst("d1", "decode"), inst("p1", "prefill")]))
    assert (p.kind, p.prefill.instance_id, p.decode.instance_id) == ("pd", "p1", "d1")


def test_an_engine_excluded_by_the_request_is_no_reason_to_wait():
    # p1 failed this request's first attempt (excluded) and is now down: nothing left.
    router, _, _ = make_router([inst("d1", "decode"), inst("p1", "prefill", healthy=False)])
    t0 = time.monotonic()
    with pytest.raises(ServeError) as info:
        plan(router, exclude={"p1"}, timeout_s=5.0)
    assert info.value.status == 503 and time.monotonic() - t0 < 0.5


def test_with_a_controller_the_request_waits_for_an_engine_switched_to_hybrid():
    router, registry, _ = make_router([inst("d1", "decode")], controller="127.0.0.1:1")
    p = plan_across(router, lambda: registry.replace([inst("d1", "hybrid")], mode="FALLBACK",
                                                     reason="no prefill engine"))
    assert (p.kind, p.single.instance_id) == ("single", "d1")


def test_a_coordinator_given_only_a_decode_engine_answers_503_at_once(loop, stubs):
    with serve(loop, [stubs(role="decode")], first_token_timeout_s=30.0) as app:
        wait_for(lambda: app.deps.registry.pools().decode)  # the view holds the engine, up
        t0 = time.monotonic()
        r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
        assert time.monotonic() - t0 < 5.0  # not the 30 s deadline
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "no_route"
        assert "no prefill engine" in error["message"] and "no hybrid engine" in error["message"]
        assert metric(app, "pdserve_coordinator_requests_total", endpoint="completions",
                      code="503") == 1
