from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_kv_blocks_used", "num_kv_blocks_free", "prompt_tokens_per_s", "generation_tokens_per_s", "prefix_cache_hit_tokens", "prefix_cache_query_tokens", "num_prompt_tokens_total", "num_generation_tokens_total", "num_prefills_total", "prefill_busy_s_total", "prefill_queue_s_total", "num_decode_steps_total", "decode_batch_total", "decode_batch_sq_total", "decode_step_s_total", "decode_batch_step_s_total", "num_finished_total", "kv_transfers_ok", "kv_exposed_s_total", "output_budget_total", "num_waiting_prompt_tokens", "num_kv_blocks_committed")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILLS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUSY_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_SQ_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_STEP_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_OK_FIELD_NUMBER: _ClassVar[int]
    KV_EXPOSED_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BUDGET_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_prefills_total: int
    prefill_busy_s_total: float
    prefill_queue_s_total: float
    num_decode_steps_total: int
    decode_batch_total: float
    decode_batch_sq_total: float
    decode_step_s_total: float
    decode_batch_step_s_total: float
    num_finished_total: int
    kv_transfers_ok: int
    kv_exposed_s_total: float
    output_budget_total: int
    num_waiting_prompt_tokens: int
    num_kv_blocks_committed: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_free: _Optional[int] = ..., prompt_tokens_per_s: _Optional[float] = ..., generation_tokens_per_s: _Optional[float] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_query_tokens: _Optional[int] = ..., num_prompt_tokens_total: _Optional[int] = ..., num_generation_tokens_total: _Optional[int] = ..., num_prefills_total: _Optional[int] = ..., prefill_busy_s_total: _Optional[float] = ..., prefill_queue_s_total: _Optional[float] = ..., num_decode_steps_total: _Optional[int] = ..., decode_batch_total: _Optional[float] = ..., decode_batch_sq_total: _Optional[float] = ..., decode_step_s_total: _Optional[float] = ..., decode_batch_step_s_total: _Optional[float] = ..., num_finished_total: _Optional[int] = ..., kv_transfers_ok: _Optional[int] = ..., kv_exposed_s_total: _Optional[float] = ..., output_budget_total: _Optional[int] = ..., num_waiting_prompt_tokens: _Optional[int] = ..., num_kv_blocks_committed: _Optional[int] = ...) -> None: ...

class InstanceReport(_message.Message):
    __slots__ = ("instance_id", "role", "process_state", "engine_address", "kv_endpoint", "kv_transport", "kv_compat_hash", "model", "load", "num_restarts", "probe_ok", "last_error", "pool", "max_model_len", "peers_checked_version", "unreachable_peers", "checks_peers")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    PROBE_OK_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PEERS_CHECKED_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_PEERS_FIELD_NUMBER: _ClassVar[int]
    CHECKS_PEERS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    process_state: str
    engine_address: str
    kv_endpoint: str
    kv_transport: str
    kv_compat_hash: str
    model: str
    load: InstanceLoad
    num_restarts: int
    probe_ok: bool
    last_error: str
    pool: str
    max_model_len: int
    peers_checked_version: int
    unreachable_peers: _containers.RepeatedCompositeFieldContainer[PeerFailure]
    checks_peers: bool
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., process_state: _Optional[str] = ..., engine_address: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., kv_transport: _Optional[str] = ..., kv_compat_hash: _Optional[str] = ..., model: _Optional[str] = ..., load: _Optional[_Union[InstanceLoad, _Mapping]] = ..., num_restarts: _Optional[int] = ..., probe_ok: _Optional[bool] = ..., last_error: _Optional[str] = ..., pool: _Optional[str] = ..., max_model_len: _Optional[int] = ..., peers_checked_version: _Optional[int] = ..., unreachable_peers: _Optional[_Iterable[_Union[PeerFailure, _Mapping]]] = ..., checks_peers: _Optional[bool] = ...) -> None: ...

