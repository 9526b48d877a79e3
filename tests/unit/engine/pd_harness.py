"""In-process P/D pairs over real transports, stepped by hand so tests can look inside."""

from __future__ import annotations

import time

import torch

from pdserve.engine.config import EngineConfig
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
