"""Tensor parallelism on CPU (gloo): an engine of 2 or 4 ranks, each a real process,
against the same engine at TP=1 and against transformers on the same random weights.

Each case saves a small random checkpoint (4 attention heads, 2 KV heads: TP=4 runs
each KV head replicated on two ranks), generates greedily from prompts long enough to
take several prefill chunks next to running decodes, and ends with every block free and
every worker stopped. Then the refusals (settings and shapes the engine
cannot shard) and the supervision of the ranks (``pdserve engine`` exits 1 when a rank
dies; a rank exits when the engine dies).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pdserve.api.sampling import SamplingParams
from pdserve.engine.config import HOST_MEMORY_TRANSPORTS, ConfigError, EngineConfig, ModelConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model, preset_config
from pdserve.engine.prepack import can_prepack
from tests.unit.engine.hf_models import (
    build_hf_model,
    full_prefill_logits,
    hf_greedy,
    save_hf_model,
)

PROMPTS = [[5, 17, 99, 3, 250, 42, 42, 7, 64, 128, 1, 300, 11, 23], list(range(40, 90)),
           list(range(100, 133))]
NUM_NEW = 16


def engine_config(model: str, tp: int, **overrides) -> EngineConfig:
    # Small chunks: the 50-token prompt takes several steps, mixed with decodes.
    return EngineConfig(model=model, tensor_parallel_size=tp, num_kv_blocks=64, block_size=4,
                        prefill_chunk_tokens=16, max_num_batched_tokens=32, num_threads=1,
                        **overrides)


def generate(model: str, tp: int, **overrides) -> list[list[int]]:
    engine = LLMEngine(engine_config(model, tp, **overrides))
    try:
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        procs = [] if engine.tp_workers is None else engine.tp_workers._procs
    finally:
        engine.close()
    assert all(p.exitcode == 0 for p in procs)  # stopped, not killed
    return outs


@pytest.mark.parametrize(("kind", "tp", "overrides"), [
    ("llama", 2, {}),
    ("llama", 4, {"attention_bias": True}),  # KV heads replicated; q/k/v and o_proj biases
    ("qwen2", 2, {}),  # q/k/v bias
    ("qwen3", 4, {}),  # per-head q/k norm
    ("mistral", 2, {}),
], ids=["llama-tp2", "llama-bias-tp4", "qwen2-tp2", "qwen3-tp4", "mistral-tp2"])
def test_greedy_output_equals_tp1_and_transformers(tmp_path, kind, tp, overrides):
    hf = build_hf_model(kind, seed=5, num_hidden_layers=2, **overrides)
    save_hf_model(hf, tmp_path)
    single = generate(str(tmp_path), 1)
    assert generate(str(tmp_path), tp) == single
    for prompt, out in zip(PROMPTS, single, strict=True):
        assert out == hf_greedy(hf, prompt, NUM_NEW)
        assert len(set(out)) >= 3, f"degenerate reference output {out}"


@pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.bfloat16),
                    reason="this CPU has no oneDNN bfloat16 matmuls")
def test_bfloat16_shards_with_prepacked_weights_give_the_plain_shards_ids(tmp_path):
    """Each rank packs its own shard once it is loaded (q/k/v bias: qwen2)."""
    hf = build_hf_model("qwen2", seed=5, num_hidden_layers=2)
    save_hf_model(hf, tmp_path)
    packed = generate(str(tmp_path), 2, dtype="bfloat16")
    assert packed == generate(str(tmp_path), 2, dtype="bfloat16", prepack_weights=False)
    assert all(len(set(out)) >= 3 for out in packed), packed


def test_a_sharded_preset_equals_the_whole_one():
    """Presets build their weights from a seed; every rank cuts its slices of the same
    weights, so the output is the unsharded preset's."""
    assert generate("tiny", 2) == generate("tiny", 1)


