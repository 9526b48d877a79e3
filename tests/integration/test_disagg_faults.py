"""Disaggregation under faults, with real engine processes over the TCP transport.

Each test pairs a prefill (P) and a decode (D) engine, injects a fault in the middle
of a KV transfer (P's writes are delayed so the window is wide), and checks: a clear
error, both engines' blocks back in the free pool, and both engines still serving.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from pdserve.runtime.engine_client import EngineClient, build_generate_request
from tests.procs import start_engine

TIMEOUTS = ["--num-kv-blocks", "64", "--block-size", "8", "--kv-transport", "tcp",
            "--kv-transfer-timeout", "2", "--kv-descriptor-timeout", "2",
            "--kv-done-timeout", "4", "--kv-abort-ack-timeout", "1", "--kv-reserve-wait-s", "1"]
PROMPT = list(range(1, 41))


def engine(role: str, *extra: str):
    proc, address = start_engine("--role", role, *TIMEOUTS, *extra)
    kv = asyncio.run(_health(address)).kv_endpoint
    return proc, address, kv


async def _health(address):
    async with EngineClient(address) as c:
        return await c.health()


async def _wait_all_free(address, timeout_s=15.0):
    async with EngineClient(address) as c:
        deadline = time.monotonic() + timeout_s
        while True:
            s = await c.stats()
            if (s.num_kv_blocks_free == s.num_kv_blocks_total and s.num_running == 0
                    and s.num_kv_transfers_active == 0 and s.num_kv_blocks_quarantined == 0):
                return s
            if time.monotonic() > deadline:
                return s
            await asyncio.sleep(0.1)


def assert_all_free(address):
    s = asyncio.run(_wait_all_free(address))
    assert s.num_kv_blocks_free == s.num_kv_blocks_total, s
    assert s.num_kv_transfers_active == 0 and s.num_kv_blocks_quarantined == 0, s


async def _collect(call):
    msgs = []
    try:
        async for m in call:
            msgs.append(m)
    except grpc.aio.AioRpcError as exc:
        return msgs, exc
    return msgs, None


async def run_pair(p_addr, p_kv, d_addr, d_kv, rid, mode="layerwise", fault=None):
    """Dispatch one request to D then P; ``fault()`` runs once P reported its first token."""
    async with EngineClient(p_addr) as pc, EngineClient(d_addr) as dc:
        kv = dict(mode=mode, transfer_id=f"x-{rid}")
        d_call = dc.generate(build_generate_request(
            rid, "", PROMPT, max_tokens=8, ignore_eos=True,
            kv_transfer={**kv, "role": "decode", "peer": p_kv}), timeout_s=60)
        d_task = asyncio.ensure_future(_collect(d_call))
        p_call = pc.generate(build_generate_request(
            rid, "", PROMPT, max_tokens=8, ignore_eos=True,
            kv_transfer={**kv, "role": "prefill", "peer": d_kv}), timeout_s=60)
        p_msgs = []
        p_error = None
        try:
            async for m in p_call:
                p_msgs.append(m)
                if len(p_msgs) == 1 and fault is not None:
                    fault()
        except grpc.aio.AioRpcError as exc:
            p_error = exc
        d_msgs, d_error = await d_task
        return p_msgs, p_error, d_msgs, d_error


def tokens(msgs):
    return [t for m in msgs for t in m.token_ids]


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        p.signal(signal.SIGCONT)
        p.stop()


def test_healthy_pair_then_kill_p_mid_transfer(procs):
    p, p_addr, p_kv = engine("prefill", "--fault-kv-send-delay", "1.5")
    d, d_addr, d_kv = engine("decode")
    procs += [p, d]
    _, _, ok_msgs, _ = asyncio.run(run_pair(p_addr, p_kv, d_addr, d_kv, "warm", mode="push"))
    assert ok_msgs[-1].finish_reason == "length" and len(tokens(ok_msgs)) == 8

    p_msgs, _, d_msgs, d_error = asyncio.run(
        run_pair(p_addr, p_kv, d_addr, d_kv, "killp", fault=lambda: p.signal(signal.SIGKILL)))
    assert len(p_msgs) == 1  # P produced its first token, then died mid-transfer
    assert d_error is None and d_msgs[-1].finish_reason == "error"
    assert "timed out" in d_msgs[-1].error
    assert_all_free(d_addr)
    # D goes on serving with a new P.
    p2, p2_addr, p2_kv = engine("prefill")
    procs.append(p2)
    _, _, d_msgs, _ = asyncio.run(run_pair(p2_addr, p2_kv, d_addr, d_kv, "after"))
    assert tokens(d_msgs) == tokens(ok_msgs)
    assert_all_free(p2_addr)
    assert_all_free(d_addr)


def test_kill_d_mid_transfer(procs):
    p, p_addr, p_kv = engine("prefill", "--fault-kv-send-delay", "0.5")
    d, d_addr, d_kv = engine("decode")
    procs += [p, d]
    p_msgs, p_error, _, d_error = asyncio.run(
        run_pair(p_addr, p_kv, d_addr, d_kv, "killd", fault=lambda: d.signal(signal.SIGKILL)))
    assert p_error is None and p_msgs[-1].finish_reason == "error", p_msgs[-1]
    # Either a write to the dead D failed, or P's deadline ended the transfer first.
    assert "writing KV" in p_msgs[-1].error or "timed out" in p_msgs[-1].error
    assert d_error is not None  # the D stream broke with its process
    assert_all_free(p_addr)
    d2, d2_addr, d2_kv = engine("decode")
    procs.append(d2)
    # P still has its fault delay: push (one delayed write job) stays inside its deadline.
    _, _, d_msgs, _ = asyncio.run(run_pair(p_addr, p_kv, d2_addr, d2_kv, "after", mode="push"))
    assert d_msgs[-1].finish_reason == "length" and len(tokens(d_msgs)) == 8, d_msgs[-1]
    assert_all_free(p_addr)


async def _stats(address):
    async with EngineClient(address) as c:
        return await c.stats()


def pause_mid_transfer(victim, observer: str, addrs: tuple, rid: str):
    """SIGSTOP ``victim`` once P reported its first token, wait until ``observer``
    (the other engine) gives the transfer up, then SIGCONT it; returns run_pair's result."""

    async def run():
        task = asyncio.ensure_future(
            run_pair(*addrs, rid, fault=lambda: victim.signal(signal.SIGSTOP)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (await _stats(observer)).kv_transfers_failed < 1:
            await asyncio.sleep(0.2)
        victim.signal(signal.SIGCONT)
        return await task

    return asyncio.run(run())


def test_sigstop_d_then_continue(procs):
    p, p_addr, p_kv = engine("prefill", "--fault-kv-send-delay", "0.3")
    d, d_addr, d_kv = engine("decode")
    procs += [p, d]
    # P's writes to the stopped D time out; P reports the failure and frees.
    p_msgs, _, d_msgs, _ = pause_mid_transfer(d, p_addr, (p_addr, p_kv, d_addr, d_kv), "stopd")
    assert p_msgs[-1].finish_reason == "error"
    assert d_msgs and d_msgs[-1].finish_reason == "error"
    assert_all_free(p_addr)
    assert_all_free(d_addr)


def test_sigstop_p_then_continue(procs):
    p, p_addr, p_kv = engine("prefill", "--fault-kv-send-delay", "0.5")
    d, d_addr, d_kv = engine("decode")
    procs += [p, d]
    # D gives up waiting for DONE, aborts, and never frees a block P could still write.
    p_msgs, _, d_msgs, _ = pause_mid_transfer(p, d_addr, (p_addr, p_kv, d_addr, d_kv), "stopp")
    assert d_msgs[-1].finish_reason == "error"
    assert p_msgs[-1].finish_reason == "error"
    assert_all_free(d_addr)
    assert_all_free(p_addr)
    # Both still serve.
    # P keeps its fault delay: push (one delayed write job) stays well inside its deadline.
    _, _, d_msgs, _ = asyncio.run(run_pair(p_addr, p_kv, d_addr, d_kv, "after", mode="push"))
    assert d_msgs[-1].finish_reason == "length" and len(tokens(d_msgs)) == 8, d_msgs[-1]


def test_abort_of_both_legs_mid_transfer_ends_both_streams(procs):
    """What the Coordinator does when its client goes away: Abort each leg by id."""
    p, p_addr, p_kv = engine("prefill", "--fault-kv-send-delay", "1.0")
    d, d_addr, d_kv = engine("decode")
    procs += [p, d]

    async def go():
        async with EngineClient(p_addr) as pc, EngineClient(d_addr) as dc:
            kv = dict(mode="layerwise", transfer_id="x-gone")
            d_task = asyncio.ensure_future(_collect(dc.generate(build_generate_request(
                "gone", "", PROMPT, max_tokens=8, ignore_eos=True,
                kv_transfer={**kv, "role": "decode", "peer": p_kv}), timeout_s=60)))
            p_call = pc.generate(build_generate_request(
                "gone", "", PROMPT, max_tokens=8, ignore_eos=True,
                kv_transfer={**kv, "role": "prefill", "peer": d_kv}), timeout_s=60)
            first = await p_call.read()  # P prefilled; its delayed writes are in flight
            aborted = (await dc.abort("gone"), await pc.abort("gone"))
            p_rest = []
            while (m := await asyncio.wait_for(p_call.read(), 10)) is not grpc.aio.EOF:
                p_rest.append(m)
            return first, aborted, p_rest, await asyncio.wait_for(d_task, 10)

    first, (d_aborted, _), p_rest, (d_msgs, d_error) = asyncio.run(go())
    assert not first.finished and d_aborted
    assert d_error is None and d_msgs[-1].finish_reason == "abort"
    # D's ABORT may reach P before our Abort does: P's stream ends either way.
    assert p_rest[-1].finished and p_rest[-1].finish_reason in ("abort", "error"), p_rest[-1]
    assert_all_free(p_addr)
    assert_all_free(d_addr)


def test_a_full_decode_answers_resource_exhausted_within_its_reserve_wait(procs):
    """D has 6 blocks and each request needs 5: while the first holds them (P's write is
    delayed), the second is refused on both legs with RESOURCE_EXHAUSTED "decode full"
    after D's reserve wait, not after the transfer deadlines; nothing leaks."""
    reserve_wait_s = 0.5
    p, p_addr, p_kv = engine("prefill", "--fault-kv-send-delay", "1.5")
    d, d_addr, d_kv = engine("decode", "--num-kv-blocks", "6",
                             "--kv-reserve-wait-s", str(reserve_wait_s))
    procs += [p, d]
    addrs = (p_addr, p_kv, d_addr, d_kv)

    async def second_after_first():
        first = asyncio.ensure_future(run_pair(*addrs, "first", mode="push"))
        await asyncio.sleep(0.3)  # the first's D leg holds the blocks now
        started_s = time.monotonic()
        second = await run_pair(*addrs, "second", mode="push")
        return await first, second, time.monotonic() - started_s

    first, second, second_s = asyncio.run(second_after_first())
    p_msgs, p_error, d_msgs, d_error = second
    assert d_error is not None and d_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert d_error.details().startswith("decode full: 5 KV blocks wanted"), d_error.details()
    assert d_msgs == []
    assert p_error is not None and p_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert p_error.details() == f"decode full (peer {d_kv})"
    assert len(p_msgs) == 1 and not p_msgs[0].finished  # P prefilled, then heard D was full
    assert second_s < reserve_wait_s + 1.0  # not the 2-4 s transfer deadlines
    assert first[1] is None and first[3] is None
    assert first[2][-1].finish_reason == "length" and len(tokens(first[2])) == 8
    assert_all_free(p_addr)
    assert_all_free(d_addr)
    for address in (p_addr, d_addr):  # load, not a failed transfer
        assert asyncio.run(_stats(address)).kv_transfers_failed == 0
    # The first request's output is what the same request gets with D to itself.
    _, _, again, _ = asyncio.run(run_pair(*addrs, "again", mode="push"))
    assert tokens(again) == tokens(first[2])
