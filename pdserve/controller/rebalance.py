"""Role switching under load imbalance: move one instance from an idle pool to an
overloaded one (pure policy; the Controller calls ``decide`` each tick in PD mode).

Algorithm: a pool is *overloaded* when its READY instances average at least
``OVERLOADED_WAITING`` queued requests or ``OVERLOADED_KV_USAGE`` of their KV
blocks; it has *headroom* when nothing is queued, KV usage is at most
``IDLE_KV_USAGE`` and it has more than one READY instance (a pool is never
emptied). When one pool is overloaded and the other has headroom, both without a
break for ``window_s``, move the least busy instance of the idle pool.

No oscillation: at most one move per ``min_interval_s``, and never the reverse
direction within ``reverse_cooldown_s`` of a move. The Controller executes a move
by changing the instance's assigned role (SetRole through the agent: in place, the
legs in flight finish in the old role).
"""

from __future__ import annotations

from dataclasses import dataclass

OVERLOADED_WAITING = 4.0
OVERLOADED_KV_USAGE = 0.90
IDLE_KV_USAGE = 0.50


@dataclass(frozen=True)
class RebalanceSettings:
    window_s: float = 30.0
    min_interval_s: float = 120.0
    reverse_cooldown_s: float = 600.0
    enabled: bool = True


@dataclass(frozen=True)
class PoolMember:
    instance_id: str
    assigned_role: str
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int


@dataclass(frozen=True)
class Move:
    instance_id: str
    from_role: str
    to_role: str
    reason: str


def _usage(m: PoolMember) -> float:
    total = m.num_kv_blocks_used + m.num_kv_blocks_free
    return m.num_kv_blocks_used / total if total else 0.0


def is_overloaded(members: list[PoolMember]) -> bool:
    if not members:
        return False
    waiting = sum(m.num_waiting for m in members) / len(members)
    usage = sum(_usage(m) for m in members) / len(members)
    return waiting >= OVERLOADED_WAITING or usage >= OVERLOADED_KV_USAGE


def has_headroom(members: list[PoolMember]) -> bool:
    if len(members) < 2:
        return False
    usage = sum(_usage(m) for m in members) / len(members)
    return all(m.num_waiting == 0 for m in members) and usage <= IDLE_KV_USAGE


class RebalancePolicy:
    def __init__(self, settings: RebalanceSettings) -> None:
        self.settings = settings
        self._imbalanced_since: dict[str, float] = {}  # overloaded role -> since
        self._last_move: tuple[float, str] | None = None  # (time, to_role)

    def decide(self, members: list[PoolMember], now_s: float) -> Move | None:
        """One tick with the READY P and D instances. Returns a move or None."""
        s = self.settings
        pools = {r: [m for m in members if m.assigned_role == r] for r in ("prefill", "decode")}
        for hot, cold in (("prefill", "decode"), ("decode", "prefill")):
            if not (s.enabled and is_overloaded(pools[hot]) and has_headroom(pools[cold])):
                self._imbalanced_since.pop(hot, None)
                continue
            since = self._imbalanced_since.setdefault(hot, now_s)
            if now_s - since < s.window_s or not self._may_move(hot, now_s):
                continue
            pick = min(pools[cold], key=lambda m: (m.num_running, m.num_kv_blocks_used))
            self._last_move = (now_s, hot)
            self._imbalanced_since.clear()
            return Move(pick.instance_id, cold, hot,
                        f"{hot} pool overloaded and {cold} pool idle for {s.window_s:g}s")
        return None

    def _may_move(self, to_role: str, now_s: float) -> bool:
        if self._last_move is None:
            return True
        at, last_to = self._last_move
        if now_s - at < self.settings.min_interval_s:
            return False
        return last_to == to_role or now_s - at >= self.settings.reverse_cooldown_s
