"""``pdserve up -f spec.yaml`` runs the whole spec, the user's way: a colocated cluster
(one hybrid engine, pinned to one core, one thread) served under the spec's model
name with the spec's routing policy, then Ctrl-C stops everything. A spec that cannot
run says why at once: a typo names the field to write, an engine that cannot start
shows its error; SIGTERM stops a PD cluster in order, leaving nothing behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.api.proto import engine_pb2, engine_pb2_grpc
from pdserve.local.runstate import is_group_alive
from tests.etcd import free_port
from tests.procs import PDSERVE, Proc


def write_spec(path: Path, core: int) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
        "metadata": {"name": "up-spec"},
        "spec": {
            "model": {"preset": "tiny", "servedName": "mymodel"},
            "engine": {"dtype": "float32", "kvCacheBytes": "16Mi"},
            "prefill": {"replicas": 0}, "decode": {"replicas": 0},
            "hybrid": {"replicas": 1, "threads": 1, "cpuAffinity": [core]},
            "routing": {"decodePolicy": "round_robin"},
        }}))


def engine_pids(nodeagent_group: int) -> list[int]:
    """Engines run in the NodeAgent's process group."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().split(") ", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[2]) == nodeagent_group and b"engine" in cmdline:
            pids.append(int(entry))
    return pids


def test_up_runs_a_colocated_spec_with_its_model_name_policy_and_cores(tmp_path):
    core = max(os.sched_getaffinity(0))
    spec, port, run_dir = tmp_path / "cluster.yaml", free_port(), tmp_path / "run"
    write_spec(spec, core)
    up = Proc([*PDSERVE, "up", "-f", str(spec), "--host", "127.0.0.1", "--port", str(port),
               "--run-dir", str(run_dir)])
    try:
        up.wait_for(r"starting cluster 'up-spec': model tiny in float32, 1 hybrid, colocated", timeout_s=30)
        up.wait_for(r"pdserve is up: http://127\.0\.0\.1:" + str(port), timeout_s=60)
        assert re.search(r"mode COLOCATED: hybrid 1/1 ready", up.output), up.output
        base = f"http://127.0.0.1:{port}"
        models = httpx.get(f"{base}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["mymodel"]
        r = httpx.post(f"{base}/v1/completions", timeout=30,
                       json={"model": "mymodel", "prompt": "Hello", "max_tokens": 4,
                             "ignore_eos": True})  # sampled: EOS would end it early 2% of runs
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["model"] == "mymodel"
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert re.search(r'routing_decisions_total\{policy="round_robin",pool="hybrid"\} 1\.0', metrics)

        groups = json.loads((run_dir / "processes.json").read_text())["groups"]
        pids = engine_pids(groups["nodeagent"])
        assert len(pids) == 1 and os.sched_getaffinity(pids[0]) == {core}
        # The control plane runs on the other cores (all of them on a one-core machine).
        rest = (os.sched_getaffinity(0) - {core}) or os.sched_getaffinity(0)
        assert {name: os.sched_getaffinity(groups[name]) for name in ("controller", "coordinator", "nodeagent")
                } == dict.fromkeys(("controller", "coordinator", "nodeagent"), rest)
        argv = Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--role") + 1] == b"hybrid"
        assert argv[argv.index(b"--threads") + 1] == b"1"

        up.popen.send_signal(signal.SIGINT)
        assert up.popen.wait(30) == 0
        assert not any(is_group_alive(g) for g in groups.values())
    finally:
        up.stop()


def write_yaml(path: Path, spec: dict, name: str = "up-spec") -> Path:
    path.write_text(yaml.safe_dump({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                                    "metadata": {"name": name}, "spec": spec}))
    return path


def logs_of(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("*.log")))


