"""The leader's working state: instance registry, health, mode, commands, the view.

Owns every ``InstanceRecord``, the ``ModeState``, the commands queued for agents
and the operator's drains. Pure with respect to I/O: the Controller feeds it
heartbeats, ticks (with clocks) and the operator's requests, and reads back
commands for agents, the routable view, events, and which keys to persist
(``dirty`` / ``removed`` / ``replacements``).

Where it decides failover (``docs/failover.md`` tells the whole story):
``apply_heartbeat`` judges each report (process exit, failing probe: FAILED at
once; a hung engine gets a ``restart`` command), ``tick`` judges silence
(``_judge_silence``: SUSPECT, then FAILED, then forgotten), re-evaluates the mode
(``_evaluate_mode``: hybrid fallback) and role switches (``_rebalance_step``,
``_send_role_commands``); ``_on_failed`` counts a failover and asks the operator
for a replacement after repeated failures.

Invariants: the view holds READY instances only, so a FAILED instance leaves it
in the same call that fails it; no command goes to an instance this leader has
not heard from (a record loaded from the store); a command is re-sent only after
``command_timeout_s`` without the reported role reaching the target; a drain is
sent once per leadership term (a new leader sends it again); the view
``version`` grows on every change of what it shows.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller import fallback, health, planner
from pdserve.controller.health import FAILED, READY, HealthThresholds, InstanceRecord
from pdserve.controller.planner import Decision, Observation, Planner, PlannerSettings
from pdserve.controller.rebalance import PoolMember, RebalancePolicy, RebalanceSettings

log = logging.getLogger(__name__)


def _ordinal(rec: InstanceRecord) -> tuple[int, str]:
    """A pool member's place: the number ending its id (``<cluster>-<pool>-<n>``)."""
    tail = rec.instance_id.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else -1, rec.instance_id)


# the planner's Observation field -> the heartbeat's cumulative counter it differences
COUNTER_OF = {
    "num_prefills": "num_prefills_total", "prompt_tokens": "num_prompt_tokens_total",
    "prefill_busy_s": "prefill_busy_s_total", "prefill_queue_s": "prefill_queue_s_total",
    "num_kv": "kv_transfers_ok", "kv_s": "kv_exposed_s_total", "num_finished": "num_finished_total",
    "output_tokens": "num_generation_tokens_total", "num_steps": "num_decode_steps_total",
    "batch": "decode_batch_total", "batch_sq": "decode_batch_sq_total", "step_s": "decode_step_s_total",
    "batch_step_s": "decode_batch_step_s_total", "output_budget": "output_budget_total",
}


# a report's load, read into each record: its zeros, then the fields the report set
# (``ListFields``, one call: 24 attribute reads were a third of a heartbeat's handling)
_LOAD_ZEROS = {f.name: f.default_value for f in pb.InstanceLoad.DESCRIPTOR.fields}


@dataclass(frozen=True)
class ClusterSettings:
    thresholds: HealthThresholds = HealthThresholds()
    fallback: fallback.FallbackSettings = fallback.FallbackSettings()
    rebalance: RebalanceSettings = RebalanceSettings()
    planner: PlannerSettings | None = None   # on: it decides roles and pool sizes, rebalance is off
    replicas: tuple[tuple[str, int], ...] = ()  # the spec's pool sizes, the planner's start
    replace_after_failures: int = 3
    replace_window_s: float = 600.0
    command_timeout_s: float = 30.0
    drain_deadline_s: float = 30.0
    forget_after_s: float = 60.0   # a silent FAILED instance is dropped after this
    # heartbeats a second the leader asks of its agents at most: past it every agent is
    # told a longer interval (``Cluster.heartbeat_interval_s``), and judged by it
    max_heartbeats_per_s: float = 500.0


@dataclass(frozen=True)
class DrainProgress:
    """An operator drain as ``Cluster.request_drain`` sees it now."""

    is_known: bool                 # False: no such instance (nothing to drain)
    is_drained: bool
    num_running: int = 0
    num_waiting: int = 0
    health: str = ""


