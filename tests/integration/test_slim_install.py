"""``pip install pdserve`` without extras is a working control plane, without torch.

A fresh venv (``python -m venv``, no system site-packages, so nothing of the test
venv) gets pdserve's wheel, built from this checkout, and its core dependencies; in it
torch and every other extra's module are missing, every control-plane command shows
its help, ``pdserve engine`` says which extra it needs, and a Coordinator routes a
completion to stub engines (served from the test's venv: the engines' stand-in).

The install comes from pip's configured index and cache, with the test venv's pip
(``--python``: the fresh venv needs none of its own) and no byte-compiling: about
15 s warm, most of this module's time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.cli import COMMANDS, NEEDS_EXTRA
from pdserve.runtime.extras import EXTRAS
from tests.procs import REPO, Proc
from tests.stub_engine import StubEngine, start_stub

pytestmark = pytest.mark.timeout(600)
CONTROL_PLANE = [c for c in COMMANDS if c not in NEEDS_EXTRA]
ENV = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")},
       "PYTHONNOUSERSITE": "1"}


def run(args: list, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def slim(tmp_path_factory) -> Path:
    """The bin directory of a venv holding pdserve (a wheel of this checkout) and its core
    dependencies only."""
    root = tmp_path_factory.mktemp("slim")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "pdserve", src / "pdserve",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    started = time.monotonic()
    built = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                 "-w", root / "dist", src], root)
    assert built.returncode == 0, built.stderr
    [wheel] = (root / "dist").glob("pdserve-*.whl")
    made = run([sys.executable, "-m", "venv", "--without-pip", root / "venv"], root)
    assert made.returncode == 0, made.stderr
    python = root / "venv" / "bin" / "python"
    installed = run([sys.executable, "-m", "pip", "--python", python, "install", "-q",
                     "--no-compile", "--disable-pip-version-check", wheel], root, timeout_s=480)
    assert installed.returncode == 0, installed.stderr[-3000:]
    print(f"slim install: {time.monotonic() - started:.1f}s")
    return python.parent


def test_the_slim_venv_has_pdserve_and_no_extra(slim, tmp_path):
    modules = sorted({m for ms in EXTRAS.values() for m in ms} | {"transformers"})
    code = ("import importlib.util, pdserve\n"
            "print(pdserve.__file__)\n"
            f"print([m for m in {modules!r} if importlib.util.find_spec(m)])")
    out = run([slim / "python", "-c", code], tmp_path)
    assert out.returncode == 0, out.stderr
    where, found = out.stdout.splitlines()
    assert Path(where).is_relative_to(slim.parent) and found == "[]"
    assert "No module named 'torch'" in run([slim / "python", "-c", "import torch"], tmp_path).stderr


def test_every_control_plane_command_shows_its_help(slim, tmp_path):
    assert {"operator", "controller", "nodeagent", "coordinator", "bench", "doctor", "up"} <= \
        set(CONTROL_PLANE)
    assert run([slim / "pdserve", "--help"], tmp_path).returncode == 0
    procs = {c: subprocess.Popen([slim / "pdserve", c, "--help"], cwd=tmp_path, env=ENV, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for c in CONTROL_PLANE}
    for command, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (command, err)
        assert out.startswith(f"usage: pdserve {command} "), (command, out)


@pytest.mark.parametrize("command", sorted(NEEDS_EXTRA))
def test_an_engine_command_names_the_engine_extra(slim, tmp_path, command):
    out = run([slim / "pdserve", command, "--help"], tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (f"error: pdserve {command}: the engine extra is not installed (no module "
                          "torch, safetensors); install it with pip install 'pdserve[engine]'\n")


def test_pdserve_up_stops_at_once_naming_the_engine_extra(slim, tmp_path):
    out = run([slim / "pdserve", "up", "--model", "tiny", "--run-dir", tmp_path / "run"], tmp_path)
    assert out.returncode == 2
    assert "error: pdserve up runs engines here: the engine extra is not installed" in out.stderr
    assert "pip install 'pdserve[engine]'" in out.stderr and "Traceback" not in out.stderr


def test_the_doctor_says_the_engine_extra_is_missing_here(slim, tmp_path):
    out = run([slim / "pdserve", "doctor", "-f", REPO / "examples" / "minimal.yaml", "--json",
               "--run-dir", tmp_path / "run"], tmp_path)
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    assert rows["engine extra"]["status"] == "warn", rows
    assert rows["engine extra"]["fix"] == "pip install 'pdserve[engine]'"
    assert "Traceback" not in out.stderr


def test_a_slim_coordinator_serves_a_completion_from_stub_engines(slim, loop):
    servers = [loop.run(start_stub(StubEngine(role=role, num_tokens=3)))
               for role in ("prefill", "decode")]
    coordinator = Proc([str(slim / "pdserve"), "coordinator", "--host", "127.0.0.1", "--port", "0",
                        "--log-level", "warning", *(f"--engine={a}" for _, a in servers)],
                       env={"PYTHONPATH": "", "PYTHONNOUSERSITE": "1"})
    try:
        url = "http://" + coordinator.wait_for(r"coordinator serving on (\S+)", timeout_s=60).group(1)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, coordinator.output
            time.sleep(0.2)
        reply = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["text"] and choice["finish_reason"] == "length"
        assert reply.json()["usage"]["completion_tokens"] == 3
    finally:
        assert coordinator.stop() is not None
        for server, _ in servers:
            loop.run(server.stop(grace=None))