@pytest.mark.parametrize(("model", "message"), [
    ({"preset": "nosuch"}, "spec.model.preset: model 'nosuch': no such preset"),
    ({"path": "/nonexistent/checkpoint"}, "spec.model.path: model '/nonexistent/checkpoint': no such file"),
], ids=["preset", "path"])
def test_a_model_that_cannot_load_stops_up_before_anything_starts(tmp_path, model, message):
    spec = write_yaml(tmp_path / "cluster.yaml", {
        "model": model, "prefill": {"replicas": 1}, "decode": {"replicas": 1}})
    run_dir = tmp_path / "run"
    started = time.monotonic()
    up = Proc([*PDSERVE, "up", "-f", str(spec), "--port", str(free_port()), "--run-dir", str(run_dir)])
    try:
        assert up.popen.wait(30) == 2
    finally:
        up.stop()
    assert time.monotonic() - started < 15
    assert f"error: {message}" in up.output, up.output
    assert not (run_dir / "processes.json").exists()  # nothing was started
    assert "Traceback" not in up.output


def test_an_engine_that_cannot_start_stops_up_at_once_with_its_error(tmp_path):
    # A checkpoint that passes up's own check (config.json, weights) but that no engine
    # can load: the engine's error stops up.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    (ckpt / "model.safetensors").write_bytes(b"")
    spec = write_yaml(tmp_path / "cluster.yaml", {
        "model": {"path": str(ckpt)}, "engine": {"dtype": "float32", "kvCacheBytes": "16Mi"},
        "prefill": {"replicas": 0}, "decode": {"replicas": 0}, "hybrid": {"replicas": 1, "threads": 1}})
    run_dir = tmp_path / "run"
    started = time.monotonic()
    up = Proc([*PDSERVE, "up", "-f", str(spec), "--port", str(free_port()), "--run-dir", str(run_dir)])
    try:
        assert up.popen.wait(60) == 1
    finally:
        up.stop()
    assert time.monotonic() - started < 60
    assert re.search(r"error: engine up-spec-hybrid-0 cannot start: it exited twice in a row with code 2 "
                     r"and the same error:\n  error: unsupported architecture \['GPT2LMHeadModel'\]",
                     up.output), up.output
    assert "Traceback" not in up.output + logs_of(run_dir)


def test_a_typo_in_the_spec_says_what_to_write_and_starts_nothing(tmp_path):
    spec = write_yaml(tmp_path / "cluster.yaml", {"model": {"preset": "tiny"}, "prefill": {"replicass": 1}})
    up = Proc([*PDSERVE, "up", "-f", str(spec), "--run-dir", str(tmp_path / "run")])
    assert up.popen.wait(30) == 2
    up.stop()
    assert "spec.prefill.replicass" in up.output and "did you mean 'replicas'?" in up.output
    assert "Traceback" not in up.output and not (tmp_path / "run").exists()


def shm_segments(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"pdserve-kv-{pid}-")]


def test_sigterm_stops_a_pd_cluster_in_order_leaving_no_traceback_and_no_shared_memory(tmp_path):
    """The spec's model is overridden by ``--model`` and its KV budget by ``--kv-cache-bytes``."""
    spec = write_yaml(tmp_path / "cluster.yaml", {
        "model": {"preset": "nosuch", "servedName": "m"}, "engine": {"dtype": "float32"},
        "prefill": {"replicas": 1, "threads": 1}, "decode": {"replicas": 1, "threads": 1},
        "kvTransfer": {"transport": "shm"}})
    port, run_dir = free_port(), tmp_path / "run"
    up = Proc([*PDSERVE, "up", "-f", str(spec), "--model", "tiny", "--kv-cache-bytes", "16Mi",
               "--port", str(port), "--run-dir", str(run_dir)])
    try:
        up.wait_for(r"starting cluster 'up-spec': model tiny in float32, 1 prefill \+ 1 decode, layerwise over shm",
                    timeout_s=30)
        up.wait_for(r"pdserve is up", timeout_s=120)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        groups = json.loads((run_dir / "processes.json").read_text())["groups"]
        pids = engine_pids(groups["nodeagent"])
        assert len(pids) == 2 and all(shm_segments(pid) for pid in pids)
        for pid in pids:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert argv[argv.index(b"--kv-cache-bytes") + 1] == b"16777216"

        up.popen.send_signal(signal.SIGTERM)
        assert up.popen.wait(60) == 0
    finally:
        up.stop()
    assert not any(is_group_alive(g) for g in groups.values())
    assert not any(shm_segments(pid) for pid in pids)
    logs = logs_of(run_dir)
    assert "Traceback" not in up.output + logs, logs
    # In order: the Coordinator and the NodeAgent were gone before the Controller stopped.
    assert "heartbeat to" not in logs and "Controller watch on" not in logs, logs


