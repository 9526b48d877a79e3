"""An engine's life under its supervisor, with stand-in engines (short Python scripts):
why it died is kept (exit code, the lines that carry the error), the same start-up
error twice in a row is a start failure, and a dead engine's shared memory goes."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from pdserve.nodeagent.process import (
    Backoff,
    EngineProcess,
    _child_setup,
    error_excerpt,
    error_line,
)
from pdserve.runtime.engine_client import EngineClient, build_generate_request
from tests.stub_engine import StubEngine, start_stub

FAST = Backoff(base_s=0.01, max_s=0.05, stable_after_s=30.0)
SERVE = "print('serving model x on 127.0.0.1:1', flush=True)"


def engine(script: str) -> EngineProcess:
    return EngineProcess("e0", lambda: ([sys.executable, "-c", script], {}), FAST, lambda: None, echo=False)


async def until(predicate, timeout_s: float = 20.0, proc: EngineProcess | None = None) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    where = "" if proc is None else (f": state {proc.state}, pid {proc.pid}, {proc.num_restarts} "
                                     f"restarts, last exit {proc.last_exit!r}")
    raise AssertionError("condition not reached" + where)


async def supervised(proc: EngineProcess, predicate) -> None:
    """Run ``proc`` until ``predicate()``, then stop it (reaped) and end its loop."""
    task = asyncio.create_task(proc.supervise())
    try:
        await until(predicate, proc=proc)
    finally:
        await proc.stop()
        await asyncio.wait_for(task, 10)


@pytest.mark.asyncio
async def test_the_same_start_up_error_twice_is_a_start_failure_with_its_lines():
    proc = engine("import sys; print('loading'); print(\"error: model 'nosuch' is neither a preset "
                  "(tiny, small) nor a directory\"); sys.exit(2)")
    await supervised(proc, lambda: proc.is_failing_to_start)
    assert proc.last_exit_code == 2
    assert proc.error_lines == ["error: model 'nosuch' is neither a preset (tiny, small) nor a directory"]
    assert proc.last_exit == ("engine exited with code 2: error: model 'nosuch' is neither a preset "
                              "(tiny, small) nor a directory")


@pytest.mark.asyncio
async def test_different_errors_or_a_run_that_served_are_not_a_start_failure(tmp_path):
    runs = tmp_path / "runs"
    # run 1: error A; run 2: error B; run 3: serves, then dies with error B; run 4: error B;
    # run 5 serves on
    script = (f"import sys, time, pathlib; p = pathlib.Path({str(runs)!r}); "
              "n = len(p.read_text()) if p.exists() else 0; p.write_text('x' * (n + 1)); "
              f"({SERVE}) if n in (2, 4) else None; time.sleep(60) if n == 4 else None; "
              "print('RuntimeError: ' + ('alpha' if n == 0 else 'beta'), flush=True); sys.exit(1)")
    proc = engine(script)
    seen = []
    await supervised(proc, lambda: seen.append(proc.is_failing_to_start)
                     or (proc.num_restarts == 4 and proc.state == "running"))
    assert not any(seen)
    assert proc.error_lines == ["RuntimeError: beta"] and proc.last_exit_code == 1


@pytest.mark.asyncio
async def test_a_dead_engines_shared_memory_is_removed_before_the_relaunch_and_at_stop():
    script = ("import os, time; open(f'/dev/shm/pdserve-kv-{os.getpid()}-test', 'w').write('kv'); "
              f"{SERVE}; time.sleep(60)")
    proc = engine(script)
    task = asyncio.create_task(proc.supervise())
    try:
        await until(lambda: proc.state == "running")
        first = proc.pid
        assert Path(f"/dev/shm/pdserve-kv-{first}-test").exists()
        proc.kill()  # as a Controller restart command: SIGKILL, so the engine cleans nothing up
        await until(lambda: proc.state == "running" and proc.pid != first)
        assert not Path(f"/dev/shm/pdserve-kv-{first}-test").exists()
        second = proc.pid
        assert Path(f"/dev/shm/pdserve-kv-{second}-test").exists()
    finally:
        await proc.stop()  # SIGTERM: the engine dies without running its atexit handlers
        await asyncio.wait_for(task, 10)
    assert not Path(f"/dev/shm/pdserve-kv-{second}-test").exists()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"pdserve-kv-{second}-")]


@pytest.mark.asyncio
async def test_a_process_of_several_engines_runs_once_each_printed_its_address():
    script = ("import time; print('pdserve engine 0 (decode) serving model x on 127.0.0.1:1', flush=True); "
              "time.sleep(0.5); print('pdserve engine 1 (decode) serving model x on 127.0.0.1:2', flush=True); "
              "time.sleep(30)")
    proc = EngineProcess("e0..e1", lambda: ([sys.executable, "-c", script], {}), FAST, lambda: None,
                         echo=False, num_engines=2)
    task = asyncio.create_task(proc.supervise())
    try:
        await until(lambda: proc.addresses == ["127.0.0.1:1"], proc=proc)
        assert proc.state == "starting"  # one of two engines serves
        await until(lambda: proc.state == "running", proc=proc)
        assert proc.addresses == ["127.0.0.1:1", "127.0.0.1:2"]
    finally:
        await proc.stop()
        await asyncio.wait_for(task, 10)


def test_the_excerpt_is_the_last_traceback_or_the_last_error_line():
    traceback = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                 "ValueError: bad block size"]
    assert error_excerpt(["starting", *traceback, ""]) == traceback
    assert error_line(traceback) == "ValueError: bad block size"
    assert error_excerpt(["loading", "error: no such file", "bye"]) == ["error: no such file", "bye"]
    assert error_excerpt(["a", "b", "c", "d"]) == ["b", "c", "d"]
    assert error_excerpt([]) == [] and error_line([]) == ""


def test_a_heartbeat_after_an_exit_reports_why_the_engine_died_not_the_last_probe():
    from pdserve.nodeagent.agent import Agent, AgentSettings, SupervisedEngine
    from pdserve.runtime.security import SecuritySettings

    inst = SupervisedEngine("e0", "decode", "decode", ["engine"])
    Agent(AgentSettings(), [inst], SecuritySettings())
    inst.last_error = "probe failed: UNAVAILABLE"
    inst.process.last_exit = "engine exited with code 1: RuntimeError: CUDA out of memory"
    inst.process._set("exited")  # what the supervisor does when the engine dies
    assert inst.report().last_error == "engine exited with code 1: RuntimeError: CUDA out of memory"


@pytest.mark.asyncio
async def test_children_forked_while_grpc_is_busy_start_cleanly():
    """The agent forks engines while its gRPC threads serve (Controller calls, probes).
    With gRPC's fork handlers on, about one child in ten crashed before its exec
    (SIGSEGV, SIGABRT in gRPC's poller); pdserve turns them off (``pdserve/__init__``)."""
    server, address = await start_stub(StubEngine(num_tokens=4))
    client = EngineClient(address)
    busy = True

    async def traffic() -> None:
        n = 0
        while busy:
            request = build_generate_request(f"r{n}", prompt_token_ids=[1, 2, 3], max_tokens=4)
            async for _ in client.generate(request):
                pass
            n += 1

    tasks = [asyncio.create_task(traffic()) for _ in range(4)]
    codes = []
    try:
        for _ in range(100):
            child = await asyncio.create_subprocess_exec(  # as EngineProcess starts an engine
                sys.executable, "-c", "raise SystemExit(3)", preexec_fn=_child_setup(()),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            codes.append(await child.wait())
    finally:
        busy = False
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        await server.stop(grace=None)
    assert set(codes) == {3}, sorted(set(codes))
