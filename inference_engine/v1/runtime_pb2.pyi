from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_MAX_TOKENS: _ClassVar[StopReason]
    STOP_REASON_EOS: _ClassVar[StopReason]
    STOP_REASON_CANCELLED: _ClassVar[StopReason]

class DecodeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODE_MODE_GREEDY: _ClassVar[DecodeMode]
    DECODE_MODE_SPECULATIVE_DRAFT: _ClassVar[DecodeMode]
    DECODE_MODE_SPECULATIVE_LOOKUP: _ClassVar[DecodeMode]
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_MAX_TOKENS: StopReason
STOP_REASON_EOS: StopReason
STOP_REASON_CANCELLED: StopReason
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

class AppendTokensRequest(_message.Message):
    __slots__ = ("session_id", "tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendTokensResponse(_message.Message):
    __slots__ = ("history_length", "next_global_position")
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEXT_GLOBAL_POSITION_FIELD_NUMBER: _ClassVar[int]
    history_length: int
    next_global_position: int
    def __init__(self, history_length: _Optional[int] = ..., next_global_position: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "max_new_tokens", "ignore_eos", "mode", "num_draft_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_new_tokens: int
    ignore_eos: bool
    mode: DecodeMode
    num_draft_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., mode: _Optional[_Union[DecodeMode, str]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "stop_reason", "history_length", "drafted_tokens", "accepted_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    stop_reason: StopReason
    history_length: int
    drafted_tokens: int
    accepted_tokens: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., history_length: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

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
