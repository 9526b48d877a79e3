"""The SLO planner's policy on synthetic timings: each test makes the requests a load
would finish with (``load``: prefill time from prompt tokens at a P engine's speed,
decode step time from the batch, one ``Observation`` per request) and reads what the
planner wants and does."""

from __future__ import annotations

import random

from pdserve.controller.planner import (
    DECODE,
    DRAINING,
    PENDING,
    PREFILL,
    READY,
    Action,
    Decision,
    Engine,
    Observation,
    Planner,
    PlannerSettings,
    decode_line,
    learn,
    predicted_tpot_s,
    total,
    wanted_decode,
    wanted_prefill,
)

SLO = PlannerSettings(ttft_ms=1000, tpot_ms=50, window_s=60, cooldown_s=120, stable_ticks=3, min_requests=20,
                      max_engines=16)


def load(planner: Planner, now_s: float, rate: float, prompt: int, output: int, *, prefill_tok_s=4000.0,
         kv_s=0.02, step_a=0.010, step_b=0.001, batch=8.0, noise=0.0, seed=0) -> None:
    """``rate`` requests/s over the planner's window before ``now_s``."""
    rng = random.Random(seed)
    n = int(rate * planner.settings.window_s)
    for i in range(n):
        jitter = 1 + rng.uniform(-noise, noise)
        planner.observe(Observation.of_request(
            at_s=now_s - planner.settings.window_s + (i + 0.5) / rate, prompt_tokens=prompt,
            output_tokens=output, prefill_s=prompt / prefill_tok_s * jitter, kv_s=kv_s,
            tpot_s=(step_a + step_b * batch * (0.5 + i % 3 / 2)) * jitter, decode_batch=batch * (0.5 + i % 3 / 2)))


def fleet(p: int, d: int, pending_p: int = 0, pending_d: int = 0, waiting: int = 0) -> list[Engine]:
    """``waiting``: prompts queued at each P engine now."""
    return ([Engine(f"p{i}", PREFILL, READY, num_running=i, num_waiting=waiting) for i in range(p)]
            + [Engine(f"d{i}", DECODE, READY, num_running=i) for i in range(d)]
            + [Engine(f"pp{i}", PREFILL, PENDING) for i in range(pending_p)]
            + [Engine(f"pd{i}", DECODE, PENDING) for i in range(pending_d)])


def ticks(planner: Planner, engines: list[Engine], start_s: float, n: int, step_s: float = 10.0, **shape):
    """``n`` ticks under a steady load; the decisions."""
    out = []
    for k in range(n):
        now = start_s + k * step_s
        planner.observations.clear()
        load(planner, now, seed=k, **shape)
        out.append(planner.decide(engines, now))
    return out


def test_the_model_learns_prefill_speed_decode_step_line_and_demand():
    planner = Planner(SLO)
    load(planner, 100.0, rate=2.0, prompt=2000, output=100, prefill_tok_s=5000, step_a=0.012, step_b=0.002)
    m = learn(planner.observations, 100.0, 60.0)
    assert m.num_requests == 120 and abs(m.rate - 2.0) < 0.05
    assert abs(m.prefill_tok_s - 5000) < 1 and m.prompt_tokens == 2000 and m.output_tokens == 100
    assert abs(m.step_a_s - 0.012) < 1e-9 and abs(m.step_b_s - 0.002) < 1e-9


def test_prefill_queueing_that_breaks_ttft_scales_prefill_up_after_the_signal_holds():
    # 3 req/s of 2000-token prompts at 4000 tok/s: 0.5 s each, 1.5 s of work per second
    planner = Planner(SLO)
    decisions = ticks(planner, fleet(1, 1), 1000.0, 3, rate=3.0, prompt=2000, output=20)
    wanted = decisions[-1].wanted
    m = decisions[-1].model
    # s = 0.5 s, budget = 1 - 0.02: N >= 1.5 / (1 - 0.5/0.98) = 3.06 -> 4
    assert wanted[PREFILL] == wanted_prefill(m, 1.0) == 4
    assert [d.action for d in decisions[:2]] == [None, None] and "1/3" in decisions[0].reason
    assert decisions[2].action == Action("scale", PREFILL, +1), decisions[2].reason


def test_a_decode_pool_with_headroom_gives_an_engine_to_a_short_prefill_pool():
    planner = Planner(SLO)
    # light decode (few output tokens) on 3 D, heavy prefill on 1 P
    decisions = ticks(planner, fleet(1, 3), 1000.0, 3, rate=1.5, prompt=2000, output=10)
    assert decisions[-1].wanted[DECODE] == 1
    action = decisions[-1].action
    assert action.kind == "switch" and action.role == PREFILL
    assert action.instance_id == "d0"  # the least busy D


