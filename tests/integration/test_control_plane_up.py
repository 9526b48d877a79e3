"""``pdserve up`` end to end, as ``make run`` starts it (the built-in cluster, the real
smollm2 model): the README's first commands, read out of README.md, answer as the
README says; ``pdserve doctor`` passes on it; it survives its own crash (the next
start clears the leftovers), and Ctrl-C stops every process it started."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import httpx

from pdserve.cli import COMMANDS
from pdserve.local.runstate import is_group_alive
from tests.etcd import free_port
from tests.procs import PDSERVE, REPO, Proc
from tests.real_model import gguf_path

README_PORT = "127.0.0.1:8000"


def readme_commands() -> list[str]:
    """The curl commands of README.md's one-machine quick start, continuations joined."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Quick start (one machine)"):text.index("### Your own checkpoint")]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith("curl ") and README_PORT in command:
                commands.append(command.split("  #")[0])
    return commands


def run_readme_commands(port: int) -> dict[str, dict]:
    """Each README command against this cluster's port (the README's is 8000), by path."""
    answers = {}
    for command in readme_commands():
        done = subprocess.run(["bash", "-c", command.replace(README_PORT, f"127.0.0.1:{port}")
                               + " --silent --show-error --fail-with-body"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        answers[re.search(r"127\.0\.0\.1:\d+(\S+)", command).group(1)] = json.loads(done.stdout)
    return answers


def test_the_readme_quick_start_has_the_commands_this_test_runs():
    paths = [re.search(r"127\.0\.0\.1:8000(\S+)", c).group(1) for c in readme_commands()]
    assert paths == ["/v1/chat/completions", "/v1/completions", "/v1/models"]


def completion(port: int) -> httpx.Response:
    base = f"http://127.0.0.1:{port}"
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    return httpx.post(f"{base}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "Hello", "max_tokens": 8})


def test_up_serves_recovers_from_a_crash_and_stops_everything(tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    args = [*PDSERVE, "up", "--port", str(port), "--run-dir", str(run_dir)]
    procs: list[Proc] = []
    try:
        _lifecycle(args, port, run_dir, procs)
    finally:
        for proc in procs:
            proc.stop()


def _lifecycle(args, port, run_dir, procs: list[Proc]) -> None:
    gguf_path()  # installed once for the session (a first `pdserve up` would install it)
    first = Proc(args)
    procs.append(first)
    first.wait_for(r"pdserve is up", timeout_s=240)
    assert "model smollm2" in first.output
    groups = json.loads((run_dir / "processes.json").read_text())["groups"]
    assert {"controller", "nodeagent"} <= set(groups)
    if "coordinator" in COMMANDS:
        deadline = time.monotonic() + 30
        while (r := completion(port)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        answers = run_readme_commands(port)
        chat = answers["/v1/chat/completions"]
        assert "Paris" in chat["choices"][0]["message"]["content"], chat
        assert chat["usage"]["prompt_tokens"] == 37  # SmolLM2's own template, system prompt included
        text = answers["/v1/completions"]["choices"][0]["text"]
        # Sampled (the README sets no temperature): words, not the random bytes of a preset.
        assert re.search(r"[A-Za-z]{3,}", text) and "\ufffd" not in text, text
        assert all(c.isprintable() or c.isspace() for c in text), text
        assert answers["/v1/models"]["data"][0] | {"created": 0} == {
            "id": "local", "object": "model", "created": 0, "owned_by": "pdserve", "max_model_len": 8192,
            "dtype": "float32"}
        engine_metrics = re.findall(r"engine metrics on (http://\S+/metrics)",
                                    (run_dir / "nodeagent.log").read_text())
        assert len(engine_metrics) == 2, engine_metrics  # the prefill and the decode engine
        for url in engine_metrics:
            assert "pdserve_engine_running_requests" in httpx.get(url, timeout=10).text
        doctor = subprocess.run([*PDSERVE, "doctor", "--run-dir", str(run_dir)], capture_output=True,
                                text=True, timeout=120)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr

    os.kill(first.popen.pid, signal.SIGKILL)  # a crash: its children are left behind
    first.popen.wait()
    assert all(is_group_alive(g) for g in groups.values())

    second = Proc(args)
    procs.append(second)
    second.wait_for(r"stopped leftovers of an earlier run", timeout_s=30)
    assert not any(is_group_alive(g) for g in groups.values())
    second.wait_for(r"pdserve is up", timeout_s=240)
    groups = json.loads((run_dir / "processes.json").read_text())["groups"]
    second.popen.send_signal(signal.SIGINT)
    assert second.popen.wait(30) == 0
    assert not any(is_group_alive(g) for g in groups.values())
    assert not (run_dir / "processes.json").exists()