class PeerFailure(_message.Message):
    __slots__ = ("instance_id", "kv_endpoint", "reason")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    kv_endpoint: str
    reason: str
    def __init__(self, instance_id: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PeerList(_message.Message):
    __slots__ = ("version", "decode")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    version: int
    decode: _containers.RepeatedCompositeFieldContainer[Peer]
    def __init__(self, version: _Optional[int] = ..., decode: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("instance_id", "kv_endpoint", "kv_compat_hash")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    kv_endpoint: str
    kv_compat_hash: str
    def __init__(self, instance_id: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., kv_compat_hash: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("agent_id", "node", "instances", "cluster_token", "peers_version")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PEERS_VERSION_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    node: str
    instances: _containers.RepeatedCompositeFieldContainer[InstanceReport]
    cluster_token: str
    peers_version: int
    def __init__(self, agent_id: _Optional[str] = ..., node: _Optional[str] = ..., instances: _Optional[_Iterable[_Union[InstanceReport, _Mapping]]] = ..., cluster_token: _Optional[str] = ..., peers_version: _Optional[int] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("command_id", "instance_id", "kind", "role", "deadline_s")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    instance_id: str
    kind: str
    role: str
    deadline_s: float
    def __init__(self, command_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., kind: _Optional[str] = ..., role: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("commands", "heartbeat_interval_s", "peers")
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    heartbeat_interval_s: float
    peers: PeerList
    def __init__(self, commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ..., heartbeat_interval_s: _Optional[float] = ..., peers: _Optional[_Union[PeerList, _Mapping]] = ...) -> None: ...

class InstanceView(_message.Message):
    __slots__ = ("instance_id", "role", "health", "engine_address", "kv_endpoint", "kv_transport", "kv_compat_hash", "load", "model", "last_heartbeat_unix_s", "max_model_len", "peers_checked_version", "peers_listed_version")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PEERS_CHECKED_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEERS_LISTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    health: str
    engine_address: str
    kv_endpoint: str
    kv_transport: str
    kv_compat_hash: str
    load: InstanceLoad
    model: str
    last_heartbeat_unix_s: float
    max_model_len: int
    peers_checked_version: int
    peers_listed_version: int
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., health: _Optional[str] = ..., engine_address: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., kv_transport: _Optional[str] = ..., kv_compat_hash: _Optional[str] = ..., load: _Optional[_Union[InstanceLoad, _Mapping]] = ..., model: _Optional[str] = ..., last_heartbeat_unix_s: _Optional[float] = ..., max_model_len: _Optional[int] = ..., peers_checked_version: _Optional[int] = ..., peers_listed_version: _Optional[int] = ...) -> None: ...

class UnusablePair(_message.Message):
    __slots__ = ("prefill_id", "decode_id", "reason")
    PREFILL_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    prefill_id: str
    decode_id: str
    reason: str
    def __init__(self, prefill_id: _Optional[str] = ..., decode_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ClusterView(_message.Message):
    __slots__ = ("version", "mode", "fallback_reason", "instances", "leader", "recent_events", "planner", "publishes_pairs", "unusable_pairs")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    RECENT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_PAIRS_FIELD_NUMBER: _ClassVar[int]
    UNUSABLE_PAIRS_FIELD_NUMBER: _ClassVar[int]
    version: int
    mode: str
    fallback_reason: str
    instances: _containers.RepeatedCompositeFieldContainer[InstanceView]
    leader: str
    recent_events: _containers.RepeatedScalarFieldContainer[str]
    planner: PlannerView
    publishes_pairs: bool
    unusable_pairs: _containers.RepeatedCompositeFieldContainer[UnusablePair]
    def __init__(self, version: _Optional[int] = ..., mode: _Optional[str] = ..., fallback_reason: _Optional[str] = ..., instances: _Optional[_Iterable[_Union[InstanceView, _Mapping]]] = ..., leader: _Optional[str] = ..., recent_events: _Optional[_Iterable[str]] = ..., planner: _Optional[_Union[PlannerView, _Mapping]] = ..., publishes_pairs: _Optional[bool] = ..., unusable_pairs: _Optional[_Iterable[_Union[UnusablePair, _Mapping]]] = ...) -> None: ...

class PlannerView(_message.Message):
    __slots__ = ("advisory", "wanted_prefill", "wanted_decode", "replicas_prefill", "replicas_decode", "reason", "last_action", "last_action_unix_s", "num_actions", "request_rate", "measured_ttft_s", "measured_tpot_s", "prefill_tokens_per_s", "ttft_target_s", "tpot_target_s", "is_balanced")
    ADVISORY_FIELD_NUMBER: _ClassVar[int]
    WANTED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    WANTED_DECODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_DECODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTION_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTION_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_RATE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TPOT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    IS_BALANCED_FIELD_NUMBER: _ClassVar[int]
    advisory: bool
    wanted_prefill: int
    wanted_decode: int
    replicas_prefill: int
    replicas_decode: int
    reason: str
    last_action: str
    last_action_unix_s: float
    num_actions: int
    request_rate: float
    measured_ttft_s: float
    measured_tpot_s: float
    prefill_tokens_per_s: float
    ttft_target_s: float
    tpot_target_s: float
    is_balanced: bool
    def __init__(self, advisory: _Optional[bool] = ..., wanted_prefill: _Optional[int] = ..., wanted_decode: _Optional[int] = ..., replicas_prefill: _Optional[int] = ..., replicas_decode: _Optional[int] = ..., reason: _Optional[str] = ..., last_action: _Optional[str] = ..., last_action_unix_s: _Optional[float] = ..., num_actions: _Optional[int] = ..., request_rate: _Optional[float] = ..., measured_ttft_s: _Optional[float] = ..., measured_tpot_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., ttft_target_s: _Optional[float] = ..., tpot_target_s: _Optional[float] = ..., is_balanced: _Optional[bool] = ...) -> None: ...

class WatchViewRequest(_message.Message):
    __slots__ = ("coordinator_id", "cluster_token")
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    coordinator_id: str
    cluster_token: str
    def __init__(self, coordinator_id: _Optional[str] = ..., cluster_token: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("instance_id", "deadline_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    deadline_s: float
    def __init__(self, instance_id: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("is_known", "is_drained", "num_running", "num_waiting", "health")
    IS_KNOWN_FIELD_NUMBER: _ClassVar[int]
    IS_DRAINED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    is_known: bool
    is_drained: bool
    num_running: int
    num_waiting: int
    health: str
    def __init__(self, is_known: _Optional[bool] = ..., is_drained: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., health: _Optional[str] = ...) -> None: ...

class Replacement(_message.Message):
    __slots__ = ("instance_id", "reason", "requested_unix_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    reason: str
    requested_unix_s: float
    def __init__(self, instance_id: _Optional[str] = ..., reason: _Optional[str] = ..., requested_unix_s: _Optional[float] = ...) -> None: ...

class ListReplacementsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListReplacementsResponse(_message.Message):
    __slots__ = ("replacements",)
    REPLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    replacements: _containers.RepeatedCompositeFieldContainer[Replacement]
    def __init__(self, replacements: _Optional[_Iterable[_Union[Replacement, _Mapping]]] = ...) -> None: ...

class AckReplacementRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class AckReplacementResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForgetClusterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForgetClusterResponse(_message.Message):
    __slots__ = ("num_keys_deleted",)
    NUM_KEYS_DELETED_FIELD_NUMBER: _ClassVar[int]
    num_keys_deleted: int
    def __init__(self, num_keys_deleted: _Optional[int] = ...) -> None: ...
