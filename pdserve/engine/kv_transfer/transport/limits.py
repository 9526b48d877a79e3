"""What the KV port admits: connection caps, deadlines, and one log line per refusal.

The KV port is reachable by anyone on the network, so the channel decides what a
connection may cost before it knows who is on the other end. Sizes per frame are
wire.py's (``HELLO_LIMITS`` before authentication, ``SERVER_LIMITS`` after); this
module holds the rest:

- ``ChannelLimits``: connections at once (in all), handshakes at once per peer host
  (connections not yet authenticated), how long a peer has to finish its HELLO, how
  long an authenticated connection may stay silent.
- ``Admission``: counts open connections; the channel asks it before starting a
  thread for a new one, tells it when the peer authenticated (its host's handshake
  slot is free again) and when the connection ends.
- ``check_hello``: a HELLO body is a JSON object whose token matches ours (when we
  have one); anything else is refused with the reason, never a traceback.
- ``RefusalLog``: a refusal is logged once with its reason, then at most once per
  ``every_s`` per (peer host, reason), with how many were held back.

Every method is thread-safe (the accept thread and the connections' threads call them).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass

from pdserve.engine.kv_transfer.transport.wire import FrameError


@dataclass(frozen=True)
class ChannelLimits:
    """Defaults fit a cluster of a thousand engines, every prefill engine linked with
    every decode engine. Only handshakes are capped per host: an authenticated peer is a
    cluster member, and one host may run many (``local`` mode puts every engine on
    127.0.0.1; a 100-engine cluster has 75 decode peers linked to each prefill port)."""

    max_connections: int = 2048  # a thread each
    max_handshakes_per_host: int = 64  # connections from one host not yet authenticated
    handshake_timeout_s: float = 5.0  # connect to WELCOME/REFUSE, HELLO included
    idle_timeout_s: float = 600.0  # server side; our own links close at half of it
    refusal_log_every_s: float = 10.0


class Admission:
    """Open server-side connections, and those still in their handshake by peer host."""

    def __init__(self, limits: ChannelLimits) -> None:
        self._limits = limits
        self._lock = threading.Lock()
        self._handshakes: dict[str, int] = {}  # host -> connections not yet authenticated
        self._total = 0

    def enter(self, host: str) -> str | None:
        """Count a new connection from ``host``; returns why it is refused (then not counted)."""
        with self._lock:
            if self._total >= self._limits.max_connections:
                return f"too many KV connections ({self._total} open)"
            num_pending = self._handshakes.get(host, 0)
            if num_pending >= self._limits.max_handshakes_per_host:
                return f"too many KV handshakes from {host} ({num_pending} at once)"
            self._handshakes[host] = num_pending + 1
            self._total += 1
            return None

    def authenticated(self, host: str) -> None:
        """A connection ``enter`` admitted passed its HELLO: it no longer holds a handshake."""
        with self._lock:
            self._end_handshake(host)

    def leave(self, host: str, is_authenticated: bool) -> None:
        """A connection ``enter`` admitted has ended (its thread, once, in ``finally``)."""
        with self._lock:
            self._total -= 1
            if not is_authenticated:
                self._end_handshake(host)

    def _end_handshake(self, host: str) -> None:
        left = self._handshakes.pop(host) - 1
        if left:
            self._handshakes[host] = left


def check_hello(body: bytes, auth_token: str | None) -> str | None:
    """The endpoint a HELLO names (None: it names none). Raises FrameError with the reason
    for a body that is not a JSON object of strings, or a token that is not ours."""
    try:
        hello = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError("malformed HELLO", f"not JSON ({exc})") from None
    if not isinstance(hello, dict):
        raise FrameError("malformed HELLO", f"a JSON {type(hello).__name__}, not an object")
    token, endpoint = hello.get("token"), hello.get("endpoint")
    if not all(v is None or isinstance(v, str) for v in (token, endpoint)):
        raise FrameError("malformed HELLO", "token and endpoint must be strings")
    if auth_token and not (token and hmac.compare_digest(token.encode(), auth_token.encode())):
        raise FrameError("bad auth token", "the HELLO's token is not this cluster's")
    return endpoint or None


class RefusalLog:
    """Rate-limited warnings for refused or broken connections."""

    _MAX_KEYS = 4096  # forget old keys beyond this, so a scan of many hosts stays bounded

    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self._log = logger
        self._every_s = every_s
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (logged at, held)

    def refused(self, host: str, kind: str, detail: str = "", verb: str = "refused") -> None:
        """Log "``verb`` KV connection from ``host``: ``kind``" unless the same line was
        logged less than ``every_s`` ago; ``detail`` is shown, never part of the key.
        ``verb`` is "closed" for a connection that had been accepted."""
        now = time.monotonic()
        key = (host, f"{verb} {kind}")
        with self._lock:
            logged_s, held = self._last.get(key, (-self._every_s, 0))
            if now - logged_s < self._every_s:
                self._last[key] = (logged_s, held + 1)
                return
            if len(self._last) >= self._MAX_KEYS:
                recent = {k: v for k, v in self._last.items() if now - v[0] < self._every_s}
                self._last = recent if len(recent) < self._MAX_KEYS else {}
            self._last[key] = (now, 0)
        more = f" ({held} more since the last report)" if held else ""
        self._log.warning("%s KV connection from %s: %s%s%s", verb, host, kind,
                          f": {detail}" if detail else "", more)
