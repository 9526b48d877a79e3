"""Routing policies, one per file, chosen separately for the prefill and decode pools."""

from __future__ import annotations

from ..prefix_index import PrefixIndex
from .base import Policy, RouteContext
from .least_loaded import LeastLoaded
from .prefix_cache_aware import PrefixCacheAware
from .round_robin import RoundRobin
from .slo_aware import SLOAware

__all__ = ["Policy", "RouteContext", "build_policy"]


def build_policy(name: str, index: PrefixIndex, pool: str) -> Policy:
    """Called once per pool by the router."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_cache_aware":
        return PrefixCacheAware(index)
    if name == "slo_aware":
        return SLOAware(index, pool)
    raise ValueError(f"unknown routing policy {name!r}")
