"""The API module's pure helpers and the test emulator's apiserver semantics."""

from __future__ import annotations

from pdserve.operator.kube import KubeError, is_subset, path
from tests.kmock_emulator import matches_selector, merge_patch


def test_paths_and_subset_comparison():
    assert path("Pod", "ns", "p", "status") == "/api/v1/namespaces/ns/pods/p/status"
    assert path("PDInstance", "ns") == "/apis/pdserve.io/v1alpha1/namespaces/ns/pdinstances"
    assert is_subset({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}, "d": 3})
    assert not is_subset({"a": [1]}, {"a": [1, 2]})
    assert KubeError(409, "x").is_transient and not KubeError(403, "x").is_transient


def test_merge_patch_and_label_selectors():
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None, "d": 3}, "l": [2]}) == {
        "a": {"c": 2, "d": 3}, "l": [2]}
    labels = {"app": "x", "tier": "engine"}
    assert matches_selector(labels, "app=x,tier==engine")
    assert matches_selector(labels, "app,!missing,tier!=web")
    assert not matches_selector(labels, "app=y") and not matches_selector(labels, "!app")
    assert matches_selector(labels, None)
