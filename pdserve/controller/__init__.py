"""Cluster brain: instance registry, health, failover, fallback, role switching."""