def test_a_steady_load_that_fits_changes_nothing():
    planner = Planner(SLO)
    engines = fleet(2, 2)
    # 1 req/s: 0.5 s prefills want 2 P; 50 streams at 40 per D (50 ms TPOT) want 2 D
    decisions = ticks(planner, engines, 1000.0, 10, rate=1.0, prompt=2000, output=1000)
    assert decisions[-1].wanted == {PREFILL: 2, DECODE: 2}, decisions[-1].reason
    assert all(d.action is None for d in decisions), [d.reason for d in decisions]
    assert "balanced" in decisions[-1].reason


def test_a_noisy_signal_around_a_threshold_does_not_flap():
    planner = Planner(SLO)
    engines = fleet(2, 2)
    actions = []
    for k in range(60):  # ten minutes of 10 s ticks, the rate moving either side of 2 P's limit
        now = 1000.0 + 10 * k
        planner.observations.clear()
        load(planner, now, rate=1.0 + (0.35 if k % 2 else -0.35), prompt=2000, output=1000, noise=0.2, seed=k)
        if (d := planner.decide(engines, now)).action is not None:
            actions.append(d.action)
    assert actions == [], actions


def test_pending_engines_are_not_capacity_and_do_not_bring_more():
    planner = Planner(SLO)
    decisions = ticks(planner, fleet(1, 1, pending_p=2), 1000.0, 5, rate=3.0, prompt=2000, output=20)
    last = decisions[-1]
    assert last.have[PREFILL] == 1 and last.wanted[PREFILL] == 4
    assert all(d.action is None for d in decisions) and "pending" in last.reason


def test_cooldown_after_an_action_and_one_action_at_a_time():
    planner = Planner(SLO)
    first = ticks(planner, fleet(1, 1), 1000.0, 3, rate=3.0, prompt=2000, output=20)
    assert first[-1].action == Action("scale", PREFILL, +1)
    # the new engine has not come up yet: the same shortage, within the cooldown
    again = ticks(planner, fleet(1, 1), 1030.0, 8, rate=3.0, prompt=2000, output=20)
    assert all(d.action is None for d in again) and "cooling down" in again[0].reason
    # the cooldown over (120 s after 1020 s): the next +1, then cooling down again
    later = ticks(planner, fleet(2, 1), 1130.0, 3, rate=3.0, prompt=2000, output=20)
    assert [d.action for d in later] == [None, Action("scale", PREFILL, +1), None]


def test_scale_down_only_when_the_load_fits_on_one_engine_fewer_for_the_whole_delay():
    settings = PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, cooldown_s=0, min_requests=20,
                               max_engines=16, scale_down_delay_s=60)
    planner = Planner(settings)
    # a light load on 4 D: 1 is wanted, and 3 would still leave room, for 60 s
    decisions = ticks(planner, fleet(1, 4), 1000.0, 7, rate=0.5, prompt=200, output=100, batch=4)
    assert all(d.action is None and d.reason.startswith(f"a surplus for {10 * k} s of the 60 s")
               for k, d in enumerate(decisions[:6])), [d.reason for d in decisions]
    assert decisions[-1].action == Action("scale", DECODE, -1, instance_id="d0"), decisions[-1].reason
    m = decisions[-1].model
    assert predicted_tpot_s(m, 3, 0.05) <= 0.8 * 0.05
    # a lull: the surplus interrupted by one busy tick starts its delay again
    planner = Planner(settings)
    ticks(planner, fleet(1, 4), 1000.0, 5, rate=0.5, prompt=200, output=100, batch=4)
    busy = ticks(planner, fleet(1, 4), 1050.0, 1, rate=20, prompt=200, output=100, batch=40)[0]
    assert busy.action is None or busy.action.delta >= 0, busy.reason
    after = ticks(planner, fleet(1, 4), 1060.0, 7, rate=0.5, prompt=200, output=100, batch=4)
    assert all(d.action is None for d in after[:-1]) and after[-1].action is not None, [d.reason for d in after]


def test_a_target_no_engine_count_can_meet_is_said_not_chased_past_the_bounds():
    settings = PlannerSettings(ttft_ms=300, tpot_ms=5, stable_ticks=1, max_prefill=4, max_decode=4, max_engines=8)
    planner = Planner(settings)
    d = ticks(planner, fleet(4, 4), 1000.0, 1, rate=1.0, prompt=2000, output=20)[-1]
    m = d.model
    assert wanted_prefill(m, 0.3) is None and wanted_decode(m, 0.005) is None
    assert "more engines do not help" in d.reason and d.wanted == {PREFILL: 4, DECODE: 4}
    assert d.action is None


def test_advisory_mode_reports_and_never_acts():
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, advisory=True))
    d = ticks(planner, fleet(1, 1), 1000.0, 1, rate=3.0, prompt=2000, output=20)[-1]
    assert d.action is None and d.reason.startswith("advisory: would add one prefill engine")


