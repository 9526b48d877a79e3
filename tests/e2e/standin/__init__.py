"""A one-machine Kubernetes stand-in for end-to-end tests (DESIGN.md: "Tested on one
machine by a cluster stand-in").

The API server is the emulator (``tests/kmock_emulator.py``, with the scale
subresource of custom resources added by ``scale``); around it run a kubelet
that starts every Pod's containers as real processes (``kubelet``, ``containers``,
``podinit``, ``probes``, ``volumes``), the controllers a control plane would run
(``controllers``: Deployments, Endpoints, garbage collection, volume binding), and
the network pieces (``network``: loopback Pod and Service addresses, a socket shim,
hosts files, a Service proxy, the API's TLS endpoint). ``cluster.Cluster`` assembles
them; ``kubectl.Kubectl`` is the tests' client. Each module's docstring says what it
emulates and what it leaves out; in short, not emulated: a network namespace per Pod
(a socket shim gives each Pod its address; programs that bypass libc for sockets,
such as Go binaries, bind on the host), users and securityContext (containers run as
root), resource limits, images (every image is the pdserve image from the host),
RBAC, DNS servers (names come from /etc/hosts), StatefulSets, ReplicaSets, Jobs.

Needs root (mount and PID namespaces), nsenter, openssl and a C compiler; without
them ``Cluster.start`` raises ``StandinUnavailable`` and the tests skip.
"""

from tests.e2e.standin.cluster import Cluster, StandinUnavailable
from tests.e2e.standin.kubectl import Kubectl, KubectlError, condition_status, wait_for

__all__ = ["Cluster", "Kubectl", "KubectlError", "StandinUnavailable", "condition_status", "wait_for"]
