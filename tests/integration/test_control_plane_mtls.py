"""Mutual TLS on the control plane, with real processes and a throwaway PKI.

A CA made for the test signs one certificate per component. The Controller and a
NodeAgent (with its decode engine) run with ``PDSERVE_TLS_CERT/KEY/CA``: the
instance becoming READY in the view proves the agent's probes of its engine and
its heartbeats to the Controller both went over mTLS. A gRPC client with a signed
certificate reads the view; one without a client certificate, one speaking plain
text and one whose certificate another CA signed are refused at the handshake.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.runtime.security import SecuritySettings, create_channel
from tests.pki import make_pki
from tests.procs import PDSERVE, Proc


def tls_env(s: SecuritySettings) -> dict[str, str]:
    return {"PDSERVE_TLS_CERT": s.tls_cert, "PDSERVE_TLS_KEY": s.tls_key, "PDSERVE_TLS_CA": s.tls_ca}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, SecuritySettings]:
    return make_pki(tmp_path_factory.mktemp("pki"), {
        "controller": "cluster-ca", "agent": "cluster-ca", "client": "cluster-ca",
        "rogue": "rogue-ca"})


def outcome(channel_factory) -> pb.ClusterView | grpc.StatusCode:
    """GetView on a channel from ``channel_factory()``: the view, or the refusal's status."""
    async def go():
        async with channel_factory() as channel:
            return await pb_grpc.ControllerStub(channel).GetView(pb.WatchViewRequest(), timeout=5)

    try:
        return asyncio.run(go())
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_signed_peers_talk_and_the_rest_are_refused_at_the_handshake(pki):
    procs: list[Proc] = []
    try:
        controller = Proc([*PDSERVE, "controller", "--store", "memory://", "--host", "127.0.0.1", "--port", "0",
                           "--heartbeat-interval", "0.2"], env=tls_env(pki["controller"]))
        procs.append(controller)
        address = controller.wait_for(r"controller serving on (\S+)", timeout_s=30).group(1)
        procs.append(Proc([*PDSERVE, "nodeagent", "--controller", address, "--instance", "d0=decode",
                           "--heartbeat-interval", "0.2", "--engine-arg=--dtype=float32",
                           "--engine-arg=--num-kv-blocks=64", "--engine-arg=--threads=1"],
                          env=tls_env(pki["agent"])))

        def signed():
            return create_channel(address, pki["client"])

        view = None
        for _ in range(600):  # the engine loads its model: up to 60 s on a busy machine
            view = outcome(signed)
            if isinstance(view, pb.ClusterView) and [i.health for i in view.instances] == ["READY"]:
                break
            time.sleep(0.1)
        assert isinstance(view, pb.ClusterView), view
        assert [(i.instance_id, i.role, i.health) for i in view.instances] == [("d0", "decode", "READY")]

        ca = Path(pki["client"].tls_ca).read_bytes()
        no_client_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        rogue = pki["rogue"]
        rogue_cert = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=Path(rogue.tls_key).read_bytes(),
            certificate_chain=Path(rogue.tls_cert).read_bytes())
        refused = {
            "plain text": outcome(lambda: grpc.aio.insecure_channel(address)),
            "no client certificate": outcome(lambda: grpc.aio.secure_channel(address, no_client_cert)),
            "certificate from another CA": outcome(lambda: grpc.aio.secure_channel(address, rogue_cert)),
        }
        assert refused == dict.fromkeys(refused, grpc.StatusCode.UNAVAILABLE)
        assert isinstance(outcome(signed), pb.ClusterView)  # still serving signed peers
    finally:
        for proc in reversed(procs):
            proc.stop()
    assert all(proc.popen.poll() is not None for proc in procs)