def test_an_idle_cluster_shrinks_to_the_minimums_one_engine_at_a_time_once_idle_a_whole_window():
    planner = Planner(PlannerSettings(stable_ticks=1, cooldown_s=0, min_prefill=1, min_decode=1, window_s=60))
    engines = fleet(3, 2)
    planner.observe(Observation(1000.0, span_s=30.0))  # just started: half a window seen
    assert planner.decide(engines, 1000.0).action is None
    planner.observe(Observation(1030.0, span_s=30.0))
    d = planner.decide(engines, 1030.0)
    assert d.wanted == {PREFILL: 1, DECODE: 1} and d.action.kind == "scale" and d.action.delta == -1


def test_a_surplus_engine_is_kept_while_the_other_pool_runs_close_to_its_target():
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=5, max_engines=16, scale_down_delay_s=0))
    # 0.4 prompts/s of 2800 tokens: 1 P meets the TTFT (0.99 s) but above 0.8 of it; D idle
    d = ticks(planner, fleet(1, 2), 1000.0, 1, rate=0.4, prompt=2800, output=10)[-1]
    assert d.wanted == {PREFILL: 1, DECODE: 1} and d.action is None
    assert "decode surplus kept, prefill runs close to its target" in d.reason
    # a light prefill load: the decode surplus goes
    d = ticks(planner, fleet(1, 2), 2000.0, 1, rate=0.4, prompt=500, output=10)[-1]
    assert d.action == Action("scale", DECODE, -1, instance_id="d0"), d.reason


def test_a_decode_line_fitted_to_batches_that_barely_vary_is_not_trusted():
    # steps at batch 31-33 whose times carry noise: a free fit's intercept is noise
    steps = [Observation.of_request(0.0, 10, 100, 0.1, tpot_s=t, decode_batch=b)
             for b, t in ((31, 0.070), (32, 0.060), (33, 0.075), (32, 0.068))]
    a, b = decode_line(total(steps))
    t = total(steps)
    assert a == 0.0 and abs(b - (t.step_s / t.num_steps) / (t.batch / t.num_steps)) < 1e-12
    # batches that spread: the fitted line
    spread = [Observation.of_request(0.0, 10, 100, 0.1, tpot_s=0.010 + 0.002 * b, decode_batch=b) for b in (2, 8, 16)]
    a, b = decode_line(total(spread))
    assert abs(a - 0.010) < 1e-9 and abs(b - 0.002) < 1e-9


def test_engines_still_leaving_hold_their_budget_and_their_pool_waits_for_them():
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=20, max_engines=3))
    leaving_d = [Engine("d9", DECODE, DRAINING)]
    # prefill is short; 1 P + 1 D ready and a D leaving: the budget of 3 is taken
    d = ticks(planner, fleet(1, 1) + leaving_d, 1000.0, 1, rate=3.0, prompt=2000, output=20)[-1]
    assert d.action is None and "at the budget of 3" in d.reason, d.reason
    # decode is short while one of its engines is leaving: no +1 D until it is gone
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=5, max_engines=8))
    d = ticks(planner, fleet(1, 1) + leaving_d, 2000.0, 1, rate=0.2, prompt=200, output=10000, batch=40)[-1]
    assert d.wanted[DECODE] > 1 and d.action is None and "still leaving" in d.reason, d.reason


def test_a_surplus_whose_engines_cannot_leave_is_held():
    planner = Planner(PlannerSettings(stable_ticks=1, cooldown_s=0, window_s=60))
    engines = [Engine("p0", PREFILL, READY, can_leave=False), Engine("d0", DECODE, READY, can_leave=False),
               Engine("d1", PREFILL, READY, can_leave=False)]  # a switched engine, not its pool's highest
    planner.observe(Observation(1000.0, span_s=60.0))  # idle a whole window: wants 1 P + 1 D
    d = planner.decide(engines, 1000.0)
    assert d.action is None and "none of its engines can leave" in d.reason, d.reason


