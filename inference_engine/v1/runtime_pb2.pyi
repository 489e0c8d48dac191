from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_MAX_TOKENS: _ClassVar[StopReason]
    STOP_REASON_EOS: _ClassVar[StopReason]
    STOP_REASON_CANCELLED: _ClassVar[StopReason]
    STOP_REASON_STOP_STRING: _ClassVar[StopReason]
    STOP_REASON_CONSTRAINT_COMPLETE: _ClassVar[StopReason]

class DecodeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODE_MODE_GREEDY: _ClassVar[DecodeMode]
    DECODE_MODE_SPECULATIVE_DRAFT: _ClassVar[DecodeMode]
    DECODE_MODE_SPECULATIVE_LOOKUP: _ClassVar[DecodeMode]
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_MAX_TOKENS: StopReason
STOP_REASON_EOS: StopReason
STOP_REASON_CANCELLED: StopReason
STOP_REASON_STOP_STRING: StopReason
STOP_REASON_CONSTRAINT_COMPLETE: StopReason
DECODE_MODE_GREEDY: DecodeMode
DECODE_MODE_SPECULATIVE_DRAFT: DecodeMode
DECODE_MODE_SPECULATIVE_LOOKUP: DecodeMode

class CreateSessionRequest(_message.Message):
    __slots__ = ("eos_token_ids", "client_label", "sink_tokens", "window_tokens")
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_LABEL_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    client_label: str
    sink_tokens: int
    window_tokens: int
    def __init__(self, eos_token_ids: _Optional[_Iterable[int]] = ..., client_label: _Optional[str] = ..., sink_tokens: _Optional[int] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id", "sink_tokens", "window_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sink_tokens: int
    window_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., sink_tokens: _Optional[int] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class AppendTokensRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "text", "messages", "add_generation_prompt", "expected_history_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    expected_history_length: int
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., expected_history_length: _Optional[int] = ...) -> None: ...

class AppendTokensResponse(_message.Message):
    __slots__ = ("history_length", "next_global_position", "tokens")
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEXT_GLOBAL_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    history_length: int
    next_global_position: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, history_length: _Optional[int] = ..., next_global_position: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "max_new_tokens", "ignore_eos", "mode", "num_draft_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop", "eos_token_ids", "logprobs", "top_logprobs", "constraint")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_new_tokens: int
    ignore_eos: bool
    mode: DecodeMode
    num_draft_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: bool
    top_logprobs: int
    constraint: Constraint
    def __init__(self, session_id: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., mode: _Optional[_Union[DecodeMode, str]] = ..., num_draft_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "time_to_first_token_ms", "total_time_ms", "tokens_per_second")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_ms: float
    total_time_ms: float
    tokens_per_second: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., time_to_first_token_ms: _Optional[float] = ..., total_time_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "stop_reason", "history_length", "drafted_tokens", "accepted_tokens", "text", "logprobs", "usage", "seed")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    stop_reason: StopReason
    history_length: int
    drafted_tokens: int
    accepted_tokens: int
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    usage: Usage
    seed: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., history_length: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("history_length",)
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    history_length: int
    def __init__(self, history_length: _Optional[int] = ...) -> None: ...

class GetSessionInfoRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetSessionInfoResponse(_message.Message):
    __slots__ = ("session_id", "history_length", "next_global_position", "cached_tokens", "sink_tokens", "window_tokens", "eos_token_ids", "client_label", "created_unix_nanos", "last_used_unix_nanos", "state_digest", "exact", "kv_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEXT_GLOBAL_POSITION_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_LABEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    history_length: int
    next_global_position: int
    cached_tokens: int
    sink_tokens: int
    window_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    client_label: str
    created_unix_nanos: int
    last_used_unix_nanos: int
    state_digest: str
    exact: bool
    kv_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., history_length: _Optional[int] = ..., next_global_position: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., window_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., client_label: _Optional[str] = ..., created_unix_nanos: _Optional[int] = ..., last_used_unix_nanos: _Optional[int] = ..., state_digest: _Optional[str] = ..., exact: _Optional[bool] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelLimits(_message.Message):
    __slots__ = ("default_sink_tokens", "max_sink_tokens", "default_window_tokens", "max_window_tokens", "default_new_tokens", "max_new_tokens", "max_tokens_per_request", "max_draft_tokens", "max_top_logprobs", "max_sessions")
    DEFAULT_SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    default_sink_tokens: int
    max_sink_tokens: int
    default_window_tokens: int
    max_window_tokens: int
    default_new_tokens: int
    max_new_tokens: int
    max_tokens_per_request: int
    max_draft_tokens: int
    max_top_logprobs: int
    max_sessions: int
    def __init__(self, default_sink_tokens: _Optional[int] = ..., max_sink_tokens: _Optional[int] = ..., default_window_tokens: _Optional[int] = ..., max_window_tokens: _Optional[int] = ..., default_new_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., max_tokens_per_request: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., max_sessions: _Optional[int] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "vocab_size", "eos_token_ids", "bos_token_id", "has_tokenizer", "has_chat_template", "limits", "exact", "block_size", "kernels", "model_fingerprint", "has_draft_model", "family", "weight_formats", "layer_attention")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMATS_FIELD_NUMBER: _ClassVar[int]
    LAYER_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    has_tokenizer: bool
    has_chat_template: bool
    limits: ModelLimits
    exact: bool
    block_size: int
    kernels: str
    model_fingerprint: str
    has_draft_model: bool
    family: str
    weight_formats: _containers.RepeatedScalarFieldContainer[str]
    layer_attention: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ..., has_chat_template: _Optional[bool] = ..., limits: _Optional[_Union[ModelLimits, _Mapping]] = ..., exact: _Optional[bool] = ..., block_size: _Optional[int] = ..., kernels: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., has_draft_model: _Optional[bool] = ..., family: _Optional[str] = ..., weight_formats: _Optional[_Iterable[str]] = ..., layer_attention: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens", "messages", "add_generation_prompt")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "text")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens", "skip_special_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class SnapshotSessionRequest(_message.Message):
    __slots__ = ("session_id", "to_dir")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TO_DIR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    to_dir: bool
    def __init__(self, session_id: _Optional[str] = ..., to_dir: _Optional[bool] = ...) -> None: ...

class SnapshotSessionResponse(_message.Message):
    __slots__ = ("data", "file", "snapshot_bytes", "history_length", "state_digest")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    file: str
    snapshot_bytes: int
    history_length: int
    state_digest: str
    def __init__(self, data: _Optional[bytes] = ..., file: _Optional[str] = ..., snapshot_bytes: _Optional[int] = ..., history_length: _Optional[int] = ..., state_digest: _Optional[str] = ...) -> None: ...

class RestoreSessionRequest(_message.Message):
    __slots__ = ("data", "file")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    file: str
    def __init__(self, data: _Optional[bytes] = ..., file: _Optional[str] = ...) -> None: ...

class RestoreSessionResponse(_message.Message):
    __slots__ = ("session_id", "history_length", "state_digest", "sink_tokens", "window_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    history_length: int
    state_digest: str
    sink_tokens: int
    window_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., history_length: _Optional[int] = ..., state_digest: _Optional[str] = ..., sink_tokens: _Optional[int] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ForkSessionResponse(_message.Message):
    __slots__ = ("session_id", "history_length", "state_digest")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    history_length: int
    state_digest: str
    def __init__(self, session_id: _Optional[str] = ..., history_length: _Optional[int] = ..., state_digest: _Optional[str] = ...) -> None: ...
