"""``pdserve controller`` on an etcd secured as in production: HTTPS only with client
certificates, etcd's users on (the Controller's user may touch ``/pdserve/`` only),
and a store list whose first endpoint is dead. Everything comes from the
``PDSERVE_ETCD_*`` variables and ``--store``: the Controller leads, its state is in
etcd, and it binds where it announces."""

from __future__ import annotations

import asyncio
import re

import grpc

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.controller.etcd_store import EtcdAccess, EtcdStore
from tests.etcd import EtcdServer, free_port
from tests.pki import issue, make_ca
from tests.procs import PDSERVE, Proc


def test_a_controller_leads_through_tls_a_user_and_the_second_endpoint(tmp_path):
    make_ca(tmp_path, "etcd-ca")
    server_cert, client_cert = issue(tmp_path, "etcd", "etcd-ca"), issue(tmp_path, "controller", "etcd-ca")
    etcd = EtcdServer(tmp_path / "data", tls=server_cert).start()
    etcd.enable_auth("pdserve", "s3cret", "/pdserve/")
    (tmp_path / "password").write_text("s3cret\n")
    env = {"PDSERVE_ETCD_CA": client_cert.tls_ca, "PDSERVE_ETCD_CERT": client_cert.tls_cert,
           "PDSERVE_ETCD_KEY": client_cert.tls_key, "PDSERVE_ETCD_USER": "pdserve",
           "PDSERVE_ETCD_PASSWORD_FILE": str(tmp_path / "password")}
    grpc_port = free_port()
    controller = Proc([*PDSERVE, "controller", "--store", f"etcd://127.0.0.1:{free_port()},{etcd.endpoint}",
                       "--advertise", f"127.0.0.1:{grpc_port}", "--port", str(grpc_port),
                       "--leader-ttl", "2"], env=env)
    try:
        m = controller.wait_for(r"controller serving on (\S+) \(http (\S+), .*, (leader|standby)\)", timeout_s=30)
        assert m.group(1) == f"127.0.0.1:{grpc_port}" and m.group(2).startswith("127.0.0.1:")
        assert m.group(3) == "leader", controller.output
        with grpc.insecure_channel(m.group(1)) as channel:
            view = pb_grpc.ControllerStub(channel).GetView(pb.WatchViewRequest(), timeout=5)
        assert view.leader == f"127.0.0.1:{grpc_port}"

        async def leader_key() -> str | None:
            store = EtcdStore([etcd.endpoint], EtcdAccess.from_files(
                client_cert.tls_ca, client_cert.tls_cert, client_cert.tls_key, "pdserve",
                str(tmp_path / "password")))
            try:
                return await store.get("/pdserve/local/leader")
            finally:
                await store.close()

        assert asyncio.run(leader_key()) == f"127.0.0.1:{grpc_port}"
        assert not re.search(r"store unreachable|Traceback", controller.output), controller.output
    finally:
        controller.stop()
        etcd.stop()
