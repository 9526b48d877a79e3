"""What a request carries when its KV moves between engines.

The Coordinator sends the same request to a prefill (P) and a decode (D) engine,
each with a ``KVTransferParams`` naming the mode, a transfer id (distinct from the
engines' request ids) and the other side's KV endpoint. Everything else (block ids,
first token, sampler state) travels between P and D directly.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("pull", "push", "layerwise")
KV_ROLES = ("prefill", "decode")
DECODE_ALLOCATION_POLICIES = ("dispatch", "prefill_complete")
# Transfer ids travel in every connector message; the Coordinator keeps its leg ids
# (request id plus an attempt suffix) within this.
MAX_TRANSFER_ID_CHARS = 128


class KVTransferError(ValueError):
    """A transfer request that cannot be honoured; the message says why."""


@dataclass(frozen=True)
class KVTransferParams:
    role: str  # this engine's part: "prefill" (send) or "decode" (receive)
    mode: str
    transfer_id: str
    peer: str  # the other engine's KV transport endpoint, "host:port"

    def validate(self) -> None:
        if self.role not in KV_ROLES:
            raise KVTransferError(f"kv_transfer.role must be one of {KV_ROLES}, got {self.role!r}")
        if self.mode not in MODES:
            raise KVTransferError(f"kv_transfer.mode must be one of {MODES}, got {self.mode!r}")
        if not self.transfer_id or len(self.transfer_id) > MAX_TRANSFER_ID_CHARS:
            raise KVTransferError(
                f"kv_transfer.transfer_id must be 1-{MAX_TRANSFER_ID_CHARS} characters, "
                f"got {len(self.transfer_id)}")
        host, _, port = self.peer.rpartition(":")
        if not host or not port.isdigit():
            raise KVTransferError(f"kv_transfer.peer must be host:port, got {self.peer!r}")