def listening_addresses(pid: int) -> set[str]:
    """The TCP addresses process ``pid`` listens on (HOST:PORT), read from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            (address, port), state, inode = fields[1].split(":"), fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
                host = socket.inet_ntop(family, raw).removeprefix("::ffff:")  # v4 mapped into v6
                found.add(f"{host}:{int(port, 16)}")
    return found


def call_code(address: str, call, metadata=()) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            call(channel, metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_up_authenticates_every_internal_call_and_listens_on_loopback_only(tmp_path):
    spec = write_yaml(tmp_path / "cluster.yaml", {
        "model": {"preset": "tiny"}, "engine": {"dtype": "float32", "kvCacheBytes": "16Mi"},
        "prefill": {"replicas": 0}, "decode": {"replicas": 0}, "hybrid": {"replicas": 1, "threads": 1}})
    port, run_dir = free_port(), tmp_path / "run"
    up = Proc([*PDSERVE, "up", "-f", str(spec), "--port", str(port), "--run-dir", str(run_dir)],
              env={"PDSERVE_CLUSTER_TOKEN": "", "PDSERVE_CLUSTER_TOKEN_FILE": ""})  # none configured
    try:
        up.wait_for(r"pdserve is up", timeout_s=120)
        token_file = run_dir / "cluster-token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text()
        assert len(token) >= 32
        groups = json.loads((run_dir / "processes.json").read_text())["groups"]
        pids = dict(groups) | {"engine": engine_pids(groups["nodeagent"])[0]}
        for name, pid in pids.items():
            assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), name
        controller = re.search(r"controller serving on (\S+)",
                               (run_dir / "controller.log").read_text()).group(1)

        def get_view(channel, metadata):
            return pb_grpc.ControllerStub(channel).GetView(pb.WatchViewRequest(), timeout=5, metadata=metadata)

        def forget(channel, metadata):
            return pb_grpc.ControllerStub(channel).ForgetCluster(pb.ForgetClusterRequest(), timeout=5,
                                                                 metadata=metadata)

        right, wrong = (("x-pdserve-token", token),), (("x-pdserve-token", "guess"),)
        assert call_code(controller, get_view) == grpc.StatusCode.UNAUTHENTICATED
        assert call_code(controller, forget) == grpc.StatusCode.UNAUTHENTICATED
        assert call_code(controller, get_view, wrong) == grpc.StatusCode.UNAUTHENTICATED
        assert call_code(controller, get_view, right) == grpc.StatusCode.OK
        with grpc.insecure_channel(controller) as channel:
            engine = get_view(channel, right).instances[0].engine_address

        def health(channel, metadata):
            return engine_pb2_grpc.EngineStub(channel).Health(engine_pb2.HealthRequest(), timeout=5,
                                                              metadata=metadata)

        assert call_code(engine, health) == grpc.StatusCode.UNAUTHENTICATED
        assert call_code(engine, health, right) == grpc.StatusCode.OK
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": "up-spec", "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text  # the Coordinator holds the token too

        for name, pid in pids.items():
            addresses = listening_addresses(pid)
            assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), (name, addresses)

        up.popen.send_signal(signal.SIGINT)
        assert up.popen.wait(30) == 0
        assert not token_file.exists()
    finally:
        up.stop()


def test_up_runs_a_kv_pool_so_one_prefill_engines_prompt_is_a_hit_on_the_other(tmp_path):
    """``kvPool.enabled``: ``pdserve up`` starts the pool's master and every engine joins
    it; round-robin prefill sends the same prompt to the other prefill engine, whose own
    cache is empty, and it reports the prompt's blocks as cached (fetched from the pool)."""
    spec = write_yaml(tmp_path / "cluster.yaml", {
        "model": {"preset": "tiny", "servedName": "tiny"},
        "engine": {"dtype": "float32", "kvCacheBytes": "16Mi", "blockSize": 16},
        "prefill": {"replicas": 2, "threads": 1}, "decode": {"replicas": 1, "threads": 1},
        "routing": {"prefillPolicy": "round_robin", "localPrefillMaxTokens": 0,
                    "loadAwareLocalPrefill": False},
        "kvPool": {"enabled": True, "segmentSize": "32Mi"}})
    port, run_dir = free_port(), tmp_path / "run"
    up = Proc([*PDSERVE, "up", "-f", str(spec), "--port", str(port), "--run-dir", str(run_dir)])
    try:
        up.wait_for(r"KV pool on 127\.0\.0\.1:\d+", timeout_s=60)
        up.wait_for(r"pdserve is up", timeout_s=180)
        prompt = "a system prompt every request shares, " * 12  # 456 tokens: 28 full blocks
        cached = []
        for _ in range(2):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            time.sleep(1.0)  # the first prefill engine's puts reach the pool
        assert cached == [0, 28 * 16], logs_of(run_dir)[-3000:]
        up.signal(signal.SIGINT)
        assert up.popen.wait(30) == 0
    finally:
        up.stop()


