"""PDPools: the scalable view of each pool. The sync rule (a scale of the PDPool is
written into the PDCluster unless the planner owns the pool or the spec's rules refuse
it; anything else mirrors the PDCluster), the builders, and whole passes against an
in-memory API that checks resourceVersions as the apiserver does."""

from __future__ import annotations

import copy

import pytest
import pytest_asyncio

from pdserve.operator import builders as b
from pdserve.operator.desired import build_cluster_objects
from pdserve.operator.doctor import DoctorRuns
from pdserve.operator.kube import KubeError, path
from pdserve.operator.pdpools import (
    PoolSync,
    build_pdpool,
    build_pdpool_status,
    build_pdpools,
    is_owned_by_planner,
    pool_selector_text,
    sync_pool,
)
from pdserve.operator.pods import build_engine_pod
from pdserve.operator.reconcile import Reconciler
from pdserve.operator.settings import OperatorSettings
from tests.kmock_emulator import matches_selector
from tests.unit.operator.test_builders import cluster
from tests.unit.operator.test_planner_follow import (
    NOW,
    PLANNER,
    MemoryKube,
    ScriptedController,
    no_checks,
)


def pdpool(pool: str = "decode", replicas: int = 1, observed: int | None = 1) -> dict:
    """The PDPool of ``pool`` of the test cluster ``c`` as read back, scaled to ``replicas``."""
    body = build_pdpool(cluster(), pool)
    body["spec"]["replicas"] = replicas
    body["status"] = {} if observed is None else {"observedClusterReplicas": observed}
    return body


# --- the rule ---------------------------------------------------------------------

def test_a_scaled_pdpool_is_a_request_the_pdcluster_takes():
    # the test cluster: 2 prefill, 1 decode, 0 hybrid; the planner off
    assert sync_pool(cluster(), "decode", pdpool(replicas=3)) == PoolSync("decode", 1, asked=3)
    assert sync_pool(cluster(), "decode", pdpool(replicas=3)).is_accepted
    assert sync_pool(cluster(), "hybrid", pdpool("hybrid", 2, observed=0)).is_accepted
    # to zero, while another pool serves
    assert sync_pool(cluster(), "prefill", pdpool("prefill", 0, observed=2)).asked == 0


def test_no_request_when_the_pdpool_holds_what_was_synced_or_the_pdclusters_size():
    assert sync_pool(cluster(), "decode", None) == PoolSync("decode", 1)                # not created yet
    assert sync_pool(cluster(), "decode", pdpool(replicas=1)) == PoolSync("decode", 1)  # in sync
    # the PDCluster changed (a hand edit, the planner): the PDPool follows it
    assert sync_pool(cluster(decode={"replicas": 4}), "decode", pdpool(replicas=1)) == PoolSync("decode", 4)
    # scaled to what the PDCluster already holds: nothing to write
    assert sync_pool(cluster(decode={"replicas": 4}), "decode", pdpool(replicas=4)) == PoolSync("decode", 4)
    # never synced (the operator just created it with the PDCluster's size): no request yet
    assert sync_pool(cluster(), "decode", pdpool(replicas=5, observed=None)) == PoolSync("decode", 1)


def test_when_both_changed_the_pdpools_scale_wins():
    # synced at 1; the PDCluster went to 4 and the PDPool to 2 before the next pass
    assert sync_pool(cluster(decode={"replicas": 4}), "decode", pdpool(replicas=2)) == PoolSync("decode", 4, 2)


def test_the_planner_owns_the_prefill_and_decode_pools_and_refuses_their_scales():
    planned = cluster(planner=PLANNER)
    for pool in ("prefill", "decode"):
        assert is_owned_by_planner(planned, pool)
        sync = sync_pool(planned, pool, pdpool(pool, 5, observed=1))
        assert sync.asked == 5 and not sync.is_accepted and "SLO planner owns" in sync.refused
    assert not is_owned_by_planner(planned, "hybrid")
    assert sync_pool(planned, "hybrid", pdpool("hybrid", 1, observed=0)).is_accepted
    # advisory, or off: the pools are the user's
    advisory = cluster(planner={**PLANNER, "advisory": True})
    assert not is_owned_by_planner(advisory, "decode")
    assert sync_pool(advisory, "decode", pdpool(replicas=5)).is_accepted


