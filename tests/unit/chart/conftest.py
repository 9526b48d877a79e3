"""Fixtures of the chart tests: the real helm (``make k8s-tools`` puts it in .venv/bin)."""

from __future__ import annotations

import pytest

from tests.kube_tools import tool_path

from .helm import Helm


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> Helm:
    binary = tool_path("helm")
    if binary is None:
        pytest.fail("helm is not installed: `make k8s-tools` (a step of `make test`) puts it "
                    "into .venv/bin")
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))
