"""Protocol buffers of the internal gRPC services and their generated modules."""

from pdserve.api.proto import controller_pb2 as _controller_pb2

# The engine's figures a heartbeat carries for the Controller's planner (cumulative
# counters and the demand gauges): ``InstanceLoad`` fields from number 9, each named as
# in the engine's ``StatsResponse``.
LOAD_COUNTERS = tuple(f.name for f in _controller_pb2.InstanceLoad.DESCRIPTOR.fields if f.number >= 9)
