"""Local mode (``pdserve up``): a whole PDCluster as processes on one machine."""
