"""Coordinator settings: one frozen pydantic model, built from CLI flags.

Owns every knob of the request path (routing, fallback, admission, deadlines,
retries, overload) and of the HTTP server in front of it. Invariants: durations are seconds (``*_s``), sizes bytes; the defaults
match ``pdserve.api.cluster`` so a Coordinator started by hand routes like one the
operator configures; a spec reaches it as flags (``pdserve.api.component_args``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.api.cluster import FallbackPolicy, RoutingPolicy, TransferMode
from pdserve.runtime.vllm_server import is_vllm_address, parse_vllm_address


class CoordinatorSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "tiny"
    """Preset name (tiny, small) or a checkpoint dir: where the tokenizer comes from."""
    served_model_name: str | None = None
    """Name clients send as ``model`` and see in /v1/models; defaults to ``model``."""
    dtype: str = "auto"
    """The engines' dtype as the spec sets it, shown in /v1/models and /ui (``auto``
    resolved as the engines resolve it: ``model_source.auto_dtype``)."""
    engines: tuple[str, ...] = ()
    """Static engine gRPC addresses, used when no Controller is given."""
    controller: str | None = None
    """Controller gRPC address; its WatchView stream is the instance view."""
    coordinator_id: str = "coordinator"
    cluster_name: str | None = None
    """The PDCluster served, for the status page; None when started by hand."""

    prefill_policy: RoutingPolicy = "prefix_cache_aware"
    decode_policy: RoutingPolicy = "least_loaded"
    kv_mode: TransferMode = "layerwise"
    local_prefill_max_tokens: int = Field(default=64, ge=0)
    """Conditional disaggregation: at most this many uncached tokens prefill on D itself."""
    load_aware_local_prefill: bool = True
    """Also prefill on D when P's predicted wait exceeds D's cost (``conditional.py``)."""
    fallback_policy: FallbackPolicy = "hybrid"
    block_size: int = Field(default=16, ge=1)
    """Engines' KV block size, for prefix hashing (static view reads it from Stats)."""
    ttft_slo_s: float | None = Field(default=None, gt=0)
    tpot_slo_s: float | None = Field(default=None, gt=0)
    """TPOT target; bounds how long a prefill on D may stall D's streams."""
    prefix_index_max_blocks: int = Field(default=65536, ge=1)
    """LRU bound of the prefix index's routed estimates: (engine, block) entries of all
    engines together, least recently routed evicted first (``prefix_index.py``)."""

    first_token_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    """How long a request may wait for its first token: admission, routing waits,
    prefill, KV transfer and every retry before it (``deadlines.py``)."""
    token_idle_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    """The longest gap between two messages of a stream, and a continuation's longest
    wait for its next token after a failure."""
    request_timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """A total for every request, the whole generation included; None: none (a client
    may still set its own; the smaller applies)."""
    max_concurrency: int = Field(default=256, ge=1)
    max_queue: int = Field(default=1024, ge=0)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    max_retries: int = Field(default=3, ge=0)
    retry_backoff_s: float = Field(default=0.02, ge=0)
    retry_backoff_max_s: float = Field(default=0.5, ge=0)
    suspect_s: float = Field(default=5.0, ge=0)
    """How long an engine that just failed a leg is avoided (when another exists)."""
    overload_max_wait_s: float = Field(default=10.0, ge=0)
    """How long a request may go on waiting for an engine with room after the first
    "full" answer; then 503 with Retry-After (the request's deadline bounds it too)."""
    move_stalled_s: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    """A stream that got nothing for this long from a decode engine that queues
    requests goes on on one with room (``moves.py``); 0: never moved."""
    poll_interval_s: float = Field(default=0.5, gt=0)
    """Static view: how often each engine's Health and Stats are read."""
    pair_probe_interval_s: float = Field(default=30.0, gt=0)
    """How often each usable P/D pair's KV path is probed again (``pairs.py``)."""
    pair_probe_retry_s: float = Field(default=2.0, gt=0)
    """How often a pair whose probe failed is probed again."""
    pair_probe_timeout_s: float = Field(default=3.0, gt=0)
    pair_probe_concurrency: int = Field(default=8, ge=1)
    max_tokens_default: int = Field(default=16, ge=1)
    api_key_file: str | None = None
    """File holding the API key (e.g. a mounted Secret); None: no auth."""
    admin_key_file: str | None = None
    """File holding the admin key: also accepted as the API key, and the only one
    that sees engine addresses in a request's timings. None: nobody sees them."""

    http_keep_alive_s: float = Field(default=5.0, gt=0)
    """An idle keep-alive connection is closed after this long."""
    http_header_timeout_s: float = Field(default=5.0, gt=0)
    """A connection must send a request's headers within this long of opening (or of
    its previous response), else it is closed."""
    http_body_timeout_s: float = Field(default=30.0, gt=0)
    """A request's body must arrive within this long of its headers, else 408."""
    max_connections: int = Field(default=4096, ge=1)
    """Open HTTP connections (or requests in flight) beyond which new requests get 503."""

    @model_validator(mode="after")
    def _one_source(self) -> CoordinatorSettings:
        if self.controller and self.engines:
            raise ValueError("give either a Controller address or static engines, not both")
        for address in filter(is_vllm_address, self.engines):
            parse_vllm_address(address)  # its ValueError says what a vLLM address looks like
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
