"""The leader's state machine, step by step with a fake clock: health, failover,
replacement requests, hybrid fallback with hysteresis, role switching."""

from __future__ import annotations

import pytest

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller import fallback
from pdserve.controller.cluster import Cluster, ClusterSettings
from pdserve.controller.health import HealthThresholds, InstanceRecord
from pdserve.controller.rebalance import RebalanceSettings

T = HealthThresholds(interval_s=1.0, suspect_after_missed=2, failed_after_missed=4)


def make_cluster(**overrides) -> Cluster:
    settings = ClusterSettings(
        thresholds=T, fallback=fallback.FallbackSettings(hysteresis_s=5, startup_grace_s=100),
        rebalance=RebalanceSettings(window_s=10, min_interval_s=50, reverse_cooldown_s=200),
        **overrides)
    cluster = Cluster(settings, now_s=0.0)
    cluster.started_s = -10.0  # past the new-leader grace window
    return cluster


def report(iid: str, role: str, state: str = "running", pool: str | None = None, **load) -> pb.InstanceReport:
    return pb.InstanceReport(instance_id=iid, role=role, pool=pool or role, process_state=state,
                             probe_ok=state == "running", engine_address=f"{iid}:1",
                             kv_endpoint=f"{iid}:2", kv_transport="tcp", load=pb.InstanceLoad(**load))


def beat(c: Cluster, now: float, *reports) -> list[pb.Command]:
    commands = c.apply_heartbeat("agent", reports, now)
    c.tick(now)
    return commands + c.apply_heartbeat("agent", [], now)


def routable(c: Cluster) -> dict[str, str]:
    return {i.instance_id: i.role for i in c.view("me").instances}


def test_ready_suspect_failed_and_back_through_starting():
    c = make_cluster()
    beat(c, 0.0, report("d0", "decode", "starting"))
    assert c.records["d0"].health == "STARTING" and routable(c) == {}
    beat(c, 1.0, report("d0", "decode"))
    assert routable(c) == {"d0": "decode"}
    c.tick(3.5)  # 2.5 intervals silent
    assert c.records["d0"].health == "SUSPECT" and routable(c) == {}
    c.tick(5.0)
    assert c.records["d0"].health == "FAILED" and c.num_failovers == 1
    beat(c, 6.0, report("d0", "decode", "starting"))
    assert c.records["d0"].health == "STARTING"
    beat(c, 7.0, report("d0", "decode"))
    assert c.records["d0"].health == "READY"


def test_the_leaders_own_stall_is_not_counted_as_silence():
    c = make_cluster()
    beat(c, 0.0, report("d0", "decode"), report("p0", "prefill"))
    c.tick(3.5, stalled_s=3.0)  # the leader's loop woke 3 s late: 0.5 s of real silence
    assert routable(c) == {"d0": "decode", "p0": "prefill"}
    beat(c, 3.6, report("p0", "prefill"))  # p0's agent heard; d0's silent from here on
    c.tick(5.0)  # d0: 5.0 - 3.0 stalled = 2 intervals
    assert c.records["d0"].health == "SUSPECT" and c.records["p0"].health == "READY"
    c.tick(7.0)
    assert c.records["d0"].health == "FAILED"  # 4 intervals net of the stall
    # a stall before an instance's last heartbeat is no credit to it
    beat(c, 8.0, report("p0", "prefill"))
    c.tick(10.5)
    assert c.records["p0"].health == "SUSPECT"


def test_many_agents_are_told_a_longer_interval_and_judged_by_it():
    c = make_cluster(max_heartbeats_per_s=2.0)
    for n in range(6):  # six agents, one engine each: 6 a second where 2 are wanted
        c.apply_heartbeat(f"agent-{n}", [report(f"d{n}", "decode")], 0.0)
    assert c.heartbeat_interval_s == 1.0  # what agents were told so far
    c.tick(0.5)
    assert c.heartbeat_interval_s == 3.0  # 6 agents / 2 a second
    for n in range(6):
        c.apply_heartbeat(f"agent-{n}", [report(f"d{n}", "decode")], 1.0)
    c.tick(5.0)  # 4 s silent: past 2 intervals of 1 s, not of 3 s
    assert all(r.health == "READY" for r in c.records.values())
    c.tick(7.0)  # 6 s: two of its intervals
    assert all(r.health == "SUSPECT" for r in c.records.values())


def test_stalls_are_forgotten_after_two_failure_windows():
    c = make_cluster()
    beat(c, 0.0, report("d0", "decode"))
    c.tick(0.5, stalled_s=0.4)
    for now in range(1, 20):
        c.apply_heartbeat("agent", [report("d0", "decode")], float(now))
        c.tick(float(now))
    assert len(c._stalls) == 0  # 2 x 4 intervals: gone


