"""Cluster tokens: one per PDCluster, derived from the operator's key, so the operator
knows every cluster's token without reading any Secret but its own.

    token(cluster) = HMAC-SHA256(key, "<namespace>/<name>/<uid>"), hex

The key is 32 random bytes in the Secret ``OperatorSettings.key_secret`` of the
operator's namespace; ``Reconciler`` creates it on first use. The operator writes
each cluster's token into the Secret ``<cluster>-token`` (create only: an existing
one is never read or changed), which every component of the cluster mounts
(``builders.shared_mounts``), and presents it on its own calls to the cluster's
Controller (``ControllerClients.for_cluster``).

Invariants: the derivation is pure (the key is an argument); a cluster recreated under the same name
gets a new uid, hence a new token; losing the key Secret changes every token (the
running components keep theirs until their Pods restart).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

from pdserve.operator.builders import build_key_secret
from pdserve.operator.kube import KubeClient, KubeError

KEY_BYTES = 32


def derive_cluster_token(key: bytes, namespace: str, name: str, uid: str | None) -> str:
    """The token of PDCluster ``namespace/name`` with ``uid``."""
    message = f"{namespace}/{name}/{uid or ''}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


async def load_operator_key(kube: KubeClient, namespace: str, name: str) -> bytes:
    """The operator's key from Secret ``namespace/name``, created with fresh random
    bytes when absent (two operators racing: the loser reads the winner's). Called
    once per operator process by ``Reconciler``; raises ``KubeError``."""
    secret = await kube.get("Secret", namespace, name)
    if secret is None:
        try:
            secret = await kube.create(build_key_secret(namespace, name, os.urandom(KEY_BYTES)))
        except KubeError as exc:
            if exc.status != 409:
                raise
            secret = await kube.get("Secret", namespace, name)
    key = base64.b64decode(((secret or {}).get("data") or {}).get("key", ""))
    if len(key) < KEY_BYTES:
        raise KubeError(422, f"Secret {namespace}/{name} holds no operator key of {KEY_BYTES} bytes")
    return key
