"""Protocol buffers of the internal gRPC services and their generated modules."""
