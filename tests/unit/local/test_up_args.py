"""``pdserve up``'s own flags: ``--model`` and ``--kv-cache-bytes`` change the spec every
component then runs, and ``--host`` must be an address of this machine."""

from __future__ import annotations

import socket

import pytest

from pdserve.api import default_cluster
from pdserve.local.up import StartError, why_cannot_listen, with_overrides


def test_model_overrides_the_spec_with_a_checkpoint_directory_or_a_preset(tmp_path, monkeypatch):
    cluster = default_cluster()
    cluster.spec.model.served_name = "mine"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    model = with_overrides(cluster, "ckpt", None).spec.model
    assert (model.path, model.preset, model.served_name) == (str(tmp_path / "ckpt"), None, "mine")
    model = with_overrides(cluster, "small", None).spec.model
    assert (model.path, model.preset) == (None, "small")
    with pytest.raises(StartError, match="--model ./nothere: no such file or directory"):
        with_overrides(cluster, "./nothere", None)
    assert cluster.spec.model.preset == "smollm2"  # the loaded spec itself is left alone


def test_kv_cache_bytes_overrides_the_spec():
    cluster = with_overrides(default_cluster(), None, 16 * 2**20)
    assert cluster.spec.engine.kv_cache_bytes == 16 * 2**20
    assert cluster.spec.model.preset == "smollm2"


def test_host_must_be_an_address_of_this_machine_with_a_free_port():
    assert why_cannot_listen("127.0.0.1", 0) is None
    assert why_cannot_listen("192.0.2.1", 8000) == "--host 192.0.2.1: not an address of this machine"
    assert why_cannot_listen("no-such-host.invalid", 8000).startswith("--host no-such-host.invalid: no such host")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert why_cannot_listen("127.0.0.1", port) == f"port {port} on 127.0.0.1 is in use; pick another with --port"


@pytest.mark.parametrize(("model", "message"), [
    ("nosuchpreset", "spec.model.preset: model 'nosuchpreset': no such preset (presets: tiny, small, smollm2)"),
    ("/no/such/dir", "no such file or directory"),
    ("empty", "config.json does not exist"),
    ("noweights", "has no *.safetensors weights"),
    ("badjson", "is not valid JSON"),
    ("fake.gguf", "is not a readable GGUF file"),
    ("notes.txt", "is a file but not a .gguf file"),
])
def test_a_model_that_cannot_load_stops_up_before_anything_starts(tmp_path, model, message):
    from pdserve.api.cluster import ModelSpec
    from pdserve.local.up import check_model

    (tmp_path / "empty").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{nope")
    (tmp_path / "fake.gguf").write_bytes(b"GGUF but not really")
    (tmp_path / "notes.txt").write_text("hello")
    cluster = default_cluster()
    is_preset = "/" not in model and "." not in model and model not in ("empty", "noweights", "badjson")
    cluster.spec.model = (ModelSpec(preset=model) if is_preset else
                          ModelSpec(path=model if model.startswith("/") else str(tmp_path / model)))
    with pytest.raises(StartError) as info:
        check_model(cluster)
    assert message in str(info.value)


def test_up_with_a_missing_model_path_fails_within_seconds(tmp_path):
    import subprocess
    import sys
    import time

    spec = tmp_path / "cluster.yaml"
    spec.write_text("apiVersion: pdserve.io/v1alpha1\nkind: PDCluster\nmetadata: {name: m}\n"
                    "spec:\n  model: {path: /no/such/checkpoint}\n  prefill: {replicas: 1}\n"
                    "  decode: {replicas: 1}\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "-f", str(spec), "--port", "0",
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "spec.model.path" in done.stderr and "/no/such/checkpoint" in done.stderr
    assert time.monotonic() - started < 20  # it names the path before any engine starts
    assert not (tmp_path / "run" / "processes.json").exists()
