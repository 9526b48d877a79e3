"""The Coordinator's own CPU per PD request, measured in one process, for comparing
code revisions whose difference is a few percent.

``coordinator_overhead.py`` measures the Coordinator as users run it (its own
process, stub engines and wrk in others), and its ``--compare`` loads two revisions
at once. On two shared vCPUs its rounds still scatter by about ±5%: the processes
contend, and a Coordinator that gets the CPU later batches more per loop turn.
Changes worth 1-3% each are lost in that. This benchmark takes the contention out:

  one process   the Coordinator's app served by its own HTTP server
                (``http_server.build_config``, uvloop), the clients and the two
                engines all run on one event loop, so nothing else is scheduled
                between them
  engines       stub engines in-process answer Health (so the Coordinator learns
                the view as it does), but the legs' session links are replaced by
                an in-process engine (``FakeLink``): it takes the session's requests
                as the frame link would (``take_outgoing``, serialized), and answers
                like an engine stepping at once: one message per running request per
                step (P: its first token with timings, then its handoff; D: 16
                tokens, the first with timings), each step's messages in one
                ``SessionResponse`` parsed and delivered as the frame link does
  clients       ``--concurrency`` keep-alive connections sending the benchmark's
                request (``coordinator_overhead.BODY``) back to back
  CPU           ``time.process_time`` over the measured requests, less the time
                the in-process engine and the clients spent (timed around their
                own work): what is left is the Coordinator's, HTTP server included,
                the engine sockets excluded

``--compare DIR`` alternates child processes of DIR's pdserve (A) and this checkout's
(B) for ``--rounds`` rounds and prints each side's median and the median of the
rounds' B / A ratios.

Rerun: .venv/bin/python benchmarks/coordinator_cpu.py [--compare DIR --rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(args) -> None:
    """One revision's measurement (run with its pdserve first on the path)."""
    import uvloop
    uvloop.run(measure(args))


class Clock:
    """CPU seconds spent in the parts that are not the Coordinator's."""

    def __init__(self) -> None:
        self.outside_s = 0.0