def test_a_shift_from_long_prompts_to_long_outputs_switches_the_surplus_engine_rather_than_removing_it():
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=20, max_engines=3))

    def phase(start_s: float, end_s: float, prompt: int, output: int, rate: float = 1.2,
              streams: float = 8.0) -> None:
        for i in range(int((end_s - start_s) * rate)):
            batch = streams * (0.5 + i % 3 / 2)
            planner.observe(Observation.of_request(
                at_s=start_s + (i + 0.5) / rate, prompt_tokens=prompt, output_tokens=output,
                prefill_s=prompt / 4000, kv_s=0.02, tpot_s=0.010 + 0.001 * batch, decode_batch=batch))

    # 45 s of 2000-token prompts with 10 outputs (2 P wanted), then 15 s of 100-token
    # prompts with 800 outputs (2 D wanted): the window averages to 1 P + 1 D, and its
    # P surplus is what the last quarter's decode load needs
    phase(940.0, 985.0, prompt=2000, output=10)
    phase(985.0, 1000.0, prompt=100, output=800)
    d = planner.decide(fleet(2, 1), 1000.0)
    assert d.wanted == {PREFILL: 1, DECODE: 1} and d.action is None, d.reason
    assert "prefill surplus kept, decode runs close to its target" in d.reason
    # the window alone fits the decode load on one engine; the last quarter does not
    recent = learn([o for o in planner.observations if o.at_s >= 985.0], 1000.0, 15.0)
    assert predicted_tpot_s(d.model, 1, 0.05) <= 0.8 * 0.05 < predicted_tpot_s(recent, 1, 0.05)
    # once the window holds the new phase, the surplus engine changes role: one action;
    # not while the one D engine measures a step well within the target (the line's
    # prediction alone), but once it runs the phase's streams (48 in flight: 58 ms)
    phase(1000.0, 1060.0, prompt=100, output=800)
    d = planner.decide(fleet(2, 1), 1060.0)
    assert d.wanted == {PREFILL: 1, DECODE: 2} and d.action is None, d.reason
    assert "decode measured well within its target" in d.reason
    planner.observations.clear()
    phase(1000.0, 1060.0, prompt=100, output=800, streams=48.0)
    d = planner.decide(fleet(2, 1), 1060.0)
    assert d.wanted == {PREFILL: 1, DECODE: 2} and d.action == Action("switch", DECODE, instance_id="p0"), d.reason


def test_decode_engines_are_sized_by_their_kv_caches_too_and_a_full_one_asks_for_one_more():
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=5, max_engines=4, scale_down_delay_s=0))

    def with_kv(p: int, d: int, used: list[int], total: int = 1000) -> list[Engine]:
        return ([Engine(f"p{i}", PREFILL, READY) for i in range(p)]
                + [Engine(f"d{i}", DECODE, READY, kv_blocks_used=u, kv_blocks_total=total)
                   for i, u in enumerate(used)][:d])

    # a light load the step line fits on one D engine; its cache at 50%: one is enough
    d = ticks(planner, with_kv(1, 1, [500]), 1000.0, 1, rate=0.5, prompt=100, output=100, batch=2.0)[-1]
    assert d.wanted[DECODE] == 1 and d.action is None, d.reason
    # the same load with the cache 90% full: 900 / (0.8 * 1000) -> 2 engines
    d = ticks(planner, with_kv(1, 1, [900]), 2000.0, 1, rate=0.5, prompt=100, output=100, batch=2.0)[-1]
    assert d.wanted[DECODE] == 2 and "decode KV 900 blocks" in d.reason, d.reason
    assert d.action == Action("scale", DECODE, +1), d.reason
    # two D engines, one full: the pool under-reads its demand, one more is wanted
    planner = Planner(planner.settings)
    d = ticks(planner, with_kv(1, 2, [960, 300]), 3000.0, 1, rate=0.5, prompt=100, output=100, batch=2.0)[-1]
    assert d.wanted[DECODE] == 3 and "one full" in d.reason, d.reason
    # a decode surplus is not removed while the KV in use would not fit one engine fewer
    planner = Planner(planner.settings)
    d = ticks(planner, with_kv(1, 2, [400, 400]), 4000.0, 1, rate=0.5, prompt=100, output=100, batch=2.0)[-1]
    assert d.wanted[DECODE] == 1 and d.action is None, d.reason
    d = ticks(planner, with_kv(1, 2, [100, 100]), 5000.0, 1, rate=0.5, prompt=100, output=100, batch=2.0)[-1]
    assert d.action == Action("scale", DECODE, -1, instance_id="d0"), d.reason


