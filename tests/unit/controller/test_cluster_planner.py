"""The SLO planner inside the leader's state machine: engines report cumulative
counters in their heartbeats (a simulated load, below), the Cluster differences them,
runs the planner on its tick and acts: a role switch through the agents' commands, a
pool size through the view that the operator and ``pdserve up`` follow."""

from __future__ import annotations

import json

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller import fallback
from pdserve.controller.cluster import Cluster, ClusterSettings
from pdserve.controller.health import HealthThresholds
from pdserve.controller.persist import StatePersister
from pdserve.controller.planner import PlannerSettings
from pdserve.controller.store import MemoryStore

T = HealthThresholds(interval_s=1.0, suspect_after_missed=2, failed_after_missed=4)
PLANNER = PlannerSettings(ttft_ms=1000, tpot_ms=50, interval_s=5, window_s=30, cooldown_s=60, stable_ticks=3,
                          min_requests=10, max_engines=8)


def make_cluster(planner=PLANNER, replicas=(("prefill", 1), ("decode", 3))) -> Cluster:
    settings = ClusterSettings(thresholds=T, fallback=fallback.FallbackSettings(hysteresis_s=5, startup_grace_s=100),
                               planner=planner, replicas=replicas)
    cluster = Cluster(settings, now_s=0.0)
    cluster.started_s = -10.0
    return cluster


class Engines:
    """Engines under a steady load, their counters advanced second by second: prompts of
    ``prompt`` tokens at ``rate``/s shared by the P engines (4000 tok/s each, so a
    saturated one finishes only what it can and the rest queue), ``output`` tokens each
    on the D engines (step time 10 ms + 1 ms per stream)."""

    def __init__(self, roles: dict[str, str]) -> None:
        self.roles = dict(roles)
        self.counters = {iid: {} for iid in roles}

    def advance(self, rate: float, prompt: int, output: int) -> None:
        ps = [i for i, r in self.roles.items() if r == "prefill"]
        ds = [i for i, r in self.roles.items() if r == "decode"]
        for iid in ps:
            done = min(rate / len(ps), 4000 / prompt)  # prompts this engine prefilled this second
            c = self.counters[iid]
            backlog = rate / len(ps) - done
            add(c, num_prefills_total=done, num_prompt_tokens_total=done * prompt,
                prefill_busy_s_total=done * prompt / 4000, prefill_queue_s_total=done * (0.1 + 5 * backlog),
                kv_transfers_ok=done, kv_exposed_s_total=done * 0.01, num_generation_tokens_total=done)
        for iid in ds:
            streams = rate * output * 0.02 / len(ds)
            step = 0.010 + 0.001 * streams
            c = self.counters[iid]
            add(c, num_finished_total=rate / len(ds), num_generation_tokens_total=rate * (output - 1) / len(ds),
                output_budget_total=rate * (output - 1) / len(ds), kv_transfers_ok=rate / len(ds))
            if streams:  # an engine with nothing to decode takes no step
                add(c, num_decode_steps_total=1 / step, decode_batch_total=streams / step,
                    decode_batch_sq_total=streams ** 2 / step, decode_step_s_total=1.0,
                    decode_batch_step_s_total=streams)

    def reports(self) -> list[pb.InstanceReport]:
        return [pb.InstanceReport(
            instance_id=iid, role=role, pool=iid[0] == "p" and "prefill" or "decode", process_state="running",
            probe_ok=True, engine_address=f"{iid}:1", kv_endpoint=f"{iid}:2", kv_transport="tcp",
            load=pb.InstanceLoad(**{k: int(v) if k.startswith("num_") or k in ("kv_transfers_ok", "output_budget_total") else v
                                    for k, v in self.counters[iid].items()}))
            for iid, role in self.roles.items()]


def add(c: dict, **delta) -> None:
    for k, v in delta.items():
        c[k] = c.get(k, 0) + v


def run(c: Cluster, engines: Engines, start: int, seconds: int, **load) -> list[pb.Command]:
    commands = []
    for now in range(start, start + seconds):
        engines.advance(**load)
        commands += c.apply_heartbeat("agent", engines.reports(), float(now))
        c.tick(float(now))
        commands += c.apply_heartbeat("agent", [], float(now))
        for cmd in commands:  # the agent switches at once
            if cmd.kind == "switch_role":
                engines.roles[cmd.instance_id] = cmd.role
    return commands


