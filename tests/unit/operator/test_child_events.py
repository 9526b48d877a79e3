"""A change of N children of a PDCluster (PDInstances, Pods) is N watch events, each
calling the child handler: while a pass waits to start, an event costs no API call
(that pass reads everything afresh), so a change of N costs passes, not N reads."""

from __future__ import annotations

import asyncio
import logging

import kopf
import pytest

from pdserve.operator import builders as b
from pdserve.operator.handlers import register
from pdserve.operator.metrics import OperatorMetrics
from pdserve.operator.reconcile import Reconciler
from pdserve.operator.settings import OperatorSettings
from tests.unit.operator.test_builders import cluster
from tests.unit.operator.test_planner_follow import MemoryKube


class CountingKube(MemoryKube):
    def __init__(self) -> None:
        super().__init__()
        self.num_gets = 0

    async def get(self, kind, namespace, name):
        self.num_gets += 1
        return await super().get(kind, namespace, name)


@pytest.mark.asyncio
async def test_child_events_while_a_pass_waits_cost_no_read_and_no_pass():
    kube = CountingKube()
    body = cluster().to_manifest()
    body["metadata"] = {"name": "c", "namespace": "ns"}
    await kube.create(body)
    reconciler = Reconciler(kube, None, OperatorSettings(operator_namespace="ns"))
    passes, release = [], asyncio.Event()

    async def one_pass(body, may_patch_spec=True):  # a pass that takes until released
        passes.append(body["metadata"]["name"])
        await release.wait()
        return []

    reconciler._reconcile = one_pass
    registry = kopf.OperatorRegistry()
    register(registry, reconciler, OperatorMetrics(), with_login=False)
    # one handler per child kind (Pods, EndpointSlices, PDInstances, PDPools), one function
    child_changed = next(h.fn for h in registry._watching.get_all_handlers() if h.fn.__name__ == "child_changed")
    event = {"namespace": "ns", "labels": {b.CLUSTER_LABEL: "c"}, "logger": logging.getLogger(__name__)}

    # a pass runs (the first event's), the second event's waits for it
    first = asyncio.create_task(child_changed(**event))
    while not passes:
        await asyncio.sleep(0)
    second = asyncio.create_task(child_changed(**event))
    while not reconciler.is_queued("ns", "c"):
        await asyncio.sleep(0)
    assert kube.num_gets == 3  # each event's read, and the running pass's fresh one

    # 100 more Pods and PDInstances change meanwhile: nothing read, nothing queued
    for _ in range(100):
        await child_changed(**event)
    assert kube.num_gets == 3

    release.set()
    await asyncio.gather(first, second)
    assert passes == ["c", "c"] and kube.num_gets == 4  # the waiting pass read everything afresh
    assert not reconciler.is_queued("ns", "c")
