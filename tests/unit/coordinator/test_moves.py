"""Moves (``coordinator/moves.py``): a stream stalled on a decode engine that queues
requests goes on on a decode engine with room, as a continuation the client does
not see; a stream stalled by a slow engine that queues nothing stays, and so does
one with nowhere to go."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.metrics import CoordinatorMetrics
from pdserve.coordinator.moves import Mover
from tests.unit.coordinator.harness import BODY, inst, metric, serve

LETTERS = "ABCDEFGH"


def _post(app, out: dict) -> None:
    start = time.monotonic()
    r = httpx.post(app.url + "/v1/completions", json={**BODY, "max_tokens": 8}, timeout=30,
                   headers={"x-pdserve-timings": "1"})
    out["response"], out["seconds"] = r, time.monotonic() - start


def _start_on_one_decode(app, stubs, decodes: list[str]):
    """Sends a request in a thread; returns (thread, out, the decode stub it landed on, the other)."""
    out: dict = {}
    thread = threading.Thread(target=_post, args=(app, out))
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        landed = [a for a in decodes if stubs.by_address[a].request_ids]
        if landed:
            busy = stubs.by_address[landed[0]]
            other = stubs.by_address[next(a for a in decodes if a != landed[0])]
            return thread, out, busy, other
        time.sleep(0.01)
    raise AssertionError("the request reached no decode engine")


def _decode(stubs, **kwargs) -> str:
    # Stalls for 30 s before its fourth token, unless the test takes the stall away.
    return stubs(role="decode", num_tokens=8, token_delay_s=0.05, stall_after=3, stall_s=30.0,
                 **kwargs)


def test_a_stream_stalled_on_a_queueing_decode_engine_goes_on_on_one_with_room(loop, stubs):
    decodes = [_decode(stubs), _decode(stubs)]
    with serve(loop, [stubs(role="prefill"), *decodes], move_stalled_s=0.3) as app:
        thread, out, busy, other = _start_on_one_decode(app, stubs, decodes)
        other.stall_s = 0.0  # the engine with room streams on
        busy.num_waiting = 3  # the busy one reports a queue (its cache is full)
        thread.join(30)
        r = out["response"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == LETTERS  # no token lost or repeated
        assert out["seconds"] < 10  # not the 30 s stall
        assert r.json()["pdserve_timings"]["attempts"] == 2
        assert metric(app, "pdserve_coordinator_moves_total") == 1
        # A move is not a failure: no retry spent, the busy engine not suspect.
        assert metric(app, "pdserve_coordinator_continuations_total") == 0
        assert metric(app, "pdserve_coordinator_retries_total", leg="decode", stage="mid_stream") == 0
        busy_id = busy.request_ids[0]
        assert busy.aborted.count(busy_id) >= 1  # its KV is freed on the busy engine
        assert other.request_ids == [busy_id + ".2"]
        endpoint = next(e for e in app.deps.registry.all() if e.role == "decode"
                        and stubs.by_address[e.address] is busy)
        assert endpoint.suspect_until == 0


def test_a_stream_moved_to_a_given_engine_goes_on_there_alone(loop, stubs):
    prefill = stubs(role="prefill")
    decodes = [_decode(stubs), _decode(stubs)]
    with serve(loop, [prefill, *decodes], move_stalled_s=0.3) as app:
        thread, out, busy, other = _start_on_one_decode(app, stubs, decodes)
        other.stall_s = 0.0
        target = next(e for e in app.deps.registry.all() if stubs.by_address.get(e.address) is other)

        async def move_once_streaming() -> bool:
            for _ in range(500):
                runs = list(app.deps.mover.runs)
                if runs and runs[0].stream_engine() is not None:
                    return runs[0].move(target)
                await asyncio.sleep(0.01)
            return False
        assert loop.run(move_once_streaming())
        thread.join(30)
        r = out["response"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == LETTERS  # no token lost or repeated
        assert out["seconds"] < 10  # not the 30 s stall
        busy_id = busy.request_ids[0]
        assert other.request_ids == [busy_id + ".2"]
        # it prefilled its prompt and tokens so far on the target: no second prefill leg
        assert len(stubs.by_address[prefill].request_ids) == 1


@pytest.mark.parametrize("case", ["slow_engine_queues_nothing", "no_engine_has_room"])
def test_a_stalled_stream_stays_when_its_engine_queues_nothing_or_none_has_room(loop, stubs, case):
    decodes = [_decode(stubs), _decode(stubs)]
    with serve(loop, [stubs(role="prefill"), *decodes], move_stalled_s=0.2) as app:
        thread, out, busy, other = _start_on_one_decode(app, stubs, decodes)
        busy.stall_s = 1.5
        other.stall_s = 0.0
        if case == "no_engine_has_room":
            busy.num_waiting = 2
            other.num_kv_blocks_free = 4  # under the reserve kept free of moved streams
        thread.join(30)
        r = out["response"]
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == LETTERS
        assert out["seconds"] >= 1.5  # it waited out the stall where it was
        assert metric(app, "pdserve_coordinator_moves_total") == 0
        assert other.request_ids == []


# -- the round's choices, on runs the test makes --

@dataclass(eq=False)
class FakeRun:
    engine: object
    last_s: float
    tokens: int = 40
    moved: bool = False
    to: object = None
    left: int = 1000

    def stream_engine(self):
        return None if self.moved else self.engine

    def progress_s(self) -> float:
        return self.last_s

    def num_tokens(self) -> int:
        return self.tokens

    def tokens_left(self) -> int:
        return self.left

    def move(self, to=None) -> bool:
        self.moved, self.to = True, to
        return True


def _mover(*engines) -> tuple[Mover, InstanceRegistry]:
    registry = InstanceRegistry()
    registry.replace(list(engines))
    return Mover(registry, CoordinatorMetrics(), stall_s=1.0, block_size=16), registry


def test_a_round_moves_the_longest_stalled_first_and_no_more_than_the_engine_queues():
    busy = inst("d0", "decode", num_waiting=2, num_kv_blocks_used=64, num_kv_blocks_free=0)
    room = inst("d1", "decode", num_kv_blocks_used=0, num_kv_blocks_free=64)
    mover, _ = _mover(busy, room)
    now = 100.0
    runs = [FakeRun(busy, now - s) for s in (0.5, 3.0, 1.5, 2.0)]  # 0.5 s: not stalled yet
    runs.append(FakeRun(room, now - 5.0))  # on the engine with room: stays
    mover.runs.update(runs)
    assert mover.move_stalled(now) == 2
    assert [r.moved for r in runs] == [False, True, False, True, False]
    # The report is as old as the view: the two moved count against its queue.
    assert mover.move_stalled(now) == 0
    assert busy.is_full(now)  # new requests try the engine with room first


def test_moved_streams_fit_in_the_room_left_and_a_new_view_counts_afresh():
    busy = inst("d0", "decode", num_waiting=5, num_kv_blocks_used=64, num_kv_blocks_free=0)
    room = inst("d1", "decode", num_kv_blocks_used=40, num_kv_blocks_free=24)
    mover, registry = _mover(busy, room)
    now = 100.0
    runs = [FakeRun(busy, now - 2.0 - i, tokens=100) for i in range(5)]  # 7 blocks each
    mover.runs.update(runs)
    # 24 free, 6 kept (10% of 64): 18 blocks hold two streams of 7.
    assert mover.move_stalled(now) == 2
    registry.replace([inst("d0", "decode", num_waiting=3, num_kv_blocks_used=64, num_kv_blocks_free=0),
                      inst("d1", "decode", num_kv_blocks_used=54, num_kv_blocks_free=10)])
    assert mover.move_stalled(now) == 0  # 10 free, 6 kept: no stream of 7 fits
    registry.replace([inst("d0", "decode", num_waiting=3, num_kv_blocks_used=64, num_kv_blocks_free=0),
                      inst("d1", "decode", num_waiting=1, num_kv_blocks_used=0, num_kv_blocks_free=64)])
    assert mover.move_stalled(now) == 0  # an engine that queues is no room
    registry.replace([inst("d0", "decode", num_waiting=3, num_kv_blocks_used=64, num_kv_blocks_free=0),
                      inst("p0", "prefill", num_kv_blocks_used=0, num_kv_blocks_free=64)])
    assert mover.move_stalled(now) == 0  # a prefill engine streams nothing: no room


def test_only_a_busy_engine_a_stream_moved_off_is_avoided_for_a_moment():
    moved_off = inst("d0", "decode", num_waiting=1, num_kv_blocks_used=64, num_kv_blocks_free=0)
    kept = inst("d1", "decode", num_waiting=1, num_kv_blocks_used=64, num_kv_blocks_free=0)
    room = inst("d2", "decode", num_kv_blocks_used=0, num_kv_blocks_free=20)
    mover, _ = _mover(moved_off, kept, room)
    now = 100.0
    # d0's stream (7 blocks) fits in the 18 blocks of room; d1's (26 blocks) does not.
    runs = [FakeRun(moved_off, now - 3.0, tokens=100), FakeRun(kept, now - 2.0, tokens=400)]
    mover.runs = runs  # in this order: d1 comes after a round that already moved one
    assert mover.move_stalled(now) == 1
    assert [r.moved for r in runs] == [True, False]
    assert moved_off.is_full(now)
    assert not kept.is_full(now)  # nothing moved off it: new requests may still try it



def test_streams_piled_on_one_engine_half_move_to_one_that_joined_its_role_on_it_alone():
    old = inst("d0", "decode", num_running=20, num_inflight=20, num_kv_blocks_used=200, num_kv_blocks_free=824)
    new = inst("d1", "decode", num_kv_blocks_used=0, num_kv_blocks_free=1024)
    prefill = inst("p0", "prefill", num_kv_blocks_used=0, num_kv_blocks_free=1024)
    mover, _ = _mover(old, new, prefill)
    now = 100.0
    runs = [FakeRun(old, now - 0.1, tokens=40 + i) for i in range(20)]  # streaming, none stalled
    mover.runs.update(runs)
    assert mover.move_stalled(now) == 0  # nothing queues
    assert mover.balance(now) == 10
    # the ten with the fewest tokens (the most left to run, the cheapest to recompute),
    # each to go on on the new engine itself (not through a prefill engine's queue)
    assert sorted(r.tokens for r in runs if r.moved) == list(range(40, 50))
    assert all(r.to is new for r in runs if r.moved)
    assert not old.is_full(now)  # new requests are the router's to place, by their legs
    # one balance at a time: until each moved stream has a new token, nothing more moves
    # (and a moved stream waiting in its target's queue is not moved back as stalled)
    old.num_inflight, new.num_inflight = 10, 0
    new.num_waiting = 10
    for r in runs:
        if r.moved:
            r.engine, r.moved, r.last_s = new, False, now - 5.0
    assert mover.balance(now) == 0
    assert mover.move_stalled(now) == 0
    # with a token each they count as moved: 10 and 10 legs, nothing moves
    for r in runs:
        if r.engine is new:
            r.tokens += 1
    new.num_waiting, new.num_inflight = 0, 10
    assert mover.balance(now) == 0
    # settled, a new pile-up moves again (balance forgets the settled streams itself)
    old.num_inflight, new.num_inflight = 20, 0
    assert mover.balance(now) == 10
    assert all(r.to is new for r in runs if r.moved)


def test_balance_counts_the_legs_planned_to_an_engine_not_only_its_streams():
    # d0 streams 6 and has 14 more legs waiting for their KV at P (the next wave); d1
    # streams 16. By streams d1 runs twice as many as d0; by legs d0 has more: nothing moves.
    d0 = inst("d0", "decode", num_inflight=20, num_kv_blocks_free=1024)
    d1 = inst("d1", "decode", num_inflight=16, num_kv_blocks_free=1024)
    mover, _ = _mover(d0, d1)
    mover.runs.update([FakeRun(d0, 100.0) for _ in range(6)] + [FakeRun(d1, 100.0) for _ in range(16)])
    assert mover.balance(100.0) == 0
    d0.num_inflight = 6  # the wave was not there: d1 has 16 legs, d0 6: five move
    assert mover.balance(100.0) == 5


def test_balance_leaves_small_differences_and_engines_with_no_room_or_a_queue():
    def round_with(target, n: int = 12, tokens: int = 40) -> int:
        busy = inst("d0", "decode", num_inflight=n, num_kv_blocks_used=0, num_kv_blocks_free=1024)
        mover, _ = _mover(busy, target)
        mover.runs.update(FakeRun(busy, 100.0, tokens=tokens) for _ in range(n))
        return mover.balance(100.0)
    assert round_with(inst("d1", "decode", num_kv_blocks_free=1024), n=7) == 0  # fewer than BALANCE_MIN
    assert round_with(inst("d1", "decode", num_kv_blocks_free=1024)) == 6
    assert round_with(inst("d1", "decode", num_inflight=11, num_kv_blocks_free=1024), n=20) == 0  # not 2x
    assert round_with(inst("d1", "decode", num_waiting=1, num_kv_blocks_free=1024)) == 0  # it queues
    assert round_with(inst("d1", "decode", draining=True, num_kv_blocks_free=1024)) == 0  # leaving
    # streams near their end (fewer tokens left than they hold) are not worth a recompute
    busy = inst("d0", "decode", num_inflight=12, num_kv_blocks_free=1024)
    mover, _ = _mover(busy, inst("d1", "decode", num_kv_blocks_free=1024))
    mover.runs.update(FakeRun(busy, 100.0, tokens=100, left=99 + i % 2) for i in range(12))
    assert mover.balance(100.0) == 6  # only the six with 100 left: all of them
    assert all(r.left == 100 for r in mover.runs if r.moved)
    # 30 free, 10% of 32 kept: 27 blocks hold 3 streams of 9 (140 tokens)
    assert round_with(inst("d1", "decode", num_kv_blocks_used=2, num_kv_blocks_free=30), tokens=140) == 3
    assert round_with(inst("p1", "prefill", num_kv_blocks_free=1024)) == 0  # another role
