"""Transport start-up choices: Mooncake's protocol and RDMA devices, NIXL's backend and
its registrations (once per KV region, never per batch). Both sides live in this
process here; the cross-process behaviour is test_transports.py's."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_transfer.transport import TransferItem, create_transport, mooncake
from tests.unit.engine.transport.leaks import assert_kv_threads_gone


def test_mooncake_refuses_an_unknown_protocol():
    with pytest.raises(ValueError, match="protocol must be one of"):
        create_transport("mooncake", protocol="udp")


def test_mooncake_rdma_is_refused_at_start_without_an_rdma_device(monkeypatch):
    monkeypatch.setattr(mooncake, "rdma_devices", lambda: [])
    with pytest.raises(RuntimeError, match="needs an RDMA NIC, and this host has none"):
        create_transport("mooncake", protocol="rdma")


def test_mooncake_rdma_names_the_device_this_host_lacks(monkeypatch):
    monkeypatch.setattr(mooncake, "rdma_devices", lambda: ["mlx5_0", "mlx5_1"])
    with pytest.raises(RuntimeError, match=r"mlx5_7 not found on this host \(it has mlx5_0, mlx5_1\)"):
        create_transport("mooncake", protocol="rdma", device_names="mlx5_0,mlx5_7")


def test_nixl_refuses_a_backend_it_cannot_start():
    with pytest.raises(RuntimeError, match="NIXL backend NOPE could not start here"):
        create_transport("nixl", backend="NOPE")


def test_nixl_registers_each_region_once_and_no_batch_registers_more(monkeypatch):
    p, d = create_transport("nixl", auth_token="t"), create_transport("nixl", auth_token="t")
    calls = []
    for side in (p, d):
        register = side._agent.register_memory
        monkeypatch.setattr(side._agent, "register_memory",
                            lambda *a, _r=register, **k: calls.append(a) or _r(*a, **k))
    src, dst = torch.arange(1 << 16, dtype=torch.int32), torch.zeros(1 << 16, dtype=torch.int32)
    try:
        p.register_memory(src.data_ptr(), src.nbytes)
        d.register_memory(dst.data_ptr(), dst.nbytes)
        assert len(calls) == 2
        piece = 4096
        for i in range(3):  # three batches, scattered pieces: no registration among them
            items = [TransferItem(src.data_ptr() + k * piece, dst.data_ptr() + (15 - k) * piece,
                                  piece) for k in range(i, 16, 3)]
            status = p.write_batch(d.endpoint, items).wait()
            assert status.is_done, status.message
        assert len(calls) == 2
        words = piece // 4
        for k in range(16):
            got = dst[(15 - k) * words:(16 - k) * words]
            assert torch.equal(got, src[k * words:(k + 1) * words]), f"piece {k}"
    finally:
        p.close()
        d.close()
    assert_kv_threads_gone()


def test_the_spec_s_mooncake_protocol_reaches_the_engine_which_refuses_rdma_without_a_nic():
    """kvTransfer.mooncake → the NodeAgent's engine flags → the engine, which refuses at
    start, saying why, on this host (it has no RDMA device)."""
    import subprocess
    import sys

    from pdserve.api.manifest import parse_manifest
    from pdserve.nodeagent.engine_args import build_engine_argv

    cluster = parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                              "metadata": {"name": "m"}, "spec": {
                                  "model": {"preset": "tiny"}, "prefill": {"replicas": 1},
                                  "decode": {"replicas": 1}, "kvTransfer": {
                                      "transport": "mooncake",
                                      "mooncake": {"protocol": "rdma", "devices": ["mlx5_0"]}}}})
    argv = build_engine_argv(cluster, "decode", ["--num-kv-blocks", "8"])
    at = argv.index("--kv-mooncake-protocol")
    assert argv[at:at + 4] == ["--kv-mooncake-protocol", "rdma", "--kv-mooncake-devices", "mlx5_0"]
    assert not mooncake.rdma_devices()  # what this test is about: no NIC here
    done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "RDMA" in done.stdout + done.stderr and "Traceback" not in done.stderr
