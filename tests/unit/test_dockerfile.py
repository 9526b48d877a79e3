"""The Dockerfile builds two images (no Docker daemon runs here, so this reads it): a
control-plane target without torch, and an engine target (the default, last) with the
engine's extras, torch from the index its TORCH build arg names."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE = re.compile(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", re.M | re.I)


def stages() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    found = list(STAGE.finditer(text))
    return {m.group(1): text[m.end():found[i + 1].start() if i + 1 < len(found) else len(text)]
            for i, m in enumerate(found)}


def arg(stage: str, name: str) -> str:
    return re.search(rf"^ARG {name}=(\S*)$", stage, re.M).group(1).strip('"')


def runs(stage: str) -> str:
    """The stage's RUN instructions, comments left out."""
    lines = [ln for ln in stage.splitlines() if not ln.lstrip().startswith("#")]
    return "\n".join(lines).split("RUN", 1)[1]


def test_two_targets_and_the_engine_is_the_default():
    assert list(stages()) == ["build", "control-plane", "engine"]


def test_the_control_plane_installs_no_extra_by_default_and_no_torch():
    control_plane = stages()["control-plane"]
    assert arg(control_plane, "CONTROL_PLANE_EXTRAS") == ""
    assert "torch" not in runs(control_plane).lower()
    assert 'pip install "${wheel}${CONTROL_PLANE_EXTRAS:+[${CONTROL_PLANE_EXTRAS}]}"' in control_plane


def test_the_engine_installs_its_extras_and_torch_from_the_chosen_index():
    engine = stages()["engine"]
    extras = arg(engine, "ENGINE_EXTRAS").split(",")
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras[0] == "engine" and set(extras) <= set(optional)
    assert arg(engine, "TORCH") == "cpu"
    assert arg(engine, "TORCH_INDEX_URL") == "https://download.pytorch.org/whl/${TORCH}"
    torch_pin = next(r for r in optional["engine"] if r.startswith("torch"))
    assert torch_pin == f"torch=={arg(engine, 'TORCH_VERSION')}"
    assert 'pip install "${wheel}[${ENGINE_EXTRAS}]"' in engine
