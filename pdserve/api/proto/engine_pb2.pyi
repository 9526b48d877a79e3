from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEventsRequest(_message.Message):
    __slots__ = ("epoch", "since_seq")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    since_seq: int
    def __init__(self, epoch: _Optional[str] = ..., since_seq: _Optional[int] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("epoch", "seq", "snapshot", "stored", "removed", "block_size")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ...) -> None: ...

class ProbePeerRequest(_message.Message):
    __slots__ = ("endpoint", "test_transfer", "timeout_s")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TEST_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    test_transfer: bool
    timeout_s: float
    def __init__(self, endpoint: _Optional[str] = ..., test_transfer: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ProbePeerResponse(_message.Message):
    __slots__ = ("ok", "reason", "handshake_s", "transfer_s", "transfer_bytes", "peer_compat_hash", "compat_hash", "transport")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    handshake_s: float
    transfer_s: float
    transfer_bytes: int
    peer_compat_hash: str
    compat_hash: str
    transport: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., handshake_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., peer_compat_hash: _Optional[str] = ..., compat_hash: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("resume",)
    RESUME_FIELD_NUMBER: _ClassVar[int]
    resume: bool
    def __init__(self, resume: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining", "num_unfinished")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_UNFINISHED_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    num_unfinished: int
    def __init__(self, draining: _Optional[bool] = ..., num_unfinished: _Optional[int] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "ignore_eos", "sample_offset", "min_tokens", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "prompt_logprobs", "guided", "n")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    sample_offset: int
    min_tokens: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    guided: GuidedDecoding
    n: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., sample_offset: _Optional[int] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., guided: _Optional[_Union[GuidedDecoding, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class GuidedDecoding(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("role", "mode", "transfer_id", "peer")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    role: str
    mode: str
    transfer_id: str
    peer: str
    def __init__(self, role: _Optional[str] = ..., mode: _Optional[str] = ..., transfer_id: _Optional[str] = ..., peer: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling", "kv_transfer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_transfer: KVTransferParams
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_transfer: _Optional[_Union[KVTransferParams, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("generate", "cancel")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    generate: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generate: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("messages", "ends")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    ends: _containers.RepeatedCompositeFieldContainer[RequestEnd]
    def __init__(self, messages: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[RequestEnd, _Mapping]]] = ...) -> None: ...

class RequestEnd(_message.Message):
    __slots__ = ("request_id", "code", "details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    details: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finished", "finish_reason", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "error", "timings", "logprobs", "prompt_logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str
    timings: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "kv_transfer_s", "kv_wait_s", "decode_s", "decode_queue_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    kv_wait_s: float
    decode_s: float
    decode_queue_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., kv_wait_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., decode_queue_s: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "role", "model", "device", "kv_transport", "kv_endpoint", "kv_compat_hash", "draining", "time_unix_s", "max_model_len", "session_port")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_PORT_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    role: str
    model: str
    device: str
    kv_transport: str
    kv_endpoint: str
    kv_compat_hash: str
    draining: bool
    time_unix_s: float
    max_model_len: int
    session_port: int
    def __init__(self, serving: _Optional[bool] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., kv_transport: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., kv_compat_hash: _Optional[str] = ..., draining: _Optional[bool] = ..., time_unix_s: _Optional[float] = ..., max_model_len: _Optional[int] = ..., session_port: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_kv_blocks_total", "num_kv_blocks_used", "num_kv_blocks_free", "kv_cache_bytes", "block_size", "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "num_preemptions", "num_prompt_tokens_total", "num_generation_tokens_total", "role", "model", "kv_transport", "kv_endpoint", "kv_compat_hash", "num_kv_transfers_active", "num_kv_blocks_quarantined", "kv_transfers_ok", "kv_transfers_failed", "kv_transfer_bytes", "kv_exposed_s_total", "kv_pool_enabled", "kv_pool_up", "kv_pool_lookup_blocks", "kv_pool_hit_blocks", "kv_pool_put_blocks", "kv_pool_fetched_bytes", "kv_pool_put_bytes", "kv_pool_put_dropped", "num_prefills_total", "prefill_busy_s_total", "prefill_queue_s_total", "num_decode_steps_total", "decode_batch_total", "decode_batch_sq_total", "decode_step_s_total", "decode_batch_step_s_total", "num_finished_total", "output_budget_total", "num_waiting_prompt_tokens", "num_kv_blocks_committed")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_OK_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_EXPOSED_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_ENABLED_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_UP_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_PUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_PUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_PUT_DROPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILLS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUSY_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_SQ_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_STEP_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BUDGET_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
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
    kv_transport: str
    kv_endpoint: str
    kv_compat_hash: str
    num_kv_transfers_active: int
    num_kv_blocks_quarantined: int
    kv_transfers_ok: int
    kv_transfers_failed: int
    kv_transfer_bytes: int
    kv_exposed_s_total: float
    kv_pool_enabled: bool
    kv_pool_up: bool
    kv_pool_lookup_blocks: int
    kv_pool_hit_blocks: int
    kv_pool_put_blocks: int
    kv_pool_fetched_bytes: int
    kv_pool_put_bytes: int
    kv_pool_put_dropped: int
    num_prefills_total: int
    prefill_busy_s_total: float
    prefill_queue_s_total: float
    num_decode_steps_total: int
    decode_batch_total: float
    decode_batch_sq_total: float
    decode_step_s_total: float
    decode_batch_step_s_total: float
    num_finished_total: int
    output_budget_total: int
    num_waiting_prompt_tokens: int
    num_kv_blocks_committed: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_free: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_cache_query_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_prompt_tokens_total: _Optional[int] = ..., num_generation_tokens_total: _Optional[int] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., kv_transport: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., kv_compat_hash: _Optional[str] = ..., num_kv_transfers_active: _Optional[int] = ..., num_kv_blocks_quarantined: _Optional[int] = ..., kv_transfers_ok: _Optional[int] = ..., kv_transfers_failed: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_exposed_s_total: _Optional[float] = ..., kv_pool_enabled: _Optional[bool] = ..., kv_pool_up: _Optional[bool] = ..., kv_pool_lookup_blocks: _Optional[int] = ..., kv_pool_hit_blocks: _Optional[int] = ..., kv_pool_put_blocks: _Optional[int] = ..., kv_pool_fetched_bytes: _Optional[int] = ..., kv_pool_put_bytes: _Optional[int] = ..., kv_pool_put_dropped: _Optional[int] = ..., num_prefills_total: _Optional[int] = ..., prefill_busy_s_total: _Optional[float] = ..., prefill_queue_s_total: _Optional[float] = ..., num_decode_steps_total: _Optional[int] = ..., decode_batch_total: _Optional[float] = ..., decode_batch_sq_total: _Optional[float] = ..., decode_step_s_total: _Optional[float] = ..., decode_batch_step_s_total: _Optional[float] = ..., num_finished_total: _Optional[int] = ..., output_budget_total: _Optional[int] = ..., num_waiting_prompt_tokens: _Optional[int] = ..., num_kv_blocks_committed: _Optional[int] = ...) -> None: ...
