"""A request's deadlines: its first token, the gaps between its tokens, its total.

A generation's length is not known in advance, so no fixed total bounds it by
default. Three bounds instead, fixed at arrival (``Deadlines.at_arrival``):

  first token   ``first_token_timeout_s`` (60) from arrival: the admission wait, the
                routing waits, prefill, the KV transfer and every retry before the
                first token
  idle gap      ``token_idle_timeout_s`` (60) after each message of the stream: an
                engine that stalls mid-stream, and a continuation's wait for its next
                token after a failure (the gap runs from the last token received)
  total         off unless set: ``request_timeout_s`` in the settings (the spec's),
                ``request_timeout`` in the body or ``x-request-timeout`` (the
                client's); the smallest applies, and caps the two above

A stream that keeps producing tokens runs to its end whatever its length.

Who enforces what: admission and the router wait until ``first_token_s``; each
attempt's legs get the deadline of the request's next token (``next_token_s``), and
a leg that streams tokens moves its own call's deadline by ``idle_s`` with each
message (``sessions.SessionCall``: a time stamp per engine message, a timer armed
again only when it fires, so a live stream costs one timer wake per idle period).

Invariants: monotonic seconds; ``first_token_s`` and every later deadline are at
most ``end_s``; a passed deadline is a 504 with code ``deadline`` that says which
bound it was (``passed``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .errors import ServeError
from .settings import CoordinatorSettings

TIMEOUT_HEADER = "x-request-timeout"
"""The client's total, in seconds (as the body's ``request_timeout``)."""
MIN_REQUEST_TIMEOUT_S = 1.0
"""The shortest total a client may ask for: a shorter one would end most requests in a
504, a server error, for what is the client's choice."""


class Deadlines(NamedTuple):
    """One request's deadlines (a tuple: built per request, and cheaper to build than a
    frozen dataclass)."""

    first_token_s: float
    """When the first token must have reached the Coordinator (monotonic)."""
    idle_s: float
    """The longest gap between two messages of a stream, or from the last one to a
    continuation's first."""
    end_s: float = math.inf
    """The total's end (monotonic); inf: no total."""
    first_token_timeout_s: float = 0.0  # for the messages of ``passed``
    total_s: float | None = None

    @classmethod
    def at_arrival(cls, arrival_s: float, settings: CoordinatorSettings,
                   client_total_s: float | None = None) -> Deadlines:
        """Called once per request by serving: the settings' bounds and the smaller of
        the settings' and the client's totals."""
        total = settings.request_timeout_s
        if client_total_s is not None and (total is None or client_total_s < total):
            total = client_total_s
        end = math.inf if total is None else arrival_s + total
        first = settings.first_token_timeout_s
        return cls(min(arrival_s + first, end), settings.token_idle_timeout_s, end, first, total)

    def next_token_s(self, last_s: float | None) -> float:
        """When the request's next token must come: ``first_token_s`` before any, else
        ``idle_s`` after ``last_s`` (when the last one came), never past ``end_s``."""
        if last_s is None:
            return self.first_token_s
        return min(last_s + self.idle_s, self.end_s)

    def passed(self, last_s: float | None) -> ServeError:
        """The 504 of a request whose deadline ``next_token_s(last_s)`` passed, naming it."""
        if self.next_token_s(last_s) >= self.end_s:
            why = f"the request's timeout of {self.total_s:g}s passed"
        elif last_s is None:
            why = f"no first token within {self.first_token_timeout_s:g}s (first-token timeout)"
        else:
            why = f"no new token for {self.idle_s:g}s (token idle timeout)"
        return ServeError(504, why, code="deadline")


def client_total_s(header: bytes | None, body_s: float | None) -> float | None:
    """The client's total: the smaller of its ``x-request-timeout`` header (``header``,
    as sent) and its body's ``request_timeout`` (validated by the schema), None when
    it gave neither; 400 when the header is not a number of seconds of at least
    ``MIN_REQUEST_TIMEOUT_S``."""
    if header is None:
        return body_s
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not (MIN_REQUEST_TIMEOUT_S <= seconds < math.inf):
        raise ServeError(400, f"{TIMEOUT_HEADER} must be a number of seconds, at least "
                         f"{MIN_REQUEST_TIMEOUT_S:g} (got {header[:32].decode('latin-1')!r})",
                         code="invalid_request_timeout", param=TIMEOUT_HEADER)
    return seconds if body_s is None else min(seconds, body_s)
