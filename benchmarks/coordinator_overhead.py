"""The Coordinator's added latency, CPU per request and throughput, next to calling stub engines directly.

Processes: stub engines (``tests/stub_engine.py``: gRPC, every answer at once; a
stub P and a stub D for ``--path pd``, one hybrid stub for ``--path single``), one
``pdserve coordinator`` in front of them, and the load generators (this process,
and ``wrk``). CPU is read per process from ``/proc/<pid>/stat`` (utime + stime,
all threads) before and after each phase, so the Coordinator's CPU per request
is its own, not the stubs' or the client's.

The request: ``POST /v1/completions``, a 180-character prompt (180 prompt tokens
with the byte tokenizer), 16 output tokens (``ignore_eos``), non-streaming.
Phases, in one run:

  direct c=1      this process calls the stubs' gRPC Generate (PD: D's call and P's
                  sent together, both read to the end), one request at a time, with
                  gRPC's blocking client (the thinnest Python one; slower than the
                  Coordinator's own legs, so the legs floor is the baseline of added)
  python c=1      the same request through the Coordinator, stdlib keep-alive client
  wrk c=1         the same with wrk (one connection): added = this - direct
  wrk c=32, c=64  throughput with wrk (one thread), ``--seconds`` each
  python c=32     throughput with an aiohttp client in this process
  stream c=8      ``stream: true`` and ``--stream-tokens`` output tokens, with wrk:
                  the Coordinator's CPU per output token
  http floor      the Coordinator's HTTP server alone (uvicorn as ``http_server``
                  configures it) answering a fixed JSON, with wrk at c=1 and c=32
  legs floor      (PD) the two legs alone: a process driving D's and P's requests on
                  the stubs' sessions as ``coordinator.sessions`` does (frames on their
                  session ports), at c=1 and c=32. The two floors' sum is what the
                  Coordinator costs at least with these libraries, whatever its own code
                  does; at c=1 its latency is the engines' answer without the
                  Coordinator (added = wrk c=1 - it)

``--profile DIR``: after the phases, py-spy records the Coordinator under wrk c=32,
then under the streaming load (collapsed stacks ``DIR/<path>[-stream].txt`` and
flame graphs ``DIR/<path>[-stream].svg``), and ``benchmarks/profile_summary.py``
prints where its time goes.

``--src DIR``: run the Coordinator from the ``pdserve`` package under DIR (another
checkout or a copy of this one). ``--compare DIR``: instead of the phases, two
Coordinators on the same stubs, this checkout's (B) and DIR's (A), loaded at the
same time (one wrk each; c=1, c=32, then the stream at c=8, ``--rounds`` times) so
that the machine's other load falls on both alike; medians of each side, and of
the ratio B / A of CPU per request: code revisions compared in one run.

``--coordinator-cpus LIST`` (e.g. ``0``): the Coordinator runs on those CPUs alone
(``taskset``), and the stubs, wrk, the floors and this process on all the others:
"one Coordinator process on one core" taken literally. It needs CPUs enough for the
load beside it (on two vCPUs the other one saturates, and the Coordinator waits).

Rerun: .venv/bin/python benchmarks/coordinator_overhead.py [--path pd|single] [--profile DIR]
       [--coordinator-cpus 0]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import itertools
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.api.proto import engine_pb2_grpc as pb_grpc  # noqa: E402
from pdserve.runtime.engine_client import build_generate_request  # noqa: E402
from pdserve.runtime.tokenizer import ByteTokenizer  # noqa: E402
from tests.procs import Proc  # noqa: E402
from tests.stub_engine import StubEngine, start_stub  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPT = ("Disaggregated serving runs the prefill of a prompt on one engine and its decode on "
          "another, moving the KV cache between them; the router in front picks both engines "
          "for each request.")[:180]
NUM_TOKENS = 16
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
        "ignore_eos": True}
CLK_TCK = os.sysconf("SC_CLK_TCK")
WRK_RESULT = re.compile(r"wrk-result requests=(\d+) p50_us=(\d+) p99_us=(\d+) errors=(\d+)")


def cpu_s(pid: int) -> float:
    """utime + stime of every thread of ``pid``, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Meter:
    """Wall time and each watched process's CPU across a ``with`` block."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def __enter__(self) -> Meter:
        self.t0, self.cpu0 = time.perf_counter(), {k: cpu_s(p) for k, p in self.pids.items()}
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.cpu = {k: cpu_s(p) - self.cpu0[k] for k, p in self.pids.items()}


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def serve_stub(role: str, num_tokens: int) -> None:
    from pdserve.runtime import gc_tuning

    async def main():
        server, address = await start_stub(StubEngine(role=role, num_tokens=num_tokens))
        gc_tuning.tune()  # as ``pdserve engine`` does once started: the stub runs its session code
        print(f"stub serving on {address}", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


# --- direct: this process calls the stubs the way the Coordinator does -----------------

_ids = itertools.count()
PROMPT_IDS = ByteTokenizer(320).encode(PROMPT, add_bos=True)


def direct_once(stubs: list[pb_grpc.EngineStub]) -> None:
    """One request on the stubs, with gRPC's blocking client (the thinnest Python one):
    PD: D's call and P's sent together, both read to their end."""
    rid = f"direct-{next(_ids)}"
    if len(stubs) == 1:
        req = build_generate_request(rid, prompt_token_ids=PROMPT_IDS, max_tokens=NUM_TOKENS)
        for _ in stubs[0].Generate(req, timeout=10):
            pass
        return
    p, d = stubs
    xfer = {"mode": "push", "transfer_id": f"x-{rid}"}
    d_req = build_generate_request(rid, prompt_token_ids=PROMPT_IDS, max_tokens=NUM_TOKENS,
                                   kv_transfer={**xfer, "role": "decode", "peer": "p"})
    p_req = build_generate_request(rid, prompt_token_ids=PROMPT_IDS, max_tokens=NUM_TOKENS,
                                   kv_transfer={**xfer, "role": "prefill", "peer": "d"})
    d_call = d.Generate(d_req, timeout=10)
    p_call = p.Generate(p_req, timeout=10)
    for _ in d_call:
        pass
    for _ in p_call:
        pass


def direct_latency(addrs: list[str], n: int) -> list[float]:
    channels = [grpc.insecure_channel(a) for a in addrs]
    stubs = [pb_grpc.EngineStub(c) for c in channels]
    try:
        for _ in range(min(200, n)):
            direct_once(stubs)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            direct_once(stubs)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        for c in channels:
            c.close()


# --- through the Coordinator -------------------------------------------------------------

def python_latency(host: str, port: int, n: int) -> list[float]:
    """One request at a time on one keep-alive connection (stdlib: the least client work)."""
    conn = http.client.HTTPConnection(host, port)
    body = orjson.dumps(BODY)
    headers = {"Content-Type": "application/json"}
    out = []
    for i in range(n + min(200, n)):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, headers)
        r = conn.getresponse()
        r.read()
        assert r.status == 200, r.status
        if i >= min(200, n):
            out.append(time.perf_counter() - t0)
    conn.close()
    return out


async def python_throughput(url: str, concurrency: int, seconds: float) -> int:
    done = 0
    stop_at = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker():
            nonlocal done
            while time.perf_counter() < stop_at:
                async with session.post(url, json=BODY) as r:
                    await r.read()
                    assert r.status == 200, r.status
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def wrk(url: str, body: dict, connections: int, seconds: float) -> tuple[int, float, float]:
    """(requests, p50 s, p99 s) of one wrk run; fails on any error or non-2xx answer."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "10s", "-s",
         str(HERE / "wrk_post.lua"), url],
        env={**os.environ, "WRK_BODY": orjson.dumps(body).decode()},
        capture_output=True, text=True, check=True).stdout
    m = WRK_RESULT.search(out)
    assert m is not None, out
    n, p50_us, p99_us, errors = map(int, m.groups())
    assert errors == 0, f"wrk saw {errors} errors:\n{out}"
    return n, p50_us * 1e-6, p99_us * 1e-6


