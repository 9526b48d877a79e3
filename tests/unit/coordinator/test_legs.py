"""The legs of a request against scripted engine streams: what a leg counts on its
engine, how its failures are classified, what is cancelled and aborted at the end,
and the one conversion of a request's parameters to the engine's wire type."""

from __future__ import annotations

import asyncio
import gc
import time

import grpc
import pytest

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.sampling import SamplingParams
from pdserve.coordinator.engine_errors import from_status
from pdserve.coordinator.errors import ServeError
from pdserve.coordinator.legs import DecodeLeg, EngineFull, Leg, LegFailure, PairedLegs, PrefillLeg
from pdserve.coordinator.lifecycle import engine_request
from pdserve.coordinator.metrics import CoordinatorMetrics
from pdserve.coordinator.timings import RequestTimings
from pdserve.runtime.engine_client import build_generate_request
from tests.unit.coordinator.harness import inst

PROMPT = [1, 2, 3, 4]


class ScriptedCall:
    """A Generate call whose messages (or errors) the test queues."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.is_cancelled = False
        self.loop = asyncio.get_running_loop()
        self.arrival_s = self.last_arrival_s = 0.0  # as ``SessionCall``'s

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def send(self, **fields) -> None:
        self.queue.put_nowait(pb.GenerateResponse(**fields))
        self.last_arrival_s = time.monotonic()

    def fail(self, code: grpc.StatusCode, details: str = "boom") -> None:
        """The call ends as a session ends it: ``code`` made pdserve's own error."""
        self.queue.put_nowait(from_status(code, details))

    def cancel(self) -> bool:
        self.is_cancelled = True
        return True


class ScriptedClient:
    def __init__(self) -> None:
        self.call = ScriptedCall()

    def generate(self, request, timeout_s=None) -> ScriptedCall:
        return self.call


class Aborts:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def abort_soon(self, engine, request_id: str) -> None:
        self.sent.append((engine.instance_id, request_id))


def make_leg(kind: type[Leg], engine, aborts: Aborts, timings: RequestTimings) -> Leg:
    request = engine_request(SamplingParams(max_tokens=4), "r1", PROMPT, 0)
    return kind(engine, request, ScriptedClient(), timings, aborts)


def call_of(leg: Leg) -> ScriptedCall:
    return leg._client.call


def test_single_leg_counts_its_load_until_the_engine_says_so():
    async def scenario():
        engine, aborts, timings = inst("h1", "hybrid"), Aborts(), RequestTimings("r1", CoordinatorMetrics())
        leg = make_leg(Leg, engine, aborts, timings)
        leg.start(10.0)
        assert (engine.num_inflight, engine.num_pending_prefill_tokens) == (1, len(PROMPT))
        call_of(leg).send(token_ids=[7], timings=pb.Timings(queue_s=0.1, prefill_s=0.2))
        call_of(leg).send(token_ids=[8], finished=True, finish_reason="length")
        stream = leg.tokens()
        assert await stream.__anext__() == [7]
        assert (engine.num_inflight, engine.num_pending_prefill_tokens) == (1, 0)  # prefill done
        assert [ids async for ids in stream] == [[8]]
        leg.close()
        assert (engine.num_inflight, engine.num_pending_prefill_tokens) == (0, 0)
        assert leg.finish_reason == "length" and not aborts.sent and not call_of(leg).is_cancelled
        assert timings.report["prefill_queue_s"] == 0.1 and timings.report["prefill_compute_s"] == 0.2
        assert engine.prefill_tokens_per_s == pytest.approx(len(PROMPT) / 0.2)

    asyncio.run(scenario())


