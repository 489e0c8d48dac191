from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_ERROR_UNSPECIFIED: _ClassVar[ShardErrorCode]
    SHARD_ERROR_EPOCH_STALE: _ClassVar[ShardErrorCode]
    SHARD_ERROR_DEADLINE_EXCEEDED: _ClassVar[ShardErrorCode]
    SHARD_ERROR_PAYLOAD_CORRUPT: _ClassVar[ShardErrorCode]
    SHARD_ERROR_FLOW_CONTROL_VIOLATION: _ClassVar[ShardErrorCode]
    SHARD_ERROR_CANCELLED: _ClassVar[ShardErrorCode]
    SHARD_ERROR_RESOURCE_EXHAUSTED: _ClassVar[ShardErrorCode]
    SHARD_ERROR_INVALID_ARGUMENT: _ClassVar[ShardErrorCode]
    SHARD_ERROR_SESSION_NOT_FOUND: _ClassVar[ShardErrorCode]
    SHARD_ERROR_FAILED_PRECONDITION: _ClassVar[ShardErrorCode]
    SHARD_ERROR_UNAVAILABLE: _ClassVar[ShardErrorCode]
    SHARD_ERROR_INTERNAL: _ClassVar[ShardErrorCode]

class TensorDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_DTYPE_UNSPECIFIED: _ClassVar[TensorDtype]
    TENSOR_DTYPE_FLOAT32: _ClassVar[TensorDtype]
    TENSOR_DTYPE_FLOAT16: _ClassVar[TensorDtype]
SHARD_ERROR_UNSPECIFIED: ShardErrorCode
SHARD_ERROR_EPOCH_STALE: ShardErrorCode
SHARD_ERROR_DEADLINE_EXCEEDED: ShardErrorCode
SHARD_ERROR_PAYLOAD_CORRUPT: ShardErrorCode
SHARD_ERROR_FLOW_CONTROL_VIOLATION: ShardErrorCode
SHARD_ERROR_CANCELLED: ShardErrorCode
SHARD_ERROR_RESOURCE_EXHAUSTED: ShardErrorCode
SHARD_ERROR_INVALID_ARGUMENT: ShardErrorCode
SHARD_ERROR_SESSION_NOT_FOUND: ShardErrorCode
SHARD_ERROR_FAILED_PRECONDITION: ShardErrorCode
SHARD_ERROR_UNAVAILABLE: ShardErrorCode
SHARD_ERROR_INTERNAL: ShardErrorCode
TENSOR_DTYPE_UNSPECIFIED: TensorDtype
TENSOR_DTYPE_FLOAT32: TensorDtype
TENSOR_DTYPE_FLOAT16: TensorDtype

