"""The agent's peer checks, step by step: its prefill engine probes the decode peers
the Controller lists (compatible ones only, each new one once), and the heartbeat
reports which list it has checked and which peers it cannot reach."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import engine_pb2 as epb
from pdserve.nodeagent.launch import ProbeFailed
from pdserve.nodeagent.peers import PeerChecks


@dataclass
class Engine:
    instance_id: str
    role: str = "prefill"
    address: str = "10.0.0.1:1"
    health: epb.HealthResponse = field(default_factory=lambda: epb.HealthResponse(kv_compat_hash="h"))


class FakeProber:
    def __init__(self) -> None:
        self.asked: list[str] = []
        self.refused: set[str] = set()
        self.is_down = False

    async def probe_peer(self, endpoint: str, timeout_s: float) -> epb.ProbePeerResponse:
        self.asked.append(endpoint)
        if self.is_down:
            raise ProbeFailed("UNAVAILABLE")
        if endpoint in self.refused:
            return epb.ProbePeerResponse(ok=False, reason=f"cannot reach {endpoint}: connection refused")
        return epb.ProbePeerResponse(ok=True, handshake_s=0.001)


def peers(version: int, *ids: str, compat: str = "h") -> pb.PeerList:
    return pb.PeerList(version=version, decode=[
        pb.Peer(instance_id=i, kv_endpoint=f"{i}:7000", kv_compat_hash="other" if i.startswith("x") else compat)
        for i in ids])


def reported(checks: PeerChecks, engine: Engine) -> tuple[int, list[str]]:
    rep = pb.InstanceReport(instance_id=engine.instance_id, role=engine.role, engine_address=engine.address)
    checks.fill(rep)
    return rep.peers_checked_version, [f"{f.instance_id}: {f.reason}" for f in rep.unreachable_peers]


def test_a_prefill_engine_probes_each_listed_peer_once_and_reports_the_list_it_checked():
    async def go():
        prober, wakes = FakeProber(), []
        checks = PeerChecks(lambda inst: prober if inst.address else None, lambda: wakes.append(1))
        p0, d9 = Engine("p0"), Engine("d9", role="decode")
        prober.refused.add("d1:7000")
        checks.update(peers(1, "d0", "d1", "x0"))  # x0: another model, never paired, never probed
        await checks.check_once([p0, d9])
        assert sorted(prober.asked) == ["d0:7000", "d1:7000"] and wakes
        assert reported(checks, p0) == (1, ["d1: cannot reach d1:7000: connection refused"])
        assert reported(checks, d9) == (0, [])  # a decode engine probes nobody

        prober.asked.clear()
        checks.update(peers(2, "d0", "d1", "d2", "x0"))
        await checks.check_once([p0, d9])
        assert prober.asked == ["d2:7000"]  # the new peer only; d1 is not due before retry_s
        assert reported(checks, p0)[0] == 2

        prober.asked.clear()
        checks.update(peers(3, "d0", "d2"))  # d1 left the list: forgotten, not reported
        await checks.check_once([p0, d9])
        assert prober.asked == [] and reported(checks, p0) == (3, [])

        p0.address = "10.0.0.1:2"  # the engine was relaunched: nothing it checked counts
        assert reported(checks, p0) == (0, [])
        prober.is_down = True
        await checks.check_once([p0, d9])
        assert sorted(prober.asked) == ["d0:7000", "d2:7000"]
        version, unreachable = reported(checks, p0)
        assert version == 3 and len(unreachable) == 2 and "did not answer" in unreachable[0]

    asyncio.run(go())


def test_a_list_with_a_peer_not_probed_yet_is_not_reported_as_checked():
    async def go():
        prober = FakeProber()
        started = asyncio.Event()
        release = asyncio.Event()

        async def slow(endpoint: str, timeout_s: float):
            started.set()
            await release.wait()
            return epb.ProbePeerResponse(ok=True)

        prober.probe_peer = slow
        checks = PeerChecks(lambda inst: prober, lambda: None)
        p0 = Engine("p0")
        checks.update(peers(1, "d0"))
        round_ = asyncio.create_task(checks.check_once([p0]))
        await started.wait()
        assert reported(checks, p0) == (0, [])  # d0's probe has no answer yet
        release.set()
        await round_
        assert reported(checks, p0) == (1, [])

    asyncio.run(go())


def test_each_prefill_engine_reports_its_checked_list_as_soon_as_its_own_peers_are_probed():
    """A new cluster: the first engine's pairs are routable once its probes are done,
    while the other engines' probes (queued behind them) still run."""
    async def go():
        gate = {"p1": asyncio.Event()}
        asked: list[str] = []

        class Prober:
            def __init__(self, instance_id: str) -> None:
                self.instance_id = instance_id

            async def probe_peer(self, endpoint: str, timeout_s: float):
                asked.append(f"{self.instance_id}->{endpoint}")
                if self.instance_id in gate:
                    await gate[self.instance_id].wait()
                return epb.ProbePeerResponse(ok=True)

        wakes: list[tuple[int, int]] = []
        engines = [Engine("p0", address="10.0.0.1:1"), Engine("p1", address="10.0.0.1:2")]
        checks = PeerChecks(lambda inst: Prober(inst.instance_id),
                            lambda: wakes.append(tuple(reported(checks, e)[0] for e in engines)),
                            max_concurrency=2)
        checks.update(peers(1, "d0", "d1", "d2"))
        round_ = asyncio.create_task(checks.check_once(engines))
        while len(asked) < 4:
            await asyncio.sleep(0)
        assert asked[:3] == ["p0->d0:7000", "p0->d1:7000", "p0->d2:7000"]  # engine by engine
        for _ in range(20):
            await asyncio.sleep(0)
        assert wakes == [(1, 0)]  # p0 reported while p1 waits for its answers
        gate["p1"].set()
        await round_
        assert wakes[-1] == (1, 1)

    asyncio.run(go())
