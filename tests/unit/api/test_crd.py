"""The generated CRDs: structural, in sync with the committed copies, CLI behaviour."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, Field

from pdserve.api import PDCluster, default_cluster
from pdserve.api.common import ApiModel, Quantity
from pdserve.api.crd import KINDS, build_crd, render_crd_files
from pdserve.api.crd_cli import DEFAULT_DIRS, add_arguments, run
from pdserve.api.structural import apply_defaults, structural_violations, to_structural

from .apiserver import admit

ROOT = Path(__file__).resolve().parents[3]


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("directory", DEFAULT_DIRS)
def test_committed_crds_match_the_models(directory):
    files = render_crd_files()
    for name, text in files.items():
        committed = ROOT / directory / name
        assert committed.is_file(), f"{committed} missing: run `pdserve crds`"
        assert committed.read_text() == text, f"{committed} is stale: run `pdserve crds`"


def test_cli_writes_then_checks_and_detects_drift(tmp_path, capsys):
    out = str(tmp_path / "crds")
    assert run(cli_args("--check", "--out", out)) == 1  # nothing written yet
    assert run(cli_args("--out", out)) == 0
    assert run(cli_args("--check", "--out", out)) == 0
    (tmp_path / "crds" / "pdserve.io_pdclusters.yaml").write_text("stale\n")
    assert run(cli_args("--check", "--out", out)) == 1
    assert "out of date" in capsys.readouterr().err


@pytest.mark.parametrize("kind", KINDS)
def test_crd_is_structural_and_well_formed(kind):
    crd = build_crd(kind)
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert structural_violations(schema) == []
    assert "$ref" not in yaml.safe_dump(schema) and "title:" not in yaml.safe_dump(schema)
    assert crd["spec"]["group"] == "pdserve.io" and version["name"] == "v1alpha1"
    scale = {"scale": KINDS[kind].scale} if KINDS[kind].scale else {}
    assert version["subresources"] == {"status": {}, **scale}
    assert crd["metadata"]["name"] == f"{crd['spec']['names']['plural']}.pdserve.io"


def test_printer_columns_and_short_names():
    cluster = build_crd("PDCluster")["spec"]
    columns = [c["name"] for c in cluster["versions"][0]["additionalPrinterColumns"]]
    assert columns == ["Mode", "Prefill", "Decode", "Hybrid", "Ready", "Age"]
    assert cluster["names"]["shortNames"] == ["pdc"]
    instance = build_crd("PDInstance")["spec"]
    assert instance["names"]["shortNames"] == ["pdi"]
    assert instance["versions"][0]["additionalPrinterColumns"]


def test_quantities_are_int_or_string():
    schema = build_crd("PDCluster")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pool = schema["properties"]["spec"]["properties"]["prefill"]["properties"]
    limit = pool["resources"]["properties"]["limits"]["additionalProperties"]
    assert limit["x-kubernetes-int-or-string"] is True and "pattern" in limit
    assert pool["nodeSelector"]["additionalProperties"] == {"type": "string"}


def test_default_cluster_is_admitted_and_unchanged_by_defaulting():
    schema = build_crd("PDCluster")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    manifest = default_cluster().to_manifest()
    stored, errors = admit(schema, manifest)
    assert errors == []
    assert PDCluster.model_validate(stored) == default_cluster()


class _Inner(ApiModel):
    size: int = Field(default=2, gt=0)


class _Outer(BaseModel):
    inner: _Inner = Field(default_factory=_Inner)
    maybe: _Inner | None = None
    name: str | None = None
    memory: Quantity = "1Gi"
    tags: dict[str, str] = Field(default_factory=dict)


def test_converter_inlines_refs_maps_optional_and_fills_nested_defaults():
    schema = to_structural(_Outer.model_json_schema())
    assert structural_violations(schema) == []
    props = schema["properties"]
    assert props["inner"]["default"] == {}  # so the apiserver defaults inner.size
    assert "default" not in props["maybe"] and props["maybe"]["type"] == "object"
    assert props["name"] == {"type": "string"}
    assert props["inner"]["properties"]["size"]["exclusiveMinimum"] is True
    assert "additionalProperties" not in props["inner"]  # extra="forbid" is not a map
    assert props["memory"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    assert apply_defaults(schema, {}) == {"inner": {"size": 2}, "memory": "1Gi"}


def test_checker_reports_non_structural_schemas():
    bad = {"type": "object", "properties": {
        "a": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "b": {"$ref": "#/$defs/B"},
        "c": {"type": "object", "properties": {}, "additionalProperties": False},
    }}
    problems = structural_violations(bad)
    assert any(p.startswith(".a:") for p in problems)
    assert any(p.startswith(".b:") and "$ref" in p for p in problems)
    assert any(p.startswith(".c:") and "additionalProperties" in p for p in problems)


@pytest.mark.parametrize(
    "tp_prefill,tp_decode,replicas_prefill,replicas_decode,replicas_hybrid",
    list(itertools.product([1, 2, 3, 4], [1, 2, 4], [0, 1], [0, 2], [None, 0, 2])),
)
def test_cel_rules_and_model_validators_agree(tp_prefill, tp_decode, replicas_prefill,
                                              replicas_decode, replicas_hybrid):
    schema = build_crd("PDCluster")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    manifest = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                "metadata": {"name": "x"}, "spec": {
                    "model": {"preset": "tiny"},
                    "prefill": {"replicas": replicas_prefill,
                                "parallelism": {"tensorParallelSize": tp_prefill}},
                    "decode": {"replicas": replicas_decode,
                               "parallelism": {"tensorParallelSize": tp_decode}}}}
    if replicas_hybrid is not None:  # None: the hybrid pool left out (the CRD defaults it)
        manifest["spec"]["hybrid"] = {"replicas": replicas_hybrid, "threads": 1}
    _, errors = admit(schema, manifest)
    try:
        PDCluster.model_validate(manifest)
        model_ok = True
    except ValueError:
        model_ok = False
    assert (errors == []) == model_ok, errors
    has_replicas = replicas_prefill or replicas_decode or replicas_hybrid
    if not has_replicas:
        assert any(e.startswith("spec.prefill.replicas") for e in errors), errors


def test_hybrid_pool_defaults_to_no_replicas_in_the_crd_and_the_models():
    schema = build_crd("PDCluster")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    manifest = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                "metadata": {"name": "x"}, "spec": {"model": {"preset": "tiny"},
                                                    "hybrid": {"threads": 2}}}
    stored, errors = admit(schema, manifest)
    assert errors == []
    assert stored["spec"]["hybrid"]["replicas"] == 0 and "replicas" not in manifest["spec"]["hybrid"]
    assert PDCluster.model_validate(stored) == PDCluster.model_validate(manifest)
    assert PDCluster.model_validate(manifest).spec.hybrid.replicas == 0


@pytest.mark.parametrize("pool", ["prefill", "decode", "hybrid"])
@pytest.mark.parametrize("field,value", [("threads", 0), ("cpuAffinity", []), ("cpuAffinity", [-1])])
def test_bad_threads_and_cpu_affinity_are_rejected_by_both(pool, field, value):
    schema = build_crd("PDCluster")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    manifest = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                "metadata": {"name": "x"}, "spec": {"model": {"preset": "tiny"},
                                                    pool: {"replicas": 1, field: value}}}
    _, errors = admit(schema, manifest)
    assert any(e.startswith(f"spec.{pool}.{field}") for e in errors), errors
    with pytest.raises(ValueError):
        PDCluster.model_validate(manifest)


def test_pdinstance_manifest_is_admitted_and_bad_role_rejected():
    from pdserve.api import PDInstance

    schema = build_crd("PDInstance")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    manifest = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDInstance",
                "metadata": {"name": "tiny-prefill-0"},
                "spec": {"role": "prefill", "cluster": "tiny", "pool": "prefill", "ordinal": 0},
                "status": {"phase": "Running", "pod": "tiny-prefill-0", "health": "Ready",
                           "endpoints": {"engine": "10.0.0.5:50051"},
                           "lastHeartbeat": "2025-01-01T12:00:00Z"}}
    assert admit(schema, manifest)[1] == []
    instance = PDInstance.model_validate(manifest)
    assert PDInstance.model_validate(instance.to_manifest()) == instance
    assert instance.status.endpoints == {"engine": "10.0.0.5:50051"}
    manifest["spec"]["role"] = "router"
    assert any(e.startswith("spec.role") for e in admit(schema, manifest)[1])


@pytest.mark.parametrize("enabled", [None, False, True])
@pytest.mark.parametrize("hybrid", [{"replicas": 1}, {"replicas": 1, "gpus": 1},
                                    {"replicas": 1, "parallelism": {"tensorParallelSize": 2}},
                                    {"replicas": 0, "gpus": 1}])
def test_the_kv_pool_rule_agrees_between_the_crd_and_the_models(enabled, hybrid):
    schema = build_crd("PDCluster")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = {"model": {"preset": "tiny"}, "hybrid": {**hybrid, "threads": 1}}
    if enabled is not None:
        spec["kvPool"] = {"enabled": enabled}
    manifest = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                "metadata": {"name": "x"}, "spec": spec}
    _, errors = admit(schema, manifest)
    refused = bool(enabled) and hybrid["replicas"] > 0 and hybrid != {"replicas": 1}
    assert any("kvPool" in e for e in errors) == refused, errors
    if refused:
        with pytest.raises(ValueError, match="kvPool"):
            PDCluster.model_validate(manifest)
    elif not errors:
        assert PDCluster.model_validate(manifest).spec.kv_pool.enabled is bool(enabled)


@pytest.mark.parametrize(("tp_prefill", "tp_decode"), [(1, 1), (2, 1), (2, 2)])
def test_the_kv_pool_refuses_sharded_prefill_and_decode_engines_in_both(tp_prefill, tp_decode):
    """Prefill and decode engines may shard (their KV is re-laid out in transit), but
    the pool keeps whole blocks: with it enabled, both pools must run at TP=1."""
    schema = build_crd("PDCluster")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = {"model": {"preset": "tiny"}, "kvPool": {"enabled": True},
            "prefill": {"replicas": 1, "parallelism": {"tensorParallelSize": tp_prefill}},
            "decode": {"replicas": 1, "parallelism": {"tensorParallelSize": tp_decode}}}
    manifest = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                "metadata": {"name": "x"}, "spec": spec}
    _, errors = admit(schema, manifest)
    refused = (tp_prefill, tp_decode) != (1, 1)
    assert any("kvPool" in e for e in errors) == refused, errors
    if refused:
        with pytest.raises(ValueError, match="kvPool"):
            PDCluster.model_validate(manifest)
    else:
        assert errors == [] and PDCluster.model_validate(manifest).spec.kv_pool.enabled


VLLM_CASES = [
    # (spec changes, refused field of the message or None)
    ({}, None),
    ({"model": {"preset": "smollm2"}}, "spec.model.preset"),
    ({"kvTransfer": {"mode": "layerwise", "transport": "nixl"}}, "spec.kvTransfer"),
    ({"kvTransfer": {"mode": "pull", "transport": "tcp"}}, "spec.kvTransfer"),
    ({"kvTransfer": None}, "spec.kvTransfer"),  # the defaults: layerwise over tcp
    ({"kvTransfer": None, "prefill": {"replicas": 0}, "decode": {"replicas": 0},
      "hybrid": {"replicas": 1}}, None),  # no PD pools: no KV moves
    ({"kvPool": {"enabled": True}}, "spec.kvPool"),
    ({"engine": {"backend": "vllm", "prefillChunkTokens": 256}}, "spec.engine.prefillChunkTokens"),
    ({"prefill": {"replicas": 1, "gpus": 1}, "decode": {"replicas": 1, "gpus": 1}}, None),
    ({"engine": {"backend": "embedded"}, "kvTransfer": None,
      "prefill": {"replicas": 1, "gpus": 1}}, "spec.prefill.gpus"),
]


@pytest.mark.parametrize(("changes", "refused"), VLLM_CASES)
def test_the_vllm_backend_rules_agree_between_the_crd_and_the_models(changes, refused):
    """With backend vllm: a Hugging Face checkpoint, KV pulled over NIXL between PD pools,
    no shared KV pool or embedded-engine chunking; GPUs allowed in the PD pools."""
    schema = build_crd("PDCluster")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = {"model": {"path": "/models/smollm2"}, "engine": {"backend": "vllm"},
            "kvTransfer": {"mode": "pull", "transport": "nixl"},
            "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    for key, value in changes.items():
        if value is None:
            spec.pop(key)
        else:
            spec[key] = value
    manifest = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                "metadata": {"name": "x"}, "spec": spec}
    _, errors = admit(schema, manifest)
    if refused is None:
        assert errors == [], errors
        assert PDCluster.model_validate(manifest).spec.engine.backend == spec["engine"]["backend"]
        return
    assert any(refused in e for e in errors), errors
    with pytest.raises(ValueError, match=refused.replace(".", r"\.")):
        PDCluster.model_validate(manifest)


def _pdpool(**spec) -> dict:
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDPool", "metadata": {"name": "tiny-decode"},
            "spec": {"cluster": "tiny", "pool": "decode", "replicas": 1, **spec},
            "status": {"replicas": 1, "readyReplicas": 1, "observedClusterReplicas": 1,
                       "selector": "pdserve.io/cluster=tiny,pdserve.io/component=engine,pdserve.io/pool=decode"}}


def test_pdpool_has_a_scale_subresource_on_fields_its_schema_declares():
    crd = build_crd("PDPool")
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["pdp"]
    schema = version["schema"]["openAPIV3Schema"]
    for key, where in version["subresources"]["scale"].items():
        node = schema
        for part in where.lstrip(".").split("."):
            node = node["properties"][part]
        # the apiserver reads replicas as an integer and the selector as a string
        assert node["type"] == ("string" if key == "labelSelectorPath" else "integer"), key
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Cluster", "Pool", "Desired", "Current", "Ready", "Age"]


def test_pdpool_manifest_is_admitted_scaled_and_keeps_its_identity():
    from pdserve.api import PDPool

    schema = build_crd("PDPool")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    stored, errors = admit(schema, _pdpool())
    assert errors == []
    assert PDPool.model_validate(stored).status.observed_cluster_replicas == 1
    # a scale (kubectl scale, an HPA) changes spec.replicas only: taken
    assert admit(schema, _pdpool(replicas=3), old=stored)[1] == []
    # the identity never changes; on create there is nothing to compare with
    for field, value in (("cluster", "other"), ("pool", "prefill")):
        _, errors = admit(schema, _pdpool(**{field: value}), old=stored)
        assert errors == [f"spec.{field}: spec.{field} is immutable"], errors
        assert admit(schema, _pdpool(**{field: value}))[1] == []
    for bad in ({"replicas": -1}, {"replicas": 1025}, {"pool": "router"}, {"cluster": ""}):
        assert admit(schema, _pdpool(**bad))[1], bad
        with pytest.raises(ValueError):
            PDPool.model_validate(_pdpool(**bad))