def test_up_runs_a_tensor_parallel_prefill_engine_feeding_a_tp1_decode_engine(tmp_path):
    """``examples/tensor-parallel-pd.yaml`` as a user runs it: the prefill engine runs two
    ranks (two processes), every request crosses from them into the TP=1 decode engine,
    and the Coordinator's answer is what one TP=1 engine generates for the prompt."""
    from pdserve.api.sampling import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    prompt = [(11 * i + 5) % 250 + 1 for i in range(70)]
    reference = LLMEngine(EngineConfig(model="tiny", dtype="float32", kv_transport="none"))
    try:
        [expected] = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
        expected_text = reference.tokenizer.decode(expected)
    finally:
        reference.close()
    port, run_dir = free_port(), tmp_path / "run"
    example = Path(__file__).parents[2] / "examples" / "tensor-parallel-pd.yaml"
    up = Proc([*PDSERVE, "up", "-f", str(example), "--port", str(port), "--run-dir", str(run_dir)])
    try:
        up.wait_for(r"pdserve is up", timeout_s=180)
        for _ in range(2):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           headers={"x-pdserve-timings": "1"},
                           json={"model": "tp-pd", "prompt": prompt, "max_tokens": 8,
                                 "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected_text
            timings = r.json()["pdserve_timings"]
            assert timings["prefill_compute_s"] > 0 and timings["kv_transfer_s"] is not None, timings
        groups = json.loads((run_dir / "processes.json").read_text())["groups"]
        roles = {}
        for pid in engine_pids(groups["nodeagent"]):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            roles[argv[argv.index(b"--role") + 1].decode()] = pid
        assert sorted(roles) == ["decode", "prefill"]
        children = Path(f"/proc/{roles['prefill']}/task/{roles['prefill']}/children").read_text()
        ranks = [pid for pid in children.split()  # not multiprocessing's resource tracker
                 if b"--multiprocessing-fork" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 1, children  # rank 1; rank 0 is the engine itself
        up.signal(signal.SIGINT)
        assert up.popen.wait(30) == 0
    finally:
        up.stop()


def test_a_cluster_whose_stdout_reader_is_gone_still_stops_everything(tmp_path):
    """``pdserve up`` under a parent that died (its stdout a pipe nobody reads, as under
    ``pdserve bench --compare`` killed): SIGTERM still stops every process it started."""
    port, run_dir = free_port(), tmp_path / "run"
    up = subprocess.Popen([*PDSERVE, "up", "--model", "tiny", "--kv-cache-bytes", "16Mi",
                           "--port", str(port), "--run-dir", str(run_dir)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in up.stdout:
            if "pdserve is up" in line or time.monotonic() > deadline:
                break
        assert "pdserve is up" in line, line
        groups = json.loads((run_dir / "processes.json").read_text())["groups"]
        assert groups and all(is_group_alive(g) for g in groups.values())
        up.stdout.close()  # the reader is gone: every later line up prints has nowhere to go
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    finally:
        if up.poll() is None:
            up.kill()
    deadline = time.monotonic() + 30
    while any(is_group_alive(g) for g in groups.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(is_group_alive(g) for g in groups.values())