async def measure(args) -> None:
    sys.path.append(str(HERE.parent))  # tests.stub_engine; pdserve stays the child's own
    import socket

    import uvicorn

    from pdserve.api.proto import engine_pb2 as pb
    from pdserve.coordinator import sessions
    from pdserve.coordinator.app import create_app
    try:
        from pdserve.runtime.gc_tuning import tune as tune_gc
    except ImportError:  # a revision from before it was shared with the engine
        from pdserve.coordinator.cli import tune_gc
    from pdserve.coordinator.http_server import build_config
    from pdserve.coordinator.settings import CoordinatorSettings
    from tests.stub_engine import StubEngine, start_stub

    clock = Clock()
    loop = asyncio.get_running_loop()

    class FakeLink:
        """In place of ``sessions._Link``: the engine in this process."""

        transport = "frames"

        def __init__(self, session) -> None:
            self._session = session
            self._scheduled = False
            self._running: dict[str, list] = {}  # request id -> [kind, messages sent]

        def wake(self) -> None:
            if not self._scheduled:
                self._scheduled = True
                loop.call_soon(self._flush)

        def _flush(self) -> None:
            self._scheduled = False
            outgoing = self._session.take_outgoing()
            if outgoing is None:
                return
            wire = outgoing.SerializeToString()
            t0 = time.process_time()
            request = pb.SessionRequest.FromString(wire)
            was_idle = not self._running
            for g in request.generate:
                self._running[g.request_id] = [g.kv_transfer.role, 0, g.sampling.max_tokens]
            for rid in request.cancel:
                self._running.pop(rid, None)
            clock.outside_s += time.process_time() - t0
            if was_idle and self._running:
                loop.call_soon(self._step)

        def _step(self) -> None:
            t0 = time.process_time()
            messages, ends = [], []
            for rid, state in list(self._running.items()):
                kind, n, max_tokens = state
                if kind == "prefill":
                    if n == 0:
                        messages.append(pb.GenerateResponse(
                            request_id=rid, token_ids=[65], num_prompt_tokens=181,
                            timings=pb.Timings(queue_s=0.0, prefill_s=0.0)))
                    else:
                        messages.append(pb.GenerateResponse(
                            request_id=rid, finished=True, finish_reason="handoff",
                            timings=pb.Timings()))
                        ends.append(pb.RequestEnd(request_id=rid))
                        del self._running[rid]
                else:
                    last = n + 1 == max_tokens
                    messages.append(pb.GenerateResponse(
                        request_id=rid, token_ids=[65 + n % 26], finished=last,
                        finish_reason="length" if last else "", num_prompt_tokens=181,
                        num_output_tokens=n + 1,
                        timings=pb.Timings(queue_s=0.0, prefill_s=0.0) if n == 0 else None))
                    if last:
                        ends.append(pb.RequestEnd(request_id=rid))
                        del self._running[rid]
                state[1] = n + 1
            wire = pb.SessionResponse(messages=messages, ends=ends).SerializeToString()
            if self._running:
                loop.call_soon(self._step)
            clock.outside_s += time.process_time() - t0
            self._session.deliver(pb.SessionResponse.FromString(wire))

        def shut(self) -> None:
            self._running.clear()

        async def closed(self) -> None:
            return None

    sessions._Link = FakeLink
    servers, addrs = [], []
    for role in ("prefill", "decode"):
        server, address = await start_stub(StubEngine(role=role))
        servers.append(server)
        addrs.append(address)
    settings = CoordinatorSettings(engines=tuple(addrs), local_prefill_max_tokens=0,
                                   load_aware_local_prefill=False, max_concurrency=1024)
    app = create_app(settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(build_config(app, settings, "warning"))
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    body = args.body.encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n" % len(body)) + body

    class Client(asyncio.Protocol):
        """Sends the request, reads the whole answer, sends the next: ``left`` in all."""

        def __init__(self, left: list[int], done: asyncio.Future, errors: list[bytes]) -> None:
            self.left, self.done, self.errors = left, done, errors
            self.buf = b""

        def connection_made(self, transport) -> None:
            self.transport = transport
            self._next()

        def _next(self) -> None:
            if self.left[0] > 0:
                self.left[0] -= 1
                self.transport.write(request)
            else:
                self.transport.close()
                if not self.done.done():
                    self.done.set_result(None)

        def data_received(self, data: bytes) -> None:
            t0 = time.process_time()
            self.buf += data
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                clock.outside_s += time.process_time() - t0
                return
            head = self.buf[:head_end]
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            if len(self.buf) < head_end + 4 + length:
                clock.outside_s += time.process_time() - t0
                return
            if not head.startswith(b"HTTP/1.1 200"):
                self.errors.append(self.buf)
            self.buf = self.buf[head_end + 4 + length:]
            self._next()
            clock.outside_s += time.process_time() - t0

    async def load(concurrency: int, num_requests: int) -> None:
        left, errors = [num_requests], []
        dones = []
        for _ in range(concurrency):
            done = loop.create_future()
            dones.append(done)
            await loop.create_connection(lambda d=done: Client(left, d, errors), "127.0.0.1", port)
        await asyncio.gather(*dones)
        if errors:
            raise SystemExit(f"{len(errors)} requests failed; first: {errors[0][:300]!r}")

    for _ in range(100):  # until the view has both engines
        try:
            await load(1, 1)
            break
        except SystemExit:
            await asyncio.sleep(0.1)
    tune_gc()  # as ``pdserve coordinator`` does, once started
    results = {}
    for concurrency in args.concurrency:
        await load(concurrency, 200)  # warm-up
        clock.outside_s = 0.0
        t0, w0 = time.process_time(), time.perf_counter()
        await load(concurrency, args.requests)
        cpu_s, wall_s = time.process_time() - t0, time.perf_counter() - w0
        results[f"c={concurrency}"] = {
            "coordinator_us": (cpu_s - clock.outside_s) / args.requests * 1e6,
            "all_us": cpu_s / args.requests * 1e6, "req_per_s": args.requests / wall_s}
    print("result " + json.dumps(results), flush=True)
    server.should_exit = True
    await serving
    for s in servers:
        await s.stop(grace=None)


def start_child(src: Path, args, cpu: int | None = None) -> subprocess.Popen:
    """A child measuring ``src``'s pdserve, on CPU ``cpu`` alone when given. The request
    is ``coordinator_overhead``'s, read here: importing that module in the child would
    put this checkout's pdserve first on its path."""
    from coordinator_overhead import BODY
    env = {**os.environ, "PYTHONPATH": str(src)}
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    return subprocess.Popen([*pin, sys.executable, "-P", __file__, "--child", "--requests",
                             str(args.requests), "--body", json.dumps(BODY),
                             *[x for c in args.concurrency for x in ("--concurrency", str(c))]],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(child: subprocess.Popen) -> dict:
    out, err = child.communicate(timeout=600)
    for line in out.splitlines():
        if line.startswith("result "):
            return json.loads(line.removeprefix("result "))
    raise SystemExit(f"child failed:\n{out[-2000:]}\n{err[-4000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--body", help=argparse.SUPPRESS)  # the child's request body
    parser.add_argument("--requests", type=int, default=3000, help="measured, per concurrency")
    parser.add_argument("--concurrency", type=int, action="append")
    parser.add_argument("--compare", metavar="DIR", help="another checkout: A/B, alternated")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    args.concurrency = args.concurrency or [1, 32]
    if args.child:
        child(args)
        return 0
    if not args.compare:
        result = result_of(start_child(HERE.parent, args))
        for phase, r in result.items():
            print(f"{phase:6} Coordinator {r['coordinator_us']:7.1f} µs/req "
                  f"(process {r['all_us']:7.1f})  {r['req_per_s']:7.0f} req/s")
        return 0
    sides = {"A": Path(args.compare).resolve(), "B": HERE.parent}
    rows: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    for rnd in range(args.rounds):
        # Both at once, each on a CPU of its own (swapped every round): what slows the
        # machine slows both.
        children = {side: start_child(sides[side], args, cpu=(i + rnd) % 2)
                    for i, side in enumerate(sides)}
        for side, c in children.items():
            for phase, r in result_of(c).items():
                rows[side].setdefault(phase, []).append(r["coordinator_us"])
    print(f"A = {args.compare}, B = this checkout; {args.rounds} rounds, both at once on a "
          f"CPU each; Coordinator CPU µs per PD request")
    for phase in rows["A"]:
        a, b = rows["A"][phase], rows["B"][phase]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        print(f"{phase:6} A {statistics.median(a):7.1f}  B {statistics.median(b):7.1f}  "
              f"B/A median {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-"
              f"{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