def test_prefill_heavy_load_on_1p_3d_switches_one_decode_engine_to_prefill_once():
    c = make_cluster()
    engines = Engines({"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"})
    # 1.5 prompts/s of 2000 tokens: 0.75 s of one P's second, TTFT 0.5 s / (1 - 0.75) = 2 s
    commands = run(c, engines, 0, 40, rate=1.5, prompt=2000, output=10)
    switches = [(x.instance_id, x.role) for x in commands if x.kind == "switch_role"]
    assert len(switches) == 1 and switches[0][1] == "prefill", [str(e) for e in c.events]
    view = c.view("me")
    assert view.planner.wanted_prefill >= 2 and view.planner.num_actions == 1
    assert view.planner.last_action.startswith(f"switch {switches[0][0]} to prefill")
    assert (view.planner.replicas_prefill, view.planner.replicas_decode) == (1, 3)  # no new engine
    assert 1.4 < view.planner.request_rate < 1.6 and 3900 < view.planner.prefill_tokens_per_s < 4100
    # the load stays: nothing more, and no switch back
    more = run(c, engines, 40, 120, rate=1.5, prompt=2000, output=10)
    assert not [x for x in more if x.kind == "switch_role"], [str(e) for e in c.events]


def test_a_short_pool_without_a_spare_engine_grows_once_and_waits_for_its_new_engine():
    c = make_cluster(replicas=(("prefill", 1), ("decode", 1)))
    engines = Engines({"p0": "prefill", "d0": "decode"})
    run(c, engines, 0, 40, rate=1.5, prompt=2000, output=10)
    p = c.view("me").planner
    assert (p.replicas_prefill, p.replicas_decode, p.num_actions) == (2, 1, 1), p.reason
    assert "add one prefill engine" in p.last_action
    # the new engine is pending (not reported yet): past the cooldown, no second +1
    run(c, engines, 40, 100, rate=1.5, prompt=2000, output=10)
    p = c.view("me").planner
    assert (p.replicas_prefill, p.num_actions) == (2, 1) and "pending" in p.reason
    # it reports: the load now fits
    engines.roles["p1"], engines.counters["p1"] = "prefill", {}
    run(c, engines, 140, 60, rate=1.5, prompt=2000, output=10)
    p = c.view("me").planner
    assert (p.replicas_prefill, p.num_actions) == (2, 1) and "balanced" in p.reason, p.reason


def test_a_saturated_pool_that_hides_its_demand_still_grows_on_its_measured_ttft():
    # 3 prompts/s offered, one P finishes 2: the counters read 2/s (rho = 1 on 1 engine
    # is what the model sees), the queue says the TTFT is broken
    c = make_cluster(replicas=(("prefill", 1), ("decode", 1)))
    run(c, Engines({"p0": "prefill", "d0": "decode"}), 0, 40, rate=3.0, prompt=2000, output=10)
    p = c.view("me").planner
    assert p.replicas_prefill == 2 and p.measured_ttft_s > 1.0


def test_advisory_mode_reports_and_changes_nothing():
    c = make_cluster(planner=PlannerSettings(**{**PLANNER.__dict__, "advisory": True}))
    engines = Engines({"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"})
    commands = run(c, engines, 0, 60, rate=1.5, prompt=2000, output=10)
    p = c.view("me").planner
    assert not [x for x in commands if x.kind == "switch_role"] and p.num_actions == 0
    assert p.advisory and p.reason.startswith("advisory: would switch")


def test_an_engine_restart_resets_its_baseline_instead_of_counting_backwards():
    c = make_cluster()
    engines = Engines({"p0": "prefill", "d0": "decode"})
    run(c, engines, 0, 10, rate=1.0, prompt=1000, output=10)
    engines.counters["p0"] = {}  # restarted: counters from zero
    run(c, engines, 10, 1, rate=1.0, prompt=1000, output=10)
    assert all(getattr(o, f) >= 0 for o in c.planner.observations for f in ("num_prefills", "prompt_tokens"))


