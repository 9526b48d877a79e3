"""Per-node supervisor: launches engines, probes them, reports heartbeats."""
