"""Security wired into every Pod: the cluster token (a Secret the operator creates),
TLS files from the Secret the spec names (cert-manager's key names), and the
Coordinator's API key, each read back through the component's own CLI and
``SecuritySettings.from_env`` as the kubelet would lay the files out."""

from __future__ import annotations

import argparse
import asyncio
import base64
from pathlib import Path

import pytest

from pdserve.operator import builders as b
from pdserve.operator.desired import build_cluster_objects
from pdserve.operator.kube import KubeError
from pdserve.operator.settings import OperatorSettings
from pdserve.operator.tokens import KEY_BYTES, derive_cluster_token, load_operator_key
from pdserve.runtime.security import SecuritySettings
from tests.unit.operator.test_builders import cluster

TOKEN = "f" * 64
TLS_FILES = {"tls.crt": b"CERT", "tls.key": b"KEY", "ca.crt": b"CA", "extra": b"x"}
SECURED = {"security": {"tlsSecret": "certs", "apiKeySecret": {"name": "keys", "key": "openai"}}}


def component_containers(c) -> list[tuple[dict, dict]]:
    """(pod spec, container) of every engine Pod, the Controller and the Coordinator."""
    objects = build_cluster_objects(c, OperatorSettings(), TOKEN, {})
    specs = [o["spec"] for o in objects if o["kind"] == "Pod"] + [
        o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"]
    return [(spec, container) for spec in specs for container in spec["containers"]]


def kubelet_files(spec: dict, container: dict, root: Path, secrets: dict[str, dict[str, bytes]]) -> dict:
    """Write each mounted Secret's files under ``root`` as the kubelet would (``items``
    honoured) and return the container's environment with paths moved under ``root``."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container["volumeMounts"]:
        source = volumes[mount["name"]].get("secret")
        if source is None:
            continue
        assert mount["readOnly"] is True
        data = secrets[source["secretName"]]
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            path = root / mount["mountPath"].lstrip("/") / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data[item["key"]])
    return {e["name"]: str(root) + e["value"] if e.get("value", "").startswith("/") else e.get("value")
            for e in container["env"]}


@pytest.mark.parametrize("spec", [{}, SECURED], ids=["token", "token-and-tls"])
def test_every_component_reads_the_cluster_token_and_tls_from_its_mounts(tmp_path, spec):
    c = cluster(**spec)
    token_secret = b.build_token_secret(c, TOKEN)
    secrets = {token_secret["metadata"]["name"]: {k: base64.b64decode(v) for k, v in token_secret["data"].items()},
               "certs": TLS_FILES, "keys": {"openai": b"sk"}}
    containers = component_containers(c)
    assert {c["name"] for _, c in containers} == {"nodeagent", "controller", "coordinator"}
    for i, (pod_spec, container) in enumerate(containers):
        env = kubelet_files(pod_spec, container, tmp_path / str(i), secrets)
        security = SecuritySettings.from_env(env)
        assert security.token == TOKEN, container["name"]
        assert security.uses_tls == bool(spec), container["name"]
        if spec:
            assert [Path(p).read_bytes() for p in (security.tls_cert, security.tls_key, security.tls_ca)] == [
                b"CERT", b"KEY", b"CA"]


def test_the_token_secret_is_owned_by_its_cluster():
    c = cluster()
    secret = b.build_token_secret(c, TOKEN)
    assert secret["metadata"]["name"] == "c-token" and secret["type"] == "Opaque"
    assert secret["metadata"]["ownerReferences"] == [b.cluster_owner(c)]
    assert base64.b64decode(secret["data"][b.TOKEN_KEY]).decode() == TOKEN


def test_the_coordinator_reads_its_api_key_through_its_own_flags(tmp_path):
    from pdserve.coordinator.cli import add_arguments, settings_from_args

    c = cluster(**SECURED)
    [(spec, container)] = [(s, k) for s, k in component_containers(c) if k["name"] == "coordinator"]
    kubelet_files(spec, container, tmp_path, {"c-token": {"token": b"t"}, "certs": TLS_FILES,
                                               "keys": {"openai": b"sk-123\n", "other": b"no"}})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = settings_from_args(parser.parse_args(container["args"][1:]))
    assert Path(str(tmp_path) + settings.api_key_file).read_text().strip() == "sk-123"
    no_key = [k for s, k in component_containers(cluster()) if k["name"] == "coordinator"][0]
    assert "--api-key-file" not in no_key["args"]


def test_every_component_takes_its_pod_arguments():
    """The arguments the operator writes are ones each component's CLI accepts."""
    from pdserve.controller.cli import add_arguments as controller_args
    from pdserve.coordinator.cli import add_arguments as coordinator_args
    from pdserve.nodeagent.cli import add_arguments as agent_args

    parsers = {}
    for name, add in (("nodeagent", agent_args), ("controller", controller_args),
                      ("coordinator", coordinator_args)):
        parsers[name] = argparse.ArgumentParser(exit_on_error=False)
        add(parsers[name])
    for _, container in component_containers(cluster(**SECURED)):
        assert container["args"][0] == container["name"]
        parsers[container["name"]].parse_args(container["args"][1:])


def test_with_tls_engines_announce_the_name_their_certificate_carries():
    plain = [k for _, k in component_containers(cluster()) if k["name"] == "nodeagent"][0]
    assert "--engine-arg=--host=$(POD_IP)" in plain["args"]
    secured = {s["hostname"]: k for s, k in component_containers(cluster(**SECURED)) if k["name"] == "nodeagent"}
    host = next(a for a in secured["c-decode-0"]["args"] if a.startswith("--engine-arg=--host="))
    assert host == "--engine-arg=--host=c-decode-0.c-engines.ns.svc"  # *.c-engines.ns.svc
    assert "--engine-arg=--kv-host=$(POD_IP)" in secured["c-decode-0"]["args"]


def test_cluster_tokens_are_per_cluster_and_stable():
    key = bytes(range(KEY_BYTES))
    token = derive_cluster_token(key, "ns", "c", "uid-1")
    assert token == derive_cluster_token(key, "ns", "c", "uid-1") and len(token) == 64
    others = {derive_cluster_token(key, "ns", "c", "uid-2"), derive_cluster_token(key, "ns2", "c", "uid-1"),
              derive_cluster_token(key, "ns", "d", "uid-1"), derive_cluster_token(b"k" * 32, "ns", "c", "uid-1")}
    assert token not in others and len(others) == 4


class SecretStore:
    """The two calls ``load_operator_key`` makes, over a dict; ``race`` answers the first
    create 409 after another operator wrote its key."""

    def __init__(self, race: bytes | None = None) -> None:
        self.secrets: dict[tuple[str, str], dict] = {}
        self.race = race

    async def get(self, kind, namespace, name):
        assert kind == "Secret"
        return self.secrets.get((namespace, name))

    async def create(self, body):
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if self.race is not None:
            self.secrets[key] = {**body, "data": {"key": base64.b64encode(self.race).decode()}}
            self.race = None
            raise KubeError(409, "exists")
        self.secrets[key] = body
        return body


def test_the_operator_key_is_created_once_and_then_read():
    store = SecretStore()
    key = asyncio.run(load_operator_key(store, "ops", "k"))
    assert len(key) == KEY_BYTES
    assert asyncio.run(load_operator_key(store, "ops", "k")) == key
    assert list(store.secrets) == [("ops", "k")]
    assert asyncio.run(load_operator_key(SecretStore(race=b"w" * 32), "ops", "k")) == b"w" * 32
