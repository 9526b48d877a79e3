"""What an engine says and accepts while it starts: load progress, sizes on its flags.

Weight loading logs tensors, bytes and the rate at most every 2 s, then a final line
(checked with a stepped clock, then on a real checkpoint with a sharded index); the
``--kv-cache-bytes`` flag reads sizes as the PDCluster spec writes them; every flag
has a help text, so ``--help`` shows its default.
"""

from __future__ import annotations

import argparse
import importlib
import logging

import pytest

from pdserve.cli import COMMANDS, main
from pdserve.engine.cli_args import add_engine_arguments, engine_config_from_args
from pdserve.engine.loader import LoadProgress, load_model
from tests.unit.engine.hf_models import build_hf_model, save_hf_model


def test_progress_is_logged_at_most_every_two_seconds_and_at_the_end(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.engine.loader")
    now = [100.0]
    progress = LoadProgress(total_bytes=10 << 20, clock=lambda: now[0])
    for t in (0.5, 1.0, 2.1, 2.5, 3.9, 4.2):
        now[0] = 100.0 + t
        progress.add(1 << 20)
    now[0] = 105.0
    progress.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "loading weights: 3 tensors, 3.0 MiB of 10.0 MiB in 2.1 s (1 MiB/s)",
        "loading weights: 6 tensors, 6.0 MiB of 10.0 MiB in 4.2 s (1 MiB/s)",
        "loaded weights: 6 tensors, 6.0 MiB of 10.0 MiB in 5.0 s (1 MiB/s)",
    ]


def test_loading_a_checkpoint_ends_with_its_totals(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.engine.loader")
    save_hf_model(build_hf_model("llama"), tmp_path, max_shard_size="100KB")
    load_model(str(tmp_path))
    [final] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded")]
    # 3 layers x 9 tensors, the embedding, the final norm and the head.
    assert final.startswith("loaded weights: 30 tensors, ") and "MiB/s" in final


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("flag", "num_bytes"), [
    ("20Gi", 20 * 2**30), ("512Mi", 512 * 2**20), ("1.5G", 1_500_000_000), ("4096", 4096),
])
def test_kv_cache_bytes_takes_spec_sizes(flag, num_bytes):
    assert engine_config_from_args(parse("--kv-cache-bytes", flag)).kv_cache_bytes == num_bytes


def test_weights_are_prepacked_unless_the_flag_says_not():
    assert engine_config_from_args(parse()).prepack_weights is True
    assert engine_config_from_args(parse("--no-prepack-weights")).prepack_weights is False


def test_a_kv_cache_size_that_is_not_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--kv-cache-bytes", "20GB")
    assert exc.value.code == 2
    assert "20Gi or 512Mi" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["engine", "generate"])
def test_every_engine_flag_has_a_help_text_so_help_shows_its_default(command, capsys):
    module = importlib.import_module(COMMANDS[command][0])
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    assert [a.option_strings for a in parser._actions if not a.help] == []
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    for shown in ("(default: 16)", "(default: 64)", "--kv-reserve-wait-s", "(default: 2.0)"):
        assert shown in text, text
    if command == "engine":
        assert "(default: INFO)" in text
