"""The ``pdserve`` command: a bad spec is one message naming the field and what to write
(a traceback only with ``--debug``), ``--version``, and defaults in every ``--help``."""

from __future__ import annotations

import pytest
import yaml

from pdserve import __version__
from pdserve.api import ManifestError
from pdserve.cli import main


@pytest.fixture
def typo_spec(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster", "metadata": {"name": "typo"},
        "spec": {"model": {"preset": "tiny"}, "prefill": {"replicass": 1}}}))
    return path


@pytest.mark.parametrize("command", [["up", "-f"], ["controller", "-f"], ["nodeagent", "--instance=a=decode", "-f"]])
def test_a_bad_spec_is_one_message_without_a_traceback(command, typo_spec, capsys):
    assert main([*command, str(typo_spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {typo_spec}: spec.prefill.replicass: Extra inputs are not permitted "
                          "(got 1); did you mean 'replicas'? (fields allowed here: replicas, gpus, ")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_debug_before_or_after_the_command_shows_the_traceback(typo_spec):
    for argv in (["--debug", "up", "-f", str(typo_spec)], ["up", "-f", str(typo_spec), "--debug"]):
        with pytest.raises(ManifestError):
            main(argv)


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"pdserve {__version__}\n"


@pytest.mark.parametrize("command,shown", [
    ("up", ["--port PORT           Coordinator REST port (default: 8000)", "(default: 900.0)",
            "--kv-cache-bytes SIZE"]),
    ("nodeagent", ["(default: 127.0.0.1:50050)", "(default: 0.5)", "(0: a free port) (default: 0)"]),
    ("controller", ["(default: memory://)", "(default: 50050)", "(default: 3)"]),
    ("coordinator", ["(default: prefix_cache_aware)", "(default: 1048576)", "(default: INFO)"]),
    ("operator", ["--namespace NAMESPACE"]),
])
def test_help_shows_the_defaults(command, shown, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    for part in shown:
        assert " ".join(part.split()) in text, text
    assert "(default: False)" not in text and "(default: None)" not in text
