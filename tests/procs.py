"""Real processes for tests: start a pdserve command, wait until it serves, reap it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PDSERVE = [sys.executable, "-m", "pdserve.cli"]


class Proc:
    """A child process whose output is collected; ``wait_for(pattern)`` scans it."""

    def __init__(self, args: list[str], env: dict | None = None) -> None:
        self.args = args
        self.popen = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float = 60.0) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = regex.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.popen.poll() is not None:
                    raise TimeoutError(f"{pattern!r} not seen; output:\n{self.output[-3000:]}")
                self._cond.wait(min(left, 0.2))

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(timeout_s)
        return self.popen.returncode


def start_engine(*extra: str, model: str = "tiny", env: dict | None = None) -> tuple[Proc, str]:
    """Start ``pdserve engine`` on a free port; returns the process and its address."""
    proc = Proc([*PDSERVE, "engine", "--model", model, "--port", "0", *extra], env=env)
    m = proc.wait_for(r"serving model .* on (\S+:\d+)", timeout_s=120)
    return proc, m.group(1)
