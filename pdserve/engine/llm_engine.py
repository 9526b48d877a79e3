"""The engine: admits requests, runs ``step()``, reports outputs and stats.

Single-threaded by design: whoever owns the engine (the gRPC server's loop thread,
the CLI, a test) calls ``add_request``/``abort_request``/``step`` from one thread.
Bad input is refused in ``add_request`` with ``EngineInputError`` and never reaches
the step loop; a request that fails later ends with ``FINISHED_ERROR`` while the
others go on.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from dataclasses import dataclass, field

from pdserve.api.detokenizer import Detokenizer
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import ConfigError, EngineConfig
from pdserve.engine.device import prepare_device
from pdserve.engine.kv_transfer.params import KVTransferError, KVTransferParams
from pdserve.engine.kv_transfer.setup import build_connector, kv_allocator
from pdserve.engine.loader import load_model
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import SamplingError, SamplingParams
from pdserve.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineInputError(ValueError):
    """A request the engine refuses; the message says why."""


class EngineUnavailable(RuntimeError):
    """The engine is draining and admits no new requests."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    timings: dict[str, float] | None = None  # with the first token and the final output


@dataclass
class TransferStats:
    """Running totals of finished KV transfers (the metrics layer reads these)."""

    num_ok: int = 0
    num_failed: int = 0
    num_bytes: int = 0
    exposed_s_total: float = 0.0  # P: time from prefill end to every write settled
    duration_s_total: float = 0.0

    def record(self, xfer, ok: bool) -> None:
        now = time.monotonic()
        if not ok:
            self.num_failed += 1
            return
        self.num_ok += 1
        self.num_bytes += sum(h.num_bytes for h in xfer.handles)
        self.duration_s_total += now - xfer.started_s
        if xfer.params.role == "prefill" and xfer.prefill_done_s is not None:
            self.exposed_s_total += now - xfer.prefill_done_s


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    kv_cache_bytes: int
    block_size: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    role: str
    model: str
    extra: dict = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        prepare_device(config.device, config.num_threads)
        model, tokenizer = load_model(config.model, config.dtype, config.device)
        self.model_config = cfg = model.config
        self.tokenizer = tokenizer
        dtype_bytes = model.embed_tokens.element_size()
        bytes_per_block = cfg.kv_bytes_per_token(dtype_bytes) * config.block_size
        num_blocks = config.num_kv_blocks or config.kv_cache_bytes // bytes_per_block
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_bytes={config.kv_cache_bytes} is below one block ({bytes_per_block} bytes)"
            )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.prefill_chunk_tokens)
        allocator = kv_allocator(config)
        self.runner = ModelRunner(model, num_blocks, config.block_size, allocator)
        self._kv_segment = getattr(allocator, "segment", None)
        self.transfer_stats = TransferStats()
        self.connector = build_connector(
            config, cfg, self.runner, self.block_manager, self.transfer_stats.record
        )
        self.last_step_idle = False
        self.draining = False
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, Detokenizer] = {}
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
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
            self._check_kv_transfer(kv_transfer)
        if request_id in self.requests:
            raise EngineInputError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise EngineInputError("the prompt is empty: send prompt text or prompt token ids")
            if self.tokenizer is None:
                raise EngineInputError("this model has no tokenizer: send prompt token ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not prompt_token_ids:
            raise EngineInputError("the prompt is empty")
        try:
            # A float or string id would pass the range check and crash the step for all.
            prompt_token_ids = [operator.index(t) for t in prompt_token_ids]
        except TypeError:
            raise EngineInputError("prompt token ids must be integers") from None
        vocab = self.model_config.vocab_size
        if any(not (0 <= t < vocab) for t in prompt_token_ids):
            raise EngineInputError(f"prompt token ids must be in [0, {vocab})")
        limit = self.token_capacity
        if len(prompt_token_ids) >= limit:
            raise EngineInputError(
                f"prompt has {len(prompt_token_ids)} tokens; this engine's limit is {limit - 1} "
                f"(max model length {self.max_model_len}, KV capacity "
                f"{self.block_manager.num_blocks * self.block_manager.block_size} tokens)"
            )
        try:
            params.validate(vocab)
        except SamplingError as exc:
            raise EngineInputError(str(exc)) from None
        params = params.with_seed()
        request = Request(request_id, prompt_token_ids, params, self.model_config.eos_token_ids,
                          arrival_s)
        self.requests[request_id] = request
        self._detok[request_id] = Detokenizer(self.tokenizer, params.stop)
        if kv_transfer is not None and kv_transfer.role == "decode":
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        elif kv_transfer is None or not self.connector.holds_prefill(kv_transfer):
            self.scheduler.add(request)
        # else: the connector releases it to the scheduler once D's blocks are reserved
        if kv_transfer is not None:
            self.connector.admit(request, kv_transfer)
        return request

    def _check_kv_transfer(self, kv: KVTransferParams) -> None:
        try:
            kv.validate()
        except KVTransferError as exc:
            raise EngineInputError(str(exc)) from None
        if self.connector is None:
            raise EngineInputError("this engine has no KV transport (kv_transport=none)")
        if self.config.role not in (kv.role, "hybrid"):
            raise EngineInputError(f"a {self.config.role} engine cannot take the {kv.role} leg")
        if kv.transfer_id in self.connector.transfers:
            raise EngineInputError(f"transfer id {kv.transfer_id!r} is already in use")

    @property
    def token_capacity(self) -> int:
        """Most tokens one request may hold: model length and the whole KV cache."""
        bm = self.block_manager
        return min(self.max_model_len, bm.num_blocks * bm.block_size)

    def abort_request(self, request_id: str) -> bool:
        """End a request and free its blocks. Idempotent; unknown ids return False."""
        request = self.requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        if request is None:
            return False
        if self.connector is not None and self.connector.owns(request):
            self.connector.abort(request, "aborted")
            return self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED, free_blocks=False)
        return self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def set_role(self, role: str) -> None:
        """Switch role in place. Called by the server on the Controller's command, after a
        drain: refused while requests or transfers are in flight."""
        if role not in ("prefill", "decode", "hybrid"):
            raise EngineInputError(f"role must be prefill, decode or hybrid, got {role!r}")
        if self.has_unfinished:
            raise EngineUnavailable(
                f"cannot switch role with {self.scheduler.num_unfinished} requests in flight; drain first"
            )
        if role != "hybrid" and self.connector is None:
            raise EngineInputError(f"a {role} engine needs a KV transport (kv_transport=none)")
        log.info("role %s -> %s", self.config.role, role)
        self.config.role = role

    def fail_request(self, request_id: str, message: str) -> RequestOutput | None:
        """End a request with an error (its blocks freed); returns its final output."""
        request = self.requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        if request is None:
            return None
        owned = self.connector is not None and self.connector.owns(request)
        if owned:
            self.connector.abort(request, message)
        if not self.scheduler.finish(request, RequestStatus.FINISHED_ERROR, message, free_blocks=not owned):
            return None
        return RequestOutput(
            request_id, [], "", True, "error", request.num_prompt_tokens,
            len(request.output_token_ids), request.num_cached_tokens, message,
        )

    @property
    def has_unfinished(self) -> bool:
        """Work left: requests to schedule, or KV transfers to drive."""
        if self.scheduler.num_unfinished:
            return True
        return self.connector is not None and self.connector.num_pending > 0

    # -- the step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Drive KV transfers, schedule, run the model once, sample, report what changed."""
        outputs = self._apply_connector_events() if self.connector is not None else []
        if any(o.new_token_ids for o in outputs):
            return outputs  # D's first tokens (KV exposed) go out now, not after a decode step
        batch = self.scheduler.schedule()
        self.last_step_idle = not batch and not outputs
        if not batch:
            return outputs
        hook = None
        if self.connector is not None:
            hook = self.connector.worker.layer_hook(self.connector.plan_layerwise(batch.items))
        sampled = self.runner.execute(batch, hook)
        now = time.monotonic()
        for request, num_new in batch.items:
            request.num_computed_tokens += num_new
            if request.num_preemptions == 0 and request.num_computed_tokens <= request.num_prompt_tokens:
                self.num_prompt_tokens_total += num_new
            self.block_manager.cache_full_blocks(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            if request.first_token_s is None:
                request.first_token_s = now
            if request.pinned:  # prefill leg: hand off instead of decoding on
                outputs.append(self._hand_off(request, token))
            else:
                outputs.append(self._append_token(request, token))
        return outputs

    def _hand_off(self, request: Request, token: int) -> RequestOutput:
        """P: report the first token and give the request's KV to the connector."""
        request.output_token_ids.append(token)
        self.num_generation_tokens_total += 1
        new_text, _ = self._detok[request.request_id].append([token])
        self.scheduler.detach(request)
        self.connector.on_prefill_done(request, token)
        return self._output(request, [token], new_text)

    def _apply_connector_events(self) -> list[RequestOutput]:
        events = self.connector.update()
        outputs = []
        for request in events.ready:
            if self.requests.get(request.request_id) is request:
                self.scheduler.add(request)
        for request, token, seed in events.exposed:
            if self.requests.get(request.request_id) is not request:
                self.block_manager.free(request)  # aborted meanwhile
                continue
            if seed is not None:  # continue P's random stream
                request.sampling_params = dataclasses.replace(request.sampling_params, seed=seed)
            request.num_computed_tokens = request.num_prompt_tokens
            self.block_manager.cache_full_blocks(request)
            self.scheduler.add_running(request)
            request.first_token_s = request.kv_exposed_s = time.monotonic()
            outputs.append(self._append_token(request, token))
        for request in events.handed_off:
            if self.requests.pop(request.request_id, None) is request:
                self._detok.pop(request.request_id, None)
                self.scheduler.finish(request, RequestStatus.FINISHED_HANDOFF, free_blocks=False)
                outputs.append(self._output(request, [], ""))
        for request, reason in events.failed:
            if self.requests.pop(request.request_id, None) is request:
                self._detok.pop(request.request_id, None)
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR, reason, free_blocks=False)
                outputs.append(self._output(request, [], ""))
        return outputs

    def _output(self, request: Request, token_ids: list[int], text: str) -> RequestOutput:
        timings = None
        if request.is_finished or len(request.output_token_ids) == 1:
            timings = request_timings(request, time.monotonic())
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
            timings=timings,
        )

    def _append_token(self, request: Request, token: int) -> RequestOutput:
        request.output_token_ids.append(token)
        self.num_generation_tokens_total += 1
        detok = self._detok[request.request_id]
        new_text, hit_stop = detok.append([token])
        params = request.sampling_params
        status = None
        if hit_stop or token in params.stop_token_ids or token in request.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.token_capacity:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            new_text += detok.flush()
            self.scheduler.finish(request, status)
            self.requests.pop(request.request_id, None)
            self._detok.pop(request.request_id, None)
        request.output_text += new_text
        return self._output(request, [token], new_text)

    # -- conveniences ----------------------------------------------------------

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_total=bm.num_blocks,
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_free=bm.num_free_blocks,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            block_size=bm.block_size,
            prefix_cache_query_tokens=bm.num_prefix_query_tokens,
            prefix_cache_hit_tokens=bm.num_prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            role=self.config.role,
            model=self.model_config.name,
            extra=self._transfer_extra(),
        )

    def _transfer_extra(self) -> dict:
        c, t = self.connector, self.transfer_stats
        if c is None:
            return {"kv_transport": "none"}
        return {
            "kv_transport": c.worker.transport.name, "kv_endpoint": c.worker.endpoint,
            "kv_compat_hash": c.worker.layout.compat_hash,
            "num_kv_transfers_active": c.num_active,
            "num_kv_blocks_quarantined": c.num_quarantined_blocks,
            "kv_transfers_ok": t.num_ok, "kv_transfers_failed": t.num_failed,
            "kv_transfer_bytes": t.num_bytes, "kv_exposed_s_total": t.exposed_s_total,
        }

    def close(self) -> None:
        """Stop the KV transport's threads; called once at shutdown."""
        if self.connector is not None:
            self.connector.worker.close()
        if self._kv_segment is not None:
            self._kv_segment.close()

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


def request_timings(request: Request, now: float) -> dict[str, float]:
    """Stage durations of ``request`` so far, for the Coordinator's breakdown."""
    t: dict[str, float] = {}
    if request.kv_exposed_s is not None:  # decode leg
        arrived_s = max(request.kv_arrived_s or request.kv_exposed_s, request.arrival_s)
        t["kv_wait_s"] = arrived_s - request.arrival_s
        t["decode_queue_s"] = max(0.0, request.first_token_s - arrived_s)
    elif request.first_scheduled_s is not None:
        t["queue_s"] = request.first_scheduled_s - request.arrival_s
        if request.first_token_s is not None:
            t["prefill_s"] = request.first_token_s - request.first_scheduled_s
    if request.is_finished and request.first_token_s is not None:
        key = "kv_transfer_s" if request.pinned else "decode_s"  # pinned: the prefill leg
        t[key] = now - request.first_token_s
    return t