def test_llama_attention_bias_includes_o_proj(tmp_path):
    """transformers puts ``attention_bias`` on o_proj too (Llama, Qwen3): its weights load
    and the logits match."""
    for kind in ("llama", "qwen3"):
        hf = build_hf_model(kind, seed=2, num_hidden_layers=2, attention_bias=True)
        assert hf.model.layers[0].self_attn.o_proj.bias is not None
        save_hf_model(hf, tmp_path / kind)
        model, _ = load_model(str(tmp_path / kind))
        assert model.config.o_proj_bias and model.layers[0].self_attn.o_bias is not None
        ours = full_prefill_logits(model, PROMPTS[1])
        with torch.no_grad():
            theirs = hf(torch.tensor([PROMPTS[1]])).logits[0].float()
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_mistral_and_qwen2_have_no_o_proj_bias():
    base = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "attention_bias": True}
    mistral = ModelConfig.from_hf_dict({**base, "architectures": ["MistralForCausalLM"]})
    qwen2 = ModelConfig.from_hf_dict({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert (mistral.attention_bias, mistral.o_proj_bias) == (False, False)
    assert (qwen2.attention_bias, qwen2.o_proj_bias) == (True, False)


def test_a_tensor_parallel_size_below_one_is_refused():
    with pytest.raises(ConfigError, match="tensor_parallel_size must be positive"):
        EngineConfig(model="tiny", tensor_parallel_size=0).validate()


@pytest.mark.parametrize(("tp", "message"), [
    (3, r"num_attention_heads \(4\) of tiny must be a multiple of tensor_parallel_size \(3\)"),
    (8, r"num_attention_heads \(4\) of tiny"),
])
def test_a_model_whose_heads_do_not_split_is_refused_before_loading(tp, message):
    with pytest.raises(ConfigError, match=message):
        LLMEngine(EngineConfig(model="tiny", tensor_parallel_size=tp))


def test_kv_heads_must_divide_or_be_divided_by_the_ranks():
    config = EngineConfig(tensor_parallel_size=4)
    six_heads = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=48,
                            intermediate_size=16, num_hidden_layers=1, num_attention_heads=12,
                            num_key_value_heads=6, max_position_embeddings=64, name="m")
    with pytest.raises(ConfigError, match=r"m: 6 KV heads cannot be split over 4 ranks"):
        config.check_model(six_heads)
    config.check_model(preset_config("tiny"))  # 4 heads, 2 KV heads: replicated twice


@pytest.mark.parametrize("device", ["cuda", "npu:1"])
@pytest.mark.parametrize("transport", HOST_MEMORY_TRANSPORTS)
def test_a_device_kv_cache_on_a_host_memory_transport_is_refused(device, transport):
    config = EngineConfig(device=device, kv_transport=transport, role="decode")
    with pytest.raises(ConfigError, match=(
            f"kv_transport '{transport}' moves host memory only and cannot carry a KV cache on "
            f"device '{device}'; run this engine with --device cpu, or with --kv-transport none")):
        config.validate()
    EngineConfig(device=device, kv_transport="none").validate()


@pytest.mark.parametrize(("flags", "message"), [
    (["--device", "cuda", "--kv-transport", "tcp", "--role", "prefill"],
     "kv_transport 'tcp' moves host memory only"),
    # no rank is started for a device the machine lacks (no torch_npu here)
    (["--device", "npu", "--kv-transport", "none", "--tensor-parallel-size", "2"],
     "device 'npu' requires the torch_npu package"),
])
def test_the_engine_cli_refuses_at_start(flags, message):
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "engine", *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def generate_tokens(prompt: list[int], *flags: str) -> list[int]:
    """``pdserve generate``'s greedy tokens for ``prompt``: in its own process (tiny, TP=1),
    or from the engine at ``--server``."""
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "--prompt-token-ids",
         ",".join(map(str, prompt)), "--max-tokens", "12", "--ignore-eos", "--json", *flags],
        capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["token_ids"]


def _start_tp_engine(tp: int) -> tuple[subprocess.Popen, list[int], str]:
    """``pdserve engine`` with ``tp`` ranks, once it serves; its worker pids; its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "engine", "--tensor-parallel-size", str(tp),
         "--kv-transport", "none", "--port", "0", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "serving model" in line, proc.stderr.read() if proc.poll() is not None else line
    workers = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = [c for c in _children(proc.pid)
                   if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        if len(workers) == tp - 1:
            break
        time.sleep(0.1)
    assert len(workers) == tp - 1
    return proc, workers, re.search(r"serving model 'tiny' on (\S+)", line).group(1)


def test_a_dead_rank_takes_the_engine_down_with_exit_code_1():
    proc, [worker], _ = _start_tp_engine(2)
    try:
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        err = proc.stderr.read()
        assert re.search(rf"tensor-parallel rank 1 \(pid {worker}\) exited with code -9: "
                         r"stopping the engine", err), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_served_tp_engine_answers_as_tp1_and_its_ranks_end_with_it():
    """Over gRPC, TP=2 answers as TP=1 does. SIGTERM: the engine stops its ranks and
    exits 0. SIGKILL: the ranks find rank 0 gone and exit on their own."""
    prompt = [5, 17, 99, 3, 250, 42, 42, 7]
    expected = generate_tokens(prompt)
    proc, workers, address = _start_tp_engine(2)
    assert generate_tokens(prompt, "--server", address) == expected
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not any(_is_alive(w) for w in workers)

    proc, [worker], _ = _start_tp_engine(2)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while _is_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _is_alive(worker)
