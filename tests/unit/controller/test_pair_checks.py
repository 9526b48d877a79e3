"""Pair checks through the Controller: it lists the decode engines to the prefill
engines' agents (each at a version), folds what the agents report into its view
(the version each P has checked, the few pairs that failed), hands out only a list
version already written, and a new leader goes on with the same numbers."""

from __future__ import annotations

import asyncio

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller.cluster import ClusterSettings
from pdserve.controller.core import Controller, ControllerSettings
from pdserve.controller.persist import StatePersister
from pdserve.controller.store import MemoryStore
from tests.unit.controller.test_cluster import beat, make_cluster, report
from tests.unit.controller.test_commit import GatedStore, eventually


def prefill(iid: str, checked: int = 0, unreachable=(), checks_peers: bool = True, **kwargs) -> pb.InstanceReport:
    """A prefill engine's report; ``checks_peers=False``: from an agent without peer checks."""
    rep = report(iid, "prefill", **kwargs)
    rep.peers_checked_version, rep.checks_peers = checked, checks_peers
    for d_id, endpoint, why in unreachable:
        rep.unreachable_peers.add(instance_id=d_id, kv_endpoint=endpoint, reason=why)
    return rep


def decode(iid: str, state: str = "running", endpoint: str = "") -> pb.InstanceReport:
    rep = report(iid, "decode", state)
    if endpoint:
        rep.kv_endpoint = endpoint
    return rep


def versions(view: pb.ClusterView) -> dict[str, int]:
    return {i.instance_id: i.peers_checked_version or i.peers_listed_version for i in view.instances}


def test_decode_engines_are_listed_at_a_version_and_each_change_lists_again():
    c = make_cluster()
    beat(c, 0.0, prefill("p0"), decode("d0"), decode("d1"))
    view = c.view("me")
    assert view.publishes_pairs and not view.unusable_pairs
    assert versions(view) == {"p0": 0, "d0": 1, "d1": 1}  # p0's agent has checked nothing yet
    assert [(d.instance_id, d.kv_endpoint) for d in c.peer_list().decode] == [("d0", "d0:2"), ("d1", "d1:2")]

    beat(c, 1.0, prefill("p0", checked=1), decode("d0"), decode("d1"), decode("d2"))
    assert versions(c.view("me")) == {"p0": 1, "d0": 1, "d1": 1, "d2": 2}  # (p0, d2) not checked yet
    assert c.peer_list().version == 2

    beat(c, 2.0, prefill("p0", checked=2), decode("d0"), decode("d1", endpoint="d1:9"), decode("d2"))
    assert versions(c.view("me"))["d1"] == 3  # a new KV endpoint: listed again, unknown to p0

    beat(c, 3.0, prefill("p0", checked=3), decode("d0", "exited"), decode("d1", endpoint="d1:9"), decode("d2"))
    assert [d.instance_id for d in c.peer_list().decode] == ["d1", "d2"]  # a FAILED one leaves the list
    beat(c, 4.0, prefill("p0", checked=4), decode("d0"), decode("d1", endpoint="d1:9"), decode("d2"))
    assert versions(c.view("me"))["d0"] == 5  # back: listed anew, so probed anew before it pairs


def test_pair_checks_are_published_only_while_every_prefill_engines_agent_runs_them():
    """Mid rolling upgrade (a new Controller, some agents from before peer checks): an old
    agent's prefill engine would report no checked version and pair with nobody, so the
    Controller publishes nothing and the Coordinators probe every pair themselves."""
    c = make_cluster()
    beat(c, 0.0, prefill("p0", checked=1), prefill("p1", checks_peers=False), decode("d0"))
    view = c.view("me")
    assert not view.publishes_pairs
    version = view.version
    beat(c, 1.0, prefill("p0", checked=1), prefill("p1", checked=1), decode("d0"))
    view = c.view("me")
    assert view.publishes_pairs and view.version > version  # a Coordinator hears of the flip
    assert versions(view) == {"p0": 1, "p1": 1, "d0": 1}


def test_the_view_publishes_only_the_pairs_that_failed_at_their_current_endpoint():
    c = make_cluster()
    beat(c, 0.0, prefill("p0"), prefill("p1"), decode("d0"), decode("d1"))
    beat(c, 1.0, prefill("p0", checked=1, unreachable=[("d1", "d1:2", "connection refused")]),
         prefill("p1", checked=1, unreachable=[("d0", "d0:old", "stale: an earlier endpoint")]),
         decode("d0"), decode("d1"))
    view = c.view("me")
    assert [(u.prefill_id, u.decode_id, u.reason) for u in view.unusable_pairs] == [
        ("p0", "d1", "connection refused")]
    version = view.version
    beat(c, 2.0, prefill("p0", checked=1), prefill("p1", checked=1), decode("d0"), decode("d1"))
    assert not c.view("me").unusable_pairs and c.view("me").version > version  # a verdict is a change