def test_a_size_the_pdclusters_rules_refuse_is_refused_and_says_why():
    # no engine at all
    only_decode = cluster(prefill={"replicas": 0})
    sync = sync_pool(only_decode, "decode", pdpool(replicas=0))
    assert not sync.is_accepted
    assert "spec.prefill.replicas, spec.decode.replicas or spec.hybrid.replicas must be greater than 0" \
        in sync.refused
    # an embedded-engine decode pool with GPUs may only exist at 0 replicas
    gpus = cluster(decode={"replicas": 0, "gpus": 1})
    sync = sync_pool(gpus, "decode", pdpool(replicas=1, observed=0))
    assert not sync.is_accepted and "spec.decode.gpus must be 0" in sync.refused


# --- the builders -----------------------------------------------------------------

def test_one_pdpool_per_pool_owned_by_the_pdcluster_with_its_sizes():
    c = cluster()
    built = build_pdpools(c)
    assert [p["metadata"]["name"] for p in built] == ["c-prefill", "c-decode", "c-hybrid"]
    assert [p["spec"] for p in built] == [{"cluster": "c", "pool": pool, "replicas": n}
                                          for pool, n in (("prefill", 2), ("decode", 1), ("hybrid", 0))]
    for p in built:
        assert p["apiVersion"] == "pdserve.io/v1alpha1" and p["kind"] == "PDPool"
        assert p["metadata"]["ownerReferences"] == [b.cluster_owner(c)]
        assert p["metadata"]["labels"][b.CLUSTER_LABEL] == "c"
        assert p["metadata"]["labels"][b.POOL_LABEL] == p["spec"]["pool"]
    assert build_pdpools(c) == built  # pure
    assert [o for o in build_cluster_objects(c, OperatorSettings(), "t", {}) if o["kind"] == "PDPool"] == built


def test_the_selector_picks_exactly_the_pools_engine_pods():
    c = cluster(hybrid={"replicas": 1})
    pods = {name: build_engine_pod(c, name, pool, "uid", OperatorSettings())
            for name, (pool, _) in b.desired_instances(c).items()}
    for pool in b.POOLS:
        selector = pool_selector_text(c, pool)
        assert selector == f"pdserve.io/cluster=c,pdserve.io/component=engine,pdserve.io/pool={pool}"
        picked = sorted(n for n, pod in pods.items() if matches_selector(pod["metadata"]["labels"], selector))
        assert picked == sorted(n for n, (p, _) in b.desired_instances(c).items() if p == pool)
    # PDPools carry the pool label too, but not the engine component: never selected
    assert not matches_selector(build_pdpool(c, "decode")["metadata"]["labels"], pool_selector_text(c, "decode"))


def test_status_counts_the_pools_pods_and_records_the_size_synced_with():
    c = cluster()
    pods = [{"metadata": {"labels": {b.POOL_LABEL: "decode"}}},
            {"metadata": {"labels": {b.POOL_LABEL: "decode"}, "deletionTimestamp": "2026-01-01T00:00:00Z"}},
            {"metadata": {"labels": {b.POOL_LABEL: "prefill"}}}]
    status = build_pdpool_status(c, pdpool(replicas=1), pods, num_ready=0)
    assert status == {"replicas": 1, "readyReplicas": 0, "selector": pool_selector_text(c, "decode"),
                      "observedClusterReplicas": 1}
    # a request still pending (spec.replicas is not the PDCluster's): the old value stays
    assert "observedClusterReplicas" not in build_pdpool_status(c, pdpool(replicas=3), pods, 0)


# --- whole passes -----------------------------------------------------------------