def test_after_an_action_only_what_was_measured_since_says_a_pool_is_saturated_or_spare():
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, cooldown_s=0, min_requests=8,
                                      max_engines=4, window_s=60, scale_down_delay_s=0))

    def requests(start_s: float, n: int, queue_s: float) -> None:
        for i in range(n):  # 400-token prompts at 4000 tok/s: 0.1 s of prefill each
            planner.observe(Observation.of_request(at_s=start_s + i, prompt_tokens=400, output_tokens=10,
                                                   prefill_s=0.1, prefill_queue_s=queue_s, kv_s=0.02,
                                                   tpot_s=0.012, decode_batch=2.0))

    # prompts that queued 2 s at one P engine, and a backlog cleared by now: nothing
    requests(940.0, 30, queue_s=2.0)
    d = planner.decide(fleet(1, 1), 1000.0)
    assert d.action is None and d.wanted[PREFILL] == 1, d.reason
    # ... with prompts queued now: the rate alone says one is enough, what they measured
    # says it is saturated
    d = planner.decide(fleet(1, 1, waiting=3), 1000.5)
    assert d.action == Action("scale", PREFILL, +1) and "measured TTFT" in d.reason, d.reason
    # the next tick: the window still holds those queued prompts, nothing new is measured:
    # no second +1, and no -1 of the engine just added either
    d = planner.decide(fleet(2, 1, waiting=3), 1001.0)
    assert d.action is None and d.wanted[PREFILL] == 1, d.reason
    # prompts since the action that still queue: one more
    requests(1002.0, 4, queue_s=2.0)
    d = planner.decide(fleet(2, 1, waiting=3), 1006.0)
    assert d.action == Action("scale", PREFILL, +1), d.reason
    # prompts since that answer at once: the surplus may go
    requests(1007.0, 10, queue_s=0.0)
    d = planner.decide(fleet(3, 1), 1020.0)
    assert d.action is not None and (d.action.role, d.action.delta) == (PREFILL, -1), d.reason


def test_a_switch_the_window_wants_and_its_last_quarter_does_not_waits():
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=20, max_engines=3))
    for start, end, prompt, output in ((940.0, 985.0, 2000, 10), (985.0, 1000.0, 100, 800)):
        for i in range(int((end - start) * 2.0)):
            batch = 8.0 * (0.5 + i % 3 / 2)
            planner.observe(Observation.of_request(
                at_s=start + (i + 0.5) / 2.0, prompt_tokens=prompt, output_tokens=output,
                prefill_s=prompt / 4000, kv_s=0.02, tpot_s=0.010 + 0.001 * batch, decode_batch=batch))
    # just switched to 1 P + 2 D for the long outputs: the window, still three quarters
    # long prompts, wants 2 P + 1 D; its last quarter wants what runs
    d = planner.decide(fleet(1, 2), 1000.0)
    assert d.wanted == {PREFILL: 2, DECODE: 1} and d.action is None, d.reason
    assert "not over its last quarter" in d.reason


def phases(planner: Planner, *spans: tuple[float, float, int, int], rate: float = 2.0, queue_s: float = 0.0) -> None:
    """Requests of each ``(start_s, end_s, prompt, output)`` span at ``rate`` per second."""
    for start, end, prompt, output in spans:
        for i in range(int((end - start) * rate)):
            batch = 8.0 * (0.5 + i % 3 / 2)
            planner.observe(Observation.of_request(
                at_s=start + (i + 0.5) / rate, prompt_tokens=prompt, output_tokens=output,
                prefill_s=prompt / 4000, prefill_queue_s=queue_s, kv_s=0.02,
                tpot_s=0.010 + 0.001 * batch, decode_batch=batch))


def test_a_pool_saturated_now_switches_on_the_last_quarter_while_the_window_still_holds_the_old_mix():
    settings = PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=20, max_engines=3)

    def engines(p: int, d: int, kv_used: int, waiting: int = 0) -> list[Engine]:
        return ([Engine(f"p{i}", PREFILL, READY, num_waiting=waiting) for i in range(p)]
                + [Engine(f"d{i}", DECODE, READY, num_running=i, kv_blocks_used=kv_used, kv_blocks_total=1000)
                   for i in range(d)])

    # long prompts, then long outputs for the last quarter: the window (2 P wanted from
    # the old mix, the budget shared) says what runs, 2 P + 1 D
    def shift() -> Planner:
        planner = Planner(settings)
        phases(planner, (940.0, 985.0, 2000, 10), (985.0, 1000.0, 100, 800))
        return planner
    # ... and the one D engine's cache has room: nothing says decode is saturated, the window waits
    d = shift().decide(engines(2, 1, kv_used=500), 1000.0)
    assert d.action is None and d.wanted == {PREFILL: 2, DECODE: 1}, d.reason
    # its cache full: the last quarter (1 P + 2 D) decides the switch now
    d = shift().decide(engines(2, 1, kv_used=990), 1000.0)
    assert d.action == Action("switch", DECODE, instance_id="p0"), d.reason
    assert "a D engine's cache is full" in d.reason and "over the last quarter want 1 P + 2 D" in d.reason
    # a third full, then half full 4 s on (50 blocks/s): full within a quarter window
    # (15 s), the switch comes before it is
    planner = shift()
    first, d = (planner.decide(engines(2, 1, kv_used=used), now) for now, used in ((996.0, 300), (1000.0, 500)))
    assert first.action is None, first.reason
    assert d.action == Action("switch", DECODE, instance_id="p0"), d.reason
    assert "caches full within a quarter window (1250 blocks)" in d.reason, d.reason
    # half full and steady: nothing
    planner = shift()
    for now in (992.0, 996.0, 1000.0):
        d = planner.decide(engines(2, 1, kv_used=500), now)
    assert d.action is None, d.reason

    # the other way: long outputs, then long prompts (2 P wanted by the last quarter); the
    # prompts queued at the one P engine now break the TTFT target: the switch is now
    def back(waiting: int) -> Decision:
        planner = Planner(settings)
        phases(planner, (940.0, 985.0, 100, 800), (985.0, 1000.0, 2000, 10), rate=2.5)
        return planner.decide(engines(1, 2, kv_used=100, waiting=waiting), 1000.0)
    d = back(waiting=0)
    assert d.action is None, d.reason
    d = back(waiting=4)
    assert d.action == Action("switch", PREFILL, instance_id="d0"), d.reason
    assert "4.0 prompts queued per P engine, 500 ms each" in d.reason


