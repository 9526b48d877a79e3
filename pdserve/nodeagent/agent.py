"""The NodeAgent: supervises its instances' engines, probes them, heartbeats to the
Controller and executes its commands.

Owns one ``SupervisedEngine`` per instance (its ``EngineProcess`` and probe
state), the Controller channel, and the command tasks. Simulated instances that share
one ``EmbeddedLaunch`` share one process (``pdserve engine --roles``, in their order:
``SupervisedEngine.index``); a restart or a relaunch of one of them is one of all.
Loops: one supervisor per engine process, one probe loop per engine, one heartbeat
loop (every interval, and at once when an engine's process state changes, so a death
is reported without waiting), and the peer checks (``peers.py``: its prefill engines
probe the decode peers the Controller lists; the verdicts ride the heartbeats).

Commands: ``drain`` (stop admitting), ``switch_role`` (SetRole at once: the legs in
flight finish in their old role; an engine that switches only when idle is drained,
switched once idle or at the deadline, and resumed; one that cannot switch in place
is relaunched with the new role), ``restart`` (kill; relaunch without backoff).

Invariants: ``probe_ok`` is False until a probe succeeded since the last launch
and after two failed probes in a row; a Controller that answers
FAILED_PRECONDITION (standby) or is unreachable makes the agent try the next
address; at most one command runs per instance at a time.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from dataclasses import dataclass, field

import grpc

from pdserve.api.proto import LOAD_COUNTERS
from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.nodeagent.launch import EmbeddedLaunch, ProbeFailed, Prober, VllmLaunch
from pdserve.nodeagent.peers import PeerChecks
from pdserve.nodeagent.process import Backoff, EngineProcess
from pdserve.runtime.aio import wait_event
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.security import SecuritySettings, create_channel

log = logging.getLogger(__name__)


@dataclass
class SupervisedEngine:
    """One instance as its agent sees it: the engine process, the last probe, the
    load to report. Built by the CLI; read by the loops, the HTTP probes and metrics."""

    instance_id: str
    pool: str
    role: str
    argv: list[str]                    # the embedded engine's (unless ``launch`` says otherwise)
    cpus: tuple[int, ...] = ()         # cores the engine is pinned to; () = not pinned
    launch: EmbeddedLaunch | VllmLaunch | None = None  # None: EmbeddedLaunch(argv); shared: one process
    process: EngineProcess | None = None
    index: int = 0                     # which engine of its process it is
    health: object | None = None       # last engine HealthResponse
    load: pb.InstanceLoad = field(default_factory=pb.InstanceLoad)
    num_probe_ok: int = 0              # successes since the last launch
    num_probe_failed: int = 0          # consecutive failures
    is_busy: bool = False              # a command is running
    last_error: str = ""
    _totals: tuple[float, int, int] | None = None

    @property
    def address(self) -> str:
        """The engine's address once its process printed it, else ""."""
        addresses = self.process.addresses
        return addresses[self.index] if self.index < len(addresses) else ""

    @property
    def probe_ok(self) -> bool:
        return self.num_probe_ok > 0 and self.num_probe_failed < 2

    @property
    def is_ready(self) -> bool:
        h = self.health
        return self.probe_ok and h is not None and (bool(h.kv_endpoint) or h.kv_transport == "none")

    def report(self) -> pb.InstanceReport:
        p, h = self.process, self.health
        state = "draining" if self.is_busy and p.state == "running" else p.state
        return pb.InstanceReport(
            instance_id=self.instance_id, role=self.role, process_state=state,
            engine_address=self.address, kv_endpoint=h.kv_endpoint if h else "",
            kv_transport=h.kv_transport if h else "", kv_compat_hash=h.kv_compat_hash if h else "",
            model=h.model if h else "", load=self.load, num_restarts=p.num_restarts,
            probe_ok=self.probe_ok, last_error=self.last_error or p.last_exit, pool=self.pool,
            max_model_len=h.max_model_len if h else 0)


@dataclass(frozen=True)
class AgentSettings:
    agent_id: str = socket.gethostname()
    controllers: tuple[str, ...] = ("127.0.0.1:50050",)
    interval_s: float = 1.0
    probe_timeout_s: float = 1.0
    probe_concurrency: int = 32          # engines probed at once, at most
    probe_max_rate: float = 100.0        # engine probes per second, at most (each engine's
                                         # interval stretches past it: 1,000 engines, every 10 s)
    backoff: Backoff = Backoff()
    echo_engine_output: bool = True
    peer_probe_interval_s: float = 30.0  # a usable (prefill, decode peer) pair probed again
    peer_probe_retry_s: float = 2.0      # a pair whose probe failed probed again
    peer_probe_timeout_s: float = 3.0
    peer_probe_concurrency: int = 8
    peer_probe_max_rate: float = 10.0    # re-probes of usable pairs per second, at most


