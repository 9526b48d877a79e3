"""``pdserve nodeagent``'s timing flags: each reaches the agent's settings, and a value
that is not a positive number is a usage error naming the flag (it was a division by
zero inside the agent's peer checks for ``--peer-probe-max-rate 0``)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.api.manifest import default_cluster
from pdserve.cli import main
from pdserve.nodeagent import cli

FLAGS = ["--probe-max-rate", "--peer-probe-interval", "--peer-probe-retry", "--peer-probe-max-rate", "--probe-timeout",
         "--heartbeat-interval", "--restart-backoff", "--restart-backoff-max", "--restart-stable-after"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["--instance=a=decode", *argv])


def test_the_flags_reach_the_agent_settings():
    args = parse(["--peer-probe-interval", "45", "--peer-probe-retry", "3.5", "--peer-probe-max-rate", "2.5",
                  "--probe-timeout", "0.7", "--heartbeat-interval", "0.25", "--restart-backoff", "0.1",
                  "--probe-max-rate", "50"])
    settings = cli.agent_settings(args, default_cluster())
    assert (settings.peer_probe_interval_s, settings.peer_probe_retry_s, settings.peer_probe_max_rate) == (45, 3.5, 2.5)
    assert (settings.probe_timeout_s, settings.interval_s, settings.backoff.base_s) == (0.7, 0.25, 0.1)
    assert settings.probe_max_rate == 50


def test_the_spec_gives_the_interval_unless_the_flag_overrides_it():
    cluster = default_cluster()
    assert cli.agent_settings(parse([]), cluster).interval_s == cluster.spec.heartbeat.interval_seconds


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_value_that_is_not_a_positive_number_is_a_usage_error(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        main(["nodeagent", "--instance=a=decode", flag, value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {flag}: '{value}'" in err, err