def test_a_saturated_pool_the_last_quarter_does_not_want_grown_is_not_switched_to():
    # steady long outputs on 1 P + 2 D, one D cache full: the last quarter wants no more
    # P and no fewer D, so no switch (the KV rule asks for a third D through a scale)
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=20, max_engines=3))
    phases(planner, (940.0, 1000.0, 100, 800))
    engines = [Engine("p0", PREFILL, READY, num_waiting=9)] + [
        Engine(f"d{i}", DECODE, READY, kv_blocks_used=990, kv_blocks_total=1000) for i in range(2)]
    d = planner.decide(engines, 1000.0)
    assert d.action is None or d.action.kind != "switch", d.reason


def test_prompts_queued_behind_a_full_decode_cache_are_decodes_shortage_not_prefills():
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=20, max_engines=4))
    # short prompts that queued 2 s at P, long outputs, P's queue now 6
    phases(planner, (940.0, 1000.0, 100, 800), rate=0.5, queue_s=2.0)

    def engines(kv_used: int) -> list[Engine]:
        return [Engine("p0", PREFILL, READY, num_waiting=6),
                Engine("d0", DECODE, READY, kv_blocks_used=kv_used, kv_blocks_total=1000)]
    # D's cache has room: P is saturated (what was measured and what queues now)
    d = planner.decide(engines(kv_used=500), 1000.0)
    assert d.wanted[PREFILL] == 2 and d.action == Action("scale", PREFILL, +1), d.reason
    # D's cache full: it holds P's prefilled KV back; decode is the one short
    planner = Planner(planner.settings)
    phases(planner, (940.0, 1000.0, 100, 800), rate=0.5, queue_s=2.0)
    d = planner.decide(engines(kv_used=990), 1000.0)
    assert d.wanted == {PREFILL: 1, DECODE: 2} and d.action == Action("scale", DECODE, +1), d.reason


def test_streams_that_started_together_and_fill_the_decode_cache_switch_though_no_prompt_arrives_since():
    # long prompts, then 40 long-output streams at once; they all decode, so no prompt
    # arrives in the last quarter (5 s), while the one D engine's cache fills at 100 blocks/s
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, window_s=20, stable_ticks=1, min_requests=5,
                                      max_engines=3))
    phases(planner, (976.0, 989.0, 2000, 10))
    phases(planner, (990.0, 991.2, 100, 800), rate=10.0)
    engines = [Engine(f"p{i}", PREFILL, READY) for i in range(2)]
    decisions = [planner.decide(engines + [Engine("d0", DECODE, READY, kv_blocks_used=used, kv_blocks_total=1000)],
                                now) for now, used in ((996.0, 300), (998.0, 500), (1000.0, 700))]
    # the first tick: the window (mostly long prompts) says what runs, and holds
    assert decisions[0].action is None and decisions[0].wanted == {PREFILL: 2, DECODE: 1}, decisions[0].reason
    d = decisions[1]
    assert d.action == Action("switch", DECODE, instance_id="p0"), d.reason
    assert "over the last quarter want 1 P + 2 D" in d.reason and "full within a quarter window" in d.reason


def test_streams_decoding_with_no_prompt_for_a_whole_window_are_a_load_not_an_idle_cluster():
    # long outputs that started together: for a whole window no prompt arrives, yet every
    # D engine decodes; an idle cluster's scale-down must not take one of them away
    planner = Planner(PlannerSettings(window_s=20, stable_ticks=1, cooldown_s=0, min_prefill=1, min_decode=1))
    engines = [Engine("p0", PREFILL, READY)] + [Engine(f"d{i}", DECODE, READY, num_running=40) for i in range(2)]
    for now in (990.0, 1000.0):
        planner.observe(Observation(now, span_s=10.0, num_steps=120.0, batch=4800.0, batch_sq=192000.0,
                                    step_s=9.6, batch_step_s=384.0))
        d = planner.decide(engines, now)
    assert d.action is None and d.wanted == {PREFILL: 1, DECODE: 2}, d.reason
    # nothing decoded either, for a whole window: idle, and the surplus D goes
    planner.observe(Observation(1021.0, span_s=21.0))
    d = planner.decide(engines, 1021.0)
    assert d.wanted == {PREFILL: 1, DECODE: 1} and d.action.kind == "scale" and d.action.delta == -1, d.reason