@dataclass
class HeartbeatStats:
    """What the agent's heartbeats took (``/metrics``): each accepted one's round trip,
    and for each engine exit the time from the agent seeing it to the Controller
    accepting the heartbeat that carried it (what a failover waits for here)."""

    num_ok: int = 0
    seconds_total: float = 0.0
    num_exit_reports: int = 0
    exit_report_seconds_total: float = 0.0
    exit_report_seconds_max: float = 0.0


class Agent:
    def __init__(self, settings: AgentSettings, instances: list[SupervisedEngine],
                 security: SecuritySettings) -> None:
        self.settings, self.security = settings, security
        self.instances = {i.instance_id: i for i in instances}
        self._wake = asyncio.Event()
        self.interval_s = settings.interval_s  # between heartbeats: the Controller's replies set it
        self._probe_limit = asyncio.Semaphore(settings.probe_concurrency)
        self._controller_index = 0
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ControllerStub | None = None
        self._tasks: list[asyncio.Task] = []
        self.num_heartbeats_failed = 0
        self.last_heartbeat_ok_s: float | None = None
        self.stats = HeartbeatStats()
        self._exits_seen_s: list[float] = []  # monotonic: exits no accepted heartbeat carried yet
        self._exits_noted: dict[str, int] = {}  # process name -> its restarts when its exit was noted
        self.processes: list[EngineProcess] = []
        self.peer_checks = PeerChecks(self._peer_prober, self._wake.set, settings.peer_probe_interval_s,
                                      settings.peer_probe_retry_s, settings.peer_probe_timeout_s,
                                      settings.peer_probe_concurrency, settings.peer_probe_max_rate)
        self._peer_probers: dict[str, tuple[str, Prober]] = {}  # instance id -> (address, prober)
        for inst in instances:
            if inst.launch is None:
                inst.launch = EmbeddedLaunch(inst.argv)
        for members in _by_launch(instances):
            first = members[0]
            name = first.instance_id + (f"..{members[-1].instance_id}" if len(members) > 1 else "")
            process = EngineProcess(name, _command(members), settings.backoff, self._on_process_change,
                                    echo=settings.echo_engine_output,
                                    cpus=tuple(sorted({c for i in members for c in i.cpus})),
                                    serving_address=first.launch.serving_address, num_engines=len(members))
            self.processes.append(process)
            for index, inst in enumerate(members):
                inst.process, inst.index = process, index

    def _on_process_change(self) -> None:
        for inst in self.instances.values():
            if inst.process.state != "running":
                inst.num_probe_ok, inst.health = 0, None
            if inst.process.state == "exited":
                inst.last_error = ""  # report why it died (``process.last_exit``), not the last probe
        for process in self.processes:  # each exit once (a process's restarts count them)
            if process.state == "exited" and self._exits_noted.get(process.instance_id) != process.num_restarts:
                self._exits_noted[process.instance_id] = process.num_restarts
                self._exits_seen_s.append(time.monotonic())
        self._wake.set()

    async def start(self) -> None:
        """Called by the CLI: launch every engine and start the loops."""
        self._tasks += [asyncio.create_task(p.supervise()) for p in self.processes]
        self._tasks += [asyncio.create_task(self._probe_loop(i)) for i in self.instances.values()]
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
        self._tasks.append(asyncio.create_task(self.peer_checks.run(lambda: list(self.instances.values()))))

    async def stop(self) -> None:
        """Called on SIGTERM: stop the loops, then every engine (reaped)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(p.stop() for p in self.processes))
        await asyncio.gather(*(prober.close() for _, prober in self._peer_probers.values()),
                             return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()

    # --- probes ---------------------------------------------------------------
    async def _probe_loop(self, inst: SupervisedEngine) -> None:
        """Health and stats every interval, at most ``probe_concurrency`` engines at once:
        an agent of a thousand engines on a busy host had a thousand probes in flight, its
        event loop's every turn ran them all, and its heartbeats waited behind them (and
        the probes' own timeouts ran out in the queue, failing engines that were fine).
        Bounded, a turn is short and a probe's timeout starts when it is sent; each
        engine's probes come less often while the agent cannot keep up. The loops start
        spread over an interval, and each engine's interval stretches so the agent sends
        at most ``probe_max_rate`` probes a second (``probe_interval_s``)."""
        prober, address = None, ""
        delay_s = random.uniform(0, self.probe_interval_s)  # the first spread, not all at once
        while True:
            await asyncio.sleep(delay_s)
            delay_s = self.probe_interval_s
            if inst.process.state != "running" or not inst.address:
                continue
            if prober is None or address != inst.address:
                if prober is not None:
                    await prober.close()
                prober, address = inst.launch.prober(inst.address, self.security), inst.address
            try:
                async with self._probe_limit:
                    inst.health = await prober.health(self.settings.probe_timeout_s)
                    stats = await prober.stats(self.settings.probe_timeout_s)
            except ProbeFailed as exc:
                inst.num_probe_failed += 1
                inst.last_error = f"probe failed: {exc}"
                if inst.num_probe_failed == 2:
                    self._wake.set()
                continue
            was_ok = inst.probe_ok
            inst.num_probe_ok += 1
            inst.num_probe_failed, inst.last_error = 0, ""
            inst.role = inst.health.role or inst.role
            inst.load = self._load(inst, stats)
            if not was_ok:
                self._wake.set()

    @property
    def probe_interval_s(self) -> float:
        """Seconds between two probes of one engine: the heartbeat interval, or longer
        where probing every engine each interval would pass ``probe_max_rate`` (an agent
        of a thousand simulated engines: their answers took most of two cores at rest).
        An engine's exit is seen at once either way (its process is this agent's child);
        a hung engine is failed after two probes."""
        return max(self.settings.interval_s, len(self.instances) / self.settings.probe_max_rate)

    def _peer_prober(self, inst: SupervisedEngine) -> Prober | None:
        """The prober the peer checks ask ``inst`` through, while it serves (one per
        address, kept apart from the probe loop's so a slow peer probe delays no health read)."""
        if inst.process.state != "running" or not inst.address or not inst.probe_ok:
            return None
        address, prober = self._peer_probers.get(inst.instance_id, ("", None))
        if address != inst.address:
            if prober is not None:
                self._tasks.append(asyncio.create_task(prober.close()))
            prober = inst.launch.prober(inst.address, self.security)
            self._peer_probers[inst.instance_id] = (inst.address, prober)
        return prober

    @staticmethod
    def _load(inst: SupervisedEngine, s) -> pb.InstanceLoad:
        now = time.monotonic()
        prompt_rate = gen_rate = 0.0
        if inst._totals is not None and now > inst._totals[0]:
            dt = now - inst._totals[0]
            prompt_rate = max(0, s.num_prompt_tokens_total - inst._totals[1]) / dt
            gen_rate = max(0, s.num_generation_tokens_total - inst._totals[2]) / dt
        inst._totals = (now, s.num_prompt_tokens_total, s.num_generation_tokens_total)
        return pb.InstanceLoad(
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_kv_blocks_used=s.num_kv_blocks_used, num_kv_blocks_free=s.num_kv_blocks_free,
            prompt_tokens_per_s=prompt_rate, generation_tokens_per_s=gen_rate,
            prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
            prefix_cache_query_tokens=s.prefix_cache_query_tokens,
            **{name: getattr(s, name) for name in LOAD_COUNTERS})

    # --- heartbeats -------------------------------------------------------------
    def _connect(self) -> pb_grpc.ControllerStub:
        if self._stub is None:
            address = self.settings.controllers[self._controller_index]
            self._channel = create_channel(address, self.security)
            self._stub = pb_grpc.ControllerStub(self._channel)
        return self._stub

    async def _next_controller(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
        self._controller_index = (self._controller_index + 1) % len(self.settings.controllers)

    async def _heartbeat_loop(self) -> None:
        """A heartbeat every ``interval_s`` from the last one's start (the time its answer
        took is not added: an agent of a thousand engines on a busy host waited a second
        for it, so its heartbeats came every two seconds and every instance turned
        SUSPECT together), and one at once on a wake-up (a command done, a peer list
        checked), at most one per quarter interval: each prefill engine's checks wake it
        as they finish, so one agent of many engines sends a burst as one."""
        while True:
            self._wake.clear()
            sent_s = time.monotonic()
            await self.heartbeat_once()
            await wait_event(self._wake, self.interval_s - (time.monotonic() - sent_s))
            if (gap_s := self.interval_s / 4 - (time.monotonic() - sent_s)) > 0:
                await asyncio.sleep(gap_s)

    async def heartbeat_once(self) -> None:
        """One heartbeat; on a standby or an unreachable replica, the next address at once."""
        built_s = time.monotonic()
        request = pb.HeartbeatRequest(
            agent_id=self.settings.agent_id, node=socket.gethostname(),
            instances=[i.report() for i in self.instances.values()],
            peers_version=self.peer_checks.peers.version)
        for report in request.instances:
            self.peer_checks.fill(report)
        for _ in self.settings.controllers:
            try:
                reply = await self._connect().Heartbeat(
                    request, timeout=max(1.0, 2 * self.settings.interval_s),
                    metadata=self.security.metadata())
                break
            except grpc.aio.AioRpcError as exc:
                self.num_heartbeats_failed += 1
                is_standby = exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                log.log(logging.INFO if is_standby else logging.WARNING, "heartbeat to %s failed: %s %s",
                        self.settings.controllers[self._controller_index], exc.code().name, exc.details())
                await self._next_controller()
        else:
            return
        self.last_heartbeat_ok_s = now_s = time.monotonic()
        self.stats.num_ok += 1
        self.stats.seconds_total += now_s - built_s
        carried = [t for t in self._exits_seen_s if t <= built_s]
        if carried:
            self._exits_seen_s = [t for t in self._exits_seen_s if t > built_s]
            self.stats.num_exit_reports += len(carried)
            self.stats.exit_report_seconds_total += sum(now_s - t for t in carried)
            self.stats.exit_report_seconds_max = max(self.stats.exit_report_seconds_max, now_s - min(carried))
        if reply.heartbeat_interval_s > 0:  # the leader's, longer with many agents; it judges silence by it
            self.interval_s = reply.heartbeat_interval_s
        if reply.HasField("peers"):
            self.peer_checks.update(reply.peers)
        for cmd in reply.commands:
            inst = self.instances.get(cmd.instance_id)
            if inst is None or inst.is_busy:
                continue
            inst.is_busy = True
            self._tasks.append(asyncio.create_task(self._execute(inst, cmd)))

    # --- commands ---------------------------------------------------------------
    async def _execute(self, inst: SupervisedEngine, cmd: pb.Command) -> None:
        log.info("%s: command %s %s", inst.instance_id, cmd.kind, cmd.role)
        try:
            if cmd.kind == "restart":
                inst.process.kill()
            elif not inst.launch.has_control:
                self._without_control(inst, cmd)
            elif inst.address:
                async with EngineClient(inst.address, self.security) as client:
                    if cmd.kind == "drain":
                        await client.drain()
                    elif cmd.kind == "switch_role":
                        await self._switch_role(inst, client, cmd.role, cmd.deadline_s or 30.0)
        except grpc.aio.AioRpcError as exc:
            inst.last_error = f"{cmd.kind} failed: {exc.code().name} {exc.details()}"
            log.warning("%s: %s", inst.instance_id, inst.last_error)
        finally:
            inst.is_busy = False
            self._wake.set()

    def _without_control(self, inst: SupervisedEngine, cmd: pb.Command) -> None:
        """An engine with no drain or role RPCs (vLLM): a role switch is a new address
        where the engine takes the role as it runs (``address_in_role``), else a relaunch
        in the new role; a drain only stops its routing (the Controller's view does)."""
        if cmd.kind != "switch_role":
            return
        inst.role = cmd.role
        address = inst.launch.address_in_role(cmd.role) if inst.address else None
        if address is None:
            log.info("%s: relaunching as %s (the engine cannot switch in place)", inst.instance_id, cmd.role)
            inst.process.kill()
            return
        inst.process.addresses = [address]  # the next probe reads the engine at it
        log.info("%s: now %s", inst.instance_id, cmd.role)

    async def _switch_role(self, inst: SupervisedEngine, client: EngineClient, role: str, deadline_s: float) -> None:
        """In place at once (the legs in flight finish in their role, ``LLMEngine.set_role``);
        an engine that switches only when idle (FAILED_PRECONDITION) is drained first and
        switched once idle or at the deadline; one that cannot switch is relaunched."""
        try:
            await client.set_role(role)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                return self._relaunch_or_raise(inst, role, exc)
            await self._drain_and_switch(inst, client, role, deadline_s)
        inst.role = role
        inst.health = await client.health(self.settings.probe_timeout_s)
        log.info("%s: now %s", inst.instance_id, role)

    async def _drain_and_switch(self, inst: SupervisedEngine, client: EngineClient, role: str,
                                deadline_s: float) -> None:
        self._wake.set()  # report "draining" now: the Controller takes it out of the view
        await client.drain()
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                await client.set_role(role)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                    await client.drain(resume=True)
                    raise
            await asyncio.sleep(0.05)
        await client.drain(resume=True)

    def _relaunch_or_raise(self, inst: SupervisedEngine, role: str, exc: grpc.aio.AioRpcError) -> None:
        if exc.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT):
            raise exc
        log.warning("%s: engine cannot switch in place (%s); relaunching as %s",
                    inst.instance_id, exc.details(), role)
        inst.role = role
        inst.process.kill()


def _command(members: list[SupervisedEngine]):
    """What launching the members' shared process runs: one engine in its role, or one
    simulated engine per member, in each one's role (a switch may have changed it)."""
    launch = members[0].launch
    if len(members) == 1:
        return lambda: launch.command(members[0].role)
    return lambda: launch.shared_command([i.role for i in members])


def _by_launch(instances: list[SupervisedEngine]) -> list[list[SupervisedEngine]]:
    """The instances grouped by the process they share (their launch), in order."""
    groups: dict[int, list[SupervisedEngine]] = {}
    for inst in instances:
        groups.setdefault(id(inst.launch), []).append(inst)
    return list(groups.values())
