"""`pdserve doctor`'s KV transport row names the transport the spec chose."""

from __future__ import annotations

from pdserve.api import default_cluster
from pdserve.local.doctor_checks import FAIL, PASS, check_transport


def cluster_with(transport: str):
    cluster = default_cluster()
    return cluster.model_copy(update={"spec": cluster.spec.model_copy(update={
        "kv_transfer": cluster.spec.kv_transfer.model_copy(update={"transport": transport})})})


def test_nixl_is_checked_as_nixl_not_as_mooncake():
    rows = check_transport(cluster_with("nixl"), require_rdma=False)
    assert [(r.name, r.status) for r in rows] == [("kv transport", PASS)]
    assert rows[0].detail == "nixl: importable"


def test_a_missing_nixl_package_fails_with_the_fix(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "nixl_cu12" else real(name, *a))
    (row,) = check_transport(cluster_with("nixl"), require_rdma=False)
    assert row.status == FAIL and "nixl-cu12" in row.detail
    assert row.fix == "pip install 'pdserve[nixl]', or use transport tcp"
