"""The engine: admits requests, runs ``step()``, reports outputs and stats.

Single-threaded by design: whoever owns the engine (the gRPC server's loop thread,
the CLI, a test) calls ``add_request``/``abort_request``/``step`` from one thread.
Bad input is refused in ``add_request`` with ``EngineInputError`` and never reaches
the step loop; a request that fails later ends with ``FINISHED_ERROR`` while the
others go on. The pieces: ``Scheduler`` (batches, token bookkeeping, the one owner
of blocks), ``ModelRunner`` (torch, built by ``load_model_parts``; a simulated engine
has ``sim.SimRunner`` in its place and never imports torch), ``OutputProcessor`` (text,
outputs) and, with a KV transport, a ``KVConnector`` reached only through its interface.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from pdserve.api.proto.engine_pb2 import StatsResponse
from pdserve.api.sampling import SamplingParams
from pdserve.engine.admission import (
    EngineInputError,
    EngineUnavailable,
    check_kv_transfer,
    check_prompt,
    check_sampling,
    start_guided,
)
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.kv_transfer.probe import ProbeResult
from pdserve.engine.kv_transfer.setup import build_connector, kv_allocator
from pdserve.engine.output import OutputProcessor, RequestOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sim import build_sim_model
from pdserve.runtime.model_source import AUTO, auto_dtype

log = logging.getLogger(__name__)
ROLE_GRACE_S = 3.0  # after a role switch, the old role's legs are still admitted this long


class ModelParts(NamedTuple):
    """What runs the model, built at start-up: a ``ModelRunner`` (``load_model_parts``) or
    a simulated engine's ``SimRunner`` (``sim.build_sim_model``)."""

    runner: object  # execute(batch, kv_ready), kv_cache, kv_cache_bytes, num_blocks
    model_config: ModelConfig
    tokenizer: object
    num_blocks: int
    tp_workers: object = None  # parallel.TPWorkers, with tensor parallelism
    kv_segment: object = None  # the KV cache's shared-memory segment, closed with the engine