@pytest.mark.parametrize("script, after_token, raised", [
    (lambda c: c.send(finished=True, finish_reason="error", error="oom"), False, ("single", "before_first_token")),
    (lambda c: c.send(finished=True, finish_reason="abort"), True, ("single", "mid_stream")),
    (lambda c: c.fail(grpc.StatusCode.UNAVAILABLE), True, ("single", "mid_stream")),
    (lambda c: c.fail(grpc.StatusCode.INVALID_ARGUMENT), False, 400),
    (lambda c: c.fail(grpc.StatusCode.DEADLINE_EXCEEDED), True, 504),
])
def test_failed_leg_is_classified_cancelled_and_aborted(script, after_token, raised):
    async def scenario():
        engine, aborts = inst("h1", "hybrid"), Aborts()
        leg = make_leg(Leg, engine, aborts, RequestTimings("r1", CoordinatorMetrics()))
        leg.start(10.0)
        if after_token:
            call_of(leg).send(token_ids=[7])
        script(call_of(leg))
        with pytest.raises((LegFailure, ServeError)) as info:
            async for _ in leg.tokens():
                pass
        leg.close()
        if isinstance(raised, int):
            assert info.value.status == raised
        else:
            assert (info.value.leg, info.value.stage) == raised and info.value.engine is engine
        assert (engine.num_inflight, engine.num_pending_prefill_tokens) == (0, 0)
        assert call_of(leg).is_cancelled and aborts.sent == [("h1", "r1")]

    asyncio.run(scenario())


def make_pair(aborts: Aborts, timings: RequestTimings):
    p, d = inst("p1", "prefill"), inst("d1", "decode")
    return p, d, PairedLegs(make_leg(PrefillLeg, p, aborts, timings), make_leg(DecodeLeg, d, aborts, timings))


def test_prefill_failure_before_the_first_token_ends_the_attempt():
    async def scenario():
        aborts = Aborts()
        p, d, pair = make_pair(aborts, RequestTimings("r1", CoordinatorMetrics()))
        pair.start(10.0)
        assert (p.num_inflight, p.num_pending_prefill_tokens, d.num_inflight) == (1, len(PROMPT), 1)
        assert d.num_pending_prefill_tokens == 0
        call_of(pair.prefill).send(finished=True, finish_reason="error", error="kv send failed")
        with pytest.raises(LegFailure) as info:  # D is still waiting for the KV
            async for _ in pair.tokens():
                pass
        pair.close()
        assert (info.value.leg, info.value.stage, info.value.engine) == ("prefill", "before_handoff", p)
        assert call_of(pair.decode).is_cancelled and aborts.sent == [("d1", "r1")]  # P's stream ended
        assert (p.num_inflight, p.num_pending_prefill_tokens, d.num_inflight) == (0, 0, 0)

    asyncio.run(scenario())


def test_a_prefill_that_failed_before_decode_is_read_ends_the_attempt_as_prefill():
    """P's failure may be in before D's stream is first read (an engine that fails at
    once): it is still the attempt's failure, not a wait for KV that never comes."""
    async def scenario():
        aborts = Aborts()
        p, d, pair = make_pair(aborts, RequestTimings("r1", CoordinatorMetrics()))
        pair.start(10.0)
        call_of(pair.prefill).send(finished=True, finish_reason="error", error="kv send failed")
        for _ in range(5):  # P's task runs to its failure first
            await asyncio.sleep(0)
        assert pair._prefill_task.done()
        with pytest.raises(LegFailure) as info:
            async for _ in pair.tokens():
                pass
        pair.close()
        assert (info.value.leg, info.value.stage, info.value.engine) == ("prefill", "before_handoff", p)
        assert call_of(pair.decode).is_cancelled and aborts.sent == [("d1", "r1")]

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_prefill_is_left_to_finish_alone_after_decode_finished():
    async def scenario():
        aborts, timings = Aborts(), RequestTimings("r1", CoordinatorMetrics())
        p, d, pair = make_pair(aborts, timings)
        pair.start(10.0)
        call_of(pair.decode).send(token_ids=[7], finished=True, finish_reason="stop",
                                  timings=pb.Timings(kv_wait_s=0.3, decode_queue_s=0.01))
        assert [ids async for ids in pair.tokens()] == [[7]]
        pair.close()
        assert pair.finish_reason == "stop" and timings.report["decode_wait_s"] == 0.3
        assert not aborts.sent and not call_of(pair.prefill).is_cancelled
        assert (p.num_inflight, p.num_pending_prefill_tokens, d.num_inflight) == (0, 0, 0)
        # P's messages arrive after D's end: counted once, and nothing is aborted.
        call_of(pair.prefill).send(token_ids=[7], timings=pb.Timings(queue_s=0.05, prefill_s=0.1))
        call_of(pair.prefill).send(finished=True, finish_reason="handoff",
                                   timings=pb.Timings(kv_transfer_s=0.02))
        await asyncio.wait_for(pair._prefill_task, 5)
        assert (p.num_inflight, p.num_pending_prefill_tokens) == (0, 0)
        assert timings.report["kv_transfer_s"] == 0.02 and not aborts.sent

    asyncio.run(scenario())