class Cluster:
    def __init__(self, settings: ClusterSettings, now_s: float) -> None:
        self.settings = settings
        self.records: dict[str, InstanceRecord] = {}
        self.mode = fallback.ModeState(mode=fallback.initial_mode(settings.fallback))
        self.started_s = now_s
        self.events: collections.deque[str] = collections.deque(maxlen=32)
        self.dirty: set[str] = set()       # instance ids to persist
        self.removed: set[str] = set()     # instance ids to delete from the store
        self.replacements: list[tuple[str, str]] = []  # (instance id, reason) to record
        self.num_failovers = 0
        self.num_role_switches = 0
        self.meta_dirty = False
        self._pending: dict[str, list[pb.Command]] = collections.defaultdict(list)  # by agent id
        self._command_ids = itertools.count(1)
        # instance id -> heartbeat time when its drain command was seen delivered
        # (None: queued, not yet delivered)
        self._drains: dict[str, float | None] = {}
        self._rebalance = RebalancePolicy(settings.rebalance)
        self.planner = Planner(settings.planner) if settings.planner is not None else None
        self.replicas: dict[str, int] = dict(settings.replicas)  # pool sizes the planner asks for
        self.decision: Decision | None = None
        self.last_action, self.last_action_unix_s, self.num_planner_actions = "", 0.0, 0
        self._planned_s = float("-inf")
        self._counters: dict[str, dict[str, float]] = {}  # instance id -> counters seen last
        self._view_key: tuple = ()
        self.view_version = 0
        self.peers_version = 0  # the peer list's (persisted in the meta, never reused)
        self._peer_list: pb.PeerList | None = None  # built once per version
        self._is_peer_left = False  # a listed decode engine left the list since the last version
        # the leader's own stalls, (monotonic end, seconds): heartbeats that came meanwhile
        # waited unread, so silence is judged net of them (``tick``'s ``stalled_s``)
        self._stalls: collections.deque[tuple[float, float]] = collections.deque()
        self.heartbeat_interval_s = settings.thresholds.interval_s  # what agents are told (``tick``)

    # --- inputs: agents -------------------------------------------------------
    def apply_heartbeat(self, agent_id: str, reports, now_s: float) -> list[pb.Command]:
        """Called by the gRPC Heartbeat handler (leader only). Returns the agent's commands."""
        now_unix_s = time.time()
        for rep in reports:
            rec = self.records.get(rep.instance_id)
            if rec is None:
                rec = self.records[rep.instance_id] = InstanceRecord(
                    rep.instance_id, pool=rep.pool or rep.role,
                    assigned_role=rep.pool or rep.role, health_since_s=now_s)
                self._drains.pop(rep.instance_id, None)  # a drain of an earlier one is done
                self.record_event(f"{rep.instance_id}: registered ({rec.pool} pool, agent {agent_id})")
            self._update_from_report(rec, agent_id, rep, now_s, now_unix_s)
            rec.interval_s = self.heartbeat_interval_s  # the reply tells its agent this
        commands = self._pending.pop(agent_id, [])
        return commands

    def _update_from_report(self, rec: InstanceRecord, agent_id: str, rep, now_s: float,
                            now_unix_s: float) -> None:
        before = rec.change_key()
        role, kv_endpoint, kv_compat_hash = rep.role, rep.kv_endpoint, rep.kv_compat_hash
        if role != rec.role or kv_endpoint != rec.kv_endpoint or kv_compat_hash != rec.kv_compat_hash:
            self._unlist(rec)  # listed again (``_update_peers``) at its new endpoint, if still a peer
        rec.peers_checked_version, rec.checks_peers = rep.peers_checked_version, rep.checks_peers
        rec.unreachable_peers = [[f.instance_id, f.kv_endpoint, f.reason] for f in rep.unreachable_peers]
        rec.agent_id, rec.role, rec.model = agent_id, role, rep.model
        rec.engine_address, rec.kv_endpoint = rep.engine_address, kv_endpoint
        rec.kv_transport, rec.kv_compat_hash = rep.kv_transport, kv_compat_hash
        rec.max_model_len = rep.max_model_len
        process_state, probe_ok = rep.process_state, rep.probe_ok
        rec.num_restarts, rec.process_state, rec.probe_ok = rep.num_restarts, process_state, probe_ok
        rec.load = load = _LOAD_ZEROS.copy()
        load.update([(f.name, v) for f, v in rep.load.ListFields()])
        rec.load_report = pb.InstanceLoad()
        rec.load_report.CopyFrom(rep.load)  # the view's copy: 2x cheaper than from the dict
        rec.last_heartbeat_s, rec.last_heartbeat_unix_s, rec.is_heard = now_s, now_unix_s, True
        is_kv_ready = bool(kv_endpoint) or rec.kv_transport == "none"
        new = health.health_from_report(rec.health, process_state, probe_ok, is_kv_ready)
        if new != rec.health:
            reason = f"process {process_state}, probe {'ok' if probe_ok else 'failing'}"
            if new == health.FAILED:
                reason = rep.last_error or reason
            self._set_health(rec, new, reason, now_s)
            if new == FAILED and process_state == "running":
                self._command(rec, "restart")  # hung engine: the agent kills and relaunches it
        if rec.command_sent_s is not None and role == self.target_role(rec):
            rec.command_sent_s = None
        if rec.change_key() != before:
            self.dirty.add(rec.instance_id)

    # --- inputs: the operator -------------------------------------------------
    def request_drain(self, instance_id: str, deadline_s: float) -> DrainProgress:
        """Called by the Drain RPC on each reconcile pass while the operator scales the
        instance down. The first call queues one ``drain`` command for its agent; the
        instance is drained once a heartbeat later than the one that delivered the
        command reports nothing running or waiting, or when it is FAILED."""
        rec = self.records.get(instance_id)
        if rec is None:
            return DrainProgress(is_known=False, is_drained=True)
        if instance_id not in self._drains:
            self._command(rec, "drain", deadline_s=deadline_s)
            self._drains[instance_id] = None
            self.record_event(f"{rec.instance_id}: drain requested by the operator")
        if self._is_drain_delivered(rec) and self._drains[instance_id] is None:
            self._drains[instance_id] = rec.last_heartbeat_s
        delivered_at = self._drains[instance_id]
        num_running, num_waiting = rec.load.get("num_running", 0), rec.load.get("num_waiting", 0)
        is_idle = (delivered_at is not None and rec.last_heartbeat_s > delivered_at
                   and num_running == 0 and num_waiting == 0)
        return DrainProgress(is_known=True, is_drained=is_idle or rec.health == FAILED,
                             num_running=num_running, num_waiting=num_waiting, health=rec.health)

    def _is_drain_delivered(self, rec: InstanceRecord) -> bool:
        """A drain was requested and its command has gone out to the agent."""
        pending = self._pending.get(rec.agent_id, [])
        return rec.instance_id in self._drains and not any(
            c.instance_id == rec.instance_id and c.kind == "drain" for c in pending)

    def clear_replacement(self, instance_id: str) -> None:
        """Called once the operator deleted the instance's Pod for recreation (its
        acknowledgement): the new Pod starts with a clean failure history."""
        rec = self.records.get(instance_id)
        if rec is not None:
            rec.replacement_requested, rec.failures = False, []
            self.dirty.add(rec.instance_id)

    def forget_all(self) -> None:
        """Called when the operator deletes the cluster: every record goes, and nothing
        is left to write or delete (``Controller.forget_cluster`` empties the store)."""
        self.records.clear()
        self._drains.clear()
        self.dirty.clear()
        self.removed.clear()
        self.replacements.clear()
        self.meta_dirty = False

    # --- the leader's periodic judgement ----------------------------------------
    def tick(self, now_s: float, stalled_s: float = 0.0) -> None:
        """Called by the Controller's commit loop every half interval (leader only):
        silence, then the mode, then role switches. ``stalled_s``: how late this tick
        came, the leader's own event loop held up (starved of CPU, a long pause); the
        heartbeats that arrived meanwhile wait unread behind the stall, so it does not
        count as their agents' silence (a late Controller is not a silent agent)."""
        if stalled_s > 0:
            self._stalls.append((now_s, stalled_s))
        self.heartbeat_interval_s = self._heartbeat_interval_s()
        self._judge_silence(now_s)
        self._evaluate_mode(now_s)
        if self.planner is None:
            self._rebalance_step(now_s)
        elif now_s - self._planned_s >= self.planner.settings.interval_s:
            self._plan_step(now_s)
            self._planned_s = now_s
        self._send_role_commands(now_s)

    def _heartbeat_interval_s(self) -> float:
        """The interval agents are told: the configured one, or longer where one
        heartbeat per agent per interval would pass ``max_heartbeats_per_s`` (each costs
        the leader about a millisecond of CPU, most of it gRPC's: a thousand agents a
        second took 88% of a core, and an exit's report waited in the queue). An engine's
        exit is still reported at once (its agent's wake-up); only silence is slower to judge."""
        num_agents = len({r.agent_id for r in self.records.values() if r.is_heard})
        return max(self.settings.thresholds.interval_s, num_agents / self.settings.max_heartbeats_per_s)

    def _judge_silence(self, now_s: float) -> None:
        """Missed heartbeats: SUSPECT, then FAILED; a FAILED instance silent for
        ``forget_after_s`` is forgotten (its agent is gone: NodeAgent or Pod loss)."""
        t = self.settings.thresholds
        # a new leader gives agents one failure window to find it before judging silence
        window_s = self.heartbeat_interval_s * t.failed_after_missed
        is_grace = now_s - self.started_s < window_s
        stalls = self._stalls
        while stalls and now_s - stalls[0][0] > 2 * window_s:
            stalls.popleft()
        for rec in list(self.records.values()):
            silent_s = now_s - rec.last_heartbeat_s
            if stalls:
                silent_s -= sum(length for end_s, length in stalls if end_s > rec.last_heartbeat_s)
            # judged by the interval its agent was told (a record loaded by a new leader: the configured one)
            missed = 0.0 if is_grace else max(0.0, silent_s) / max(t.interval_s, rec.interval_s)
            if self._is_drain_delivered(rec) and missed >= t.suspect_after_missed:
                # drained on request (scale-down), then stopped: it left, it did not fail
                self._forget(rec.instance_id, "stopped after its drain")
                continue
            new = health.health_from_silence(rec.health, missed, t)
            self._set_health(rec, new, f"missed {int(missed)} heartbeats", now_s)
            if rec.health == FAILED and now_s - rec.last_heartbeat_s >= self.settings.forget_after_s:
                self._forget(rec.instance_id, f"silent for {self.settings.forget_after_s:g}s")

    def _forget(self, instance_id: str, why: str) -> None:
        self._unlist(self.records[instance_id])
        del self.records[instance_id]
        self._drains.pop(instance_id, None)
        self._counters.pop(instance_id, None)
        self.removed.add(instance_id)
        self.record_event(f"{instance_id}: forgotten ({why})")

    def _evaluate_mode(self, now_s: float) -> None:
        """PD <-> FALLBACK (hybrid fallback) from the alive instances of each pool."""
        alive = collections.Counter(r.assigned_role for r in self.records.values()
                                    if r.health in health.ALIVE)
        was_complete = self.mode.has_been_complete
        event = fallback.evaluate(self.mode, alive, now_s, self.started_s, self.settings.fallback)
        self.meta_dirty |= was_complete != self.mode.has_been_complete
        if event:
            self.meta_dirty = True
            self.record_event(event, logging.WARNING)

    # --- decisions ------------------------------------------------------------
    def target_role(self, rec: InstanceRecord) -> str:
        return fallback.target_role(self.mode, rec.assigned_role, self.settings.fallback)

    def _rebalance_step(self, now_s: float) -> None:
        if self.mode.mode != fallback.PD or any(r.command_sent_s for r in self.records.values()):
            return
        members = [PoolMember(r.instance_id, r.assigned_role, r.load.get("num_running", 0),
                              r.load.get("num_waiting", 0), r.load.get("num_kv_blocks_used", 0),
                              r.load.get("num_kv_blocks_free", 0))
                   for r in self.records.values() if r.health == READY and r.is_heard]
        move = self._rebalance.decide(members, now_s)
        if move:
            self.records[move.instance_id].assigned_role = move.to_role
            self.dirty.add(move.instance_id)
            self.record_event(f"{move.instance_id}: role switch {move.from_role} -> {move.to_role} "
                              f"({move.reason})", logging.WARNING)

    def _plan_step(self, now_s: float) -> None:
        """The SLO planner's tick: what the engines did since the last one, then its
        decision; a switch changes the engine's assigned role (``_send_role_commands``
        switches it in place), a scale changes the pool size the actuators follow."""
        if not self.mode.has_been_complete:
            return  # still starting: not idle, not measurable
        self.planner.observe(self._observe(now_s, now_s - self._planned_s))
        if self.mode.mode != fallback.PD or any(r.command_sent_s for r in self.records.values()):
            return  # fallback, or a switch under way: its effect is not measurable yet
        self.decision = d = self.planner.decide(self._planner_engines(), now_s)
        if d.action is None:
            return
        self.num_planner_actions += 1
        self.last_action, self.last_action_unix_s = planner.describe(d.action), time.time()
        if d.action.kind == "switch":
            rec = self.records[d.action.instance_id]
            before, rec.assigned_role = rec.assigned_role, d.action.role
            self.dirty.add(rec.instance_id)
            self.record_event(f"{rec.instance_id}: role switch {before} -> {rec.assigned_role} "
                              f"(planner: {d.reason})", logging.WARNING)
        else:  # +1: a new engine of the role's pool; -1: the pool of the engine that leaves
            pool = self.records[d.action.instance_id].pool if d.action.delta < 0 else d.action.role
            self.replicas[pool] = max(0, self.replicas.get(pool, 0) + d.action.delta)
            self.meta_dirty = True
            self.record_event(f"planner: {self.last_action}: {pool} pool to {self.replicas[pool]} "
                              f"({d.reason})", logging.WARNING)

    def _observe(self, now_s: float, span_s: float) -> Observation:
        """The engines' counters since the last tick, summed. An engine seen for the first
        time, or whose counters went back (a restart), sets its baseline only. KV
        transfers count on P's side (D counts the same transfer too)."""
        sums = dict.fromkeys(COUNTER_OF, 0.0)
        seen = {}
        for rec in self.records.values():
            if not rec.is_heard or rec.health == FAILED:
                continue
            now = seen[rec.instance_id] = {k: rec.load.get(k, 0) for k in COUNTER_OF.values()}
            last = self._counters.get(rec.instance_id)
            if last is None or any(now[k] < last[k] for k in now):
                continue
            for field, counter in COUNTER_OF.items():
                if field in ("num_kv", "kv_s") and rec.role == "decode":
                    continue
                sums[field] += now[counter] - last[counter]
        self._counters = seen
        return Observation(now_s, span_s=span_s if span_s < float("inf") else 0.0, **sums)

    def _planner_engines(self) -> list[planner.Engine]:
        """Prefill and decode engines as the planner counts them: one switching role
        counts in its new role (starting), one draining in none; a pool the planner grew
        and whose new engines have not reported yet has them pending."""
        engines, alive = [], collections.Counter()
        for r in self.records.values():
            if r.assigned_role not in (planner.PREFILL, planner.DECODE) or r.health == FAILED:
                continue
            alive[r.pool] += 1
            if r.health == health.DRAINING or r.instance_id in self._drains:  # leaving
                state = planner.DRAINING
            elif r.health == READY and r.role == self.target_role(r):
                state = planner.READY
            else:
                state = planner.STARTING
            used = r.load.get("num_kv_blocks_used", 0)
            engines.append(planner.Engine(r.instance_id, r.assigned_role, state,
                                          r.load.get("num_running", 0), r.load.get("num_waiting", 0),
                                          kv_blocks_used=used,
                                          kv_blocks_total=used + r.load.get("num_kv_blocks_free", 0),
                                          waiting_prompt_tokens=r.load.get("num_waiting_prompt_tokens", 0),
                                          kv_blocks_committed=r.load.get("num_kv_blocks_committed", 0)))
        for pool in (planner.PREFILL, planner.DECODE):
            engines += [planner.Engine(f"{pool}-pending-{i}", pool, planner.PENDING)
                        for i in range(self.replicas.get(pool, 0) - alive[pool])]
            # asked away but not drained yet: the actuators remove a pool's highest ordinals,
            # so only the highest one staying may leave next, and never a pool's last
            members = sorted((r for r in self.records.values() if r.pool == pool and r.health != FAILED
                              and r.assigned_role in (planner.PREFILL, planner.DECODE)), key=_ordinal)
            staying = max(self.replicas.get(pool, 0), 0)
            leaving = {r.instance_id for r in members[staying:]}
            next_out = members[staying - 1].instance_id if 1 < staying <= len(members) else None
            in_pool = {r.instance_id for r in members}
            engines = [dataclasses.replace(e, state=planner.DRAINING) if e.instance_id in leaving
                       else dataclasses.replace(e, can_leave=e.instance_id == next_out)
                       if e.instance_id in in_pool else e
                       for e in engines]
        return engines

    def planner_view(self) -> pb.PlannerView | None:
        if self.planner is None:
            return None
        s, d = self.planner.settings, self.decision
        m = d.model if d is not None else None
        return pb.PlannerView(
            advisory=s.advisory, reason=d.reason if d else "no decision yet",
            is_balanced=d is not None and d.wanted == d.have,
            wanted_prefill=d.wanted[planner.PREFILL] if d else 0,
            wanted_decode=d.wanted[planner.DECODE] if d else 0,
            replicas_prefill=self.replicas.get(planner.PREFILL, 0),
            replicas_decode=self.replicas.get(planner.DECODE, 0),
            last_action=self.last_action, last_action_unix_s=self.last_action_unix_s,
            num_actions=self.num_planner_actions,
            request_rate=m.rate if m else 0.0, measured_ttft_s=m.measured_ttft_s if m else 0.0,
            measured_tpot_s=m.measured_tpot_s if m else 0.0, prefill_tokens_per_s=m.prefill_tok_s if m else 0.0,
            ttft_target_s=s.ttft_ms / 1e3, tpot_target_s=s.tpot_ms / 1e3)

    def _send_role_commands(self, now_s: float) -> None:
        for rec in self.records.values():
            target = self.target_role(rec)
            # a record loaded by a new leader may predate the last switch: act on reports only
            if not rec.is_heard or rec.health != READY or not rec.role or rec.role == target:
                continue
            if rec.command_sent_s is not None and now_s - rec.command_sent_s < self.settings.command_timeout_s:
                continue
            rec.command_sent_s = now_s
            self.num_role_switches += 1
            self._command(rec, "switch_role", role=target, deadline_s=self.settings.drain_deadline_s)
            self.record_event(f"{rec.instance_id}: switch role {rec.role} -> {target} (in place: the legs in flight finish in the old role)")

    def _command(self, rec: InstanceRecord, kind: str, **fields) -> None:
        """Queue a command for ``rec``'s agent; its next heartbeat reply carries it."""
        cmd = pb.Command(command_id=f"c{next(self._command_ids)}", instance_id=rec.instance_id,
                         kind=kind, **fields)
        self._pending[rec.agent_id].append(cmd)

    def _set_health(self, rec: InstanceRecord, new: str, reason: str, now_s: float) -> None:
        event = health.set_health(rec, new, reason, now_s)
        if not event:
            return
        self.dirty.add(rec.instance_id)
        self.record_event(event, logging.WARNING if new == FAILED else logging.INFO)
        if new == FAILED:
            self._on_failed(rec, reason)

    def _on_failed(self, rec: InstanceRecord, reason: str) -> None:
        """A transition into FAILED (it left the view already): count the failover, and
        after ``replace_after_failures`` within ``replace_window_s`` ask the operator to
        recreate the instance's Pod (``replacements``, written by the persister)."""
        self.num_failovers += 1
        n = health.count_recent_failures(rec, self.settings.replace_window_s, time.time())
        if n >= self.settings.replace_after_failures and not rec.replacement_requested:
            rec.replacement_requested = True
            why = f"{n} failures within {self.settings.replace_window_s:g}s; last: {reason}"
            self.replacements.append((rec.instance_id, why))
            self.record_event(f"{rec.instance_id}: replacement requested ({why})", logging.WARNING)

    def record_event(self, line: str, level: int = logging.INFO) -> None:
        """Log ``line`` and keep it for the view's ``recent_events``."""
        log.log(level, "%s", line)
        self.events.append(f"{time.strftime('%H:%M:%S')} {line}")

    # --- pair checks: the peer list --------------------------------------------
    def _unlist(self, rec: InstanceRecord) -> None:
        """``rec`` leaves the peer list (it left, failed, or changed role or endpoint):
        if it comes back it is listed at a new version, which no agent has checked."""
        if rec.peers_listed_version:
            rec.peers_listed_version = 0
            self._is_peer_left = True
            self.dirty.add(rec.instance_id)

    def _update_peers(self) -> None:
        """The decode engines the prefill engines' agents probe: each one not FAILED with a
        KV endpoint (STARTING ones too, so their pairs are checked by the time they are
        READY). A new one is listed at a new version; one that left bumps it too."""
        new = []
        for rec in self.records.values():
            if rec.role == "decode" and rec.kv_endpoint and rec.health != FAILED:
                if not rec.peers_listed_version:
                    new.append(rec)
            else:
                self._unlist(rec)
        if new or self._is_peer_left:
            self.peers_version += 1
            self.meta_dirty, self._is_peer_left, self._peer_list = True, False, None
            for rec in new:
                rec.peers_listed_version = self.peers_version
                self.dirty.add(rec.instance_id)

    def peer_list(self) -> pb.PeerList:
        """The peer list now: what an agent holding another version is sent
        (``Controller.heartbeat``, once the list is written to the store)."""
        self._update_peers()
        if self._peer_list is None or self._peer_list.version != self.peers_version:
            self._peer_list = pb.PeerList(version=self.peers_version, decode=[
                pb.Peer(instance_id=r.instance_id, kv_endpoint=r.kv_endpoint, kv_compat_hash=r.kv_compat_hash)
                for r in sorted(self.records.values(), key=lambda r: r.instance_id) if r.peers_listed_version])
        return self._peer_list

    # --- outputs --------------------------------------------------------------
    def view(self, leader: str) -> pb.ClusterView:
        """The routable view (READY only); ``version`` bumps when its content changes.
        With it the pair checks: each instance's peer versions, and the pairs between
        routable instances whose prefill agent reported the decode engine unreachable at
        its current KV endpoint (exceptions only: the view stays O(instances)). Published
        only while every routable prefill engine's agent runs peer checks (an agent from
        before them, mid rolling upgrade, would leave its engine's pairs unchecked)."""
        self._update_peers()
        routable = sorted((r for r in self.records.values() if r.health == READY),
                          key=lambda r: r.instance_id)
        decode_at = {r.instance_id: r.kv_endpoint for r in routable if r.role == "decode"}
        unusable = tuple((r.instance_id, d_id, why) for r in routable if r.role == "prefill"
                         for d_id, endpoint, why in r.unreachable_peers if decode_at.get(d_id) == endpoint)
        publishes = all(r.checks_peers for r in routable if r.role == "prefill")
        key = (self.mode.mode, self.mode.reason, leader, publishes, tuple(sorted(self.replicas.items())), tuple(
            (r.instance_id, r.role, r.engine_address, r.kv_endpoint, r.kv_compat_hash,
             r.peers_checked_version, r.peers_listed_version) for r in routable), unusable)
        if key != self._view_key:
            self._view_key, self.view_version = key, self.view_version + 1
        return pb.ClusterView(
            version=self.view_version, mode=self.mode.mode, fallback_reason=self.mode.reason,
            leader=leader, recent_events=list(self.events)[-10:], planner=self.planner_view(),
            instances=[pb.InstanceView(
                instance_id=r.instance_id, role=r.role, health=r.health,
                engine_address=r.engine_address, kv_endpoint=r.kv_endpoint,
                kv_transport=r.kv_transport, kv_compat_hash=r.kv_compat_hash, model=r.model,
                load=r.load_report if r.load_report is not None else pb.InstanceLoad(**r.load),
                last_heartbeat_unix_s=r.last_heartbeat_unix_s,
                max_model_len=r.max_model_len, peers_checked_version=r.peers_checked_version,
                peers_listed_version=r.peers_listed_version)
                for r in routable],
            publishes_pairs=publishes, unusable_pairs=[
                pb.UnusablePair(prefill_id=p_id, decode_id=d_id, reason=why) for p_id, d_id, why in unusable])
