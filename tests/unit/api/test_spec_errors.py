"""A spec with a typo says what to write instead: the closest field or value, and what
is allowed there; sizes such as 20Gi are read the same by the spec and every flag."""

from __future__ import annotations

import argparse

import pytest

from pdserve.api import ManifestError, load_manifest, parse_manifest
from pdserve.api.common import bytes_arg, parse_bytes


def problem_lines(spec: dict) -> list[str]:
    with pytest.raises(ManifestError) as info:
        parse_manifest({"kind": "PDCluster", "metadata": {"name": "x"}, "spec": spec})
    return info.value.lines()


def test_a_typo_in_a_field_name_gets_the_closest_field_and_the_allowed_ones():
    [line] = problem_lines({"model": {"preset": "tiny"}, "prefill": {"replicass": 2}})
    assert line.startswith("spec.prefill.replicass: Extra inputs are not permitted (got 2); "
                           "did you mean 'replicas'? (fields allowed here: replicas, gpus,")
    [line] = problem_lines({"model": {"preset": "tiny"}, "KVtransfer": {}})
    assert "did you mean 'kvTransfer'?" in line
    [line] = problem_lines({"model": {"preset": "tiny"}, "hybrid": {"tolerations": [{"operatr": "x"}]}})
    assert line.startswith("spec.hybrid.tolerations[0].operatr:") and "did you mean 'operator'?" in line
    [line] = problem_lines({"model": {"preset": "tiny"}, "zzz": 1})
    assert "unknown field (fields allowed here: model, engine, prefill" in line


def test_a_typo_in_a_value_gets_the_closest_allowed_value():
    lines = problem_lines({"model": {"preset": "tiny"}, "kvTransfer": {"mode": "layerwize"},
                           "engine": {"blockSize": 17}})
    assert lines == [
        "spec.engine.blockSize: Input should be 1, 2, 4, 8, 16, 32, 64, 128 or 256 (got 17)",
        "spec.kvTransfer.mode: Input should be 'pull', 'push' or 'layerwise' (got 'layerwize'); "
        "did you mean 'layerwise'?"]


def test_the_message_has_one_line_per_problem_and_a_wrong_kind_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kind: PDClustr\nmetadata: {name: x}\nspec: {model: {preset: tiny}}\n")
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert info.value.explain() == (f"{path}: no PDCluster document (found: PDClustr); "
                                    "did you mean kind: PDCluster?")
    with pytest.raises(ManifestError) as info:
        parse_manifest({"metadata": {"name": "x"}, "spec": {"model": {"preset": "tiny"},
                                                            "prefill": {"replicass": 1, "gpus": -1}}})
    text = info.value.explain()
    assert text.splitlines()[0] == "<manifest>: 2 problems"
    assert [ln[:2] for ln in text.splitlines()[1:]] == ["  ", "  "]


@pytest.mark.parametrize("text,size", [
    ("20Gi", 20 * 2**30), ("512Mi", 512 * 2**20), ("1.5G", 1_500_000_000), ("4096", 4096),
    (" 8Ki ", 8192), (64, 64),
])
def test_sizes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text,message", [
    ("20GB", "not a size: write bytes as a number with an optional suffix Ki, Mi, Gi"),
    ("500m", "not a whole, non-negative number of bytes"),
    ("-1Gi", "not a whole, non-negative number of bytes"),
])
def test_bad_sizes_say_what_is_allowed(text, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(text)
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-bytes", type=bytes_arg)
    assert parser.parse_args(["--kv-cache-bytes", "2Gi"]).kv_cache_bytes == 2 * 2**30
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        bytes_arg(text)