def test_process_exit_fails_at_once_and_repeated_failures_request_a_replacement():
    c = make_cluster(replace_after_failures=2)
    for n in range(2):
        beat(c, 10.0 * n, report("d0", "decode"))
        version = c.view("me").version
        c.apply_heartbeat("agent", [report("d0", "decode", "exited")], 10.0 * n + 1)
        assert routable(c) == {} and c.view("me").version > version  # left the view in the same call
    assert c.records["d0"].replacement_requested
    assert [iid for iid, _ in c.replacements] == ["d0"]


def test_hung_engine_gets_a_restart_command():
    c = make_cluster()
    beat(c, 0.0, report("d0", "decode"))
    hung = report("d0", "decode")
    hung.probe_ok = False
    commands = c.apply_heartbeat("agent", [hung], 1.0)
    commands += c.apply_heartbeat("agent", [], 1.0)
    assert c.records["d0"].health == "FAILED"
    assert [cmd.kind for cmd in commands] == ["restart"]


def test_fallback_switches_survivors_to_hybrid_and_pd_returns_after_hysteresis():
    c = make_cluster()
    beat(c, 0.0, report("p0", "prefill"), report("d0", "decode"))
    assert c.mode.mode == "PD" and c.mode.has_been_complete
    c.apply_heartbeat("agent", [report("p0", "prefill", "exited")], 1.0)
    commands = beat(c, 1.0, report("d0", "decode"))
    assert c.mode.mode == "FALLBACK" and c.mode.missing_roles == ["prefill"]
    assert [(x.kind, x.instance_id, x.role) for x in commands] == [("switch_role", "d0", "hybrid")]
    beat(c, 2.0, report("d0", "hybrid"), report("p0", "prefill", "starting"))
    assert routable(c) == {"d0": "hybrid"}
    beat(c, 3.0, report("d0", "hybrid"), report("p0", "prefill"))
    assert c.mode.mode == "FALLBACK"  # hysteresis: not yet
    commands = beat(c, 8.5, report("d0", "hybrid"), report("p0", "prefill"))
    assert c.mode.mode == "PD"
    assert [(x.kind, x.instance_id, x.role) for x in commands] == [("switch_role", "d0", "decode")]


def test_no_fallback_while_the_cluster_is_still_starting():
    c = make_cluster()
    c.started_s = 0.0
    beat(c, 0.0, report("d0", "decode"), report("p0", "prefill", "starting"))
    assert c.mode.mode == "PD"
    c.tick(101.0)
    assert c.mode.mode == "FALLBACK"


@pytest.mark.parametrize("load_seconds", [5, 20])
def test_role_switch_only_after_a_sustained_imbalance(load_seconds):
    c = make_cluster()
    hot = {"num_waiting": 10, "num_kv_blocks_used": 50, "num_kv_blocks_free": 50}
    idle = {"num_kv_blocks_used": 0, "num_kv_blocks_free": 100}
    commands = []
    for now in range(0, load_seconds + 1):
        commands += beat(c, float(now), report("p0", "prefill", **hot), report("d0", "decode", **idle),
                         report("d1", "decode", **idle))
    switches = [(x.instance_id, x.role) for x in commands if x.kind == "switch_role"]
    assert switches == ([] if load_seconds < 10 else [("d0", "prefill")])
    if switches:  # steady load afterwards: no second move, no move back
        for now in range(load_seconds + 1, load_seconds + 40):
            more = beat(c, float(now), report("p0", "prefill", **hot), report("d0", "prefill", **idle),
                        report("d1", "decode", **idle))
            assert not [x for x in more if x.kind == "switch_role"]


def test_a_new_leader_commands_only_instances_it_has_heard_from():
    c = make_cluster()
    loaded = InstanceRecord("d0", agent_id="agent", pool="decode", assigned_role="decode",
                            role="hybrid", health="READY")  # written mid-switch by the last leader
    c.records["d0"] = loaded
    c.tick(1.0)
    assert c.apply_heartbeat("agent", [], 1.0) == []  # no switch on a stale record
    assert beat(c, 1.1, report("d0", "decode", pool="decode")) == []  # the switch had completed
    assert beat(c, 1.2, report("d0", "hybrid", pool="decode"))[0].role == "decode"  # it had not


def colocated_cluster() -> Cluster:
    """A spec with only the hybrid pool: no PD pool is configured."""
    settings = ClusterSettings(thresholds=T, fallback=fallback.FallbackSettings(
        hysteresis_s=5, startup_grace_s=100, configured_roles=()))
    cluster = Cluster(settings, now_s=0.0)
    cluster.started_s = -10.0
    return cluster


def test_a_colocated_cluster_serves_in_colocated_mode_and_never_falls_back():
    c = colocated_cluster()
    assert c.view("me").mode == "COLOCATED"  # from the first view on, not PD
    commands = beat(c, 0.0, report("h0", "hybrid"), report("h1", "hybrid", "starting"))
    assert routable(c) == {"h0": "hybrid"} and commands == []
    c.apply_heartbeat("agent", [report("h0", "hybrid", "exited")], 1.0)
    commands = beat(c, 200.0, report("h1", "hybrid"))  # past the startup grace, one engine down
    assert c.mode.mode == "COLOCATED" and c.mode.reason == "" and commands == []
    assert routable(c) == {"h1": "hybrid"}
    assert not [e for e in c.events if "FALLBACK" in e]


