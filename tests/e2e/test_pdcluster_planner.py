"""The operator follows the SLO planner, on the cluster stand-in with the chart's
operator: a PDCluster of 2 prefill and 1 decode engines (the tiny preset) with the
planner on and no traffic. The Controller's planner finds the cluster idle and asks
for one prefill engine; the operator patches ``spec.prefill.replicas`` to 1 (never
lower: ``minPrefill`` is 1), drains the surplus instance through the Controller and
deletes it, posts the Events (``FollowedPlanner``, ``PlannerScaled``) and writes
``status.planner`` and the ``Planner`` condition. The cluster left serves a
completion through its Coordinator Service.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import yaml

from tests.e2e.standin import condition_status
from tests.e2e.test_pdcluster_e2e import SERVING, chart, etcd, install, until  # noqa: F401
from tests.procs import REPO

pytestmark = pytest.mark.timeout(180)

NAME = "plan"
# intervalSeconds 1, stableIntervals 2, cooldownSeconds 0: an idle cluster shrinks
# seconds after its engines report; windowSeconds 10: idle is a short window here
PLANNER = {"enabled": True, "intervalSeconds": 1, "stableIntervals": 2, "cooldownSeconds": 0,
           "windowSeconds": 10, "minPrefill": 1, "minDecode": 1}


def test_an_idle_cluster_is_shrunk_by_the_planner_and_the_operator_follows(cluster, chart):  # noqa: F811 - the fixture
    k = cluster.kubectl
    install(cluster, chart)
    manifest = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
    manifest["metadata"] = {"name": NAME, "namespace": SERVING}
    manifest["spec"]["prefill"]["replicas"] = 2
    manifest["spec"]["planner"] = PLANNER
    k.apply(manifest)

    def pdcluster() -> dict:
        return k.get("PDCluster", NAME, SERVING) or {}

    def instances() -> list[str]:
        return sorted(i["metadata"]["name"] for i in k.list("PDInstance", SERVING))

    # the planner asks for one prefill engine; the operator writes it into the spec
    until(cluster, lambda: pdcluster().get("spec", {}).get("prefill", {}).get("replicas") == 1, 120,
          "spec.prefill.replicas patched to 1 by the operator")
    until(cluster, lambda: instances() == [f"{NAME}-decode-0", f"{NAME}-prefill-0"], 60,
          f"{NAME}-prefill-1 drained and deleted")

    def settled():
        pdc = pdcluster()
        status = pdc.get("status") or {}
        return pdc if (condition_status(pdc, "Ready") == "True"
                       and status.get("observedGeneration") == pdc["metadata"]["generation"]
                       and (status.get("readyPrefill"), status.get("readyDecode")) == (1, 1)) else None

    pdc = until(cluster, settled, 60, f"PDCluster {NAME} Ready on 1 prefill and 1 decode engine")
    assert (pdc["spec"]["prefill"]["replicas"], pdc["spec"]["decode"]["replicas"]) == (1, 1), pdc["spec"]
    planner = pdc["status"]["planner"]
    assert planner["numActions"] >= 1 and "remove one prefill engine" in planner["lastAction"], planner
    assert planner["lastActionTime"] and planner["ttftTargetSeconds"] == 2.0, planner
    assert condition_status(pdc, "Planner") in ("True", "False"), pdc["status"]["conditions"]

    def events() -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for e in k.list("Event", SERVING):
            if e["involvedObject"].get("name") == NAME:
                found.setdefault(e.get("reason"), []).append(e.get("message", ""))
        return found

    # the operator posts a pass's Events after its changes, so they may trail them a little
    until(cluster, lambda: {"FollowedPlanner", "PlannerScaled", "DeletedInstance"} <= set(events()), 30,
          "the FollowedPlanner, PlannerScaled and DeletedInstance Events")
    found = events()
    assert "spec.prefill.replicas 2 -> 1 (the SLO planner's pool sizes)" in found["FollowedPlanner"], found
    assert any(m.startswith("remove one prefill engine: ") for m in found["PlannerScaled"]), found
    assert f"deleted {NAME}-prefill-1 (drained)" in found["DeletedInstance"], found
    # the planner decides every second: once the surplus left, its decision is balanced
    until(cluster, lambda: condition_status(pdcluster(), "Planner") == "True", 30,
          "the Planner condition True (balanced)")
    assert pdcluster()["spec"]["prefill"]["replicas"] == 1  # held at minPrefill, never below

    # the cluster left serves
    address = cluster.resolve(f"{NAME}-coordinator.{SERVING}.svc")
    body = json.dumps({"model": NAME, "prompt": "Hello, planner", "max_tokens": 8, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://{address}:8000/v1/completions", body,
                                     {"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 8, answer
