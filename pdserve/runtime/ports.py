"""Free ports for listeners that a process binds later (often much later: a vLLM binds its
KV side channel after loading its model).

A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, the same range
it draws every outgoing connection's local port from; any connection made between the
choice and the bind may take it. Ports chosen here lie outside that range, where only
another listener can take them.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below this: well-known and registered services' usual ports
HIGHEST = 65535
TRIES = 200


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def candidates(low: int, high: int) -> list[range]:
    """The port ranges outside the ephemeral ``low``..``high``, at or above ``LOWEST``."""
    spans = [range(LOWEST, low), range(high + 1, HIGHEST + 1)]
    return [r for r in spans if len(r) > 0]


def free_ports(host: str = "127.0.0.1", n: int = 1, *, rng: random.Random | None = None,
               ephemeral: tuple[int, int] | None = None) -> list[int]:
    """``n`` distinct ports free on ``host`` now, outside the ephemeral range (held
    together while chosen). Falls back to the kernel's choice when no range is left
    outside it (an ephemeral range covering nearly all ports)."""
    rng = rng or random.Random()
    spans = candidates(*(ephemeral or ephemeral_range()))
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket(_family(host)))
            ports.append(_bind_outside(sock, host, spans, rng, ports))
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(host, 1)[0]


def _bind_outside(sock: socket.socket, host: str, spans: list[range], rng: random.Random,
                  taken: list[int]) -> int:
    weights = [len(r) for r in spans]
    for _ in range(TRIES if spans else 0):
        port = rng.choice(rng.choices(spans, weights)[0])
        if port in taken:
            continue
        try:
            sock.bind((host, port))
        except OSError:
            continue
        return port
    sock.bind((host, 0))
    return sock.getsockname()[1]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
