"""In-process P/D pairs over real transports, stepped by hand so tests can look inside."""

from __future__ import annotations

import ctypes
import multiprocessing
import time
import types

import torch

from pdserve.engine.config import EngineConfig, kv_heads_of
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.llm_engine import LLMEngine

MODES = ("pull", "push", "layerwise")
TRANSPORTS = ("tcp", "shm", "mooncake", "nixl")  # every transport, in the correctness tests
COMMON = dict(model="tiny", num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)


def make_engine(role: str, transport: str = "tcp", **overrides) -> LLMEngine:
    cfg = {**COMMON, "role": role, "kv_transport": transport, "kv_transfer_timeout_s": 3.0,
           "kv_descriptor_timeout_s": 3.0, "kv_done_timeout_s": 6.0, "kv_abort_ack_timeout_s": 1.0,
           **overrides}
    return LLMEngine(EngineConfig(**cfg))


def submit_pair(p: LLMEngine, d: LLMEngine, rid: str, prompt, params, mode: str) -> None:
    """What the Coordinator does: the same request to D and P with one transfer id."""
    xid = f"x-{rid}"
    d.add_request(f"d-{rid}", prompt, params,
                  kv_transfer=KVTransferParams("decode", mode, xid, p.connector.endpoint))
    p.add_request(f"p-{rid}", prompt, params,
                  kv_transfer=KVTransferParams("prefill", mode, xid, d.connector.endpoint))


def run_until_idle(*engines: LLMEngine, timeout_s: float = 20.0, on_outputs=None) -> dict:
    """Step every engine until none has work; returns request id -> list of outputs."""
    outputs: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while any(e.has_unfinished for e in engines):
        assert time.monotonic() < deadline, "engines did not finish in time"
        for e in engines:
            for out in e.step():
                outputs.setdefault(out.request_id, []).append(out)
                if on_outputs is not None:
                    on_outputs(e, out)
        time.sleep(0.0005)
    return outputs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def prompt_kv(engine: LLMEngine, block_table: list[int], num_tokens: int) -> torch.Tensor:
    """The KV of positions [0, num_tokens) of a request: [layers, 2, tokens, heads, dim]."""
    kv = engine.runner.kv_cache
    bs = engine.block_manager.block_size
    slots = torch.tensor([block_table[p // bs] * bs + p % bs for p in range(num_tokens)])
    flat = kv.view(kv.shape[0], 2, -1, kv.shape[-2], kv.shape[-1])
    return flat[:, :, slots].clone()


def assert_all_free(*engines: LLMEngine) -> None:
    for e in engines:
        bm = e.block_manager
        assert bm.num_free_blocks == bm.num_blocks, f"{e.config.role}: {bm.num_used_blocks} blocks leaked"
        assert not e.requests and not e.scheduler.running and not e.scheduler.waiting
        if e.connector is not None:
            assert e.connector.num_pending == 0


def full_kv(engine: LLMEngine, block_table: list[int], num_tokens: int) -> torch.Tensor:
    """Like ``prompt_kv``, over every tensor-parallel rank: [layers, 2, tokens, all heads,
    dim], each head read from the lowest rank holding it. With a KV transport the ranks'
    caches are one region (``kv_transfer.setup.kv_allocator``), read here through its
    layout; without one only rank 0's heads are in this process."""
    layout = engine.connector.layout if engine.connector is not None else None
    if layout is None or layout.tp_size == 1:
        return prompt_kv(engine, block_table, num_tokens)
    kv = engine.runner.kv_cache
    region = (ctypes.c_char * layout.region_bytes).from_address(layout.base_addr)
    slabs = torch.frombuffer(region, dtype=kv.dtype).view(layout.tp_size, *kv.shape)
    bs = layout.block_size
    slots = torch.tensor([block_table[p // bs] * bs + p % bs for p in range(num_tokens)])
    heads = []
    for h in range(layout.num_kv_heads):
        rank = next(r for r in range(layout.tp_size)
                    if kv_heads_of(r, layout.tp_size, layout.num_kv_heads)[0] <= h
                    < sum(kv_heads_of(r, layout.tp_size, layout.num_kv_heads)))
        first = kv_heads_of(rank, layout.tp_size, layout.num_kv_heads)[0]
        flat = slabs[rank].reshape(kv.shape[0], 2, -1, kv.shape[-2], kv.shape[-1])
        heads.append(flat[:, :, slots, h - first])
    return torch.stack(heads, dim=3).clone()


class EngineProcess:
    """One engine in a process of its own, driven over a pipe: a tensor-parallel engine
    joins torch.distributed's one default group per process, so a P and a D that both
    shard cannot share the test's process. Offers what the harness's functions use
    (``add_request``, ``step``, ``has_unfinished``, ``connector.endpoint``, ``stats``,
    ``close``) plus ``full_kv`` of a running request and ``assert_all_free``."""

    def __init__(self, role: str, transport: str = "tcp", **overrides) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_process_main, args=(role, transport, overrides, theirs),
                                 name=f"test-engine-{role}")
        self._proc.start()
        theirs.close()
        self.connector = types.SimpleNamespace(endpoint=self._call("endpoint"))
        self.config = types.SimpleNamespace(role=role)

    def _call(self, method: str, *args, **kwargs):
        self._conn.send((method, args, kwargs))
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def add_request(self, *args, **kwargs) -> None:
        self._call("add_request", *args, **kwargs)

    def step(self) -> list:
        return self._call("step")

    @property
    def has_unfinished(self) -> bool:
        return self._call("has_unfinished")

    def stats(self):
        return self._call("stats")

    def full_kv(self, request_id: str) -> torch.Tensor:
        return self._call("full_kv", request_id)

    def assert_all_free(self) -> None:
        self._call("assert_all_free")

    def close(self) -> None:
        if self._proc.is_alive():
            self._call("close")
        self._proc.join(timeout=30)
        assert self._proc.exitcode == 0, f"engine process exited with {self._proc.exitcode}"


def _engine_process_main(role: str, transport: str, overrides: dict, conn) -> None:
    engine = make_engine(role, transport, **overrides)

    def kv_of(request_id: str) -> torch.Tensor:
        req = next(r for r in engine.scheduler.running if r.request_id == request_id)
        return full_kv(engine, req.block_table, req.num_prompt_tokens)

    calls = {
        "endpoint": lambda: engine.connector.endpoint if engine.connector else None,
        "add_request": engine.add_request,
        "step": lambda: list(engine.step()),
        "has_unfinished": lambda: engine.has_unfinished,
        "stats": engine.stats,
        "full_kv": kv_of,
        "assert_all_free": lambda: assert_all_free(engine),
    }
    while True:
        method, args, kwargs = conn.recv()
        if method == "close":
            engine.close()
            conn.send((True, None))
            return
        try:
            conn.send((True, calls[method](*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's process
            conn.send((False, exc))
