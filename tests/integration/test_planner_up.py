"""The SLO planner on ``pdserve up -f``, the user's way: a 1 prefill + 2 decode cluster
with ``spec.planner`` on serves a load whose mix shifts, and the planner moves an
engine to where the load is, with no client error:

1. long prompts, one output token each: the prefill engine breaks the TTFT target and
   a decode engine has nothing to do, so one decode engine becomes a prefill engine;
2. short prompts, long outputs: now the decode engine breaks the TPOT target and a
   prefill engine is spare, so one prefill engine goes back to decode.

The targets are set where each phase breaks one of them whatever the machine's speed
(a 1,200-token prefill of the ``small`` preset takes longer than the TTFT budget left
by three clients; no CPU decode step fits 5 ms). Every request of both phases must
return 200 with its whole output while engines drain and switch."""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path

import httpx
import yaml

from pdserve.local.agents import get_view
from pdserve.local.runstate import RunState
from pdserve.local.up import TOKEN_FILE
from pdserve.runtime.security import TOKEN_FILE_ENV, SecuritySettings
from tests.etcd import free_port
from tests.procs import PDSERVE, Proc

NAME = "planned"


def write_spec(path: Path) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster", "metadata": {"name": NAME},
        "spec": {
            "model": {"preset": "small"},
            "engine": {"dtype": "float32", "kvCacheBytes": "128Mi"},
            "prefill": {"replicas": 1, "threads": 1}, "decode": {"replicas": 2, "threads": 1},
            "routing": {"localPrefillMaxTokens": 0, "loadAwareLocalPrefill": False},
            "slo": {"ttftMs": 400, "tpotMs": 5},
            "planner": {"enabled": True, "intervalSeconds": 1, "windowSeconds": 16, "stableIntervals": 2,
                        "cooldownSeconds": 4, "minRequests": 3, "minPrefill": 1, "maxPrefill": 2,
                        "minDecode": 1, "maxDecode": 2, "maxEngines": 3},
        }}))


class Load:
    """``clients`` threads sending completions of ``prompt_tokens`` random ids and
    ``max_tokens`` outputs until stopped; every answer is checked."""

    def __init__(self, base: str, clients: int, prompt_tokens: int, max_tokens: int) -> None:
        self.base, self.prompt_tokens, self.max_tokens = base, prompt_tokens, max_tokens
        self.ok, self.errors = 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self, seed: int) -> None:
        rng = random.Random(seed * 7919 + self.prompt_tokens)
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                prompt = [rng.randrange(10, 8000) for _ in range(self.prompt_tokens)]
                try:
                    r = client.post(f"{self.base}/v1/completions", json={
                        "model": NAME, "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                        "temperature": 0})
                except httpx.HTTPError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != self.max_tokens:
                    self.errors.append(f"{r.status_code}: {r.text[:300]}")
                else:
                    self.ok += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(150)


def wait_for_action(controller: str, security: SecuritySettings, words: str, timeout_s: float):
    """The view once the planner's last action holds ``words``."""
    deadline = time.monotonic() + timeout_s
    view = None
    while time.monotonic() < deadline:
        view = get_view(controller, security)
        if view is not None and words in view.planner.last_action:
            return view
        time.sleep(0.5)
    raise AssertionError(f"no planner action {words!r} in {timeout_s:g}s; last view:\n{view}")


def roles(controller: str, security: SecuritySettings, expected: dict[str, int],
          timeout_s: float = 60.0) -> dict[str, int]:
    """Ready engines by role, once they are ``expected`` (an action decided is carried
    out after the view says so: drain, then switch), or the last seen with 3 ready."""
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        view = get_view(controller, security)
        if view is not None and len(view.instances) == 3:
            seen = {r: sum(i.role == r for i in view.instances) for r in ("prefill", "decode")}
            if seen == expected:
                break
        time.sleep(0.5)
    return seen


def test_the_planner_switches_roles_as_the_load_shifts_with_no_client_error(tmp_path, monkeypatch):
    spec, port, run_dir = tmp_path / "cluster.yaml", free_port(), tmp_path / "run"
    write_spec(spec)
    up = Proc([*PDSERVE, "up", "-f", str(spec), "--host", "127.0.0.1", "--port", str(port),
               "--run-dir", str(run_dir)])
    loads = []
    try:
        up.wait_for(r"pdserve is up", timeout_s=180)
        controller = RunState(run_dir).read_addresses()["controller"]
        monkeypatch.setenv(TOKEN_FILE_ENV, str(run_dir / TOKEN_FILE))
        security = SecuritySettings.from_env()
        base = f"http://127.0.0.1:{port}"
        assert roles(controller, security, {"prefill": 1, "decode": 2}) == {"prefill": 1, "decode": 2}

        loads.append(Load(base, clients=3, prompt_tokens=1200, max_tokens=1))
        view = wait_for_action(controller, security, "to prefill", timeout_s=120)
        phase1_actions = view.planner.num_actions
        loads[-1].stop()
        assert roles(controller, security, {"prefill": 2, "decode": 1}) == {"prefill": 2, "decode": 1}
        # why: the TTFT measured, or before any prompt finished, the prompts waiting at P
        # at the speed the first chunks showed
        assert (view.planner.measured_ttft_s > view.planner.ttft_target_s
                or "prompt tokens waiting at P" in view.planner.reason), view.planner

        loads.append(Load(base, clients=8, prompt_tokens=16, max_tokens=48))
        view = wait_for_action(controller, security, "to decode", timeout_s=150)
        loads[-1].stop()
        assert roles(controller, security, {"prefill": 1, "decode": 2}) == {"prefill": 1, "decode": 2}
        assert view.planner.num_actions - phase1_actions <= 2, view.planner
        assert phase1_actions <= 2, view.planner
        # the engines were switched, never added or removed
        assert (view.planner.replicas_prefill, view.planner.replicas_decode) == (1, 2)
        for load in loads:
            assert load.errors == [] and load.ok > 0, (load.errors[:5], load.ok)
        assert "planner: starting" not in up.output and "planner: draining" not in up.output
        assert len(re.findall(r"planner: switch \S+ to (prefill|decode) \(", up.output)) >= 2, up.output
    finally:
        for load in loads:
            load.stop()
        up.stop(timeout_s=60)