def load_model_parts(config: EngineConfig) -> ModelParts:
    """The model (rank 0 of it) and its KV cache. torch is imported here, not at the top,
    so a simulated engine's process never loads it."""
    from pdserve.engine.loader import load_rank0, model_config
    from pdserve.engine.parallel import TPWorkers
    from pdserve.engine.runner import ModelRunner
    from pdserve.runtime.gguf_file import parsed_once

    with parsed_once():  # the check and the load read one parse of a GGUF file
        config.check_model(model_config(config.model))
        # With tensor parallelism this process is rank 0; the other ranks start first.
        tp_workers = TPWorkers(config) if config.tensor_parallel_size > 1 else None
        try:
            model, tokenizer, num_blocks = load_rank0(config)
            allocator = kv_allocator(config)
            runner = ModelRunner(model, num_blocks, config.block_size, allocator,
                                 tp_workers.send_step if tp_workers else None)
            if tp_workers is not None:
                tp_workers.start_cache(num_blocks, config.block_size, getattr(allocator, "fd", None))
        except BaseException:
            if tp_workers is not None:
                tp_workers.close()
            raise
    if config.compile_prefill:  # after the parse is dropped: the compile takes seconds
        from pdserve.engine.compiled import enable  # torch._dynamo: only where it runs

        enable(model)
    return ModelParts(runner, model.config, tokenizer, num_blocks, tp_workers,
                      getattr(allocator, "segment", None))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.dtype == AUTO:  # the checkpoint's (model_source.auto_dtype)
            config.dtype, why = auto_dtype(config.model)
            log.info("dtype auto: %s (%s)", config.dtype, why)
        config.validate()
        parts = (ModelParts(*build_sim_model(config)) if config.simulate is not None
                 else load_model_parts(config))
        self.config = config
        self.runner, self.tp_workers, self._kv_segment = parts.runner, parts.tp_workers, parts.kv_segment
        self.model_config = cfg = parts.model_config
        self.tokenizer = tokenizer = parts.tokenizer
        num_blocks = parts.num_blocks
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_events = self.block_manager.events = KVEventLog()
        self.connector = build_connector(config, cfg, self.runner, self.block_manager)
        self.kv_pool = None
        if config.kv_pool:  # kv_pool.py imports torch: only an engine that shares KV loads it
            from pdserve.engine.kv_pool import attach_pool

            self.kv_pool = attach_pool(config, cfg, self.runner, self.block_manager)
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        # Most tokens one request may hold: model length and the whole KV cache.
        self.token_capacity = min(self.max_model_len, num_blocks * config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.prefill_chunk_tokens,
                                   self.token_capacity, self.connector)
        self.output = OutputProcessor(tokenizer)
        self.grammars = None  # a simulated engine serves no constrained decoding
        if config.simulate is None:
            from pdserve.engine.guided import Grammars  # torch and llguidance

            self.grammars = Grammars(tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        self.requests: dict[str, Request] = self.output.requests  # live, by request id
        self.last_step_idle = False
        self.draining = False
        self._old_role, self._old_role_until = "", 0.0  # still admitted after a switch (``set_role``)
        log.info(
            "engine ready: model=%s role=%s device=%s dtype=%s kv_blocks=%d (%.1f MiB) block_size=%d",
            cfg.name, config.role, config.device, config.dtype, num_blocks,
            self.runner.kv_cache_bytes / 2**20, config.block_size,
        )

    # -- admission -----------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        prompt: str | None = None,
        kv_transfer: KVTransferParams | None = None,
        arrival_s: float | None = None,
    ) -> Request:
        """Validate and queue a request. Raises ``EngineInputError`` on bad input.

        ``arrival_s`` (monotonic) is when the request reached the engine's process; the
        loop stamps it on receipt, so queue time includes waiting for a running step.

        With ``kv_transfer`` the request is one leg of a disaggregated request: as
        ``prefill`` it stops after the first token and hands its KV to the peer; as
        ``decode`` it waits for the peer's KV and then decodes.
        """
        params = sampling_params or SamplingParams()
        if self.draining:
            raise EngineUnavailable("the engine is draining and admits no new requests")
        if kv_transfer is not None:
            old_role = self._old_role if time.monotonic() < self._old_role_until else ""
            check_kv_transfer(kv_transfer, params, self.config.role, self.connector, old_role)
        if request_id in self.requests:
            raise EngineInputError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise EngineInputError("the prompt is empty: send prompt text or prompt token ids")
            if self.tokenizer is None:
                raise EngineInputError("this model has no tokenizer: send prompt token ids")
            prompt_token_ids = self.tokenizer.encode(prompt, add_bos=True)
        vocab, bm = self.model_config.vocab_size, self.block_manager
        prompt_token_ids = check_prompt(prompt_token_ids, vocab, self.token_capacity,
                                        self.max_model_len, bm.num_blocks * bm.block_size)
        params = check_sampling(params, vocab)
        guided = start_guided(self.grammars, params, prompt_token_ids)
        request = Request(request_id, prompt_token_ids, params, self.model_config.eos_token_ids,
                          arrival_s)
        request.guided = guided
        self.output.add(request)
        if kv_transfer is None or self.connector.admit(request, kv_transfer):
            self.scheduler.add(request)
        # else: the connector hands it back (P: destination reserved; D: KV arrived)
        return request

    def abort_request(self, request_id: str) -> bool:
        """End a request and free its blocks. Idempotent; unknown ids return False."""
        return self.end_request(request_id, RequestStatus.FINISHED_ABORTED) is not None

    def end_request(self, request_id: str, status: RequestStatus,
                    error: str | None = None) -> RequestOutput | None:
        """End a live request from outside the step (abort, failure, shutdown): its blocks
        are freed, or kept by the connector until no write can land. Returns the final
        output its stream ends with; None for an unknown or finished id (idempotent)."""
        request = self.output.pop(request_id)
        if request is None or not self.scheduler.finish(request, status, error):
            return None
        return self.output.output(request, [], with_timings=False)

    def set_role(self, role: str) -> None:
        """Switch role in place, on the Controller's command. New legs are admitted in the
        new role at once; the requests and transfers in flight finish in the role they
        were admitted in (a decode leg waiting for its KV, a stream, a prefill sending its
        KV): legs go by their own ``KVTransferParams.role``, and the engine runs both
        kinds of step. A switch no longer waits for the old role's streams to end. For
        ``ROLE_GRACE_S`` the old role's legs are still admitted: a Coordinator routes by
        a view that hears of the switch a heartbeat later."""
        if role not in ("prefill", "decode", "hybrid"):
            raise EngineInputError(f"role must be prefill, decode or hybrid, got {role!r}")
        if role != "hybrid" and self.connector is None:
            raise EngineInputError(f"a {role} engine needs a KV transport (kv_transport=none)")
        log.info("role %s -> %s (%d requests in flight finish in theirs)", self.config.role, role,
                 self.scheduler.num_unfinished)
        if role != self.config.role:
            self._old_role, self._old_role_until = self.config.role, time.monotonic() + ROLE_GRACE_S
        self.config.role = role

    def probe_peer(self, peer: str, test_transfer: bool, timeout_s: float, done) -> None:
        """The ProbePeer RPC (through ``EngineLoop.call``): starts a connector probe;
        ``done(ProbeResult)`` is called on this thread when it ends."""
        if self.connector is None:
            done(ProbeResult(False, "this engine has no KV transport (kv_transport=none)"))
            return
        self.connector.probe(peer, test_transfer, timeout_s, done)

    def service_kv(self) -> list[RequestOutput]:
        """Run the connector's message handling once without a model step: called by the
        loop when a control message woke an idle engine (handshakes, probes)."""
        return self._apply_kv_events()

    @property
    def has_unfinished(self) -> bool:
        """Work left: requests to schedule, or KV transfers to drive."""
        if self.scheduler.num_unfinished:
            return True
        return self.connector is not None and self.connector.num_pending > 0

    # -- the step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Apply KV events, schedule, run the model once, sample, report what changed."""
        outputs = self._apply_kv_events()
        if any(o.new_token_ids for o in outputs):
            return outputs  # D's first tokens (KV exposed) go out now, not after a decode step
        batch = self.scheduler.schedule()
        self.last_step_idle = not batch and not outputs
        if batch:
            hook = self.connector.layer_hook(batch.items) if self.connector is not None else None
            num_prefill = sum(n for r, n in batch.items if r.num_computed_tokens < r.num_prompt_tokens or n > 1)
            started = time.perf_counter()
            sampled = self.runner.execute(batch, hook)
            changes = self.scheduler.postprocess(batch, sampled, self.output.detokenize)
            self.scheduler.counters.step(num_prefill, len(batch.items), time.perf_counter() - started)
            outputs += self.output.build(changes)
        return outputs

    def _apply_kv_events(self) -> list[RequestOutput]:
        if self.connector is None:
            return []
        events = self.connector.collect_events()
        return self.output.build(self.scheduler.apply_kv_events(events, self.output.detokenize))

    # -- conveniences ----------------------------------------------------------

    def stats(self) -> StatsResponse:
        """A snapshot in the wire type (the loop publishes one after every step)."""
        bm, sched = self.block_manager, self.scheduler
        kv = self.connector.stats() if self.connector is not None else {"kv_transport": "none"}
        return StatsResponse(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_kv_blocks_total=bm.num_blocks, num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_free=bm.num_free_blocks, kv_cache_bytes=self.runner.kv_cache_bytes,
            block_size=bm.block_size, prefix_cache_query_tokens=bm.num_prefix_query_tokens,
            prefix_cache_hit_tokens=bm.num_prefix_hit_tokens,
            num_preemptions=sched.num_preemptions,
            num_prompt_tokens_total=sched.num_prompt_tokens_total,
            num_generation_tokens_total=sched.num_generation_tokens_total,
            **sched.counters.fields(), **self._demand(), role=self.config.role, model=self.model_config.name, **kv,
            **(self.kv_pool.stats_fields() if self.kv_pool is not None else {}),
        )

    def _demand(self) -> dict[str, int]:
        """What is coming, as ``StatsResponse`` gauges: the prompt tokens waiting to be
        prefilled here, and the blocks the unfinished requests here will hold at their
        longest (a prefill leg its prompt and first token; a decode leg, one waiting for its
        KV included, all its ``max_tokens``)."""
        sched, bm = self.scheduler, self.block_manager
        waiting = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                      for queue in (sched.waiting, sched.running) for r in queue)
        committed = sum(bm.num_blocks_for(r.num_prompt_tokens + 1 if r.pinned else sched.final_tokens(r))
                        for r in self.requests.values() if not r.is_finished)
        return {"num_waiting_prompt_tokens": waiting, "num_kv_blocks_committed": committed}

    def close(self) -> None:
        """Stop the KV transport's threads and the tensor-parallel ranks; called once at
        shutdown."""
        if self.connector is not None:
            self.connector.close()
        if self.kv_pool is not None:
            self.kv_pool.close()
        if self._kv_segment is not None:
            self._kv_segment.close()
        if self.tp_workers is not None:
            self.tp_workers.close()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion; returns each one's output token ids (tests, CLI)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        reqs = [
            self.add_request(rid, p, sp) for rid, p, sp in zip(ids, prompts, params_list, strict=True)
        ]
        while self.has_unfinished:
            self.step()
        return [r.output_token_ids for r in reqs]
