"""pdserve: prefill/decode disaggregated LLM inference on Kubernetes.

One import root with six subpackages: ``api`` (schemas, the bottom layer) and the
five components ``engine``, ``coordinator``, ``controller``, ``nodeagent`` and
``operator``, which talk to each other only over the network.
"""

import os

__version__ = "0.1.0"

# pdserve's processes start children by fork and exec (the NodeAgent its engines, ``pdserve
# up`` its components) and never use gRPC in a forked child, which is what gRPC's fork
# handlers are for. With them on, a child forked while gRPC's threads run can crash
# between the fork and the exec (SIGSEGV, or SIGABRT in its event engine's poller): an
# engine that never started. Off unless the environment says otherwise; read by gRPC at
# its initialisation, so this is set before any pdserve module creates a channel.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