def test_state_from_an_earlier_pd_spec_turns_colocated():
    c = colocated_cluster()
    c.mode = fallback.ModeState(mode="FALLBACK", reason="no ready prefill instance",
                                missing_roles=["prefill"], has_been_complete=True)
    beat(c, 0.0, report("h0", "hybrid"))
    assert c.mode.mode == "COLOCATED" and c.mode.missing_roles == [] and c.meta_dirty
    assert "FALLBACK -> COLOCATED" in c.events[-1]


def test_hybrid_pool_instances_serve_as_they_are_next_to_pd_pools():
    c = make_cluster()
    commands = beat(c, 0.0, report("p0", "prefill"), report("d0", "decode"), report("h0", "hybrid"))
    assert c.mode.mode == "PD" and routable(c) == {"p0": "prefill", "d0": "decode", "h0": "hybrid"}
    assert commands == []
    c.apply_heartbeat("agent", [report("p0", "prefill", "exited")], 1.0)
    commands = beat(c, 1.0, report("d0", "decode"), report("h0", "hybrid"))
    assert c.mode.mode == "FALLBACK" and c.mode.missing_roles == ["prefill"]  # not "hybrid"
    assert [(x.instance_id, x.role) for x in commands] == [("d0", "hybrid")]


def test_controller_settings_configure_only_the_pd_pools_with_replicas():
    import argparse

    from pdserve.api import parse_manifest
    from pdserve.controller.cli import add_arguments, build_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    def configured(**pools):
        spec = parse_manifest({"kind": "PDCluster", "metadata": {"name": "x"},
                               "spec": {"model": {"preset": "tiny"}, **pools}})
        return build_settings(args, spec, "me").cluster.fallback.configured_roles
    assert configured(prefill={"replicas": 0}, decode={"replicas": 0}, hybrid={"replicas": 2}) == ()
    assert configured(hybrid={"replicas": 1}) == ("prefill", "decode")


def test_a_fixed_split_turns_overload_switching_off_and_the_flag_wins():
    import argparse

    from pdserve.api import parse_manifest
    from pdserve.controller.cli import add_arguments, build_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def switching(flags: list[str], **planner) -> bool:
        spec = parse_manifest({"kind": "PDCluster", "metadata": {"name": "x"},
                               "spec": {"model": {"preset": "tiny"}, "planner": planner}})
        return build_settings(parser.parse_args(flags), spec, "me").cluster.rebalance.enabled
    assert switching([]) and not switching([], overloadSwitching=False)
    assert not switching(["--no-rebalance"], overloadSwitching=True)


def test_the_engines_max_model_len_reaches_the_view_and_the_coordinators_endpoints():
    from pdserve.coordinator.instances import InstanceRegistry
    from pdserve.coordinator.watcher import views_from_view

    c = make_cluster()
    p, d = report("p0", "prefill"), report("d0", "decode")
    p.max_model_len, d.max_model_len = 4096, 2048
    beat(c, 0.0, p, d)
    registry = InstanceRegistry()
    registry.apply_view(views_from_view(c.view("me")))
    assert sorted(i.max_model_len for i in registry.all()) == [2048, 4096]
    assert registry.max_model_len() == 2048  # the longest request every engine takes
    restored = InstanceRecord.from_json(c.records["d0"].to_json(), 0.0)
    assert restored.max_model_len == 2048  # a new leader knows it before the next beat


def test_a_report_marks_its_record_dirty_only_when_a_persisted_field_changes():
    c = make_cluster()
    beat(c, 0.0, report("d0", "decode", num_running=3))
    c.dirty.clear()
    c.apply_heartbeat("agent", [report("d0", "decode", num_running=5, decode_step_s_total=2.5)], 1.0)
    assert not c.dirty  # the load alone is not persisted
    rec = c.records["d0"]
    assert rec.load["num_running"] == 5 and rec.load["decode_step_s_total"] == 2.5
    assert rec.load["num_waiting"] == 0 and type(rec.load["prefill_busy_s_total"]) is float  # unset: its zero
    moved = report("d0", "decode")
    moved.engine_address = "elsewhere:1"
    c.apply_heartbeat("agent", [moved], 2.0)
    assert c.dirty == {"d0"} and "num_running" in rec.load and rec.load["num_running"] == 0
    c.dirty.clear()
    failing = report("d0", "decode")
    failing.unreachable_peers.add(instance_id="p0", kv_endpoint="p0:2", reason="refused")
    failing.engine_address = "elsewhere:1"
    c.apply_heartbeat("agent", [failing], 3.0)
    assert c.dirty == {"d0"}  # a list field replaced by a different list
    c.dirty.clear()
    c.apply_heartbeat("agent", [failing], 4.0)
    assert not c.dirty  # the same list again
    before = rec.change_key()
    rec.failures.append(5.0)  # grown in place, as ``set_health`` does
    assert rec.change_key() != before
