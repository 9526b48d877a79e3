"""The SLO planner's policy: how many prefill and decode engines the load needs to meet
``spec.slo``, and the one cheapest action that moves the fleet towards it (pure: the
caller passes the clock, the observations and the engines; ``Cluster`` runs it on the
leader's tick).

Inputs, each tick:
- what the engines did since the last tick (``Observation``): the differences of the
  cumulative counters each engine reports in its heartbeat's ``InstanceLoad``, summed:
  prompts prefilled, prompt tokens computed (prefix-cache hits excluded), seconds of
  prefill steps, queueing before prefill, KV transfers and their exposed time (the
  part of the transfer the first token waits for), generations finished and their
  tokens, and the decode steps with the sums of a line of step time against batch.
  Counters cost the same at any load and come from every backend's engine;
- the engines (``Engine``): role and state, and what is coming (the embedded engine's
  gauges; 0 from one that does not report them): the prompt tokens waiting to be
  prefilled, the KV blocks the unfinished requests will hold at their longest. A ``pending`` engine (a Pod not scheduled
  yet, a process not started) is not capacity: it is neither counted as serving nor
  allowed to trigger more of its role.

Model, learnt online from the observations of the last ``window_s`` (no offline
profile):
- prefill speed ``r`` (tokens/s of one P engine): prompt tokens computed over prefill
  seconds;
- decode step time against batch, ``tpot = a + b * batch`` (least squares over every
  decode step of the window when its batches spread enough to fit a line; else the
  line through the origin and the measured mean, ``decode_line``);
- demand: request rate ``lam`` (the larger of the whole window's and its last
  quarter's, each over the seconds its observations cover, so a rise is followed at
  once and a fall only once it lasts), mean
  computed prompt and output tokens, mean exposed KV transfer time ``kv`` (its share of
  the TTFT, which no peer models).

Wanted engines:
- prefill: each of ``N`` P engines is a queue with utilisation ``rho = lam * s / N``
  (``s``: one prompt's prefill time); its TTFT is about ``s / (1 - rho) + kv``.
  Meeting the TTFT target ``T`` takes ``N >= lam * s / (1 - s / (T - kv))``; when
  ``s`` alone exceeds the budget no number of engines helps, and the planner says so
  rather than scaling. A saturated pool finishes only what it can, so the measured
  rate under-reads the demand: when the measured TTFT (queue + prefill + kv) breaks
  the target while prompts queue at the P engines now, at least one engine more than
  runs is wanted (not while a D engine is full: it holds P's prefilled KV back, and
  P's queue is then D's). And the prompt tokens waiting at the P engines now, and one
  prompt more, must be prefilled within the budget: ``N >= (waiting + one) / (r * (T -
  kv))`` (a change to long prompts waits there before any is measured);
- decode: one D engine holds at most ``B = (tpot_target - a) / b`` streams within the
  TPOT target; by Little's law ``lam * out * tpot_target`` streams are in flight, so
  ``N >= that / B``; likewise one more than runs when the measured step time at the
  measured batch breaks the target. And the streams' KV must fit: the READY D
  engines' blocks in use a quarter window on (``_decode_kv``: at the rate they grew
  over the last quarter, or towards the blocks the streams were allowed as far as that
  rate goes in half a window, and no further: streams that start together fill the
  cache over their outputs' length) over ``KV_TARGET`` of one engine's cache, one more than runs when one is
  ``KV_FULL`` (a full D turns requests away, so its use under-reads the demand). On a
  CPU, where a step costs nearly the same at any batch, it is the KV cache, not the
  step time, that a decode pool runs out of first;
- both within ``[min, max]`` per pool and ``max_engines`` in all (a budget too small
  for both is shared in proportion to what each wants).

Actions, cheapest first, one at a time:
0. the mix has changed and a pool is saturated now: switch one READY engine to it when
   the last quarter wants that pool grown and the other shrunk, and the window, which
   still averages the old mix in for most of its length, does not want the opposite.
   Saturated now (``_pressed``): the prompt tokens waiting at the P engines now (else
   the prompts queued, at the last quarter's prefill time each) break the TTFT target (not while a D engine is full);
   a D engine's cache is ``KV_FULL``, or all of them will be within a quarter window,
   or the step time the last quarter's requests since the last action measured breaks
   the TPOT target. Without it a phase change waited for the window to turn (three
   quarters of it), then for the moved engine to fill;
1. the total is right but the split is wrong: switch one READY engine of the pool with
   a surplus (its least busy) to the other role: no new Pod; to decode only when decode
   measured since the last action breaks ``headroom`` of its TPOT target or its caches
   fill (``_decode_measured_comfortable``: the step line's prediction alone made the
   mixed phase switch back and forth); never from a pool that measures over its own
   target since the last action (``_measured_comfortable`` with a share of 1);
2. the total is short: +1 in the pool short by the larger share, unless that pool has
   a pending engine (then wait: more Pods would pend too);
3. the total is over: -1 in the role with a surplus (once it has lasted
   ``scale_down_delay_s``, or the window was idle: a lull between two phases is not a
   surplus; one of its engines that may leave:
   the actuators remove a pool's highest ordinal, and a pool keeps one), only when the load re-predicted
   on one engine fewer still meets the SLO with ``headroom`` to spare, and the other
   pool is not itself close to its target (then the surplus engine is kept: it is the
   other pool's cheapest capacity, a switch away). Both hold for the window's load and
   for its last quarter's alone: when the mix shifts (long prompts to long outputs),
   the window still averages the old phase in, and the engine it would call a surplus
   is the one the new phase needs; kept, it is switched once the window shows it,
   instead of removed and started again one cooldown later.

Anti-oscillation: a decision acts only after it was the same for ``stable_ticks``
ticks in a row (a switch to a pool saturated by what it holds now, prompt tokens
waiting at P, a full D cache, or D caches filling towards full with the blocks their
streams were already allowed, one tick fewer: each tick it waits, its queue grows);
after an action nothing more until ``cooldown_s`` has passed (the effect is measured
before the next move); what the requests measured (TTFT, TPOT, a
full D) counts only from those seen since the last action, as does the comfort a
scale-down needs (the window before it holds the queue the action answered); too few
requests (``min_requests``) change nothing but scale-downs of a cluster idle for a whole
window (no prompt prefilled, no token decoded; not one just started),
never below the minimums. In
``advisory`` mode the decision is reported and never acted on.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import NamedTuple

PREFILL, DECODE = "prefill", "decode"
MIN_BATCH_SPREAD = 0.2  # below it, the decode line goes through the origin (``decode_line``)
KV_TARGET = 0.8  # D engines are wanted so that their KV caches run at most this full
KV_FULL = 0.95   # a D engine this full turns requests away: its pool under-reads the demand
READY, STARTING, PENDING, DRAINING = "ready", "starting", "pending", "draining"


@dataclass(frozen=True)
class PlannerSettings:
    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0
    interval_s: float = 5.0        # between decisions (the caller's tick)
    window_s: float = 60.0
    cooldown_s: float = 120.0
    stable_ticks: int = 3
    min_requests: int = 20
    headroom: float = 0.8          # a scale-down keeps predicted latencies under this share of the SLO
    min_prefill: int = 1
    max_prefill: int = 64
    min_decode: int = 1
    max_decode: int = 64
    max_engines: int = 128
    advisory: bool = False
    scale_down_delay_s: float = 60.0  # a load must fit on one engine fewer this long before one goes


@dataclass(frozen=True)
class Observation:
    """What the engines did since the last tick, summed over them (the differences of
    their cumulative counters, ``InstanceLoad``), or one finished request (``of_request``)."""

    at_s: float
    span_s: float = 0.0             # the seconds it covers (0: one request)
    num_prefills: int = 0           # prompts prefilled to their first token
    prompt_tokens: float = 0.0      # prompt tokens computed (prefix-cache hits excluded)
    prefill_busy_s: float = 0.0     # seconds of steps that computed prompt tokens
    prefill_queue_s: float = 0.0    # summed over the prompts: arrival to first scheduled
    num_kv: int = 0                 # KV transfers done
    kv_s: float = 0.0               # summed: the transfers' time not hidden behind prefill
    num_finished: int = 0           # generations ended (stop or length)
    output_tokens: float = 0.0
    # decode steps (only decode tokens computed): count, and the sums of the least
    # squares line of step time against batch
    num_steps: float = 0.0
    batch: float = 0.0
    batch_sq: float = 0.0
    step_s: float = 0.0
    batch_step_s: float = 0.0
    output_budget: float = 0.0      # the output tokens the ended generations were allowed

    @classmethod
    def of_request(cls, at_s: float, prompt_tokens: int, output_tokens: int, prefill_s: float,
                   tpot_s: float, decode_batch: float, prefill_queue_s: float = 0.0,
                   kv_s: float = 0.0) -> Observation:
        """One request, its decode as ``output_tokens`` steps of ``tpot_s`` at ``decode_batch``."""
        n = float(output_tokens)
        return cls(at_s, 0.0, 1, prompt_tokens, prefill_s, prefill_queue_s, 1, kv_s, 1, n, n, n * decode_batch,
                   n * decode_batch ** 2, n * tpot_s, n * decode_batch * tpot_s)


COUNTED = tuple(f for f in Observation.__dataclass_fields__ if f != "at_s")


def total(observations) -> Observation:
    """The sum of ``observations`` (its ``at_s``: the last one's)."""
    sums = dict.fromkeys(COUNTED, 0.0)
    at_s = 0.0
    for o in observations:
        at_s = o.at_s
        for f in COUNTED:
            sums[f] += getattr(o, f)
    return Observation(at_s, **sums)


@dataclass(frozen=True)
class Engine:
    instance_id: str
    role: str           # prefill | decode
    state: str          # ready | starting | pending | draining
    num_running: int = 0
    num_waiting: int = 0
    can_leave: bool = True  # a scale-down may remove it (the actuators remove a pool's highest ordinal)
    kv_blocks_used: int = 0  # its KV cache now (0 total: not reported)
    kv_blocks_total: int = 0
    waiting_prompt_tokens: int = 0  # prompt tokens waiting to be prefilled here now
    kv_blocks_committed: int = 0    # blocks its unfinished requests hold at their longest (0: not reported)


class DecodeKV(NamedTuple):
    """The READY decode engines' caches."""
    used: int = 0               # blocks in use now, in all
    per_engine: float = 0.0     # mean blocks per engine (0: none reports its cache)
    is_full: bool = False       # one of them at least ``KV_FULL`` now
    projected: int = 0          # ``used`` a quarter window on (``Planner._decode_kv``)
    is_full_soon: bool = False  # ``projected`` at least ``KV_FULL`` of them all
    is_held_full: bool = False  # the blocks their streams were allowed reach that alone


@dataclass(frozen=True)
class Action:
    kind: str           # switch | scale
    role: str           # the role that gains (switch, scale +1) or loses (scale -1)
    delta: int = 0      # scale: +1 or -1
    instance_id: str = ""  # switch: the engine that changes role; scale -1: the one that leaves


@dataclass(frozen=True)
class Model:
    """What the window says of the load and of one engine's speed."""

    num_requests: int           # prompts prefilled in the window
    rate: float                 # requests/s
    prompt_tokens: float        # computed (uncached), per request
    output_tokens: float
    prefill_tok_s: float        # one P engine
    prefill_queue_s: float      # measured, per request
    kv_s: float                 # measured, per transfer: the part the TTFT waits for
    step_a_s: float             # tpot = a + b * batch
    step_b_s: float
    decode_batch: float = 0.0   # measured, mean over the decode steps
    span_s: float = 0.0         # the seconds the window's observations cover
    num_steps: float = 0.0      # decode steps
    output_share: float = 1.0   # of the output tokens the finished generations were allowed, the share they used

    @property
    def is_idle(self) -> bool:
        """No prompt prefilled and no token decoded: streams decoding with no prompt coming
        (long outputs started together) are a load."""
        return self.num_requests == 0 and self.num_steps == 0

    @property
    def measured_tpot_s(self) -> float:
        return self.step_a_s + self.step_b_s * self.decode_batch

    @property
    def measured_ttft_s(self) -> float:
        """What the requests of the window waited for their first token (without the
        Coordinator's own time): queue, prefill, exposed KV transfer."""
        prefill_s = self.prompt_tokens / self.prefill_tok_s if self.prefill_tok_s else 0.0
        return self.prefill_queue_s + prefill_s + self.kv_s


@dataclass(frozen=True)
class Decision:
    wanted: dict[str, int]
    have: dict[str, int]
    action: Action | None
    reason: str
    model: Model | None = None


def fit_line(n: float, sx: float, sy: float, sxx: float, sxy: float) -> tuple[float, float]:
    """Least squares ``y = a + b x`` from its sums; a flat line through the mean when x
    does not vary."""
    if n <= 0:
        return 0.0, 0.0
    var = sxx - sx * sx / n
    if var < 1e-9 * max(1.0, sxx):
        return sy / n, 0.0
    b = (sxy - sx * sy / n) / var
    return (sy - b * sx) / n, b


def decode_line(t: Observation) -> tuple[float, float]:
    """Decode step time against batch, ``(a, b)``. The least-squares line only when the
    window's batches spread (their coefficient of variation at least
    ``MIN_BATCH_SPREAD``) and the line is sane (``0 <= a <=`` the mean step, ``b > 0``):
    a line fitted to batches that barely vary extrapolates its intercept from noise.
    Otherwise the line through the origin and the measured mean (``a = 0``: each stream
    costs the same share of a step), which predicts a slower step at a larger batch
    than any line with an intercept, so it errs towards more decode engines."""
    if t.num_steps <= 0 or t.batch <= 0:
        return 0.0, 0.0
    mean_batch, mean_step = t.batch / t.num_steps, t.step_s / t.num_steps
    spread = math.sqrt(max(0.0, t.batch_sq / t.num_steps - mean_batch ** 2)) / mean_batch
    a, b = fit_line(t.num_steps, t.batch, t.step_s, t.batch_sq, t.batch_step_s)
    if spread >= MIN_BATCH_SPREAD and b > 0 and 0 <= a <= mean_step:
        return a, b
    return 0.0, mean_step / mean_batch


def learn(observations, now_s: float, window_s: float) -> Model:
    """The model of the window's observations (already limited to the window)."""
    observations = list(observations)
    t = total(observations)
    n = int(t.num_prefills)
    share = min(1.0, t.output_tokens / t.output_budget) if t.output_budget > 0 else 1.0
    speed = t.prompt_tokens / t.prefill_busy_s if t.prefill_busy_s > 0 else 0.0
    if n == 0:  # no prompt finished yet; a first chunk's step already tells the speed
        return Model(0, 0.0, 0.0, 0.0, speed, 0.0, 0.0, 0.0, 0.0, span_s=t.span_s, num_steps=t.num_steps,
                     output_share=share)
    recent = total(o for o in observations if o.at_s >= now_s - window_s / 4)
    a, b = decode_line(t)
    return Model(
        num_requests=n, rate=max(n / (t.span_s or window_s), recent.num_prefills / (recent.span_s or window_s / 4)),
        prompt_tokens=t.prompt_tokens / n,
        output_tokens=t.output_tokens / t.num_finished if t.num_finished else 0.0,
        prefill_tok_s=speed,
        prefill_queue_s=t.prefill_queue_s / n, kv_s=t.kv_s / t.num_kv if t.num_kv else 0.0,
        step_a_s=a, step_b_s=b,
        decode_batch=t.batch / t.num_steps if t.num_steps else 0.0, span_s=t.span_s, num_steps=t.num_steps,
        output_share=share)


def predicted_ttft_s(m: Model, num_prefill: int) -> float:
    """TTFT on ``num_prefill`` P engines (inf when they cannot keep up)."""
    if m.rate == 0 or m.prefill_tok_s == 0:
        return m.kv_s
    s = m.prompt_tokens / m.prefill_tok_s
    rho = m.rate * s / max(num_prefill, 1e-9)
    return math.inf if rho >= 1 else s / (1 - rho) + m.kv_s


def predicted_tpot_s(m: Model, num_decode: int, tpot_target_s: float) -> float:
    """Time per output token with the in-flight streams spread over ``num_decode`` engines."""
    streams = m.rate * m.output_tokens * tpot_target_s
    return m.step_a_s + m.step_b_s * streams / max(num_decode, 1e-9)


def wanted_prefill(m: Model, ttft_s: float) -> int | None:
    """P engines for the TTFT target, or None when no number of them meets it."""
    if m.rate == 0 or m.prefill_tok_s == 0:
        return 0
    s = m.prompt_tokens / m.prefill_tok_s
    budget = ttft_s - m.kv_s
    if s >= budget:
        return None
    return math.ceil(m.rate * s / (1 - s / budget) - 1e-9)


def wanted_decode(m: Model, tpot_s: float) -> int | None:
    """D engines for the TPOT target, or None when one step alone is slower than it."""
    if m.rate == 0 or m.output_tokens == 0:
        return 0
    if m.step_a_s >= tpot_s:
        return None
    streams = m.rate * m.output_tokens * tpot_s
    if m.step_b_s == 0:
        return 1
    return math.ceil(streams / ((tpot_s - m.step_a_s) / m.step_b_s) - 1e-9)


@dataclass
class Planner:
    settings: PlannerSettings
    observations: deque[Observation] = field(default_factory=deque)
    _last: tuple[Action | None, int] = (None, 0)   # the decision seen last and how many ticks in a row
    _acted_s: float = -math.inf
    _kv: DecodeKV = DecodeKV()  # this tick's decode caches (set by ``decide``)
    _kv_seen: deque[tuple[float, frozenset, int]] = field(default_factory=deque)  # (at, READY D engines, used)
    _queued: float = 0.0  # this tick's prompts waiting per READY P engine (set by ``decide``)
    _backlog: int = 0     # this tick's prompt tokens waiting at the READY P engines (set by ``decide``)
    _num_prefill: int = 0  # and how many of them there are
    _prompts: int = 0      # and the prompts they run or queue
    _surplus_since: float = math.inf  # the first of the ticks in a row that wanted one engine fewer
    _saturated: frozenset = frozenset()  # this tick's pools saturated by what they hold now (``_pressed``)

    def observe(self, observation: Observation) -> None:
        self.observations.append(observation)

    def decide(self, engines: list[Engine], now_s: float) -> Decision:
        """One tick: what the load wants, and the action to take now (None: hold)."""
        s = self.settings
        while self.observations and self.observations[0].at_s < now_s - s.window_s:
            self.observations.popleft()
        model = learn(self.observations, now_s, s.window_s)
        recent = learn((o for o in self.observations if o.at_s >= now_s - s.window_s / 4), now_s, s.window_s / 4)
        have = {r: sum(e.role == r and e.state in (READY, STARTING) for e in engines) for r in (PREFILL, DECODE)}
        pending = {r: sum(e.role == r and e.state == PENDING for e in engines) for r in (PREFILL, DECODE)}
        # what the requests measured, only since the last action: the window before it
        # holds the load the action answered (the queue it built, the old phase's mix)
        since = learn((o for o in self.observations if o.at_s > self._acted_s), now_s, s.window_s)
        few = max(3, s.min_requests // 4)  # enough requests for a quarter of the window
        measured = since if since.num_requests >= few else None
        # the last quarter's demand on the window's speeds, however few its requests (none
        # is news too: no prompt arrived): what the early switch (``_action``, 0.) follows
        quarter = replace(recent, prefill_tok_s=model.prefill_tok_s or recent.prefill_tok_s, kv_s=model.kv_s,
                          step_a_s=model.step_a_s, step_b_s=model.step_b_s,
                          output_tokens=recent.output_tokens or model.output_tokens)
        recent = recent if recent.num_requests >= few else None
        # the last quarter's requests since the last action: whether a pool is saturated now
        latest = learn((o for o in self.observations if o.at_s >= now_s - s.window_s / 4 and o.at_s > self._acted_s),
                       now_s, s.window_s / 4)
        self._kv = self._decode_kv(engines, now_s, model.output_share)
        prefill = [e for e in engines if e.role == PREFILL and e.state == READY]
        self._queued = sum(e.num_waiting for e in prefill) / len(prefill) if prefill else 0.0
        self._backlog, self._num_prefill = sum(e.waiting_prompt_tokens for e in prefill), len(prefill)
        self._prompts = sum(e.num_running + e.num_waiting for e in prefill)
        wanted, unreachable = self._wanted(model, have, measured)
        # the last quarter's own wants: a switch must agree with them (``_action``)
        recent_wanted = self._wanted(recent, have, measured, few)[0] if recent else None
        quarter_wanted = (self._wanted(quarter, have, measured, 0)[0]
                          if model.num_requests or model.prefill_tok_s else None)
        pressed = self._pressed(quarter, latest if latest.num_requests >= few else None)
        action, reason = self._action(engines, model, have, pending, wanted, recent, measured, recent_wanted,
                                      pressed, quarter_wanted)
        if unreachable:
            reason = f"{unreachable}; {reason}"
        # hysteresis: the same action for stable_ticks ticks, then act, then cool down
        same = action is not None and self._last[0] is not None and _key(action) == _key(self._last[0])
        self._last = (action, self._last[1] + 1 if same else 1)
        if action is None:
            self._surplus_since = math.inf
            return Decision(wanted, have, None, reason, model)
        # scale up fast, scale down slowly: a load that fits on one engine fewer must do so
        # for ``scale_down_delay_s`` (an idle window has already); a lull between two
        # phases is not a surplus, and the engine removed would be started again soon after
        shrink = action.kind == "scale" and action.delta < 0 and not model.is_idle
        self._surplus_since = min(self._surplus_since, now_s) if shrink else math.inf
        if shrink and now_s - self._surplus_since < s.scale_down_delay_s:
            return Decision(wanted, have, None, f"a surplus for {now_s - self._surplus_since:.0f} s of the "
                            f"{s.scale_down_delay_s:.0f} s it must last: {reason}", model)
        if now_s - self._acted_s < s.cooldown_s:
            return Decision(wanted, have, None, f"cooling down after the last action: {reason}", model)
        # a switch to a pool saturated now by what it holds now (prompt tokens waiting, a
        # cache full or filling with what its streams were allowed) holds one tick fewer:
        # every tick it waits, the queue grows
        hold = s.stable_ticks - 1 if action.kind == "switch" and action.role in self._saturated else s.stable_ticks
        if self._last[1] < max(1, hold):
            return Decision(wanted, have, None, f"waiting for the signal to hold "
                            f"({self._last[1]}/{max(1, hold)}): {reason}", model)
        if s.advisory:
            return Decision(wanted, have, None, f"advisory: would {describe(action)}: {reason}", model)
        self._acted_s = now_s
        self._last = (None, 0)
        return Decision(wanted, have, action, reason, model)

    def _wanted(self, m: Model, have: dict[str, int], measured: Model | None = None,
                min_requests: int | None = None) -> tuple[dict[str, int], str]:
        """Engines per role for the SLO, within the bounds and the budget; the reason
        when the SLO cannot be met by engines alone. ``measured``: the requests since the
        last action (None: too few yet), which alone may say a pool is saturated."""
        s = self.settings
        notes = []
        if m.num_requests < (s.min_requests if min_requests is None else min_requests):
            # too little traffic to learn from: keep what runs, within the bounds
            want = {PREFILL: have[PREFILL], DECODE: have[DECODE]}
            if m.is_idle and m.span_s >= 0.9 * s.window_s:  # idle for a whole window
                want = {PREFILL: s.min_prefill, DECODE: s.min_decode}
        else:
            p = wanted_prefill(m, s.ttft_ms / 1e3)
            d = wanted_decode(m, s.tpot_ms / 1e3)
            if p is None:
                notes.append(f"one prompt's prefill ({m.prompt_tokens / m.prefill_tok_s * 1e3:.0f} ms) "
                             f"leaves no room in the TTFT target: more engines do not help")
                p = s.max_prefill
            if d is None:
                notes.append(f"one decode step ({m.step_a_s * 1e3:.0f} ms) exceeds the TPOT target: "
                             "more engines do not help")
                d = s.max_decode
            # a saturated pool under-reads the demand: what the requests measured decides.
            # For prefill, while its prompts queue now (a backlog already cleared is not
            # saturation) and no D engine is full (a full D holds P's prefilled KV back,
            # and P's queue is then D's)
            if (measured and p <= have[PREFILL] and measured.measured_ttft_s > s.ttft_ms / 1e3
                    and self._queued >= 1 and not self._kv.is_full):
                notes.append(f"measured TTFT {measured.measured_ttft_s * 1e3:.0f} ms over the target")
                p = have[PREFILL] + 1
            # the prompts waiting now, and one more arriving (``_pressed``), must be
            # prefilled within the target (not behind a full D, as above): a change of mix
            # is seen here before any of them is served
            if self._backlog and m.prefill_tok_s and not self._kv.is_full and s.ttft_ms / 1e3 > m.kv_s:
                tokens = self._backlog + self._one_prompt(m)
                p_now = math.ceil(tokens / (m.prefill_tok_s * (s.ttft_ms / 1e3 - m.kv_s)) - 1e-9)
                if p_now > p:
                    notes.append(f"{self._backlog} prompt tokens waiting at P")
                    p = p_now
            if measured and d <= have[DECODE] and measured.measured_tpot_s > s.tpot_ms / 1e3:
                notes.append(f"measured TPOT {measured.measured_tpot_s * 1e3:.0f} ms over the target")
                d = have[DECODE] + 1
            # the streams' KV must fit the D engines' caches: a full one refuses requests
            kv = self._kv
            if kv.per_engine:
                d_kv = math.ceil(kv.projected / (KV_TARGET * kv.per_engine) - 1e-9)
                if kv.is_full and measured and d_kv <= have[DECODE]:
                    d_kv = have[DECODE] + 1
                if d_kv > d:
                    notes.append(f"decode KV {kv.used} blocks" + (
                        f" ({kv.projected} a quarter window on)" if kv.projected > kv.used else "")
                        + f", {kv.per_engine:.0f} per engine" + (", one full" if kv.is_full else ""))
                    d = d_kv
            want = {PREFILL: p, DECODE: d}
        want = {PREFILL: min(max(want[PREFILL], s.min_prefill), s.max_prefill),
                DECODE: min(max(want[DECODE], s.min_decode), s.max_decode)}
        count = want[PREFILL] + want[DECODE]
        if count > s.max_engines:
            p = max(s.min_prefill, min(s.max_engines - s.min_decode,
                                       round(s.max_engines * want[PREFILL] / count)))
            want = {PREFILL: p, DECODE: s.max_engines - p}
            notes.append(f"the budget of {s.max_engines} engines is short of {count}")
        return want, "; ".join(notes)

    def _action(self, engines: list[Engine], m: Model, have: dict[str, int], pending: dict[str, int],
                want: dict[str, int], recent: Model | None = None,
                measured: Model | None = None,
                recent_wanted: dict[str, int] | None = None,
                pressed: dict[str, str] | None = None,
                quarter_wanted: dict[str, int] | None = None) -> tuple[Action | None, str]:
        s = self.settings
        pressed = pressed or {}
        # a scale-down must fit the window's load and its last quarter's: after the mix
        # shifts, the window still averages in the old phase, and the engine it calls a
        # surplus is the one the new phase needs (a switch keeps it; -1 then +1 restarts it)
        loads = [m] if recent is None else [m, recent]
        short = {r: want[r] - have[r] for r in (PREFILL, DECODE)}
        leaving = {r: sum(e.role == r and e.state == DRAINING for e in engines) for r in (PREFILL, DECODE)}
        summary = f"want {want[PREFILL]} P + {want[DECODE]} D, have {have[PREFILL]} P + {have[DECODE]} D"
        # a switch (no new Pod), one of two ways:
        # 0. the mix has changed and a pool is saturated now: the last quarter decides a
        #    switch the window (still averaging the old mix in) does not oppose;
        # 1. the window says the split is wrong, and the last quarter alone wants it too:
        #    after the mix shifts back, the window's average (and a budget shared in its
        #    proportions) still asks for the split the old phase needed
        for gain, lose in ((PREFILL, DECODE), (DECODE, PREFILL)):
            if (gain in pressed and quarter_wanted and quarter_wanted[gain] > have[gain]
                    and quarter_wanted[lose] < have[lose] and short[gain] >= 0 and short[lose] <= 0):
                why = (f"{summary}; over the last quarter want {quarter_wanted[PREFILL]} P + "
                       f"{quarter_wanted[DECODE]} D, and {gain} is saturated now ({pressed[gain]})")
            elif short[gain] > 0 and short[lose] < 0:
                if recent_wanted and not (recent_wanted[gain] > have[gain] or recent_wanted[lose] < have[lose]):
                    return None, (f"{summary}: {lose} has a surplus and {gain} is short over the window, "
                                  f"not over its last quarter")
                if measured is not None and not self._measured_comfortable(measured, lose, 1.0):
                    return None, (f"{summary}: {lose} has a surplus as predicted, but measures over its "
                                  f"target since the last action")
                if gain == DECODE and self._decode_measured_comfortable(measured, have[DECODE]):
                    return None, (f"{summary}: {lose} has a surplus and {gain} is short as predicted, but "
                                  f"decode measured well within its target")
                why = f"{summary}: {lose} has a surplus and {gain} is short"
            else:
                continue
            ready = [e for e in engines if e.role == lose and e.state == READY]
            if ready:
                return Action("switch", gain, instance_id=_least_busy(ready).instance_id), why
        if short[PREFILL] == 0 and short[DECODE] == 0:
            return None, f"{summary}: balanced"
        # 2. the total is short: +1 where the shortage is larger
        gains = [r for r in (PREFILL, DECODE) if short[r] > 0]
        if gains:
            role = max(gains, key=lambda r: (short[r] / max(want[r], 1), r == PREFILL))
            if pending[role]:
                return None, f"{summary}: {pending[role]} {role} engine(s) pending: waiting for them"
            if leaving[role]:  # asked away and not gone: growing the pool again would flap
                return None, f"{summary}: a {role} engine is still leaving: waiting for it"
            if len([e for e in engines if e.role in (PREFILL, DECODE)]) >= s.max_engines:
                return None, f"{summary}: at the budget of {s.max_engines} engines"
            return Action("scale", role, +1), f"{summary}: {role} is short"
        # 3. the total is over: -1 only if the load re-predicted on one fewer meets the SLO,
        # and the other pool is not close to its own target (the surplus engine is its
        # cheapest capacity: a switch, no new Pod, once it needs it)
        for role in sorted((r for r in (PREFILL, DECODE) if short[r] < 0), key=lambda r: short[r]):
            other = DECODE if role == PREFILL else PREFILL
            if m.num_requests and not all(self._comfortable(x, other, have[other]) for x in loads):
                return None, f"{summary}: a {role} surplus kept, {other} runs close to its target"
            if not (m.num_requests == 0 or all(self._comfortable(x, role, have[role] - 1) for x in loads)):
                continue
            # the requests since the last action must show the pool comfortable too: the
            # window's rate under-reads a pool that was saturated until then
            if m.num_requests and not (measured and self._measured_comfortable(measured, role)):
                continue
            leavers = [e for e in engines if e.role == role and e.state == READY and e.can_leave]
            if not leavers:
                return None, (f"{summary}: a {role} surplus, but none of its engines can leave (a pool "
                              "gives up its highest ordinal and keeps one)")
            e = _least_busy(leavers)
            return (Action("scale", role, -1, instance_id=e.instance_id),
                    f"{summary}: the load fits on {have[role] - 1} {role} engine(s)")
        return None, f"{summary}: a surplus, but one engine fewer would come too close to the SLO"

    def _one_prompt(self, m: Model) -> float:
        """One prompt's tokens: ``m``'s mean; before any prompt finished, the mean of those
        at the P engines now (the first chunks' steps already told the speed)."""
        return m.prompt_tokens or self._backlog / max(1, self._prompts)

    def _pressed(self, quarter: Model, latest: Model | None) -> dict[str, str]:
        """The pools saturated now, each with what says so: the prompt tokens waiting at
        each P engine now, then one prompt of the last quarter's, at the window's prefill
        speed (else the prompts queued, at the last quarter's prefill time each) break the
        TTFT target (one prompt: before any finished, the mean of those at P now; not
        while a D engine is full: it holds P's prefilled KV back, and P's queue is then
        D's); a D engine's cache is full, or all of them will be within a quarter window,
        or the step time the last quarter's requests since the last action measured
        breaks the TPOT target."""
        s, out = self.settings, {}
        tpot_s = s.tpot_ms / 1e3
        self._saturated = frozenset()
        if quarter.prefill_tok_s and not self._kv.is_full:
            one_s = self._one_prompt(quarter) / quarter.prefill_tok_s
            prefill = self._backlog / quarter.prefill_tok_s / max(1, self._num_prefill)  # per engine
            if self._backlog and prefill + one_s + quarter.kv_s > s.ttft_ms / 1e3:
                out[PREFILL] = f"{self._backlog} prompt tokens waiting at P, {prefill * 1e3:.0f} ms per engine"
                self._saturated |= {PREFILL}
            elif (self._queued + 1) * one_s + quarter.kv_s > s.ttft_ms / 1e3:
                out[PREFILL] = f"{self._queued:.1f} prompts queued per P engine, {one_s * 1e3:.0f} ms each"
        if self._kv.is_full:
            out[DECODE] = "a D engine's cache is full"
            self._saturated |= {DECODE}
        elif self._kv.is_full_soon:
            out[DECODE] = f"the D engines' caches full within a quarter window ({self._kv.projected} blocks)"
            if self._kv.is_held_full:  # by the streams they hold now, not a rate's forecast alone
                self._saturated |= {DECODE}
        elif latest and latest.measured_tpot_s > tpot_s:
            out[DECODE] = f"TPOT {latest.measured_tpot_s * 1e3:.0f} ms measured"
        return out

    def _decode_measured_comfortable(self, measured: Model | None, num_decode: int) -> bool:
        """What the requests since the last action measured keeps decode under ``headroom``
        of its TPOT target, and the ``num_decode`` D engines' caches are not filling past
        ``KV_TARGET``: a switch to decode that only the line of step time against batch
        predicts (fitted where the batch barely varies, it errs towards more decode
        engines) would take a serving prefill engine away and come back."""
        kv = self._kv
        filling = kv.per_engine and kv.projected > KV_TARGET * kv.per_engine * max(1, num_decode)
        return measured is not None and not filling and self._measured_comfortable(measured, DECODE)

    def _measured_comfortable(self, measured: Model, role: str, share: float | None = None) -> bool:
        """What the requests measured stays under ``share`` (default ``headroom``) of
        ``role``'s target. With ``share`` 1, a pool that is not is no surplus, whatever the
        model predicts (a host slower than the one the targets were set for makes both
        pools short)."""
        s = self.settings
        share = s.headroom if share is None else share
        if role == PREFILL:
            return measured.measured_ttft_s <= share * s.ttft_ms / 1e3
        return measured.measured_tpot_s <= share * s.tpot_ms / 1e3

    def _comfortable(self, m: Model, role: str, num: int) -> bool:
        """The load predicted on ``num`` engines of ``role`` stays under ``headroom`` of its target."""
        s = self.settings
        if role == PREFILL:
            return predicted_ttft_s(m, num) <= s.headroom * s.ttft_ms / 1e3
        kv = self._kv
        if kv.per_engine and kv.projected > s.headroom * KV_TARGET * num * kv.per_engine:
            return False
        return predicted_tpot_s(m, num, s.tpot_ms / 1e3) <= s.headroom * s.tpot_ms / 1e3

    def _decode_kv(self, engines: list[Engine], now_s: float, output_share: float = 1.0) -> DecodeKV:
        """``decode_kv``, and the blocks in use a quarter window on, on the same READY D
        engines: at the rate they grew over the last quarter; or, where the engines report
        the blocks their unfinished requests hold at their longest (``committed``, each
        stream its ``max_tokens``, scaled by ``output_share``, the share of their budget
        the window's finished streams used), as far towards that as the same rate (or the
        last tick's, when faster) goes in half a window, and no further. Streams that
        started together fill a cache over their outputs' length: full now is a switch too late, and what they were allowed
        says where they go before the rate has carried them there. Long prompts reserved
        at once are a step, not a rate: their streams were allowed little more. Steady
        streams, some ending as others start, are allowed more than they use yet do not
        grow: the rate bounds the projection."""
        used, per_engine, is_full = decode_kv(engines)
        ready = [e for e in engines if e.role == DECODE and e.state == READY and e.kv_blocks_total > 0]
        ids = frozenset(e.instance_id for e in ready)
        quarter, seen = self.settings.window_s / 4, self._kv_seen
        if seen and seen[-1][1] != ids:
            seen.clear()  # another set of engines: their sum moved by a switch, not by streams
        seen.append((now_s, ids, used))
        while seen[0][0] < now_s - quarter:
            seen.popleft()
        at_s, _, then = seen[0]
        projected, held = used, 0.0
        rate = (used - then) / (now_s - at_s) if now_s > at_s else 0.0
        if committed := sum(e.kv_blocks_committed for e in ready):
            # streams that just started grow at once: a quarter that began before them
            # (or held the old phase's streams, ending) dilutes their rate, the last tick's does not
            if len(seen) > 2 and now_s > seen[-2][0]:
                rate = max(rate, (used - seen[-2][2]) / (now_s - seen[-2][0]))
            if rate > 0:
                held = used + output_share * max(0, committed - used)
                projected = round(max(used, min(held, used + rate * 2 * quarter)))
        elif rate > 0:
            projected = round(used + rate * quarter)
        full = KV_FULL * per_engine * len(ready)
        return DecodeKV(used, per_engine, is_full, projected, bool(ready) and projected >= full,
                        bool(ready) and held >= full)


def decode_kv(engines: list[Engine]) -> tuple[int, float, bool]:
    """The READY decode engines' KV now: (blocks used in all, mean blocks per engine, one
    of them at least ``KV_FULL``); (0, 0.0, False) when none reports its cache."""
    ready = [e for e in engines if e.role == DECODE and e.state == READY and e.kv_blocks_total > 0]
    if not ready:
        return 0, 0.0, False
    return (sum(e.kv_blocks_used for e in ready), sum(e.kv_blocks_total for e in ready) / len(ready),
            any(e.kv_blocks_used >= KV_FULL * e.kv_blocks_total for e in ready))


def _least_busy(engines: list[Engine]) -> Engine:
    """The engine whose drain ends first: the fewest requests running and queued, then the
    fewest blocks committed (a decode leg waiting for its KV is in neither queue yet, and
    its drain waits for that prefill too)."""
    return min(engines, key=lambda e: (e.num_running + e.num_waiting, e.kv_blocks_committed, e.instance_id))


def _key(action: Action) -> tuple[str, str, int]:
    """What makes two ticks' actions the same (a switch may pick another engine)."""
    return action.kind, action.role, action.delta


def describe(action: Action) -> str:
    if action.kind == "switch":
        return f"switch {action.instance_id} to {action.role}"
    return f"{'add' if action.delta > 0 else 'remove'} one {action.role} engine"