# --- floors: what the Coordinator's two libraries cost alone ----------------------------

def serve_http_floor() -> None:
    """The Coordinator's HTTP server (``http_server.build_config``: uvicorn, httptools,
    uvloop) in front of an app that reads the body and answers a
    fixed JSON of the size of the benchmark's answer: the HTTP part of a request."""
    import uvicorn

    from pdserve.coordinator.http_server import build_config
    from pdserve.coordinator.settings import CoordinatorSettings

    answer = orjson.dumps({"id": "cmpl-" + "0" * 32, "object": "text_completion",
                           "choices": [{"index": 0, "text": "x" * NUM_TOKENS}]})
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(answer)).encode())]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # as the CLI's
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    config = build_config(app, CoordinatorSettings(), "warning")
    config.lifespan = "off"
    print(f"http floor serving on 127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


def legs_floor(concurrency: int, seconds: float, addrs: list[str]) -> None:
    """The Coordinator's two legs of a PD request and nothing else: ``concurrency``
    loops each sending D's and P's request on the engines' sessions
    (``coordinator.sessions``, on uvloop, as in the Coordinator) and reading both to
    their end; prints this process's CPU per request."""
    import uvloop

    from pdserve.coordinator.sessions import EmbeddedEngine
    from pdserve.runtime import gc_tuning
    from pdserve.runtime.engine_client import EngineClient

    async def main():
        p, d = (EmbeddedEngine(EngineClient(a)) for a in addrs)
        done = 0

        async def one() -> None:
            rid = f"floor-{next(_ids)}"
            xfer = {"mode": "push", "transfer_id": f"x-{rid}"}
            d_call = d.generate(build_generate_request(
                rid, prompt_token_ids=PROMPT_IDS, max_tokens=NUM_TOKENS,
                kv_transfer={**xfer, "role": "decode", "peer": "p"}), 10)
            p_call = p.generate(build_generate_request(
                rid, prompt_token_ids=PROMPT_IDS, max_tokens=NUM_TOKENS,
                kv_transfer={**xfer, "role": "prefill", "peer": "d"}), 10)
            async for _ in d_call:
                pass
            async for _ in p_call:
                pass

        durations: list[float] = []

        async def loop(stop_at: float) -> None:
            nonlocal done
            while (t0 := time.perf_counter()) < stop_at:
                await one()
                durations.append(time.perf_counter() - t0)
                done += 1

        await asyncio.gather(*(loop(time.perf_counter() + 1.0) for _ in range(concurrency)))
        gc_tuning.tune()  # as the Coordinator does once started
        done, cpu0 = 0, time.process_time()
        durations.clear()
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(*(loop(stop_at) for _ in range(concurrency)))
        print(f"legs-floor requests={done} cpu_s={time.process_time() - cpu0:.6f} "
              f"p50_s={pct(durations, 50):.6f} p99_s={pct(durations, 99):.6f}", flush=True)

    uvloop.run(main())


def floors(args, addrs: list[str]) -> tuple[float, float] | None:
    """The two floors (``serve_http_floor``, ``legs_floor``) at c=1 and c=32: the CPU per
    request below which no change inside the Coordinator brings it, with these libraries.
    Returns the two legs' own (p50, p99) seconds at c=1 (PD): the engines called the
    Coordinator's way, without the Coordinator."""
    server = Proc([sys.executable, __file__, "--serve-http-floor"])
    try:
        url = "http://" + server.wait_for(r"http floor serving on (\S+)", 30).group(1) + "/"
        time.sleep(0.5)
        for c in (1, args.concurrency):
            with Meter({"server": server.popen.pid}) as m:
                n, p50, p99 = wrk(url, BODY, c, args.seconds)
            print(f"{'http floor c=' + str(c):14}{n:>8}{p50 * 1e3:>8.3f}{p99 * 1e3:>8.3f}"
                  f"{n / m.wall_s:>9.0f}{m.cpu['server'] / n * 1e6:>10.1f} µs/req")
    finally:
        server.stop()
    if args.path != "pd":
        return None
    at_c1 = None
    for c in (1, args.concurrency):
        out = subprocess.run([sys.executable, __file__, "--legs-floor", str(c), str(args.seconds),
                              *addrs], capture_output=True, text=True, check=True, cwd=HERE.parent).stdout
        m = re.search(r"legs-floor requests=(\d+) cpu_s=([\d.]+) p50_s=([\d.]+) p99_s=([\d.]+)", out)
        n, (cpu, p50, p99) = int(m[1]), map(float, m.groups()[1:])
        at_c1 = at_c1 or (p50, p99)
        print(f"{'legs floor c=' + str(c):14}{n:>8}{p50 * 1e3:>8.3f}{p99 * 1e3:>8.3f}"
              f"{n / args.seconds:>9.0f}{cpu / n * 1e6:>10.1f} µs/req")
    return at_c1


# --- the run -----------------------------------------------------------------------------

def parse_cpu_list(text: str) -> set[int]:
    """CPUs of a taskset-style list: ``0``, ``0,2``, ``0-3``."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def start_stubs(args) -> tuple[list[Proc], list[str]]:
    roles = ("prefill", "decode") if args.path == "pd" else ("hybrid",)
    stubs = [Proc([sys.executable, __file__, "--serve-stub", r, "--stream-tokens",
                   str(args.stream_tokens)]) for r in roles]
    return stubs, [s.wait_for(r"stub serving on (\S+)", 30).group(1) for s in stubs]


def start_coordinator(src: str | None, addrs: list[str], cpus: str | None = None) -> tuple[Proc, str]:
    """``pdserve coordinator`` on ``addrs``, from ``src``'s pdserve (None: this checkout),
    on the CPUs of the taskset list ``cpus`` when given."""
    src_dir = Path(src).resolve() if src else HERE.parent
    pin = ["taskset", "-c", cpus] if cpus else []
    # -P: the package comes from PYTHONPATH, not from the working directory.
    # Every request of the PD path takes both legs: no prefill on D for a short prompt.
    coord = Proc([*pin, sys.executable, "-P", "-m", "pdserve.cli", "coordinator", "--port", "0",
                  "--log-level", "warning", "--max-concurrency", "1024",
                  "--local-prefill-max-tokens", "0", "--no-load-aware-local-prefill",
                  *[x for a in addrs for x in ("--engine", a)]], env={"PYTHONPATH": str(src_dir)})
    hostport = coord.wait_for(r"serving on (\S+)", 60).group(1)
    time.sleep(0.5)
    return coord, hostport


def compare(args, addrs: list[str]) -> None:
    """A and B loaded at the same time, each by its own wrk, so that whatever else runs
    on the machine weighs on both alike; CPU per request is each Coordinator's own.
    Phases per round: c=1, c=``--concurrency``, and the stream of ``--stream-tokens``
    tokens at c=8, whose CPU is also given per output token."""
    sides = {"A": start_coordinator(args.compare, addrs, args.coordinator_cpus),
             "B": start_coordinator(None, addrs, args.coordinator_cpus)}
    stream_body = {**BODY, "max_tokens": args.stream_tokens, "stream": True}
    phases = (("c=1", BODY, 1), (f"c={args.concurrency}", BODY, args.concurrency),
              ("stream c=8", stream_body, 8))
    rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(len(sides)) as pool:
            for rnd in range(args.rounds + 1):  # round 0 warms up
                for phase, body, c in phases:
                    with Meter({side: coord.popen.pid for side, (coord, _) in sides.items()}) as m:
                        runs = {side: pool.submit(wrk, f"http://{hostport}/v1/completions", body, c,
                                                  args.seconds)
                                for side, (_, hostport) in sides.items()}
                        results = {side: run.result() for side, run in runs.items()}
                    for side, (n, p50, _) in results.items():
                        if rnd:
                            rows.setdefault((phase, side), []).append(
                                (m.cpu[side] / n * 1e6, n / m.wall_s, p50 * 1e3))
    finally:
        for coord, _ in sides.values():
            coord.stop()
    print(f"A = {args.compare}, B = this checkout; both loaded at once; medians of "
          f"{args.rounds} rounds of {args.seconds:g} s")
    print(f"{'phase':12}{'side':>5}{'CPU µs/req':>12}{'µs/token':>10}{'req/s':>9}{'p50 ms':>9}")
    for phase, _, _ in phases:
        num_tokens = args.stream_tokens if phase.startswith("stream") else NUM_TOKENS
        for side in sides:
            vals = rows[(phase, side)]
            cpu, rps, p50 = (statistics.median(v[i] for v in vals) for i in range(3))
            print(f"{phase:12}{side:>5}{cpu:12.0f}{cpu / num_tokens:10.1f}{rps:9.0f}{p50:9.3f}")
    b_over_a = [statistics.median(b[0] / a[0] for a, b in zip(rows[(phase, "A")], rows[(phase, "B")],
                                                              strict=True))
                for phase, _, _ in phases]
    print("CPU per request, B / A (median of the rounds' ratios): "
          + ", ".join(f"{phase}: {r:.3f}" for (phase, _, _), r in zip(phases, b_over_a, strict=True)))


def report(name: str, m: Meter, n: int, lat: list[float] | tuple[float, float] | None,
           per: str = "req") -> None:
    if isinstance(lat, list):
        lat = (pct(lat, 50), pct(lat, 99))
    p50, p99 = (f"{lat[0] * 1e3:8.3f}", f"{lat[1] * 1e3:8.3f}") if lat else ("       -", "       -")
    coord = m.cpu.get("coordinator")
    per_us = f"{coord / n * 1e6:9.1f}" if coord is not None else "        -"
    stubs = sum(v for k, v in m.cpu.items() if k != "coordinator")
    cores = f"{coord / m.wall_s:6.2f}" if coord is not None else "     -"
    print(f"{name:14}{n:8d}{p50}{p99}{n / m.wall_s:9.0f}{per_us} µs/{per:3}{cores}"
          f"{stubs / m.wall_s:7.2f}", flush=True)


def profile(args, coord: Proc, url: str, stream_body: dict) -> None:
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    spy = str(Path(sys.executable).with_name("py-spy"))
    loads = ((args.path, BODY, args.concurrency), (f"{args.path}-stream", stream_body, 8))
    for name, body, connections in loads:
        for fmt, ext in (("raw", "txt"), ("flamegraph", "svg")):
            # --threads: each stack names its thread; the summary keeps the event loop's
            # (gRPC's poller thread waits in C, which py-spy counts as busy).
            rec = subprocess.Popen([spy, "record", "--threads", "--pid", str(coord.popen.pid),
                                    "--duration", str(int(args.seconds)), "--rate", "200",
                                    "--format", fmt, "-o", str(out / f"{name}.{ext}")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached
            wrk(url, body, connections, args.seconds + 1)
            rec.wait(60)
        print(f"\nprofile of {name} (wrk c={connections}), {out / name}.svg:", flush=True)
        subprocess.run([sys.executable, str(HERE / "profile_summary.py"), str(out / f"{name}.txt"),
                        "--thread", str(coord.popen.pid)], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", choices=("pd", "single"), default="pd")
    ap.add_argument("--requests", type=int, default=1000, help="per latency phase")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=6.0, help="per throughput phase")
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--profile", default=None, metavar="DIR")
    ap.add_argument("--src", default=None, metavar="DIR", help="run the Coordinator from DIR's pdserve")
    ap.add_argument("--compare", default=None, metavar="DIR",
                    help="compare this checkout's Coordinator with DIR's, both loaded at once")
    ap.add_argument("--rounds", type=int, default=5, help="with --compare")
    ap.add_argument("--coordinator-cpus", default=None, metavar="LIST",
                    help="the Coordinator alone on these CPUs (taskset list, e.g. 0), the rest elsewhere")
    ap.add_argument("--serve-stub", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-http-floor", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--legs-floor", nargs="+", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_stub:
        serve_stub(args.serve_stub, args.stream_tokens)
        return 0
    if args.serve_http_floor:
        serve_http_floor()
        return 0
    if args.legs_floor:
        legs_floor(int(args.legs_floor[0]), float(args.legs_floor[1]), args.legs_floor[2:])
        return 0
    if shutil.which("wrk") is None:
        print("error: wrk is not installed (Debian package wrk; make deps installs it)", file=sys.stderr)
        return 2
    if args.coordinator_cpus:
        cpus = parse_cpu_list(args.coordinator_cpus)
        others = os.sched_getaffinity(0) - cpus
        if not cpus or not others:
            print(f"error: --coordinator-cpus {args.coordinator_cpus} leaves no CPU for the load "
                  f"(this process may use {sorted(os.sched_getaffinity(0))})", file=sys.stderr)
            return 2
        os.sched_setaffinity(0, others)  # the stubs, wrk and the floors inherit it
    stubs, addrs = start_stubs(args)
    stub_pids = {f"stub{i}": s.popen.pid for i, s in enumerate(stubs)}
    if args.compare:
        try:
            compare(args, addrs)
        finally:
            for p in stubs:
                p.stop()
        return 0
    coord, hostport = start_coordinator(args.src, addrs, args.coordinator_cpus)
    url = f"http://{hostport}/v1/completions"
    host, port = hostport.rsplit(":", 1)
    all_pids = {**stub_pids, "coordinator": coord.popen.pid}
    stream_body = {**BODY, "max_tokens": args.stream_tokens, "stream": True}
    try:
        print(f"path={args.path} prompt={len(PROMPT)} chars, {NUM_TOKENS} output tokens; "
              f"src={args.src or 'this checkout'}"
              + (f"; Coordinator on CPUs {args.coordinator_cpus}, the rest on "
                 f"{','.join(map(str, sorted(os.sched_getaffinity(0))))}" if args.coordinator_cpus else ""))
        print(f"{'phase':14}{'requests':>8}{'p50 ms':>8}{'p99 ms':>8}{'req/s':>9}"
              f"{'coordinator CPU':>16}{'cores':>6}{'stubs':>7}")
        with Meter(stub_pids) as m:
            direct = direct_latency(addrs, args.requests)
        report("direct c=1", m, args.requests, direct)
        with Meter(all_pids) as m:
            lat = python_latency(host, int(port), args.requests)
        report("python c=1", m, args.requests + min(200, args.requests), lat)
        with Meter(all_pids) as m:
            n, p50, p99 = wrk(url, BODY, 1, args.seconds)
        report("wrk c=1", m, n, (p50, p99))
        added = (p50 - pct(direct, 50), p99 - pct(direct, 99))
        p50_c1, p99_c1 = p50, p99
        for c in (32, 64):
            with Meter(all_pids) as m:
                n, p50, p99 = wrk(url, BODY, c, args.seconds)
            report(f"wrk c={c}", m, n, (p50, p99))
        with Meter(all_pids) as m:
            n = asyncio.run(python_throughput(url, args.concurrency, args.seconds))
        report(f"python c={args.concurrency}", m, n, None)
        with Meter(all_pids) as m:
            n, p50, p99 = wrk(url, stream_body, 8, args.seconds)
        report("stream c=8", m, n * args.stream_tokens, None, per="tok")
        print(f"added by the Coordinator at c=1 (wrk - direct): p50 {added[0] * 1e3:.3f} ms, "
              f"p99 {added[1] * 1e3:.3f} ms")
        legs = floors(args, addrs)
        if legs is not None:
            print(f"added by the Coordinator at c=1 (wrk - legs floor c=1): p50 "
                  f"{(p50_c1 - legs[0]) * 1e3:.3f} ms, p99 {(p99_c1 - legs[1]) * 1e3:.3f} ms")
        print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
              "(other processes share them)")
        if args.profile:
            profile(args, coord, url, stream_body)
    finally:
        for p in (coord, *stubs):
            p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
