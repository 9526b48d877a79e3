"""Container probes as the kubelet runs them.

Handlers: ``httpGet`` (host default: the Pod IP; a named port is looked up in the
container's ports; 200-399 passes; redirects are not followed), ``tcpSocket``
(connect), ``exec`` (inside the container, exit 0 passes), ``grpc`` (the standard
health service answers SERVING). Timing: first run ``initialDelaySeconds`` after the
container starts, then every ``periodSeconds`` (default 10), each run bounded by
``timeoutSeconds`` (1); ``successThreshold`` (1) passes in a row make the result
pass, ``failureThreshold`` (3) failures in a row make it fail. All times are
multiplied by the cluster's ``time_scale``.

Initial results: readiness fails until it passes; liveness passes until it fails;
a startup probe fails until it passes, and while it has not passed the other two
do not run. A container without a startup probe counts as started when it runs.
Runs on the cluster loop; one run per probe at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp

DEFAULTS = {"initialDelaySeconds": 0, "periodSeconds": 10, "timeoutSeconds": 1,
            "successThreshold": 1, "failureThreshold": 3}
Exec = Callable[[list[str], float], Awaitable[tuple[int, str]]]


def resolve_port(container: dict, port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


class Probe:
    """One probe (``kind``: readiness, liveness or startup) of one container run."""

    def __init__(self, kind: str, spec: dict, container: dict, pod_ip: str, time_scale: float,
                 http: aiohttp.ClientSession, run_exec: Exec, started_at: float) -> None:
        self.kind, self.spec, self.container, self.pod_ip = kind, spec, container, pod_ip
        self.http, self.run_exec = http, run_exec
        self.settings = {k: spec.get(k, v) for k, v in DEFAULTS.items()}
        self.period_s = self.settings["periodSeconds"] * time_scale
        self.timeout_s = self.settings["timeoutSeconds"] * max(time_scale, 0.5)
        self.next_at = started_at + self.settings["initialDelaySeconds"] * time_scale
        self.is_passing = kind == "liveness"
        self.num_successes = self.num_failures = 0
        self.last_message = ""
        self._task: asyncio.Task | None = None

    def tick(self, now: float) -> None:
        """Start a run when one is due (called by the Pod worker every pass)."""
        if now >= self.next_at and (self._task is None or self._task.done()):
            self.next_at = now + self.period_s
            self._task = asyncio.get_running_loop().create_task(self._run())

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        try:
            ok, message = await asyncio.wait_for(self.check(), self.timeout_s)
        except TimeoutError:
            ok, message = False, f"timed out after {self.timeout_s:g}s"
        except (OSError, aiohttp.ClientError, ValueError) as exc:
            ok, message = False, f"{type(exc).__name__}: {exc}"
        self.last_message = message
        if ok:
            self.num_successes, self.num_failures = self.num_successes + 1, 0
            if self.num_successes >= self.settings["successThreshold"]:
                self.is_passing = True
        else:
            self.num_successes, self.num_failures = 0, self.num_failures + 1
            if self.num_failures >= self.settings["failureThreshold"]:
                self.is_passing = False

    async def check(self) -> tuple[bool, str]:
        spec = self.spec
        if "httpGet" in spec:
            get = spec["httpGet"]
            scheme = get.get("scheme", "HTTP").lower()
            url = (f"{scheme}://{get.get('host') or self.pod_ip}:{resolve_port(self.container, get['port'])}"
                   f"{get.get('path', '/')}")
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            async with self.http.get(url, headers=headers, allow_redirects=False, ssl=False) as response:
                return 200 <= response.status < 400, f"HTTP {response.status}"
        if "tcpSocket" in spec:
            port = resolve_port(self.container, spec["tcpSocket"]["port"])
            _, writer = await asyncio.open_connection(spec["tcpSocket"].get("host") or self.pod_ip, port)
            writer.close()
            return True, "connected"
        if "exec" in spec:
            code, output = await self.run_exec(spec["exec"]["command"], self.timeout_s)
            return code == 0, output[-200:]
        if "grpc" in spec:
            return await self._grpc(spec["grpc"])
        return False, f"unsupported probe handler: {sorted(spec)}"

    async def _grpc(self, spec: dict) -> tuple[bool, str]:
        import grpc

        service = (spec.get("service") or "").encode()
        request = (b"\x0a" + bytes([len(service)]) + service) if service else b""
        async with grpc.aio.insecure_channel(f"{self.pod_ip}:{int(spec['port'])}") as channel:
            reply = await channel.unary_unary("/grpc.health.v1.Health/Check")(request, timeout=self.timeout_s)
        return reply == b"\x08\x01", "SERVING" if reply == b"\x08\x01" else f"status {reply!r}"


def container_probes(container: dict, pod_ip: str, time_scale: float, http: aiohttp.ClientSession,
                     run_exec: Exec, started_at: float | None = None) -> dict[str, Probe]:
    started_at = time.monotonic() if started_at is None else started_at
    return {kind: Probe(kind, container[f"{kind}Probe"], container, pod_ip, time_scale, http, run_exec, started_at)
            for kind in ("startup", "liveness", "readiness") if container.get(f"{kind}Probe")}
