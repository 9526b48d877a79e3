"""``pip install pdserve`` is the control plane; the engine, the Mooncake and NIXL
transports and bench plots are extras. The extras' table (``pdserve.runtime.extras``)
matches ``pyproject.toml``; no control-plane command imports an extra's module when it
loads; a command that needs a missing extra says which one to install, never a traceback.
(``tests/integration/test_slim_install.py`` installs the control plane alone and runs it.)
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from pdserve.api.manifest import default_cluster, parse_manifest
from pdserve.cli import main, run_command
from pdserve.local.up import StartError, check_extras
from pdserve.runtime import extras

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
CONTROL_PLANE_MODULES = [
    "pdserve.cli", "pdserve.coordinator.app", "pdserve.coordinator.cli", "pdserve.controller.cli",
    "pdserve.controller.service", "pdserve.nodeagent.cli", "pdserve.nodeagent.agent",
    "pdserve.operator.cli", "pdserve.operator.handlers", "pdserve.bench.cli", "pdserve.local.doctor",
    "pdserve.local.up", "pdserve.runtime.kv_pool_master", "pdserve.api.crd_cli",
]
EXTRA_MODULES = sorted({m for modules in extras.EXTRAS.values() for m in modules} | {"transformers"})


def without(monkeypatch, *modules: str) -> None:
    """Make ``modules`` look uninstalled to ``importlib.util.find_spec``."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in modules else real(name, *a))


def test_the_extras_table_is_pyprojects():
    optional = PYPROJECT["project"]["optional-dependencies"]
    assert set(optional) - {"all", "test"} == set(extras.EXTRAS)
    assert optional["all"] == [f"pdserve[{','.join(extras.EXTRAS)}]"]
    dists = packages_distributions()
    for extra, modules in extras.EXTRAS.items():
        names = {Requirement(r).name for r in optional[extra]}
        assert {d.lower() for m in modules for d in dists[m]} == names, extra


def test_the_core_needs_no_extra():
    core = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    in_extras = {Requirement(r).name for e in extras.EXTRAS
                 for r in PYPROJECT["project"]["optional-dependencies"][e]}
    assert not core & in_extras
    assert {"llguidance", "gguf", "tokenizers", "jinja2"} <= core  # the Coordinator's


def test_control_plane_modules_import_no_extra():
    code = (f"import sys\nfor m in {CONTROL_PLANE_MODULES!r}: __import__(m)\n"
            f"print(sorted(m for m in {EXTRA_MODULES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["engine", "generate"])
def test_an_engine_command_without_the_engine_names_the_extra(monkeypatch, capsys, command):
    without(monkeypatch, "torch")
    assert main([command, "--help"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"error: pdserve {command}: the engine extra is not installed (no module "
                            "torch); install it with pip install 'pdserve[engine]'\n")


def test_a_simulated_engine_needs_no_engine_extra(monkeypatch, capsys):
    without(monkeypatch, "torch", "safetensors")
    with pytest.raises(SystemExit) as exit_:
        main(["engine", "--simulate", "--help"])
    assert exit_.value.code == 0 and "--sim-prefill-base-ms" in capsys.readouterr().out
    simulated = parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                                "metadata": {"name": "c"}, "spec": {
                                    "model": {"preset": "tiny"}, "engine": {"simulate": {}},
                                    "prefill": {"replicas": 1}, "decode": {"replicas": 1}}})
    check_extras(simulated)  # pdserve up starts it on a control-plane-only install


class _Needs:
    """A command module whose ``run`` imports a module that is not installed."""

    def __init__(self, module: str) -> None:
        self.module = module

    def run(self, args) -> int:
        raise ModuleNotFoundError(f"No module named {self.module!r}", name=self.module)


def test_a_missing_extra_at_run_time_is_one_line(capsys):
    assert run_command(_Needs("mooncake.store"), None, False, "engine") == 1
    assert capsys.readouterr().err == ("error: pdserve engine: the mooncake extra is not installed "
                                       "(no module mooncake.store); install it with "
                                       "pip install 'pdserve[mooncake]'\n")
    with pytest.raises(ModuleNotFoundError):  # --debug shows the traceback
        run_command(_Needs("mooncake.store"), None, True, "engine")
    with pytest.raises(ModuleNotFoundError):  # a module of no extra is a bug, not a missing extra
        run_command(_Needs("yaml"), None, False, "engine")


def test_bench_plot_without_matplotlib_fails_before_any_load(monkeypatch, capsys):
    without(monkeypatch, "matplotlib")
    # an unreachable server: the flag is refused before anything is sent
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--plot", "plots"]) == 2
    assert capsys.readouterr().err == ("error: --plot: the plots extra is not installed (no module "
                                       "matplotlib); install it with pip install 'pdserve[plots]'\n")


def test_up_checks_the_engine_and_the_specs_transport_before_starting(monkeypatch):
    check_extras(default_cluster())  # everything is installed here
    without(monkeypatch, "torch", "safetensors", "mooncake")
    with pytest.raises(StartError, match=r"pdserve up runs engines here: the engine extra is not "
                                         r"installed \(no module torch, safetensors\); install it "
                                         r"with pip install 'pdserve\[engine\]'"):
        check_extras(default_cluster())
    monkeypatch.undo()
    without(monkeypatch, "mooncake")
    spec = {"model": {"preset": "tiny"}, "prefill": {"replicas": 1}, "decode": {"replicas": 1},
            "kvTransfer": {"transport": "mooncake"}}
    cluster = parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                              "metadata": {"name": "c"}, "spec": spec})
    with pytest.raises(StartError, match=r"pip install 'pdserve\[mooncake\]'"):
        check_extras(cluster)
    colocated = {**spec, "prefill": {"replicas": 0}, "decode": {"replicas": 0},
                 "hybrid": {"replicas": 1}}
    check_extras(parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                                 "metadata": {"name": "c"}, "spec": colocated}))  # no transfer


def test_the_doctor_says_which_extra_this_host_lacks_for_the_specs_engines(monkeypatch):
    from pdserve.local.doctor_checks import check_extras as doctor_extras

    assert [(c.name, c.status) for c in doctor_extras(default_cluster())] == [("engine extra", "pass")]
    without(monkeypatch, "torch", "safetensors")
    [row] = doctor_extras(default_cluster())
    assert (row.name, row.status, row.fix) == ("engine extra", "warn", "pip install 'pdserve[engine]'")
    assert "no module torch, safetensors" in row.detail and "pdserve up" in row.detail
