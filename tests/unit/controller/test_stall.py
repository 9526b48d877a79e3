"""A leader whose own event loop stalls (starved of CPU, paused) does not count the
stall as its agents' silence: the heartbeats that arrived meanwhile wait unread behind
it, so judging them by the clock alone turned every instance SUSPECT, then FAILED, on a
busy host. How late the commit loop woke is counted (``stalled_s``) and taken off."""

from __future__ import annotations

import asyncio
import time

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller.cluster import ClusterSettings
from pdserve.controller.core import Controller, ControllerSettings
from pdserve.controller.health import HealthThresholds
from pdserve.controller.store import MemoryStore

T = HealthThresholds(interval_s=0.2, suspect_after_missed=2, failed_after_missed=4)


def heartbeat() -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(agent_id="a", instances=[pb.InstanceReport(
        instance_id="d0", role="decode", pool="decode", process_state="running", probe_ok=True,
        engine_address="10.0.0.1:1", kv_endpoint="10.0.0.1:2", kv_transport="tcp")])


def test_a_stalled_leader_does_not_fail_the_instances_it_could_not_hear():
    async def go():
        leader = Controller(ControllerSettings(cluster_name="c", cluster=ClusterSettings(thresholds=T)),
                            MemoryStore())
        await leader.start()
        for _ in range(6):  # past a new leader's grace (one failure window: 0.8 s)
            await leader.heartbeat(heartbeat())
            await asyncio.sleep(0.2)
        assert leader.cluster.records["d0"].health == "READY"
        await leader.heartbeat(heartbeat())
        time.sleep(1.2)  # the loop stalls: 6 intervals, past FAILED by the clock
        await asyncio.sleep(0.15)  # the commit loop's tick runs first, then the agent is heard
        health = leader.cluster.records["d0"].health
        stalled_s = leader.stalled_s
        await leader.heartbeat(heartbeat())
        await asyncio.sleep(0.1)
        silent_health = leader.cluster.records["d0"].health
        await asyncio.sleep(0.6)  # now truly silent: 3+ intervals
        late_health = leader.cluster.records["d0"].health
        await leader.stop()
        assert health == "READY" and stalled_s > 1.0, (health, stalled_s)
        assert silent_health == "READY" and late_health in ("SUSPECT", "FAILED")

    asyncio.run(go())
