from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_kv_blocks_used", "num_kv_blocks_free", "prompt_tokens_per_s", "generation_tokens_per_s", "prefix_cache_hit_tokens", "prefix_cache_query_tokens")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_free: _Optional[int] = ..., prompt_tokens_per_s: _Optional[float] = ..., generation_tokens_per_s: _Optional[float] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_query_tokens: _Optional[int] = ...) -> None: ...

class InstanceReport(_message.Message):
    __slots__ = ("instance_id", "role", "process_state", "engine_address", "kv_endpoint", "kv_transport", "kv_compat_hash", "model", "load", "num_restarts", "probe_ok", "last_error", "pool", "max_model_len")
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
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., process_state: _Optional[str] = ..., engine_address: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., kv_transport: _Optional[str] = ..., kv_compat_hash: _Optional[str] = ..., model: _Optional[str] = ..., load: _Optional[_Union[InstanceLoad, _Mapping]] = ..., num_restarts: _Optional[int] = ..., probe_ok: _Optional[bool] = ..., last_error: _Optional[str] = ..., pool: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("agent_id", "node", "instances", "cluster_token")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    node: str
    instances: _containers.RepeatedCompositeFieldContainer[InstanceReport]
    cluster_token: str
    def __init__(self, agent_id: _Optional[str] = ..., node: _Optional[str] = ..., instances: _Optional[_Iterable[_Union[InstanceReport, _Mapping]]] = ..., cluster_token: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("commands", "heartbeat_interval_s")
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    heartbeat_interval_s: float
    def __init__(self, commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class InstanceView(_message.Message):
    __slots__ = ("instance_id", "role", "health", "engine_address", "kv_endpoint", "kv_transport", "kv_compat_hash", "load", "model", "last_heartbeat_unix_s", "max_model_len")
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
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., health: _Optional[str] = ..., engine_address: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., kv_transport: _Optional[str] = ..., kv_compat_hash: _Optional[str] = ..., load: _Optional[_Union[InstanceLoad, _Mapping]] = ..., model: _Optional[str] = ..., last_heartbeat_unix_s: _Optional[float] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ClusterView(_message.Message):
    __slots__ = ("version", "mode", "fallback_reason", "instances", "leader", "recent_events")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    RECENT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    mode: str
    fallback_reason: str
    instances: _containers.RepeatedCompositeFieldContainer[InstanceView]
    leader: str
    recent_events: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., mode: _Optional[str] = ..., fallback_reason: _Optional[str] = ..., instances: _Optional[_Iterable[_Union[InstanceView, _Mapping]]] = ..., leader: _Optional[str] = ..., recent_events: _Optional[_Iterable[str]] = ...) -> None: ...

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
