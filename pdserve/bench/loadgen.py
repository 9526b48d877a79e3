"""When requests are sent: arrival streams, run bounds, warm-up and the progress line.

Owns the timing of a run. A run is one or more *streams* running at once, each an
arrival process over a sampler: open loop (Poisson or periodic at a rate; a request
is sent on schedule whether or not earlier ones finished) or closed loop (N workers,
each sending its next request when its last one ended). ``--rate``/``--concurrency``
on the command line replace every class's own arrival with one stream that mixes
the classes by share. A run stops sending when its request budget is spent or its
duration is over, then waits for every request in flight: none is cut off, so
every request sent is in the results.

Invariants: one ``Budget`` per run decides every send (a request is counted sent
before it is built, so ``num_requests`` is never exceeded); samplers and arrival
RNGs are rebuilt for each run, so every sweep point, target and round sends the
same sequence per class.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, replace

from pdserve.runtime.aio import wait_event

from .client import CompletionClient
from .prompts import ClassSampler, MixSampler
from .stats import RequestResult
from .workload import Arrival, Workload, WorkloadError

PROGRESS_EVERY_S = 0.5
PROGRESS_EVERY_S_NOT_TTY = 10.0
WARMUP_SEED_OFFSET = 7919


@dataclass(frozen=True)
class Stream:
    label: str
    arrival: Arrival
    sampler: ClassSampler | MixSampler


@dataclass(frozen=True)
class RunSettings:
    prompt_kind: str = "ids"
    vocab_size: int = 256
    num_requests: int | None = None
    duration_s: float | None = None
    num_warmup: int = 1
    show_progress: bool = True


def build_streams(workload: Workload, override: Arrival | None, settings: RunSettings) -> list[Stream]:
    """Fresh samplers for one run: one stream per class with its own arrival, plus the shared one."""
    samplers = [ClassSampler(c, workload.seed, settings.prompt_kind, settings.vocab_size)
                for c in workload.classes]
    if override is not None:
        return [Stream("all", override, MixSampler(samplers, workload.seed))]
    streams = [Stream(s.cls.name, s.cls.arrival, s) for s in samplers if s.cls.arrival is not None]
    shared = [s for s in samplers if s.cls.arrival is None]
    if shared:
        if workload.arrival is None:
            names = ", ".join(s.cls.name for s in shared)
            raise WorkloadError(f"class(es) {names} have no arrival: give them rate or concurrency, "
                                f"set one for the workload, or pass --rate/--concurrency")
        streams.append(Stream("shared", workload.arrival, MixSampler(shared, workload.seed)))
    return streams


class Budget:
    """The run's bounds; ``take()`` is called before every send."""

    def __init__(self, num_requests: int | None, duration_s: float | None) -> None:
        self.max_requests = num_requests
        self.deadline = None if duration_s is None else time.perf_counter() + duration_s
        self.num_sent = 0
        self.spent = asyncio.Event()

    def take(self) -> bool:
        if not self.spent.is_set() and self.deadline is not None and time.perf_counter() >= self.deadline:
            self.spent.set()
        if self.spent.is_set():
            return False
        self.num_sent += 1
        if self.max_requests is not None and self.num_sent >= self.max_requests:
            self.spent.set()
        return True

    async def wait_until(self, when_s: float) -> bool:
        """Sleep until ``when_s`` (perf_counter); False when the budget ran out first."""
        delay = when_s - time.perf_counter()
        if self.deadline is not None:
            delay = min(delay, self.deadline - time.perf_counter())
        if delay > 0:
            await wait_event(self.spent, delay)
        return not self.spent.is_set()


class Progress:
    """A one-line status on stderr: redrawn in place on a terminal, a line now and then elsewhere."""

    def __init__(self, label: str, budget: Budget, enabled: bool) -> None:
        self.label, self.budget, self.enabled = label, budget, enabled
        self.is_tty = sys.stderr.isatty()
        self.num_done = self.num_errors = 0
        self.started = time.perf_counter()

    def line(self) -> str:
        b = self.budget
        total = f"/{b.max_requests}" if b.max_requests is not None else ""
        left = "" if b.deadline is None else f", {max(0.0, b.deadline - time.perf_counter()):.0f}s left"
        return (f"[{self.label}] {self.num_done}{total} done, {b.num_sent - self.num_done} in flight, "
                f"{self.num_errors} errors, {time.perf_counter() - self.started:.1f}s{left}")

    async def run(self) -> None:
        every = PROGRESS_EVERY_S if self.is_tty else PROGRESS_EVERY_S_NOT_TTY
        while self.enabled:
            await asyncio.sleep(every)
            self.draw()

    def draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.is_tty:
            print(f"\r{self.line()}\033[K", end="\n" if final else "", file=sys.stderr, flush=True)
        else:
            print(self.line(), file=sys.stderr, flush=True)


async def run_streams(client: CompletionClient, streams: list[Stream], settings: RunSettings,
                      seed: int, label: str) -> list[RequestResult]:
    """Send until the budget is spent, then wait for every request in flight."""
    if settings.num_requests is None and settings.duration_s is None:
        raise WorkloadError("a run needs a bound: num_requests or duration_s")
    budget = Budget(settings.num_requests, settings.duration_s)
    progress = Progress(label, budget, settings.show_progress)
    results: list[RequestResult] = []
    in_flight: set[asyncio.Task] = set()

    async def send_one(stream: Stream) -> None:
        result = await client.complete(stream.sampler.next())
        results.append(result)
        progress.num_done += 1
        progress.num_errors += not result.is_ok

    async def open_loop(stream: Stream) -> None:
        rng = random.Random(f"{seed}:arrivals:{stream.label}")
        next_s = time.perf_counter()
        while await budget.wait_until(next_s) and budget.take():
            task = asyncio.create_task(send_one(stream))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            rate = stream.arrival.rate
            next_s += rng.expovariate(rate) if stream.arrival.kind == "poisson" else 1.0 / rate

    async def closed_loop(stream: Stream) -> None:
        async def worker() -> None:
            while budget.take():
                await send_one(stream)
        await asyncio.gather(*(worker() for _ in range(stream.arrival.concurrency)))

    drawer = asyncio.create_task(progress.run())
    try:
        await asyncio.gather(*(closed_loop(s) if s.arrival.kind == "closed" else open_loop(s)
                               for s in streams))
        while in_flight:
            await asyncio.gather(*list(in_flight))
    finally:
        drawer.cancel()
        for task in in_flight:
            task.cancel()
    progress.draw(final=True)
    return results


async def run_point(client: CompletionClient, workload: Workload, override: Arrival | None,
                    settings: RunSettings, label: str) -> list[RequestResult]:
    """One measured run: warm-up requests (sent one by one, not recorded), then the load."""
    streams = build_streams(workload, override, settings)
    # Another seed: warm-up prompts must not be prefix-cache hits for the measured ones.
    warmup = build_streams(replace(workload, seed=workload.seed + WARMUP_SEED_OFFSET),
                           Arrival("closed", concurrency=1), settings)[0].sampler
    for _ in range(settings.num_warmup):
        await client.complete(warmup.next())
    return await run_streams(client, streams, settings, workload.seed, label)