class TensorFragment(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ActivationTensor(_message.Message):
    __slots__ = ("dtype", "shape", "fragments", "crc32c")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    dtype: TensorDtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    fragments: _containers.RepeatedCompositeFieldContainer[TensorFragment]
    crc32c: int
    def __init__(self, dtype: _Optional[_Union[TensorDtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., fragments: _Optional[_Iterable[_Union[TensorFragment, _Mapping]]] = ..., crc32c: _Optional[int] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("route_session_id", "route_epoch", "deadline_unix_nanos", "sink_tokens", "window_tokens", "max_block", "max_rollback", "requested_credits")
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_CREDITS_FIELD_NUMBER: _ClassVar[int]
    route_session_id: str
    route_epoch: int
    deadline_unix_nanos: int
    sink_tokens: int
    window_tokens: int
    max_block: int
    max_rollback: int
    requested_credits: int
    def __init__(self, route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., deadline_unix_nanos: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., window_tokens: _Optional[int] = ..., max_block: _Optional[int] = ..., max_rollback: _Optional[int] = ..., requested_credits: _Optional[int] = ...) -> None: ...

class SessionAccepted(_message.Message):
    __slots__ = ("route_session_id", "route_epoch", "credits", "layer_start", "layer_end")
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    route_session_id: str
    route_epoch: int
    credits: int
    layer_start: int
    layer_end: int
    def __init__(self, route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., credits: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class ActivationChunk(_message.Message):
    __slots__ = ("route_session_id", "route_epoch", "deadline_unix_nanos", "idempotency_step", "position", "hidden", "token_ids", "all_logits")
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_LOGITS_FIELD_NUMBER: _ClassVar[int]
    route_session_id: str
    route_epoch: int
    deadline_unix_nanos: int
    idempotency_step: int
    position: int
    hidden: ActivationTensor
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    all_logits: bool
    def __init__(self, route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., deadline_unix_nanos: _Optional[int] = ..., idempotency_step: _Optional[int] = ..., position: _Optional[int] = ..., hidden: _Optional[_Union[ActivationTensor, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., all_logits: _Optional[bool] = ...) -> None: ...

class DecodeStep(_message.Message):
    __slots__ = ("route_epoch", "deadline_unix_nanos", "idempotency_step", "position", "token_id", "hidden")
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    route_epoch: int
    deadline_unix_nanos: int
    idempotency_step: int
    position: int
    token_id: int
    hidden: ActivationTensor
    def __init__(self, route_epoch: _Optional[int] = ..., deadline_unix_nanos: _Optional[int] = ..., idempotency_step: _Optional[int] = ..., position: _Optional[int] = ..., token_id: _Optional[int] = ..., hidden: _Optional[_Union[ActivationTensor, _Mapping]] = ...) -> None: ...

class ShardTrim(_message.Message):
    __slots__ = ("route_epoch", "deadline_unix_nanos", "idempotency_step", "position", "tokens")
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    route_epoch: int
    deadline_unix_nanos: int
    idempotency_step: int
    position: int
    tokens: int
    def __init__(self, route_epoch: _Optional[int] = ..., deadline_unix_nanos: _Optional[int] = ..., idempotency_step: _Optional[int] = ..., position: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class ShardDigest(_message.Message):
    __slots__ = ("route_epoch", "deadline_unix_nanos", "idempotency_step", "position")
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    route_epoch: int
    deadline_unix_nanos: int
    idempotency_step: int
    position: int
    def __init__(self, route_epoch: _Optional[int] = ..., deadline_unix_nanos: _Optional[int] = ..., idempotency_step: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class CancelSignal(_message.Message):
    __slots__ = ("route_epoch", "work_id")
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    route_epoch: int
    work_id: int
    def __init__(self, route_epoch: _Optional[int] = ..., work_id: _Optional[int] = ...) -> None: ...

class FlowControl(_message.Message):
    __slots__ = ("credits_granted", "credits_available")
    CREDITS_GRANTED_FIELD_NUMBER: _ClassVar[int]
    CREDITS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    credits_granted: int
    credits_available: int
    def __init__(self, credits_granted: _Optional[int] = ..., credits_available: _Optional[int] = ...) -> None: ...

class ShardRequestFrame(_message.Message):
    __slots__ = ("open", "chunk", "decode", "trim", "cancel", "digest", "kv_export", "kv_import")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    TRIM_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    KV_EXPORT_FIELD_NUMBER: _ClassVar[int]
    KV_IMPORT_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    chunk: ActivationChunk
    decode: DecodeStep
    trim: ShardTrim
    cancel: CancelSignal
    digest: ShardDigest
    kv_export: ShardKvExport
    kv_import: ShardKvImport
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., chunk: _Optional[_Union[ActivationChunk, _Mapping]] = ..., decode: _Optional[_Union[DecodeStep, _Mapping]] = ..., trim: _Optional[_Union[ShardTrim, _Mapping]] = ..., cancel: _Optional[_Union[CancelSignal, _Mapping]] = ..., digest: _Optional[_Union[ShardDigest, _Mapping]] = ..., kv_export: _Optional[_Union[ShardKvExport, _Mapping]] = ..., kv_import: _Optional[_Union[ShardKvImport, _Mapping]] = ...) -> None: ...

class ShardStepResult(_message.Message):
    __slots__ = ("idempotency_step", "position", "next_position", "output", "layer_digests", "keys", "values")
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LAYER_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    idempotency_step: int
    position: int
    next_position: int
    output: ActivationTensor
    layer_digests: _containers.RepeatedScalarFieldContainer[bytes]
    keys: _containers.RepeatedCompositeFieldContainer[ActivationTensor]
    values: _containers.RepeatedCompositeFieldContainer[ActivationTensor]
    def __init__(self, idempotency_step: _Optional[int] = ..., position: _Optional[int] = ..., next_position: _Optional[int] = ..., output: _Optional[_Union[ActivationTensor, _Mapping]] = ..., layer_digests: _Optional[_Iterable[bytes]] = ..., keys: _Optional[_Iterable[_Union[ActivationTensor, _Mapping]]] = ..., values: _Optional[_Iterable[_Union[ActivationTensor, _Mapping]]] = ...) -> None: ...

class ShardAck(_message.Message):
    __slots__ = ("idempotency_step", "duplicate", "cancelled")
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    idempotency_step: int
    duplicate: bool
    cancelled: bool
    def __init__(self, idempotency_step: _Optional[int] = ..., duplicate: _Optional[bool] = ..., cancelled: _Optional[bool] = ...) -> None: ...

class ShardError(_message.Message):
    __slots__ = ("code", "message", "retryable", "session_closed", "idempotency_step")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    SESSION_CLOSED_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    code: ShardErrorCode
    message: str
    retryable: bool
    session_closed: bool
    idempotency_step: int
    def __init__(self, code: _Optional[_Union[ShardErrorCode, str]] = ..., message: _Optional[str] = ..., retryable: _Optional[bool] = ..., session_closed: _Optional[bool] = ..., idempotency_step: _Optional[int] = ...) -> None: ...

class ShardResponseFrame(_message.Message):
    __slots__ = ("accepted", "result", "ack", "error", "flow")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FLOW_FIELD_NUMBER: _ClassVar[int]
    accepted: SessionAccepted
    result: ShardStepResult
    ack: ShardAck
    error: ShardError
    flow: FlowControl
    def __init__(self, accepted: _Optional[_Union[SessionAccepted, _Mapping]] = ..., result: _Optional[_Union[ShardStepResult, _Mapping]] = ..., ack: _Optional[_Union[ShardAck, _Mapping]] = ..., error: _Optional[_Union[ShardError, _Mapping]] = ..., flow: _Optional[_Union[FlowControl, _Mapping]] = ...) -> None: ...

class ShardCapabilityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardCapability(_message.Message):
    __slots__ = ("model_name", "model_fingerprint", "num_layers", "layer_start", "layer_end", "hidden_size", "vocab_size", "activation_dtype", "max_block", "max_rollback", "max_sessions", "max_sink", "max_window", "max_credits", "kernels")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SINK_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_CREDITS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_fingerprint: str
    num_layers: int
    layer_start: int
    layer_end: int
    hidden_size: int
    vocab_size: int
    activation_dtype: TensorDtype
    max_block: int
    max_rollback: int
    max_sessions: int
    max_sink: int
    max_window: int
    max_credits: int
    kernels: str
    def __init__(self, model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., activation_dtype: _Optional[_Union[TensorDtype, str]] = ..., max_block: _Optional[int] = ..., max_rollback: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_sink: _Optional[int] = ..., max_window: _Optional[int] = ..., max_credits: _Optional[int] = ..., kernels: _Optional[str] = ...) -> None: ...

class ShardHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardHealthResponse(_message.Message):
    __slots__ = ("serving", "detail", "sessions", "kv_bytes", "steps", "rows", "busy_seconds", "forwards")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    detail: str
    sessions: int
    kv_bytes: int
    steps: int
    rows: int
    busy_seconds: float
    forwards: int
    def __init__(self, serving: _Optional[bool] = ..., detail: _Optional[str] = ..., sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., steps: _Optional[int] = ..., rows: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., forwards: _Optional[int] = ...) -> None: ...

class ShardCancelRequest(_message.Message):
    __slots__ = ("route_session_id", "route_epoch", "work_id")
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    route_session_id: str
    route_epoch: int
    work_id: int
    def __init__(self, route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., work_id: _Optional[int] = ...) -> None: ...

class ShardCancelResponse(_message.Message):
    __slots__ = ("session_existed", "cancelled")
    SESSION_EXISTED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    session_existed: bool
    cancelled: bool
    def __init__(self, session_existed: _Optional[bool] = ..., cancelled: _Optional[bool] = ...) -> None: ...

class ShardReleaseRequest(_message.Message):
    __slots__ = ("route_session_id", "route_epoch")
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    route_session_id: str
    route_epoch: int
    def __init__(self, route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ...) -> None: ...

class ShardReleaseResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class ShardKvExport(_message.Message):
    __slots__ = ("route_epoch", "deadline_unix_nanos", "idempotency_step", "position")
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    route_epoch: int
    deadline_unix_nanos: int
    idempotency_step: int
    position: int
    def __init__(self, route_epoch: _Optional[int] = ..., deadline_unix_nanos: _Optional[int] = ..., idempotency_step: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class ShardKvImport(_message.Message):
    __slots__ = ("route_epoch", "deadline_unix_nanos", "idempotency_step", "position", "target_position", "keys", "values")
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TARGET_POSITION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    route_epoch: int
    deadline_unix_nanos: int
    idempotency_step: int
    position: int
    target_position: int
    keys: _containers.RepeatedCompositeFieldContainer[ActivationTensor]
    values: _containers.RepeatedCompositeFieldContainer[ActivationTensor]
    def __init__(self, route_epoch: _Optional[int] = ..., deadline_unix_nanos: _Optional[int] = ..., idempotency_step: _Optional[int] = ..., position: _Optional[int] = ..., target_position: _Optional[int] = ..., keys: _Optional[_Iterable[_Union[ActivationTensor, _Mapping]]] = ..., values: _Optional[_Iterable[_Union[ActivationTensor, _Mapping]]] = ...) -> None: ...

class ShardBatchEntry(_message.Message):
    __slots__ = ("route_session_id", "frame")
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    route_session_id: str
    frame: ShardRequestFrame
    def __init__(self, route_session_id: _Optional[str] = ..., frame: _Optional[_Union[ShardRequestFrame, _Mapping]] = ...) -> None: ...

class ShardBatchRequest(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ShardBatchEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[ShardBatchEntry, _Mapping]]] = ...) -> None: ...

class ShardBatchResponse(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[ShardResponseFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[ShardResponseFrame, _Mapping]]] = ...) -> None: ...