def test_long_prompts_waiting_at_p_switch_an_engine_before_any_of_them_is_prefilled():
    # long outputs, short prompts for the whole window; then long prompts arrive and wait
    # at the one P engine: nothing measured shows them yet, the prompt tokens waiting do
    settings = PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=20, max_engines=3)

    def decide(waiting_tokens: int) -> Decision:
        planner = Planner(settings)
        phases(planner, (940.0, 1000.0, 100, 800), rate=2.5)
        # d0 runs as many streams as d1, but more of its decode legs wait for their KV
        # (committed blocks): its drain would wait for their prefills too
        engines = [Engine("p0", PREFILL, READY, num_waiting=4, waiting_prompt_tokens=waiting_tokens)] + [
            Engine(f"d{i}", DECODE, READY, num_running=3, kv_blocks_used=100, kv_blocks_total=1000,
                   kv_blocks_committed=350 - 200 * i) for i in range(2)]
        return planner.decide(engines, 1000.0)
    d = decide(400)  # four short prompts: 0.1 s of prefill
    assert d.action is None and d.wanted == {PREFILL: 1, DECODE: 2}, d.reason
    d = decide(8000)  # four long ones: 2 s at 4000 tokens/s, the target is 1 s
    assert d.action == Action("switch", PREFILL, instance_id="d1"), d.reason
    assert "8000 prompt tokens waiting at P" in d.reason, d.reason


def test_the_blocks_streams_were_allowed_bring_a_filling_cache_forward_and_steady_streams_do_not():
    planner = Planner(PlannerSettings(window_s=20))  # the rate projects a quarter, 5 s

    def kv(used_then: int, used: int, committed: int, share: float = 1.0):
        planner._kv_seen.clear()
        for now, u in ((998.0, used_then), (1000.0, used)):
            engines = [Engine("d0", DECODE, READY, kv_blocks_used=u, kv_blocks_total=1000,
                              kv_blocks_committed=committed)]
            out = planner._decode_kv(engines, now, share)
        return out
    # 60 blocks/s: 720 a quarter on, from an engine that does not say what its streams were allowed
    assert kv(300, 420, committed=0).projected == 720
    # the streams were allowed 1700: full within a quarter, since they go on at that rate
    # (1020 half a window on)
    filling = kv(300, 420, committed=1700)
    assert filling.projected == 1020 and filling.is_full_soon
    # they were allowed 600 only: they stop there
    assert kv(300, 420, committed=600).projected == 600 and not kv(300, 420, committed=600).is_full_soon
    # they use half of what they are allowed (the window's finished streams say so)
    assert kv(300, 420, committed=1700, share=0.5).projected == 1020  # 1060 expected
    assert kv(300, 420, committed=1000, share=0.5).projected == 710
    # six long prompts reserved at once, each allowed a few tokens more: a step, not a rate
    prompts = kv(0, 384, committed=390)
    assert prompts.projected == 390 and not prompts.is_full_soon
    # steady streams hold less than they were allowed and do not grow: nothing comes
    steady = kv(500, 500, committed=1700)
    assert steady.projected == 500 and not steady.is_full_soon


def test_streams_that_just_started_are_projected_at_their_last_ticks_growth_not_the_quarters():
    planner = Planner(PlannerSettings(window_s=20))  # a quarter: 5 s
    # flat for the quarter's first 3 s, then 96 streams start and grow 100 blocks/s
    for now, used in ((995.0, 100), (997.0, 100), (998.0, 100), (1000.0, 300)):
        kv = planner._decode_kv([Engine("d0", DECODE, READY, kv_blocks_used=used, kv_blocks_total=1000,
                                        kv_blocks_committed=1700)], now)
    # the quarter's rate (40 blocks/s) goes to 700 in half a window; the last tick's to 1300
    assert kv.projected == 1300 and kv.is_full_soon
    # the quarter began with the old phase's streams, which ended: it shrank over the
    # quarter, and grows at the last tick's rate
    planner._kv_seen.clear()
    for now, used in ((995.0, 400), (997.0, 100), (998.0, 100), (1000.0, 300)):
        kv = planner._decode_kv([Engine("d0", DECODE, READY, kv_blocks_used=used, kv_blocks_total=1000,
                                        kv_blocks_committed=1700)], now)
    assert kv.projected == 1300 and kv.is_full_soon
    # an engine that does not say what its streams were allowed: the quarter's rate only
    planner._kv_seen.clear()
    for now, used in ((995.0, 100), (997.0, 100), (998.0, 100), (1000.0, 300)):
        kv = planner._decode_kv([Engine("d0", DECODE, READY, kv_blocks_used=used, kv_blocks_total=1000)], now)
    assert kv.projected == 500 and not kv.is_full_soon


