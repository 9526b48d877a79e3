"""Pools in the spec: the hybrid (colocated) pool, engine threads and the core-pinning rule."""

from __future__ import annotations

import pytest

from pdserve.api import PDCluster, parse_manifest
from pdserve.api.cluster import PoolSpec
from pdserve.api.instance import instance_name, instance_ordinal


def spec(**fields) -> PDCluster:
    return parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                           "metadata": {"name": "c"}, "spec": {"model": {"preset": "tiny"}, **fields}})


def test_a_hybrid_only_cluster_is_valid_and_every_pool_has_its_own_settings():
    c = spec(prefill={"replicas": 0}, decode={"replicas": 0},
             hybrid={"replicas": 2, "threads": 1, "cpuAffinity": [0, 1]},
             engine={"prefillChunkTokens": 256})
    assert (c.spec.prefill.replicas, c.spec.decode.replicas, c.spec.hybrid.replicas) == (0, 0, 2)
    assert c.spec.hybrid.threads == 1 and c.spec.hybrid.cpu_affinity == [0, 1]
    assert c.spec.engine.prefill_chunk_tokens == 256
    assert c.to_manifest()["spec"]["hybrid"]["cpuAffinity"] == [0, 1]
    assert spec().spec.hybrid.replicas == 0 and spec().spec.prefill.threads is None


def test_no_replicas_in_any_pool_names_the_field():
    with pytest.raises(ValueError, match="spec.hybrid.replicas"):
        spec(prefill={"replicas": 0}, decode={"replicas": 0})


@pytest.mark.parametrize("cores,threads,expected", [
    ([0, 1], None, [[0], [1], [0]]),                       # one core each, i % len
    ([4, 5, 6, 7], 2, [[4, 5], [6, 7], [4, 5]]),            # blocks of `threads`, wrapping
    ([0, 1, 2], 2, [[0, 1], [0, 2], [1, 2]]),               # a block may wrap around the end
    ([3], 4, [[3], [3], [3]]),                             # more threads than cores: shared
])
def test_each_replica_gets_its_cores_by_the_documented_rule(cores, threads, expected):
    pool = PoolSpec(replicas=3, threads=threads, cpu_affinity=cores)
    assert [pool.cpus_for_replica(i) for i in range(3)] == expected


def test_a_tensor_parallel_engine_gets_cores_for_all_its_ranks():
    pool = PoolSpec(replicas=2, threads=1, cpu_affinity=[0, 1, 2, 3],
                    parallelism={"tensorParallelSize": 2})
    assert [pool.cpus_for_replica(i) for i in range(2)] == [[0, 1], [2, 3]]


def test_no_cpu_affinity_means_no_pinning():
    assert PoolSpec(threads=2).cpus_for_replica(0) is None


def test_instance_ordinal_reads_back_instance_name():
    assert instance_ordinal("c", "hybrid", instance_name("c", "hybrid", 12)) == 12
    assert instance_ordinal("c", "hybrid", "c-decode-1") is None
    assert instance_ordinal("c", "hybrid", "c-hybrid-x") is None
    assert instance_ordinal("c", "hybrid", "c-hybrid-01") is None
