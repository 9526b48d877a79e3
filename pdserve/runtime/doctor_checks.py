"""The cluster-level checks of ``pdserve doctor``, shared by the CLI
(``pdserve.local.doctor``) and the operator (``pdserve.operator.doctor``, the
PDCluster's ``Doctor`` condition): they need the Controller's view of the routable
instances and the network, no local file.

``check_engines`` asks every engine of the view for Health and Stats (serving the
model, KV budget against the max model length, clock skew to this host), compares
the P and D compatibility hashes and runs a ProbePeer test transfer for every
P -> D pair. A vLLM engine (a ``vllm://`` address) is asked over HTTP
(``vllm_server.VllmClient``): the same rows, its version against the other vLLM
engines', and for a pair a test request through it (``VllmServer.test_request``: P's
side channel accepts a connection, and D takes a fresh prompt from P over the
connector). Each finding is a ``Check`` row (pass / warn / fail, what was found, how
to fix it); nothing raises but cancellation. Every call has a deadline, so one call of
``check_engines`` ends within about ``RPC_TIMEOUT_S * 2 + VLLM_TEST_TIMEOUT_S + 3``
seconds whatever the engines do (``VLLM_RPC_TIMEOUT_S * 3 + VLLM_TEST_TIMEOUT_S + 3``
with vLLM engines).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pdserve.api.proto import controller_pb2 as cpb
from pdserve.api.proto import engine_pb2 as pb
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.security import SecuritySettings
from pdserve.runtime.vllm_server import VllmClient, VllmUnavailable, is_vllm_address

PASS, WARN, FAIL = "pass", "warn", "fail"
RPC_TIMEOUT_S = 5.0
# A vLLM serves /health and /metrics from the event loop of its API server, which a busy
# engine (or a host whose cores NIXL's progress threads keep busy) answers late: busy is
# not dead, so vLLM gets longer.
VLLM_RPC_TIMEOUT_S = 15.0
PROBE_TIMEOUT_S = 5.0
VLLM_TEST_TIMEOUT_S = 15.0  # a vLLM pair's whole test request: two computations of a short prompt
SKEW_WARN_S, SKEW_FAIL_S = 1.0, 30.0  # clock skew to an engine: warn, fail


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass | warn | fail
    detail: str
    fix: str = ""


async def check_engines(instances: Sequence[cpb.InstanceView], security: SecuritySettings) -> list[Check]:
    """Every engine of ``instances`` (the Controller's view), and every P -> D pair.
    ``security`` is what the engines accept (the cluster token, TLS)."""
    clients = {i.instance_id: VllmClient(i.engine_address) if is_vllm_address(i.engine_address)
               else EngineClient(i.engine_address, security) for i in instances}
    checks: list[Check] = []
    try:
        answers = await asyncio.gather(*(_engine_facts(clients[i.instance_id]) for i in instances))
        for inst, (health, stats, skew_s, error) in zip(instances, answers, strict=True):
            checks += check_engine(inst, health, stats, skew_s, error)
        checks += check_hashes(instances)
        vllm = [c for c in clients.values() if isinstance(c, VllmClient)]
        if vllm:
            versions = await asyncio.gather(*(c.version(VLLM_RPC_TIMEOUT_S) for c in vllm),
                                            return_exceptions=True)
            checks.append(check_vllm_versions([c.address for c in vllm], versions))
        pairs = [(p, d) for p in instances if p.role == "prefill" for d in instances if d.role == "decode"]
        probes = await asyncio.gather(*(_probe_pair(clients[p.instance_id], clients[d.instance_id], d)
                                        for p, d in pairs), return_exceptions=True)
        checks += [check_probe(p, d, answer) for (p, d), answer in zip(pairs, probes, strict=True)]
    finally:
        for client in clients.values():
            await client.close()
    return checks


async def _probe_pair(p, d, d_view) -> pb.ProbePeerResponse:
    """P's test transfer to D: the embedded engine's ProbePeer, or a test request
    through a vLLM pair."""
    if isinstance(p, VllmClient) and isinstance(d, VllmClient):
        try:
            return await asyncio.wait_for(p.test_request(d, VLLM_TEST_TIMEOUT_S), VLLM_TEST_TIMEOUT_S)
        except TimeoutError:
            return pb.ProbePeerResponse(ok=False, reason=f"no test request through the pair in "
                                                         f"{VLLM_TEST_TIMEOUT_S:g} s")
    if isinstance(p, VllmClient) or isinstance(d, VllmClient):
        return pb.ProbePeerResponse(ok=False, reason="a vLLM engine cannot pair with an embedded one")
    return await p.probe_peer(d_view.kv_endpoint, test_transfer=True, timeout_s=PROBE_TIMEOUT_S)


async def _engine_facts(client: EngineClient):
    """(health, stats, clock skew in s or None, error or "")."""
    try:
        timeout_s = VLLM_RPC_TIMEOUT_S if isinstance(client, VllmClient) else RPC_TIMEOUT_S
        sent = time.time()
        health = await client.health(timeout_s=timeout_s)
        received = time.time()
        stats = await client.stats(timeout_s=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return None, None, None, f"{exc.code().name}: {exc.details()}"
    except VllmUnavailable as exc:
        return None, None, None, str(exc)
    skew = health.time_unix_s - (sent + received) / 2 if health.time_unix_s else None
    return health, stats, skew, ""


def check_engine(inst, health, stats, skew_s: float | None, error: str) -> list[Check]:
    """One engine's rows: serving, KV budget, clock."""
    name = f"engine {inst.instance_id}"
    if error:
        return [Check(name, FAIL, f"{inst.engine_address} does not answer Health/Stats: {error}",
                      "check the engine's log; restart it")]
    rows = [Check(name, PASS if health.serving and health.model else FAIL,
                  f"{health.role} serving model {health.model!r} on {health.device}, "
                  f"KV {health.kv_transport} at {health.kv_endpoint or '-'}")]
    capacity = stats.num_kv_blocks_total * stats.block_size
    if health.max_model_len and capacity < health.max_model_len:
        rows.append(Check(f"{name} kv budget", FAIL,
                          f"{stats.num_kv_blocks_total} blocks x {stats.block_size} = {capacity} tokens "
                          f"< max model length {health.max_model_len}",
                          "raise spec.engine.kvCacheBytes (or lower spec.engine.maxModelLen)"))
    else:
        rows.append(Check(f"{name} kv budget", PASS,
                          f"{capacity} tokens of KV >= max model length {health.max_model_len or '?'}"))
    if is_vllm_address(inst.engine_address):
        pass  # vLLM does not tell its clock: nothing to compare
    elif skew_s is None:
        rows.append(Check(f"{name} clock", WARN, "the engine reports no time; clock skew not checked",
                          "upgrade the engine"))
    else:
        status = FAIL if abs(skew_s) >= SKEW_FAIL_S else WARN if abs(skew_s) >= SKEW_WARN_S else PASS
        rows.append(Check(f"{name} clock", status, f"skew {skew_s:+.3f} s to this host",
                          "" if status == PASS else "run NTP (chrony) on both hosts"))
    return rows


def check_vllm_versions(addresses: list[str], versions: list) -> Check:
    """One vLLM version on every vLLM engine: P and D of different versions may not agree
    on the KV connector's wire."""
    seen = {a: v for a, v in zip(addresses, versions, strict=True) if isinstance(v, str)}
    failed = [f"{a} ({v})" for a, v in zip(addresses, versions, strict=True) if not isinstance(v, str)]
    if failed:
        return Check("vllm versions", FAIL, "no version from " + ", ".join(failed),
                     "check the engine's log; restart it")
    if len(set(seen.values())) > 1:
        return Check("vllm versions", FAIL, "versions differ: " + ", ".join(f"{a}={v}" for a, v in seen.items()),
                     "run one vLLM version on every engine (the image or spec.engine.vllm.command)")
    return Check("vllm versions", PASS, f"every vLLM engine runs {next(iter(seen.values()))}")


def check_hashes(instances) -> list[Check]:
    hashes = {i.kv_compat_hash for i in instances if i.role in ("prefill", "decode")}
    if len(hashes) <= 1:
        return [Check("kv compatibility", PASS, f"P and D hashes match ({next(iter(hashes), 'none')})")]
    listed = ", ".join(f"{i.instance_id}={i.kv_compat_hash}" for i in instances)
    return [Check("kv compatibility", FAIL, f"hashes differ: {listed}",
                  "run one model, dtype and block size on every P and D engine")]


def check_probe(p, d, answer) -> Check:
    """The row of P ``p``'s ProbePeer of D ``d``: its reply, or the exception raised."""
    name = f"kv {p.instance_id} -> {d.instance_id}"
    if isinstance(answer, grpc.aio.AioRpcError):
        return Check(name, FAIL, f"{p.instance_id} did not run the probe: {answer.code().name}: "
                                 f"{answer.details()}", "upgrade or restart the prefill engine")
    if isinstance(answer, BaseException):
        return Check(name, FAIL, f"probe failed: {answer}", "")
    if not answer.ok:
        return Check(name, FAIL, answer.reason,
                     "open the D's KV port to the P (firewall, NetworkPolicy), check both run one model")
    if not answer.transfer_bytes:  # a vLLM pair: its test request says what it moved
        return Check(name, PASS, answer.reason)
    return Check(name, PASS, f"handshake {answer.handshake_s * 1e3:.1f} ms, test transfer of "
                             f"{answer.transfer_bytes} bytes {answer.transfer_s * 1e3:.1f} ms over "
                             f"{answer.transport}")
