"""``pdserve doctor`` against a real ``pdserve up -f examples/minimal.yaml`` cluster
(every check passes, exit 0, including a real P -> D test transfer), and against a
spec whose model path does not exist (fail with the reason, exit non-zero)."""

from __future__ import annotations

import signal
import subprocess

import httpx

from tests.etcd import free_port
from tests.procs import PDSERVE, Proc
from tests.real_model import gguf_path


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, "doctor", *args], capture_output=True, text=True, timeout=120)


def test_doctor_passes_on_a_running_minimal_cluster(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    up = Proc([*PDSERVE, "up", "-f", "examples/minimal.yaml", "--port", str(port),
               "--run-dir", str(run_dir)])
    try:
        up.wait_for(r"pdserve is up", timeout_s=180)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": "Hello", "max_tokens": 4})
        assert answer.status_code == 200, answer.text  # the engine sessions are open now
        result = doctor("-f", "examples/minimal.yaml", "--run-dir", str(run_dir))
        assert result.returncode == 0, result.stdout + result.stderr
        rows = result.stdout.splitlines()
        assert not [r for r in rows if r.startswith(("FAIL", "WARN"))], result.stdout
        probe = next(r for r in rows if r.startswith("PASS") and "-> tiny-decode-0" in r and "kv " in r)
        assert "test transfer of" in probe and "over tcp" in probe
        assert any(r.startswith("PASS") and "coordinator" in r for r in rows)
        sessions = next(r for r in rows if "engine sessions" in r)
        assert sessions.startswith("PASS") and "on the engines' session ports" in sessions
        assert rows[-1].endswith("0 warn, 0 fail")
        up.popen.send_signal(signal.SIGINT)
        assert up.popen.wait(60) == 0
    finally:
        up.stop()


def test_doctor_fails_with_the_reason_on_a_missing_model_path(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(
        "apiVersion: pdserve.io/v1alpha1\nkind: PDCluster\nmetadata:\n  name: nomodel\n"
        "spec:\n  model:\n    path: /nonexistent/checkpoint\n"
        "  prefill:\n    replicas: 1\n  decode:\n    replicas: 1\n")
    result = doctor("-f", str(spec), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1, result.stdout + result.stderr
    line = next(r for r in result.stdout.splitlines() if "model source" in r)
    assert line.startswith("FAIL") and "'/nonexistent/checkpoint': no such file or directory" in line
    assert "fix: point spec.model.path" in result.stdout


def test_doctor_without_a_target_checks_the_built_in_cluster(tmp_path):
    gguf_path()  # the preset is installed (as `pdserve up` would have done)
    result = doctor("--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1, result.stdout + result.stderr  # nothing runs yet
    rows = result.stdout.splitlines()
    model = next(r for r in rows if "model source" in r)
    assert model.startswith("PASS") and "preset 'smollm2'" in model
    assert model.endswith(".gguf), served in float32 (auto: GGUF weights dequantized to float32)")
    template = next(r for r in rows if "chat template" in r)
    assert template.startswith("PASS") and "tokenizer.chat_template" in template
    assert "no running `pdserve up` for 'local'" in result.stdout and "fix: pdserve up" in result.stdout