class VersionedKube(MemoryKube):
    """MemoryKube plus resourceVersions: bumped on every write, and a merge patch that
    names one answered 409 when the object has moved on (the apiserver's precondition).
    ``has_pdpools`` False: the PDPool CRD is not installed (404 on every PDPool call)."""

    def __init__(self) -> None:
        super().__init__()
        self.version, self.has_pdpools = 0, True

    def _bump(self, key: str) -> None:
        self.version += 1
        self.objects[key]["metadata"]["resourceVersion"] = str(self.version)

    async def list(self, kind, namespace, labels):
        if kind == "PDPool" and not self.has_pdpools:
            raise KubeError(404, "cannot list PDPool: is its CRD installed?")
        return await super().list(kind, namespace, labels)

    async def create(self, body):
        await super().create(body)
        key = path(body["kind"], body["metadata"]["namespace"], body["metadata"]["name"])
        self._bump(key)
        return copy.deepcopy(self.objects[key])

    async def patch(self, kind, namespace, name, patch, subresource=None):
        key = path(kind, namespace, name)
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if key in self.objects and wanted and wanted != self.objects[key]["metadata"]["resourceVersion"]:
            raise KubeError(409, "the object has been modified")
        if await super().patch(kind, namespace, name, patch, subresource) is None:
            return None
        self._bump(key)
        return copy.deepcopy(self.objects[key])

    def pdpool(self, pool: str) -> dict:
        return self.objects[path("PDPool", "ns", f"c-{pool}")]

    async def scale(self, pool: str, replicas: int) -> None:
        """``kubectl scale pdpool/c-<pool> --replicas N`` (an HPA writes the same field)."""
        await self.patch("PDPool", "ns", f"c-{pool}", {"spec": {"replicas": replicas}})


@pytest_asyncio.fixture
async def env():
    kube, ctrl = VersionedKube(), ScriptedController()
    doctor = DoctorRuns(checks=no_checks)
    reconciler = Reconciler(kube, ctrl, OperatorSettings(operator_namespace="ns"), clock=lambda: NOW,
                            doctor=doctor)
    body = cluster().to_manifest()
    body["metadata"] = {"name": "c", "namespace": "ns"}
    await kube.create(body)
    yield kube, reconciler
    await doctor.close()


