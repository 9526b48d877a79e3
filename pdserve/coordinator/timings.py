"""One request's timings: what a client sees with ``x-pdserve-timings: 1``.

``report`` is that dict: the request id (the client's ``x-request-id`` when it sent
one), the engines it ran on, the number of attempts, the stage durations
(``<stage>_s``, one of ``metrics.STAGES``) and the client-side latencies serving adds
at the end (``ttft_s``, ``tpot_s``, ``e2e_s``). Written on the event loop by the
request's legs (engine-reported stages), its run (routing, attempts) and serving
(first decode, latencies); never read per token.

Invariants: a stage is added up across attempts (the client waited for all of them)
and every addition is also observed once in the stage histogram; the engines'
addresses (``ADDRESS_KEYS``) reach only an admin (``visible``).
"""

from __future__ import annotations

from .metrics import CoordinatorMetrics

ADDRESS_KEYS = ("prefill_instance", "decode_instance")


class RequestTimings:
    __slots__ = ("report", "_metrics")

    def __init__(self, request_id: str, metrics: CoordinatorMetrics) -> None:
        self.report: dict[str, float | int | str | None] = {"request_id": request_id}
        self._metrics = metrics

    def visible(self, is_admin: bool) -> dict[str, float | int | str | None]:
        """What the client is shown: the whole report for an admin, else all but the
        engines' addresses. Called by serving at the end of the request."""
        if is_admin:
            return self.report
        return {k: v for k, v in self.report.items() if k not in ADDRESS_KEYS}

    def observe_cached(self, num_tokens: int) -> None:
        """A prefilling engine's prefix-cache hits, against the router's prediction."""
        self._metrics.prefix_reported.inc(num_tokens)

    def observe(self, stage: str, seconds: float) -> None:
        key = stage + "_s"
        self.report[key] = float(self.report.get(key) or 0.0) + seconds
        self._metrics.observe_stage(stage, seconds)
