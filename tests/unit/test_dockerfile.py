"""The Dockerfile builds three images (no Docker daemon runs here, so this reads it): a
control-plane target without torch, a vllm-engine target (vLLM's image with pdserve in a
venv of its own), and an engine target (the default, last) with the engine's extras,
torch from the index its TORCH build arg names."""

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


def test_three_targets_and_the_engine_is_the_default():
    assert list(stages()) == ["build", "control-plane", "vllm-engine", "engine"]


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
    # The compiled prefill (engine/compiled.py) builds C++ at start; without it the engine serves eager.
    assert re.search(r"apt-get install[^&]*\bg\+\+", runs(engine))


def test_the_vllm_engine_adds_pdserve_to_vllms_image_without_touching_vllm():
    """pdserve's wheel goes into its own venv, whose bin comes after vLLM's on PATH (the
    NodeAgent runs `vllm serve` from PATH), and `pdserve` is the entrypoint."""
    text = (ROOT / "Dockerfile").read_text()
    before_first_from = text.split("\nFROM ", 1)[0]
    vllm_engine = stages()["vllm-engine"]
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v\S+$", before_first_from, re.M)
    assert re.search(r"^FROM \$\{VLLM_IMAGE\} AS vllm-engine$", text, re.M)
    assert "RUN python3 -m venv /opt/pdserve" in vllm_engine
    assert '/opt/pdserve/bin/pip install --no-cache-dir --disable-pip-version-check "${wheel}"' \
        in vllm_engine
    assert re.search(r"PATH=\$\{PATH\}:/opt/pdserve/bin$", vllm_engine, re.M)
    assert not re.search(r"^\s*(RUN )?(pip|uv pip|python3 -m pip) install", vllm_engine, re.M)
    assert 'ENTRYPOINT ["pdserve"]' in vllm_engine and 'CMD ["--help"]' in vllm_engine
    assert "HOME=/home/pdserve" in vllm_engine