def test_the_first_chunks_tell_the_prefill_speed_before_any_prompt_is_prefilled():
    # a fresh cluster: nothing finished yet, one step of 2048 prompt tokens took 1 s, and
    # 4608 prompt tokens of six prompts wait at the one P engine: 2.25 s at that speed,
    # and a new prompt (one of those, 768 tokens, 0.375 s) breaks the target of 2.5 s
    planner = Planner(PlannerSettings(ttft_ms=2500, tpot_ms=100, window_s=20, stable_ticks=1, min_requests=5,
                                      max_engines=3, max_prefill=2, max_decode=2))
    planner.observe(Observation(1.0, span_s=1.0, prompt_tokens=2048, prefill_busy_s=1.0))
    engines = [Engine("p0", PREFILL, READY, num_running=2, num_waiting=4, waiting_prompt_tokens=4608)] + [
        Engine(f"d{i}", DECODE, READY) for i in range(2)]
    d = planner.decide(engines, 2.0)
    assert d.model.prefill_tok_s == 2048 and d.model.num_requests == 0
    assert d.action == Action("switch", PREFILL, instance_id="d0"), d.reason
    assert "4608 prompt tokens waiting at P, 2250 ms per engine" in d.reason
    # no step measured yet: nothing is known of the speed, and nothing moves
    planner = Planner(planner.settings)
    planner.observe(Observation(1.0, span_s=1.0))
    assert planner.decide(engines, 2.0).action is None


def test_a_switch_to_a_pool_saturated_by_what_it_holds_now_holds_one_tick_fewer():
    settings = PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=2, min_requests=20, max_engines=3)

    def ticks_with(*used: int, committed: int = 0) -> list[Decision]:
        planner = Planner(settings)
        phases(planner, (940.0, 985.0, 2000, 10), (985.0, 1000.0, 100, 800))
        return [planner.decide([Engine(f"p{i}", PREFILL, READY) for i in range(2)]
                               + [Engine("d0", DECODE, READY, kv_blocks_used=u, kv_blocks_total=1000,
                                         kv_blocks_committed=committed)], now)
                for now, u in zip((996.0, 998.0, 1000.0), used, strict=False)]
    # the one D cache full now: the first tick that sees it acts
    full = ticks_with(990)
    assert full[0].action == Action("switch", DECODE, instance_id="p0"), full[0].reason
    # full only a quarter window on (a forecast): the signal holds the two ticks first
    soon = ticks_with(500, 600, 700)
    assert soon[0].action is None and "full within" not in soon[0].reason, soon[0].reason
    assert soon[1].action is None and "waiting for the signal to hold (1/2)" in soon[1].reason, soon[1].reason
    assert soon[2].action == Action("switch", DECODE, instance_id="p0"), soon[2].reason
    # the streams it holds were allowed more blocks than its cache has: they will fill
    # it whatever comes next; the first tick that sees the cache grow acts
    held = ticks_with(500, 600, 700, committed=1700)
    assert held[0].action is None, held[0].reason
    assert held[1].action == Action("switch", DECODE, instance_id="p0"), held[1].reason
    # allowed less than the cache holds: they stop short of full, nothing to switch for
    under = ticks_with(500, 600, 700, committed=900)
    assert all(d.action is None for d in under), under[-1].reason


def test_a_pool_that_measures_over_its_target_gives_no_engine_away_whatever_is_predicted():
    # a host too slow for both targets: 3000-token prompts want 4 P engines, and decode
    # measures 58 ms a token against 50 (batches of 24-72) so it wants 3; the budget of 3
    # shares that as 2 P + 1 D, but decode, over its own target, is no surplus to give
    planner = Planner(PlannerSettings(ttft_ms=1000, tpot_ms=50, stable_ticks=1, min_requests=20, max_engines=3))
    for i in range(60):
        batch = 48.0 * (0.5 + i % 3 / 2)
        planner.observe(Observation.of_request(
            at_s=940.5 + i, prompt_tokens=3000, output_tokens=100, prefill_s=0.75, kv_s=0.02,
            tpot_s=0.010 + 0.001 * batch, decode_batch=batch))
    engines = [Engine("p0", PREFILL, READY)] + [Engine(f"d{i}", DECODE, READY) for i in range(2)]
    d = planner.decide(engines, 1000.0)
    assert d.wanted == {PREFILL: 2, DECODE: 1}, d.reason
    assert d.action is None and "decode has a surplus as predicted, but measures over its target" in d.reason
