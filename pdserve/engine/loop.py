"""The engine's own thread: the only thread that touches ``LLMEngine``.

Other threads (the gRPC server's event loop) talk to it through ``submit`` and
``abort``, which enqueue commands; the loop drains them between steps, runs
``step()`` while there is work, and hands each ``RequestOutput`` to the request's
sink. A failing step never kills the loop: every request in it ends with an error
and the engine goes on with new ones.

A busy engine is not a dead one: after every step and every drained command the
loop publishes ``snapshot`` (a ``StatsResponse``, replaced whole, never mutated), so
Health, Stats and metrics scrapes are answered at once from it instead of queueing
behind a step that may run for seconds. A request's arrival time is stamped in
``submit`` (on receipt), so time spent waiting for a running step counts as queue.

Every admitted request has a sink until its last output, and that output says
``finished``: a step's, an abort's (``finish_reason`` "abort") or a failure's. The
inbox is one FIFO, so an ``abort`` queued after a ``submit`` is handled after it;
admission is skipped for a caller that cancelled its admission future first.

An idle engine does not step, so a KV control message (a peer's HELLO or PROBE)
wakes it: the connector's wake-up queues one "kv" command (at most one queued at a
time), and the loop runs ``service_kv`` for it when no step would.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from pdserve.api.proto.engine_pb2 import StatsResponse
from pdserve.api.sampling import SamplingParams
from pdserve.engine.admission import EngineInputError, EngineUnavailable
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import RequestStatus

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.snapshot: StatsResponse = engine.stats()
        self.is_idle = True  # no request or transfer left, as of the last snapshot
        self._kv_wake_queued = threading.Event()
        if engine.connector is not None:
            engine.connector.set_wakeup(self._wake_for_kv)

    def _wake_for_kv(self) -> None:
        """Transport threads: a control message arrived; queue one "kv" command."""
        if not self._kv_wake_queued.is_set():
            self._kv_wake_queued.set()
            self._inbox.put(("kv",))

    def _publish(self) -> None:
        # One attribute store each: readers on other threads see the old or the new one whole.
        self.snapshot = self.engine.stats()
        self.is_idle = not self.engine.has_unfinished

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout_s)
        self.engine.close()

    # -- called from other threads ------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        prompt: str | None,
        params: SamplingParams,
        sink: Sink,
        kv_transfer=None,
    ) -> Future:
        """Queue a request. The future resolves to None once admitted, or raises
        ``EngineInputError`` when the engine refuses it; cancelling it before the loop
        took it up means the request is never admitted."""
        admitted: Future = Future()
        self._inbox.put(("add", request_id, prompt_token_ids, prompt, params, sink, admitted,
                         kv_transfer, time.monotonic()))
        return admitted

    def abort(self, request_id: str, owner: Sink | None = None) -> Future:
        """End a request; its stream gets a last output with ``finish_reason`` "abort".
        With ``owner``, only while that sink still owns the id (a call ending its own
        request never ends another call's). The future resolves to whether it ended one;
        idempotent."""
        ended: Future = Future()
        self._inbox.put(("abort", request_id, owner, ended))
        return ended

    def fail_all(self, message: str) -> Future:
        """End every live request with ``message`` as its error (shutdown); resolves to
        how many."""
        return self.call(lambda engine: self._fail_all(message))

    def call(self, fn: Callable[[LLMEngine], object]) -> Future:
        """Run ``fn(engine)`` on the loop thread (stats, reconfiguration)."""
        result: Future = Future()
        self._inbox.put(("call", fn, result))
        return result

    # -- the loop thread ------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self.engine.has_unfinished:
                wait_s = 0.5
            elif self.engine.last_step_idle:
                wait_s = 0.001  # only transfers to drive: poll, but don't spin
            else:
                wait_s = 0.0
            try:
                if self._drain(wait_s):
                    self._publish()
            except Exception:  # noqa: BLE001 - the loop must survive anything a command does
                log.exception("engine command failed")
            if self.engine.has_unfinished:
                self._step()
                self._publish()

    def _drain(self, wait_s: float) -> int:
        """Run queued commands; returns how many ran."""
        num_done = 0
        while True:
            try:
                cmd = self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait()
            except queue.Empty:
                return num_done
            wait_s = 0.0
            num_done += 1
            kind = cmd[0]
            if kind == "add":
                _, rid, ids, prompt, params, sink, admitted, kv, arrival_s = cmd
                if not admitted.set_running_or_notify_cancel():
                    continue  # the caller went away before we got to it
                try:
                    self.engine.add_request(rid, ids, params, prompt, kv, arrival_s=arrival_s)
                except Exception as exc:  # noqa: BLE001 - the caller must hear of it
                    if not isinstance(exc, (EngineInputError, EngineUnavailable)):
                        log.exception("admitting request %s failed", rid)
                    admitted.set_exception(exc)
                    continue
                self._sinks[rid] = sink
                admitted.set_result(None)
                log.info("request %s admitted", rid)
            elif kind == "abort":
                _, rid, owner, ended = cmd
                _resolve(ended, self._abort, rid, owner)
            elif kind == "call":
                _, fn, result = cmd
                _resolve(result, fn, self.engine)
            elif kind == "kv":
                self._kv_wake_queued.clear()
                if not self.engine.has_unfinished:  # else the next step handles it
                    self._deliver(self.engine.service_kv())

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
            log.exception("engine step failed; failing its requests")
            self._fail_all(f"engine step failed: {exc}")
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
                log.info(
                    "request %s finished reason=%s prompt_tokens=%d output_tokens=%d cached=%d",
                    out.request_id, out.finish_reason, out.num_prompt_tokens,
                    out.num_output_tokens, out.num_cached_tokens,
                )
            if sink is not None:
                sink(out)

    def _abort(self, rid: str, owner: Sink | None) -> bool:
        if owner is not None and self._sinks.get(rid) is not owner:
            return False
        out = self.engine.end_request(rid, RequestStatus.FINISHED_ABORTED)
        sink = self._sinks.pop(rid, None)
        if out is None:
            return False
        log.info("request %s aborted", rid)
        if sink is not None:
            sink(out)
        return True

    def _fail_all(self, message: str) -> int:
        num_failed = 0
        for rid in list(self.engine.requests):
            out = self.engine.end_request(rid, RequestStatus.FINISHED_ERROR, message)
            sink = self._sinks.pop(rid, None)
            if out is not None:
                num_failed += 1
                if sink is not None:
                    sink(out)
        return num_failed


def _resolve(future: Future, fn: Callable[..., object], *args) -> None:
    """Run ``fn(*args)`` and hand its result or exception to ``future``, unless the caller
    cancelled the future meanwhile (``fn`` runs either way)."""
    try:
        value = fn(*args)
    except Exception as exc:  # noqa: BLE001 - handed back to the caller
        if future.set_running_or_notify_cancel():
            future.set_exception(exc)
        return
    if future.set_running_or_notify_cancel():
        future.set_result(value)
