"""Cluster brain: instance registry, health, failover, fallback, role switching.

The failover story across components, mechanism by mechanism: ``docs/failover.md``.
"""
