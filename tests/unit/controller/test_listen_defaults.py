"""Where the control plane listens when not told: the Controller on the address it
announces (``--advertise``), else 127.0.0.1, and the NodeAgent on 127.0.0.1; every
address only when asked (``--host 0.0.0.0``, as the operator does in Pods)."""

from __future__ import annotations

import argparse

from pdserve.controller import cli as controller_cli
from pdserve.nodeagent import cli as nodeagent_cli


def parse(module, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_controller_listens_where_it_announces():
    assert controller_cli.listen_host(parse(controller_cli)) == "127.0.0.1"
    assert controller_cli.listen_host(parse(controller_cli, "--advertise", "10.1.2.3:50050")) == "10.1.2.3"
    assert controller_cli.listen_host(parse(controller_cli, "--advertise", "[fd00::7]:50050")) == "fd00::7"
    assert controller_cli.listen_host(parse(controller_cli, "--host", "0.0.0.0",
                                            "--advertise", "10.1.2.3:50050")) == "0.0.0.0"
    assert controller_cli.host_port("fd00::7", 1) == "[fd00::7]:1"


def test_the_nodeagent_listens_on_loopback_unless_told():
    assert parse(nodeagent_cli, "--instance", "d0=decode").host == "127.0.0.1"
    assert parse(nodeagent_cli, "--instance", "d0=decode", "--host", "0.0.0.0").host == "0.0.0.0"


def test_etcd_access_comes_from_flags_or_the_environment(tmp_path, monkeypatch):
    (tmp_path / "pw").write_text("s3cret\n")
    monkeypatch.setenv("PDSERVE_ETCD_USER", "pdserve")
    monkeypatch.setenv("PDSERVE_ETCD_PASSWORD_FILE", str(tmp_path / "pw"))
    access = controller_cli.etcd_access(parse(controller_cli, "--etcd-ca", "/ca.crt"))
    assert (access.ca_file, access.user, access.password, access.uses_tls) == ("/ca.crt", "pdserve", "s3cret", True)
    monkeypatch.delenv("PDSERVE_ETCD_USER")
    monkeypatch.delenv("PDSERVE_ETCD_PASSWORD_FILE")
    assert not controller_cli.etcd_access(parse(controller_cli)).uses_tls
