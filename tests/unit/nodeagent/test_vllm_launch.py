"""A vLLM engine's command line, environment and address follow the spec, the pool and
the role; it serves once uvicorn says so; its probes read vLLM's routes."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from pdserve.api import parse_manifest
from pdserve.nodeagent.launch import VllmLaunch
from pdserve.nodeagent.process import Backoff, EngineProcess
from pdserve.nodeagent.vllm_args import cpu_list
from pdserve.runtime.vllm_server import parse_vllm_address


def vllm_cluster(**engine):
    return parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                           "metadata": {"name": "v"}, "spec": {
                               "model": {"path": "/models/smollm2", "servedName": "smollm2"},
                               "engine": {"backend": "vllm", "dtype": "float32", "maxModelLen": 2048,
                                          "enablePrefixCaching": False, **engine,
                                          "vllm": {"command": ["python", "-m", "vllm.api"],
                                                   "extraArgs": ["--enforce-eager"],
                                                   "env": {"VLLM_CPU_OMP_THREADS_BIND": "3"}}},
                               "kvTransfer": {"mode": "pull", "transport": "nixl"},
                               "prefill": {"replicas": 1, "cpuAffinity": [0, 1], "threads": 2},
                               "decode": {"replicas": 1, "gpus": 1},
                               "hybrid": {"replicas": 1}}})


def flags(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}


def test_prefill_argv_env_and_address():
    launch = VllmLaunch(vllm_cluster(), "prefill", "127.0.0.7", cpus=(0, 1), extra=["--seed", "3"])
    argv, env = launch.command("prefill")
    f = flags(argv)
    assert argv[:3] == ["python", "-m", "vllm.api"] and argv[-3:] == ["--enforce-eager", "--seed", "3"]
    assert f["--model"] == "/models/smollm2" and f["--served-model-name"] == "smollm2"
    assert f["--host"] == "127.0.0.7" and f["--dtype"] == "float32" and f["--max-model-len"] == "2048"
    assert f["--kv-cache-memory-bytes"] == str(256 * 2**20) and "--no-enable-prefix-caching" in argv
    assert "--block-size" not in argv and "--enable-per-request-metrics" in argv
    assert json.loads(f["--kv-transfer-config"]) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    # the spec's env wins over the pinned cores' binding
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "3" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.7"
    # nothing serves until uvicorn says so; then the address says role, side channel, connector
    assert launch.serving_address("INFO Starting vLLM server on http://127.0.0.7:1") is None
    address = launch.serving_address("INFO:     Application startup complete.")
    http, identity = parse_vllm_address(address)
    assert http == f"127.0.0.7:{f['--port']}" and identity.role == "prefill"
    assert identity.kv_endpoint == f"127.0.0.7:{env['VLLM_NIXL_SIDE_CHANNEL_PORT']}"
    assert identity.kv_connector == "NixlConnector"


def test_a_relaunch_in_another_role_changes_the_kv_role_and_the_address():
    launch = VllmLaunch(vllm_cluster(numKvBlocks=100), "decode", "127.0.0.1")
    argv, env = launch.command("decode")
    assert json.loads(flags(argv)["--kv-transfer-config"]) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cuda"}
    assert flags(argv)["--num-gpu-blocks-override"] == "100" and "VLLM_TARGET_DEVICE" not in env
    first = launch.serving_address("Application startup complete")
    argv, _ = launch.command("hybrid")
    assert "--kv-transfer-config" not in argv
    hybrid = launch.serving_address("Application startup complete")
    assert hybrid != first and parse_vllm_address(hybrid)[1].role == "hybrid"
    assert parse_vllm_address(hybrid)[1].kv_endpoint == ""


def test_cpu_list_is_a_linux_cpulist():
    assert cpu_list((0,)) == "0" and cpu_list((3, 0, 1, 2, 6)) == "0-3,6"


def test_the_process_runs_vllms_command_with_its_env_and_serves_at_the_ready_line(tmp_path):
    """EngineProcess runs ``command()`` with its environment and takes the address from
    ``serving_address``: a stand-in that prints the env and uvicorn's line."""
    script = ("import os, time; print('side', os.environ['VLLM_NIXL_SIDE_CHANNEL_PORT'], flush=True); "
              "print('INFO:     Application startup complete.', flush=True); time.sleep(30)")
    launch = VllmLaunch(vllm_cluster(), "prefill", "127.0.0.1")
    seen = {}

    def command():
        argv, env = launch.command("prefill")
        seen.update(env)
        return [sys.executable, "-c", script], env

    async def main():
        proc = EngineProcess("p", command, Backoff(), lambda: None, echo=False,
                             serving_address=launch.serving_address)
        task = asyncio.create_task(proc.supervise())
        for _ in range(200):
            if proc.state == "running":
                break
            await asyncio.sleep(0.05)
        assert proc.state == "running"
        assert parse_vllm_address(proc.address)[1].kv_endpoint.endswith(
            ":" + seen["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert any("side " + seen["VLLM_NIXL_SIDE_CHANNEL_PORT"] in line for line in proc._tail)
        await proc.stop()
        task.cancel()

    asyncio.run(main())
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ


def test_vllm_takes_hybrid_and_its_launched_role_in_place_but_not_the_other_pd_role():
    launch = VllmLaunch(vllm_cluster(), "prefill", "127.0.0.1")
    assert launch.address_in_role("hybrid") is None  # nothing launched yet
    launch.command("prefill")
    launched = launch.serving_address("Application startup complete")
    hybrid = launch.address_in_role("hybrid")
    assert parse_vllm_address(hybrid)[0] == parse_vllm_address(launched)[0]  # the same server
    assert parse_vllm_address(hybrid)[1].role == "hybrid"
    assert launch.address_in_role("prefill") == launched
    assert launch.address_in_role("decode") is None  # a producer does not consume: relaunch