async def settle(kube: VersionedKube, reconciler: Reconciler) -> list:
    """One pass, then what the kubelet and the Deployment controller would do; the Events."""
    events = await reconciler.reconcile(kube.pdcluster())
    for pod in kube.names("Pod"):
        kube.set_status("Pod", pod, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
    for component in ("controller", "coordinator"):
        kube.set_status("Deployment", f"c-{component}", {"availableReplicas": 1})
    return events


def replicas(kube: VersionedKube) -> dict[str, tuple[int, int, int | None]]:
    """Pool -> (the PDCluster's size, the PDPool's spec.replicas, its observedClusterReplicas)."""
    return {pool: (kube.pdcluster()["spec"][pool]["replicas"], kube.pdpool(pool)["spec"]["replicas"],
                   (kube.pdpool(pool).get("status") or {}).get("observedClusterReplicas"))
            for pool in b.POOLS}


@pytest.mark.asyncio
async def test_a_pdpool_scale_resizes_the_pool_and_a_pdcluster_edit_resizes_the_pdpool(env):
    kube, reconciler = env
    events = await settle(kube, reconciler)
    assert kube.names("PDPool") == ["c-decode", "c-hybrid", "c-prefill"]
    assert {(e.reason, e.message) for e in events} >= {("Created", "created PDPool c-decode")}
    await settle(kube, reconciler)
    assert replicas(kube) == {"prefill": (2, 2, 2), "decode": (1, 1, 1), "hybrid": (0, 0, 0)}
    status = kube.pdpool("decode")["status"]
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert status["selector"] == "pdserve.io/cluster=c,pdserve.io/component=engine,pdserve.io/pool=decode"

    # kubectl scale pdpool/c-decode --replicas 2: the spec follows, a second engine is made
    await kube.scale("decode", 2)
    events = await settle(kube, reconciler)
    assert ("ScaledByPool", "spec.decode.replicas 1 -> 2 (PDPool c-decode was scaled)") in {
        (e.reason, e.message) for e in events}
    assert replicas(kube)["decode"] == (2, 2, 2)
    assert "c-decode-1" in kube.names("PDInstance") and "c-decode-1" in kube.names("Pod")
    pdc = kube.pdcluster()  # the status was written from the patched spec, in the same pass
    assert pdc["status"]["desiredDecode"] == 2 and pdc["status"]["observedGeneration"] == pdc["metadata"]["generation"]
    await settle(kube, reconciler)
    assert kube.pdpool("decode")["status"]["replicas"] == 2 == kube.pdpool("decode")["status"]["readyReplicas"]

    # the PDCluster edited by hand: the PDPool follows, nothing is asked of the PDCluster
    await kube.patch("PDCluster", "ns", "c", {"spec": {"hybrid": {"replicas": 1}}})
    events = await settle(kube, reconciler)
    assert replicas(kube)["hybrid"] == (1, 1, 1) and "c-hybrid-0" in kube.names("PDInstance")
    assert not [e for e in events if e.reason in ("ScaledByPool", "ScaleRefused")]
    # scaled back to 0: the pool drains away like any scale-down (its Pod counts until then)
    await kube.scale("hybrid", 0)
    await settle(kube, reconciler)
    assert replicas(kube)["hybrid"] == (0, 0, 0)


@pytest.mark.asyncio
async def test_a_refused_scale_is_set_back_with_a_warning_on_the_pdpool(env):
    kube, reconciler = env
    await settle(kube, reconciler)
    await kube.patch("PDCluster", "ns", "c", {"spec": {"prefill": {"replicas": 0}}})
    await settle(kube, reconciler)
    await kube.scale("decode", 0)  # the last engine of the cluster
    events = await settle(kube, reconciler)
    [warning] = [e for e in events if e.reason == "ScaleRefused"]
    assert warning.type == "Warning" and warning.about["metadata"]["name"] == "c-decode"
    assert warning.message.startswith("scale to 0 refused: the PDCluster's rules refuse it: ")
    assert warning.message.endswith("spec.replicas is set back to 1, the PDCluster's spec.decode.replicas")
    assert replicas(kube)["decode"] == (1, 1, 1)
    # refused once: the next pass has nothing to say
    assert not [e for e in await settle(kube, reconciler) if e.reason == "ScaleRefused"]

    # the apiserver refuses the patch (an admission webhook, say): the same
    await kube.scale("decode", 3)
    kube.refuse["PDCluster"] = 422
    events = await settle(kube, reconciler)
    [warning] = [e for e in events if e.reason == "ScaleRefused"]
    assert "the API refused it: HTTP 422" in warning.message
    assert replicas(kube)["decode"] == (1, 1, 1)


@pytest.mark.asyncio
async def test_with_the_planner_on_a_pd_pools_scale_is_set_back_and_the_hybrid_pool_is_the_users(env):
    kube, reconciler = env
    await kube.patch("PDCluster", "ns", "c", {"spec": {"planner": PLANNER}})
    await settle(kube, reconciler)
    await kube.scale("decode", 3)
    events = await settle(kube, reconciler)
    [warning] = [e for e in events if e.reason == "ScaleRefused"]
    assert "the SLO planner owns spec.decode.replicas" in warning.message
    assert replicas(kube)["decode"] == (1, 1, 1)
    await kube.scale("hybrid", 1)
    await settle(kube, reconciler)
    assert replicas(kube)["hybrid"] == (1, 1, 1)


@pytest.mark.asyncio
async def test_a_scale_made_during_a_pass_is_never_overwritten(env):
    kube, reconciler = env
    await settle(kube, reconciler)
    # the PDCluster changes, and an autoscaler scales the PDPool before the pass writes it
    await kube.patch("PDCluster", "ns", "c", {"spec": {"decode": {"replicas": 3}}})
    stale = copy.deepcopy(kube.pdpool("decode"))
    await kube.scale("decode", 2)
    moved = await reconciler._set_pdpool_replicas(stale, 3)  # what the pass would write, read before
    assert moved == stale and kube.pdpool("decode")["spec"]["replicas"] == 2  # 409: left alone
    # the next pass reads the scale as a request: it is the later one, it wins
    await settle(kube, reconciler)
    assert replicas(kube)["decode"] == (2, 2, 2)


@pytest.mark.asyncio
async def test_without_the_pdpool_crd_the_pass_goes_on(env):
    kube, reconciler = env
    kube.has_pdpools = False
    await settle(kube, reconciler)
    await settle(kube, reconciler)
    assert kube.names("PDPool") == [] and kube.names("PDInstance") == ["c-decode-0", "c-prefill-0", "c-prefill-1"]
    assert kube.pdcluster()["status"]["readyDecode"] == 1
