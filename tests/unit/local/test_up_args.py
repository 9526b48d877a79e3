"""``pdserve up``'s own flags: ``--model`` and ``--kv-cache-bytes`` change the spec every
component then runs, and ``--host`` must be an address of this machine."""

from __future__ import annotations

import socket

import pytest

from pdserve.api import default_cluster
from pdserve.local.up import StartError, why_cannot_listen, with_overrides


def test_model_overrides_the_spec_with_a_checkpoint_directory_or_a_preset(tmp_path, monkeypatch):
    cluster = default_cluster()
    cluster.spec.model.served_name = "mine"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    model = with_overrides(cluster, "ckpt", None).spec.model
    assert (model.path, model.preset, model.served_name) == (str(tmp_path / "ckpt"), None, "mine")
    model = with_overrides(cluster, "small", None).spec.model
    assert (model.path, model.preset) == (None, "small")
    with pytest.raises(StartError, match="--model ./nothere: no such directory"):
        with_overrides(cluster, "./nothere", None)
    assert cluster.spec.model.preset == "tiny"  # the loaded spec itself is left alone


def test_kv_cache_bytes_overrides_the_spec():
    cluster = with_overrides(default_cluster(), None, 16 * 2**20)
    assert cluster.spec.engine.kv_cache_bytes == 16 * 2**20
    assert cluster.spec.model.preset == "tiny"


def test_host_must_be_an_address_of_this_machine_with_a_free_port():
    assert why_cannot_listen("127.0.0.1", 0) is None
    assert why_cannot_listen("192.0.2.1", 8000) == "--host 192.0.2.1: not an address of this machine"
    assert why_cannot_listen("no-such-host.invalid", 8000).startswith("--host no-such-host.invalid: no such host")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert why_cannot_listen("127.0.0.1", port) == f"port {port} on 127.0.0.1 is in use; pick another with --port"
