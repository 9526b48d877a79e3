"""The engine command line follows the cluster spec and the instance's pool; engines are
pinned to their pool's cores; restarts back off and reset; simulated engines of a pool
share processes, each still reported as its own engine."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from pdserve.api import PDCluster, parse_manifest
from pdserve.api.manifest import default_cluster
from pdserve.nodeagent.agent import Agent, AgentSettings, SupervisedEngine
from pdserve.nodeagent.cli import engine_cpus, share_processes
from pdserve.nodeagent.engine_args import build_engine_argv, with_role
from pdserve.nodeagent.process import Backoff, EngineProcess
from pdserve.runtime.security import SecuritySettings


def test_argv_from_the_default_cluster():
    argv = build_engine_argv(default_cluster(), "decode", ["--threads", "1"])
    flags = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert argv[3] == "engine" and argv[-2:] == ["--threads", "1"]
    assert flags["--model"] == "smollm2" and flags["--role"] == "decode" and flags["--port"] == "0"
    assert flags["--kv-transport"] == "tcp" and flags["--kv-cache-bytes"] == str(512 * 2**20)
    assert with_role(argv, "hybrid")[argv.index("--role") + 1] == "hybrid"


def test_backoff_doubles_up_to_the_cap():
    b = Backoff(base_s=0.5, max_s=3.0)
    assert [b.delay_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def pools_cluster() -> PDCluster:
    return parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                           "metadata": {"name": "c"}, "spec": {
                               "model": {"preset": "tiny"},
                               "engine": {"prefillChunkTokens": 256},
                               "prefill": {"replicas": 1, "threads": 2, "cpuAffinity": [0]},
                               "decode": {"replicas": 1},
                               "hybrid": {"replicas": 2, "threads": 1, "cpuAffinity": [0, 1]}}})


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_each_instance_gets_its_pools_threads_and_the_cluster_chunk():
    c = pools_cluster()
    hybrid, prefill, decode = (build_engine_argv(c, pool) for pool in ("hybrid", "prefill", "decode"))
    assert (flag(hybrid, "--role"), flag(hybrid, "--threads")) == ("hybrid", "1")
    assert (flag(prefill, "--role"), flag(prefill, "--threads")) == ("prefill", "2")
    assert flag(decode, "--threads") is None  # unset: the engine's default
    assert {flag(a, "--prefill-chunk-tokens") for a in (hybrid, prefill, decode)} == {"256"}
    assert flag(build_engine_argv(default_cluster(), "decode"), "--prefill-chunk-tokens") is None
    # a raw --engine-arg comes last, so it wins over the spec
    assert build_engine_argv(c, "hybrid", ["--threads", "4"])[-2:] == ["--threads", "4"]


def test_engine_cpus_follow_the_pool_rule_and_need_pool_named_ids(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    c = pools_cluster()
    assert engine_cpus(c, "c-hybrid-0", "hybrid") == (0,)
    assert engine_cpus(c, "c-hybrid-1", "hybrid") == (1,)
    assert engine_cpus(c, "c-prefill-0", "prefill") == (0,)
    assert engine_cpus(c, "c-decode-0", "decode") == ()  # no cpuAffinity: not pinned
    with pytest.raises(SystemExit, match="c-hybrid-<ordinal>"):
        engine_cpus(c, "my-engine", "hybrid")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    with pytest.raises(SystemExit, match=r"core\(s\) \[0\] are not available"):
        engine_cpus(c, "c-hybrid-0", "hybrid")


@pytest.mark.asyncio
async def test_a_pinned_engine_process_runs_on_its_cores_only(tmp_path):
    """The supervisor applies the affinity in the child: a stand-in engine writes it down."""
    core = min(os.sched_getaffinity(0))
    out = tmp_path / "cores"
    script = (f"import os, time; open({str(out)!r}, 'w').write(repr(sorted(os.sched_getaffinity(0)))); "
              "print('serving model x on 127.0.0.1:1', flush=True); time.sleep(30)")
    proc = EngineProcess("e", lambda: ([sys.executable, "-c", script], {}), Backoff(), lambda: None,
                         echo=False, cpus=(core,))
    task = asyncio.create_task(proc.supervise())
    for _ in range(200):
        if proc.state == "running":
            break
        await asyncio.sleep(0.05)
    assert proc.state == "running" and out.read_text() == f"[{core}]"
    await proc.stop()
    await asyncio.wait_for(task, 10)
    assert proc._proc.returncode is not None  # reaped


def test_a_simulate_block_runs_simulated_engines_with_the_fields_it_sets():
    def cluster(spec: dict) -> PDCluster:
        return parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                               "metadata": {"name": "c"}, "spec": {
                                   "model": {"preset": "small"}, "prefill": {"replicas": 1},
                                   "decode": {"replicas": 1}, **spec}})

    argv = build_engine_argv(cluster({"engine": {"simulate": {"prefillPerTokenMs": 0.25}}}), "decode")
    assert "--simulate" in argv and flag(argv, "--sim-prefill-per-token-ms") == "0.25"
    assert "--sim-decode-base-ms" not in argv  # unset: the engine's default
    shared = build_engine_argv(cluster({"engine": {"simulate": {"perProcess": 4}}}), "decode")
    assert "--simulate" in shared and not any("per-process" in a for a in shared)  # the agent's, not the engine's
    assert "--simulate" not in build_engine_argv(cluster({}), "decode")
    with pytest.raises(ValueError, match="simulated engines are embedded engines that move KV over tcp"):
        cluster({"engine": {"simulate": {}}, "kvTransfer": {"transport": "shm"}})


def test_simulated_engines_of_a_pool_share_processes_in_their_current_roles():
    c = parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster", "metadata": {"name": "c"},
                        "spec": {"model": {"preset": "small"}, "engine": {"simulate": {"perProcess": 3}},
                                 "prefill": {"replicas": 2}, "decode": {"replicas": 4}}})
    instances = [SupervisedEngine(f"c-{pool}-{i}", pool, pool, build_engine_argv(c, pool))
                 for pool, n in (("prefill", 2), ("decode", 4)) for i in range(n)]
    share_processes(instances, c.spec.engine.simulate.per_process)
    agent = Agent(AgentSettings(), instances, SecuritySettings())
    # a pool never shares a process with another; each process holds at most perProcess
    assert [p.num_engines for p in agent.processes] == [2, 3, 1]
    assert [i.index for i in instances] == [0, 1, 0, 1, 2, 0]
    assert agent.processes[1].instance_id == "c-decode-0..c-decode-2"
    argvs = [p._command()[0] for p in agent.processes]
    assert [flag(a, "--roles") for a in argvs] == ["prefill,prefill", "decode,decode,decode", None]
    assert flag(argvs[2], "--role") == "decode"  # alone: a plain engine

    instances[3].role = "prefill"  # switched in place: a relaunch starts it in its new role
    assert flag(agent.processes[1]._command()[0], "--roles") == "decode,prefill,decode"
    shared = agent.processes[1]
    shared.addresses, shared.state = ["h:1", "h:2", "h:3"], "running"
    assert [i.report().engine_address for i in instances[2:5]] == ["h:1", "h:2", "h:3"]
    assert [i.report().engine_address for i in instances[:2]] == ["", ""]  # not serving yet
