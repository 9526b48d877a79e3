"""What one engine did, as cumulative counters: the Controller's SLO planner learns the
engine's speed and the cluster's demand from their differences between heartbeats
(``controller/planner.py``). Counters, not per-request samples, so what travels and what
the Controller computes does not grow with the load.

Owned by the scheduler (prompts prefilled, generations finished and the output they were
allowed) and fed by the engine
after every model step (``step``: the step's time goes to prefill when it computed any
prompt token, else to the decode line of step time against batch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdserve.engine.request import Request


@dataclass
class LoadCounters:
    num_prefills_total: int = 0
    prefill_busy_s_total: float = 0.0
    prefill_queue_s_total: float = 0.0
    num_decode_steps_total: int = 0
    decode_batch_total: float = 0.0
    decode_batch_sq_total: float = 0.0
    decode_step_s_total: float = 0.0
    decode_batch_step_s_total: float = 0.0
    num_finished_total: int = 0
    output_budget_total: int = 0  # the output tokens the finished generations were allowed

    def prefilled(self, request: Request) -> None:
        """Called when a prompt prefilled here gets its first token."""
        self.num_prefills_total += 1
        if request.first_scheduled_s is not None:
            self.prefill_queue_s_total += max(0.0, request.first_scheduled_s - request.arrival_s)

    def finished(self, budget: int) -> None:
        """Called when a generation ends here (stop or length), with the output tokens it
        was allowed: the planner reads what share of their budget streams use."""
        self.num_finished_total += 1
        self.output_budget_total += budget

    def step(self, num_prefill_tokens: int, num_decodes: int, seconds: float) -> None:
        """Called after each model step with what it computed and how long it took."""
        if num_prefill_tokens:
            self.prefill_busy_s_total += seconds
        elif num_decodes:
            self.num_decode_steps_total += 1
            self.decode_batch_total += num_decodes
            self.decode_batch_sq_total += num_decodes * num_decodes
            self.decode_step_s_total += seconds
            self.decode_batch_step_s_total += num_decodes * seconds

    def fields(self) -> dict[str, float]:
        """As ``StatsResponse`` fields."""
        return asdict(self)