def test_an_agent_is_sent_the_written_list_when_it_holds_another_and_a_new_leader_counts_on():
    async def go():
        store = GatedStore()
        leader = Controller(ControllerSettings(cluster_name="c"), store)
        await leader.start()

        async def beat_(*reports, held: int = 0) -> pb.HeartbeatResponse:
            return await leader.heartbeat(pb.HeartbeatRequest(agent_id="a", instances=reports,
                                                              peers_version=held))

        await beat_(prefill("p0"), decode("d0"))
        await eventually(lambda: leader._peers is not None)
        reply = await beat_(prefill("p0"), decode("d0"))
        assert reply.HasField("peers") and [d.instance_id for d in reply.peers.decode] == ["d0"]
        first = reply.peers.version
        reply = await beat_(prefill("p0", checked=first), decode("d0"), held=first)
        assert not reply.HasField("peers")  # it holds this one: nothing to send

        store.gate.clear()  # etcd stalls while d1 registers: its list version is not written
        await beat_(prefill("p0", checked=first), decode("d0"), decode("d1"), held=first)
        await asyncio.sleep(0.3)
        reply = await beat_(prefill("p0", checked=first), decode("d0"), decode("d1"), held=first)
        assert not reply.HasField("peers")  # not handed out before it is written
        store.gate.set()
        await eventually(lambda: leader._peers.version > first)
        reply = await beat_(prefill("p0", checked=first), decode("d0"), decode("d1"), held=first)
        assert [d.instance_id for d in reply.peers.decode] == ["d0", "d1"]
        second = reply.peers.version
        await beat_(prefill("p0", checked=second, unreachable=[("d1", "d1:2", "refused")]),
                    decode("d0"), decode("d1"), held=second)
        await eventually(lambda: leader.view().unusable_pairs)
        await leader.stop()

        # a successor publishes what the agents reported, and lists a new engine past them
        successor = await StatePersister(store, "/pdserve/c", 30).load(ClusterSettings(), 0.0)
        view = successor.view("successor")
        assert versions(view) == {"p0": second, "d0": first, "d1": second}
        assert [(u.prefill_id, u.decode_id) for u in view.unusable_pairs] == [("p0", "d1")]
        successor.apply_heartbeat("a", [decode("d2")], 1.0)
        assert versions(successor.view("successor"))["d2"] > second

    asyncio.run(go())


def test_a_memory_store_round_trip_keeps_the_peer_fields():
    async def go():
        store = MemoryStore()
        persister = StatePersister(store, "/pdserve/c", 30)
        c = await persister.load(ClusterSettings(), 0.0)
        c.apply_heartbeat("a", [prefill("p0", checked=7, unreachable=[("d0", "d0:2", "x")]), decode("d0")], 0.0)
        c.view("me")
        await persister.flush(c, 0.0)
        loaded = await persister.load(ClusterSettings(), 1.0)
        assert loaded.records["p0"].unreachable_peers == [["d0", "d0:2", "x"]]
        assert loaded.records["d0"].peers_listed_version == loaded.peers_version == 1

    asyncio.run(go())


def test_a_prefill_engines_checked_version_alone_is_not_a_store_write():
    """Each decode engine that joins moves every prefill engine's checked version (P
    writes per join at a thousand engines): it is written with the record's next write,
    and a successor that loads an older one routes fewer pairs, never an unchecked one."""
    async def go():
        store = MemoryStore()
        persister = StatePersister(store, "/pdserve/c", 30)
        c = await persister.load(ClusterSettings(), 0.0)
        c.apply_heartbeat("a", [prefill("p0"), decode("d0")], 0.0)
        c.view("me")
        await persister.flush(c, 0.0)
        c.apply_heartbeat("a", [prefill("p0", checked=1), decode("d0")], 1.0)
        assert "p0" not in c.dirty  # the checked version alone
        c.apply_heartbeat("a", [prefill("p0", checked=1), decode("d0"), decode("d1")], 2.0)
        c.view("me")  # d1 listed at version 2: d1 and the meta written, not p0
        assert c.dirty == {"d1"}
        await persister.flush(c, 2.0)
        successor = await persister.load(ClusterSettings(), 3.0)
        assert versions(successor.view("s")) == {"p0": 0, "d0": 1, "d1": 2}  # (p0, *) wait for p0's beat
        successor.apply_heartbeat("a", [prefill("p0", checked=2), decode("d0"), decode("d1")], 3.0)
        assert versions(successor.view("s"))["p0"] == 2

        c.apply_heartbeat("a", [prefill("p0", checked=2, unreachable=[("d1", "d1:2", "refused")]),
                                decode("d0"), decode("d1")], 4.0)
        assert "p0" in c.dirty  # a verdict is written, and the checked version with it
        await persister.flush(c, 4.0)
        assert (await persister.load(ClusterSettings(), 5.0)).records["p0"].peers_checked_version == 2

    asyncio.run(go())
