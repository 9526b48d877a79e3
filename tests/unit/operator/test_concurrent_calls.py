"""A pass's calls on many instances run a few at once (``Reconciler._each``): a scale of
N engines is 2 N creates, and one after another they cost N round trips of the
apiserver. At most ``api_concurrency`` are in flight; a failed call fails the pass only
after the others ended, and the next pass finishes the job without writing twice."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.operator.kube import KubeError
from pdserve.operator.reconcile import Reconciler
from pdserve.operator.settings import OperatorSettings
from tests.unit.operator.test_builders import cluster
from tests.unit.operator.test_planner_follow import MemoryKube, ScriptedController


class SlowKube(MemoryKube):
    """Each write takes a while; counts the writes in flight. ``fail``: names whose
    create answers 500 (once each)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = self.max_in_flight = 0
        self.fail: set[str] = set()
        self.num_creates: dict[str, int] = {}

    async def _slow(self, call):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.005)
            return await call
        finally:
            self.in_flight -= 1

    async def create(self, body):
        name = f"{body['kind']}/{body['metadata']['name']}"
        self.num_creates[name] = self.num_creates.get(name, 0) + 1
        if name in self.fail:
            self.fail.discard(name)
            await self._slow(asyncio.sleep(0))
            raise KubeError(500, f"{name}: the apiserver is busy")
        return await self._slow(super().create(body))

    async def patch(self, kind, namespace, name, patch, subresource=None):
        return await self._slow(super().patch(kind, namespace, name, patch, subresource))

    async def delete(self, kind, namespace, name):
        return await self._slow(super().delete(kind, namespace, name))


@pytest.mark.asyncio
async def test_a_scale_creates_a_few_at_a_time_and_a_failed_create_loses_nothing():
    kube, ctrl = SlowKube(), ScriptedController()
    reconciler = Reconciler(kube, ctrl, OperatorSettings(operator_namespace="ns", api_concurrency=4))
    body = cluster(decode={"replicas": 20}).to_manifest()
    body["metadata"] = {"name": "c", "namespace": "ns"}
    await kube.create(body)
    kube.fail = {"Pod/c-decode-7"}

    with pytest.raises(KubeError, match="busy"):
        await reconciler.reconcile(kube.pdcluster())
    assert 2 <= kube.max_in_flight <= 4
    decode = [f"c-decode-{i}" for i in range(20)]
    assert set(kube.names("PDInstance")) == {"c-prefill-0", "c-prefill-1", *decode}
    assert set(kube.names("Pod")) == {"c-prefill-0", "c-prefill-1", *decode} - {"c-decode-7"}

    events = await reconciler.reconcile(kube.pdcluster())
    created = [e.message for e in events if e.reason == "CreatedPod"]
    assert len(created) == 1 and created[0].startswith("created Pod c-decode-7 (decode, "), created
    assert len(kube.names("Pod")) == 22
    assert all(n == 1 for name, n in kube.num_creates.items()  # nothing written twice
               if name.split("/")[0] in ("PDInstance", "Pod") and name != "Pod/c-decode-7"), kube.num_creates
    assert kube.num_creates["Pod/c-decode-7"] == 2

    # scaled down to 2: the 18 surplus drained (the Controller says done) and deleted
    for name in kube.names("Pod"):
        kube.set_status("Pod", name, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
    for component in ("controller", "coordinator"):
        kube.set_status("Deployment", f"c-{component}", {"availableReplicas": 1})
    kube.max_in_flight = 0
    await kube.patch("PDCluster", "ns", "c", {"spec": {"decode": {"replicas": 2}}})
    ctrl.drained = set(decode[2:])
    events = await reconciler.reconcile(kube.pdcluster())
    assert [e.message for e in events if e.reason == "DeletedInstance"] == [
        f"deleted c-decode-{i} (drained)" for i in range(2, 20)]  # in instance order
    assert sorted(ctrl.drain_calls) == sorted(decode[2:])
    assert set(kube.names("PDInstance")) == {"c-prefill-0", "c-prefill-1", "c-decode-0", "c-decode-1"}
    assert 2 <= kube.max_in_flight <= 4