def test_the_planners_pool_sizes_survive_a_change_of_leader():
    async def scenario():
        store = MemoryStore()
        c = make_cluster(replicas=(("prefill", 1), ("decode", 1)))
        run(c, Engines({"p0": "prefill", "d0": "decode"}), 0, 40, rate=1.5, prompt=2000, output=10)
        assert c.replicas["prefill"] == 2
        persister = StatePersister(store, "/pdserve/t", 30)
        await persister.flush(c, 40.0)
        assert json.loads(await store.get("/pdserve/t/meta"))["planner_replicas"]["prefill"] == 2
        loaded = await persister.load(c.settings, 41.0)
        assert (loaded.replicas["prefill"], loaded.replicas["decode"]) == (2, 1)

    import asyncio
    asyncio.run(scenario())


def test_the_planner_is_the_spec_s_unless_the_command_line_turns_it_on_off_or_advisory():
    from pdserve.api.cluster import PDClusterSpec
    from pdserve.controller.cli import planner_settings

    spec = PDClusterSpec.model_validate({"model": {"preset": "tiny"}, "slo": {"ttftMs": 500},
                                         "planner": {"enabled": True, "maxEngines": 4}})
    on = planner_settings(spec)
    assert on.ttft_ms == 500 and on.tpot_ms == 100 and on.max_engines == 4 and not on.advisory
    assert planner_settings(spec, "off") is None
    assert planner_settings(spec, "advisory").advisory
    off = spec.model_copy(update={"planner": spec.planner.model_copy(update={"enabled": False})})
    assert planner_settings(off) is None and planner_settings(off, "on") is not None


def test_the_planners_metrics_say_what_it_wants_asks_and_measured():
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.controller.service import planner_metrics

    c = make_cluster()
    run(c, Engines({"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"}), 0, 40,
        rate=1.5, prompt=2000, output=10)

    class One:
        def collect(self):
            return planner_metrics(c.planner_view())

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    assert 'pdserve_controller_planner_engines{kind="asked",role="decode"} 3.0' in text
    assert "pdserve_controller_planner_actions_total 1.0" in text
    assert "pdserve_controller_planner_ttft_target_seconds 1.0" in text


def test_an_idle_cluster_loses_one_engine_per_pool_above_its_minimum_and_not_one_more():
    """The engine asked away counts as leaving until the actuator stops it: the
    planner does not ask again (and again) while the operator has not drained it yet."""
    quick = PlannerSettings(interval_s=1, window_s=5, stable_ticks=2, cooldown_s=0, min_prefill=1, min_decode=1)
    c = make_cluster(planner=quick, replicas=(("prefill", 2), ("decode", 1)))
    engines = Engines({"p-prefill-0": "prefill", "p-prefill-1": "prefill", "d-decode-0": "decode"})
    run(c, engines, 0, 30, rate=0.0, prompt=100, output=10)
    p = c.view("me").planner
    assert (p.replicas_prefill, p.replicas_decode, p.num_actions) == (1, 1, 1), p.reason
    assert [e.state for e in c._planner_engines() if e.instance_id == "p-prefill-1"] == ["draining"]


def test_a_scale_down_takes_the_pool_of_an_engine_that_may_leave_never_a_pools_last():
    quick = PlannerSettings(interval_s=1, window_s=5, stable_ticks=2, cooldown_s=0, min_prefill=1, min_decode=1)
    c = make_cluster(planner=quick, replicas=(("prefill", 1), ("decode", 2)))
    # d-decode-0 was switched to prefill: 2 P by role, but the prefill pool has one engine
    engines = Engines({"p-prefill-0": "prefill", "d-decode-0": "prefill", "d-decode-1": "decode"})
    for rec_id in ("d-decode-0",):
        engines.counters[rec_id] = {}
    run(c, engines, 0, 2, rate=0.0, prompt=100, output=10)
    c.records["d-decode-0"].assigned_role = "prefill"
    run(c, engines, 2, 30, rate=0.0, prompt=100, output=10)
    p = c.view("me").planner
    assert (p.replicas_prefill, p.replicas_decode) == (1, 2), p.reason
    assert "none of its engines can leave" in p.reason and p.num_actions == 0
