"""Control messages between a P and a D engine, over the transport's notify path.

Every message is a small JSON object with a type ``t``, the sender's endpoint
``from`` and, for per-request messages, the transfer id ``x``. ``decode`` refuses
anything malformed with ``MessageError``; the connector logs and drops it, so a bad
message never breaks an engine.

    HELLO / HELLO_ACK   handshake once per peer: the sender's KVLayout
    RESERVE             D → P  destination blocks reserved (push, layerwise)
    WANT_DEST           P → D  prefill done, reserve now (prefill_complete policy)
    DONE                P → D  every layer written; carries the resumable state
    READY               P → D  pull: prefilled blocks held under lease; state
    RELEASE             D → P  pull: read finished, free the blocks
    ABORT / ABORT_ACK   either way / P → D: stop; after the ack no write lands
    FAILED              P → D  the transfer failed on P's side
    PROBE / PROBE_ACK   a probe (``x``: the probe id) and its answer: each side's KVLayout
    PROBE_REJECT        the answer when the layouts do not match; ``reason`` says how

An ABORT's ``reason`` says why; D's starts with ``DECODE_FULL`` when it had no blocks
to reserve within its reserve wait: load, so P ends its leg "decode full", not failed.
"""

from __future__ import annotations

import json

TYPES = {"HELLO", "HELLO_ACK", "HELLO_REJECT", "RESERVE", "WANT_DEST", "DONE", "READY",
         "RELEASE", "ABORT", "ABORT_ACK", "FAILED", "PROBE", "PROBE_ACK", "PROBE_REJECT"}
PROBE_REPLIES = ("PROBE_ACK", "PROBE_REJECT")
MAX_MESSAGE_BYTES = 1 << 20
DECODE_FULL = "decode full"  # D's ABORT reason (and the gRPC details) when it had no room
CANCELLED = "cancelled"  # an ABORT's or FAILED's reason when the request was aborted by its client


class MessageError(ValueError):
    pass


def encode(kind: str, sender: str, **fields) -> bytes:
    assert kind in TYPES
    return json.dumps({"t": kind, "from": sender, **fields}, separators=(",", ":")).encode()


def decode(raw: bytes) -> dict:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(raw)} bytes is too large")
    try:
        msg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MessageError(f"not JSON: {exc}") from None
    if not isinstance(msg, dict) or msg.get("t") not in TYPES or not isinstance(msg.get("from"), str):
        raise MessageError(f"unknown message {str(msg)[:200]!r}")
    if msg["t"] not in ("HELLO", "HELLO_ACK", "HELLO_REJECT") and not isinstance(msg.get("x"), str):
        raise MessageError(f"{msg['t']} without a transfer id")
    blocks = msg.get("blocks")
    if blocks is not None and (
        not isinstance(blocks, list) or not all(isinstance(b, int) and b >= 0 for b in blocks)
    ):
        raise MessageError("blocks must be a list of non-negative integers")
    return msg