def test_a_leg_closed_at_its_last_token_is_done_not_aborted():
    """A stop string in the last message's text closes the run as that message's tokens
    are handed on: the engine has finished, so nothing is cancelled or aborted."""
    async def scenario():
        aborts, timings = Aborts(), RequestTimings("r1", CoordinatorMetrics())
        p, d, pair = make_pair(aborts, timings)
        pair.start(10.0)
        call_of(pair.prefill).send(token_ids=[7], timings=pb.Timings(queue_s=0.05, prefill_s=0.1))
        call_of(pair.decode).send(token_ids=[7])
        call_of(pair.decode).send(token_ids=[8], finished=True, finish_reason="length")
        stream = pair.tokens()
        assert [await stream.__anext__(), await stream.__anext__()] == [[7], [8]]
        pair.close()  # before the stream's end was read
        assert pair.finish_reason == "length" and pair.decode.finished
        assert not aborts.sent and not call_of(pair.decode).is_cancelled
        assert not call_of(pair.prefill).is_cancelled  # P ends by itself: its handoff
        call_of(pair.prefill).send(finished=True, finish_reason="handoff", timings=pb.Timings())
        await asyncio.wait_for(pair._prefill_task, 5)
        assert (p.num_inflight, p.num_pending_prefill_tokens, d.num_inflight) == (0, 0, 0)
        assert not aborts.sent

    asyncio.run(scenario())


def test_client_gone_mid_stream_cancels_and_aborts_both_legs():
    async def scenario():
        aborts = Aborts()
        p, d, pair = make_pair(aborts, RequestTimings("r1", CoordinatorMetrics()))
        pair.start(10.0)
        call_of(pair.decode).send(token_ids=[7])
        stream = pair.tokens()
        assert await stream.__anext__() == [7]
        pair.close()  # what closing the run does
        assert call_of(pair.decode).is_cancelled and call_of(pair.prefill).is_cancelled
        assert sorted(aborts.sent) == [("d1", "r1"), ("p1", "r1")]
        assert (p.num_inflight, p.num_pending_prefill_tokens, d.num_inflight) == (0, 0, 0)

    asyncio.run(scenario())


def test_engine_request_is_what_is_left_of_the_stream():
    params = SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, seed=None, stop=["\n"],
                              ignore_eos=True, min_tokens=4)
    kv = pb.KVTransferParams(role="decode", mode="push", transfer_id="x-r1.2", peer="p1:2")
    continued = engine_request(params, "r1.2", [1, 2, 3, 9, 9, 9], 3, kv)
    assert continued == build_generate_request(
        "r1.2", prompt_token_ids=[1, 2, 3, 9, 9, 9], max_tokens=7, temperature=0.7, top_p=0.9,
        stop=["\n"], ignore_eos=True, min_tokens=1, sample_offset=3,
        kv_transfer={"role": "decode", "mode": "push", "transfer_id": "x-r1.2", "peer": "p1:2"})
    assert not continued.sampling.HasField("seed")
    first = engine_request(SamplingParams(max_tokens=4, seed=7), "r1", [1, 2], 0)
    assert first.sampling.seed == 7 and first.sampling.max_tokens == 4
    assert not first.HasField("kv_transfer")


def test_both_legs_failing_at_once_leaves_no_error_unretrieved():
    async def scenario():
        reported = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        aborts = Aborts()
        _, _, pair = make_pair(aborts, RequestTimings("r1", CoordinatorMetrics()))
        pair.start(10.0)
        call_of(pair.prefill).fail(grpc.StatusCode.INVALID_ARGUMENT)  # e.g. a prompt too long:
        call_of(pair.decode).fail(grpc.StatusCode.INVALID_ARGUMENT)  # both engines refuse it
        with pytest.raises(ServeError):
            async for _ in pair.tokens():
                pass
        pair.close()
        del pair  # the request is over: nothing holds its legs
        await asyncio.sleep(0)
        gc.collect()  # a forgotten future's error is reported when it is collected
        await asyncio.sleep(0)
        assert reported == []

    asyncio.run(scenario())


