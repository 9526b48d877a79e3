"""Loading manifests for local mode: the default cluster and errors naming fields."""

from __future__ import annotations

from decimal import Decimal

import pytest
import yaml

from pdserve.api import (
    ManifestError,
    PDCluster,
    PDInstance,
    default_cluster,
    dump_manifest,
    load_manifest,
    parse_manifest,
)
from pdserve.api.common import parse_quantity
from pdserve.api.instance import instance_name


def test_default_cluster_is_smollm2_one_plus_one_layerwise_tcp():
    spec = default_cluster().spec
    assert spec.model.preset == "smollm2"
    assert (spec.prefill.replicas, spec.decode.replicas) == (1, 1)
    assert (spec.kv_transfer.mode, spec.kv_transfer.transport) == ("layerwise", "tcp")


def test_dump_then_load_round_trips(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(dump_manifest(default_cluster("demo")))
    assert load_manifest(path) == default_cluster("demo")
    assert PDCluster.from_file(path).metadata.name == "demo"


def test_multi_document_file_picks_the_kind(tmp_path):
    path = tmp_path / "all.yaml"
    instance = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDInstance",
                "metadata": {"name": "demo-prefill-0"},
                "spec": {"role": "prefill", "cluster": "demo", "pool": "prefill", "ordinal": 0}}
    path.write_text(yaml.safe_dump_all([instance, default_cluster("demo").to_manifest()]))
    assert load_manifest(path).metadata.name == "demo"
    assert load_manifest(path, PDInstance).spec.role == "prefill"


def test_errors_name_file_and_every_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "kind: PDCluster\nmetadata: {name: bad}\n"
        "spec:\n  model: {preset: tiny}\n  prefill: {replicas: -2, gpus: x}\n"
        "  kvTransfer: {transport: carrier-pigeon}\n  engine: {kvCacheBytes: 8Gx}\n"
    )
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    problems = info.value.problems
    assert str(path) in str(info.value)
    fields = [p.split(":")[0] for p in problems]
    assert fields == ["spec.engine.kvCacheBytes", "spec.prefill.replicas",
                      "spec.prefill.gpus", "spec.kvTransfer.transport"]
    assert "(got -2)" in problems[1] and "carrier-pigeon" in problems[3]


def test_unknown_fields_and_missing_model_are_reported():
    with pytest.raises(ManifestError) as info:
        parse_manifest({"metadata": {"name": "x"}, "spec": {"prefil": {"replicas": 1}}})
    assert info.value.problems == ["spec.model: Field required",
                                   "spec.prefil: Extra inputs are not permitted"]


@pytest.mark.parametrize("text,problem", [
    ("kind: [", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping"),
    ("kind: Deployment\n", r"no PDCluster document \(found: Deployment\)"),
])
def test_unreadable_files(tmp_path, text, problem):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(ManifestError, match=problem):
        load_manifest(path)
    with pytest.raises(ManifestError, match="cannot read"):
        load_manifest(tmp_path / "missing.yaml")


def test_snake_case_is_accepted_in_python():
    cluster = parse_manifest({"metadata": {"name": "x"}, "spec": {
        "model": {"preset": "tiny"}, "kv_transfer": {"mode": "pull"}}})
    assert cluster.spec.kv_transfer.mode == "pull"


@pytest.mark.parametrize("value,expected", [
    (3, Decimal(3)), ("8Gi", Decimal(8 * 2**30)), ("500m", Decimal("0.5")),
    ("1.5k", Decimal(1500)), ("1e3", Decimal(1000)),
])
def test_parse_quantity(value, expected):
    assert parse_quantity(value) == expected


def test_instance_name():
    assert instance_name("demo", "decode", 3) == "demo-decode-3"


def test_a_cluster_name_too_long_for_its_objects_is_refused_naming_the_limit():
    doc = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
           "metadata": {"name": "a" * 52}, "spec": {"model": {"preset": "tiny"}}}
    with pytest.raises(ManifestError) as info:
        parse_manifest(doc, PDCluster, "test")
    assert "at most 51" in str(info.value) and "63" in str(info.value)
    parse_manifest({**doc, "metadata": {"name": "a" * 51}}, PDCluster, "test")
