"""pdserve: prefill/decode disaggregated LLM inference on Kubernetes.

One import root with six subpackages: ``api`` (schemas, the bottom layer) and the
five components ``engine``, ``coordinator``, ``controller``, ``nodeagent`` and
``operator``, which talk to each other only over the network.
"""

__version__ = "0.1.0"
