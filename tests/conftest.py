"""Loaded before every test module: ``pdserve`` first, so that its settings for gRPC
(``pdserve/__init__.py``: no fork handlers) are in place before a test module imports
grpc, as they are in pdserve's own processes, whose entry points import pdserve first."""

import pdserve  # noqa: F401