def test_a_full_engine_is_load_not_a_failure():
    async def scenario():
        engine, aborts = inst("d1", "decode"), Aborts()
        leg = make_leg(DecodeLeg, engine, aborts, RequestTimings("r1", CoordinatorMetrics()))
        leg.start(10.0)
        call_of(leg).fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode full: 12 blocks wanted, 3 free")
        with pytest.raises(EngineFull) as info:
            async for _ in leg.tokens():
                pass
        leg.close()
        assert (info.value.leg, info.value.engine, info.value.details) == (
            "decode", engine, "decode full: 12 blocks wanted, 3 free")
        assert engine.num_inflight == 0
        # gRPC's own RESOURCE_EXHAUSTED (a message too large) stays an engine failure.
        leg = make_leg(DecodeLeg, engine, aborts, RequestTimings("r1", CoordinatorMetrics()))
        leg.start(10.0)
        call_of(leg).fail(grpc.StatusCode.RESOURCE_EXHAUSTED)
        with pytest.raises(LegFailure):
            async for _ in leg.tokens():
                pass
        leg.close()

    asyncio.run(scenario())


def test_p_first_token_goes_out_before_d_has_the_kv():
    """P's message of the first token comes before D's (D exposes the KV only after the
    step it was in): the token is handed on at P's arrival, D's copy of it is dropped,
    and D's tokens follow, each timed by its own arrival."""
    async def scenario():
        aborts, timings = Aborts(), RequestTimings("r1", CoordinatorMetrics())
        p, d, pair = make_pair(aborts, timings)
        pair.start(10.0)
        stream = pair.tokens()
        call_of(pair.prefill).send(token_ids=[7], timings=pb.Timings(queue_s=0.05, prefill_s=0.1))
        assert await asyncio.wait_for(stream.__anext__(), 5) == [7]  # D has sent nothing
        assert pair.has_token and pair.arrival_s == call_of(pair.prefill).last_arrival_s
        assert pair.last_arrival_s == pair.arrival_s  # the idle gap runs from P's token
        await asyncio.sleep(0.01)
        call_of(pair.decode).send(token_ids=[7], timings=pb.Timings(kv_wait_s=0.1, decode_queue_s=0.2))
        call_of(pair.decode).send(token_ids=[8], finished=True, finish_reason="length")
        assert [ids async for ids in stream] == [[8]]
        assert pair.arrival_s == call_of(pair.decode).arrival_s  # D's own stamp again
        call_of(pair.prefill).send(finished=True, finish_reason="handoff", timings=pb.Timings())
        await asyncio.wait_for(pair.wait_report(), 5)
        pair.close()
        assert timings.report["decode_queue_s"] == 0.2 and not aborts.sent
        assert (p.num_inflight, p.num_pending_prefill_tokens, d.num_inflight) == (0, 0, 0)

    asyncio.run(scenario())


@pytest.mark.parametrize("failing", ["prefill", "decode"])
def test_a_failure_after_p_first_token_went_out_is_mid_stream(failing):
    """Once P's first token went out, the attempt's failure before D's first message is
    a continuation's (the client has a token): P's failure still ends the attempt (D
    would wait for KV that never comes), and D's is classified mid-stream."""
    async def scenario():
        aborts = Aborts()
        p, d, pair = make_pair(aborts, RequestTimings("r1", CoordinatorMetrics()))
        pair.start(10.0)
        stream = pair.tokens()
        call_of(pair.prefill).send(token_ids=[7], timings=pb.Timings(queue_s=0.05, prefill_s=0.1))
        assert await asyncio.wait_for(stream.__anext__(), 5) == [7]
        fails = call_of(pair.prefill if failing == "prefill" else pair.decode)
        fails.send(finished=True, finish_reason="error", error="kv send failed")
        with pytest.raises(LegFailure) as info:
            await asyncio.wait_for(stream.__anext__(), 5)
        pair.close()
        want = ("prefill", "before_handoff", p) if failing == "prefill" else ("decode", "mid_stream", d)
        assert (info.value.leg, info.value.stage, info.value.engine) == want
        assert (p.num_inflight, p.num_pending_prefill_tokens, d.num_inflight) == (0, 0, 0)

    asyncio.run(scenario())
