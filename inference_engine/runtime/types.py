"""Typed requests and results at the runtime's boundary (no protobuf below the servicer)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from inference_engine.decoding.call_output import Usage
from inference_engine.decoding.logprobs import TokenLogprobs
from inference_engine.decoding.options import GenerationOptions
from inference_engine.security.settings import ANONYMOUS
from inference_engine.text.chat import ChatInput, TextInput

DEFAULT_DRAFT_TOKENS = 4  # K when a request asks for 0


class StopReason(enum.Enum):
    """Why a Generate call ended."""

    MAX_TOKENS = 1  # produced max_new_tokens
    EOS = 2  # produced an end-of-sequence token (included in the stream)
    CANCELLED = 3  # the session was closed or the server is shutting down
    STOP_STRING = 4  # the streamed text reached a stop string
    CONSTRAINT_COMPLETE = 5  # the output completed the call's constraint (no further token allowed)


class DecodeMode(enum.Enum):
    """How Generate produces tokens (all token-identical to greedy)."""

    GREEDY = 0  # one target forward per token
    SPECULATIVE_DRAFT = 1  # a draft model proposes, the target verifies
    SPECULATIVE_LOOKUP = 2  # n-gram matches in the session's history propose


@dataclass(frozen=True)
class CreateSessionParams:
    """A validated CreateSession request."""

    eos_token_ids: tuple[int, ...]  # empty = the model's EOS ids
    client_label: str  # echoed back
    sink: int  # 0 = server default
    window: int  # 0 = server default
    owner: str = ANONYMOUS  # identity the session will belong to


@dataclass(frozen=True)
class AppendParams:
    """A validated AppendTokens request."""

    session_id: str  # target session
    tokens: tuple[int, ...]  # non-empty, each < vocab size; () when `text` is set
    text: TextInput | ChatInput | None = None  # text or chat messages, tokenized once the session is held
    expected_history_length: int | None = None  # fail unless the history holds exactly this many tokens
    owner: str = ANONYMOUS  # caller's identity (must own the session)


@dataclass(frozen=True)
class GenerateParams:
    """A validated Generate request."""

    session_id: str  # target session
    max_new_tokens: int  # 1..server limit (0 in the request: the server default)
    ignore_eos: bool  # keep going past EOS tokens
    mode: DecodeMode = DecodeMode.GREEDY  # decoding strategy
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS  # K, drafts per step (speculative modes)
    options: GenerationOptions = GenerationOptions()  # sampling, stop strings, EOS ids, logprobs
    owner: str = ANONYMOUS  # caller's identity (must own the session)


@dataclass(frozen=True)
class SessionCreated:
    """Result of CreateSession."""

    session_id: str  # unguessable id
    sink: int  # effective sink tokens
    window: int  # effective window tokens


@dataclass(frozen=True)
class AppendResult:
    """Result of AppendTokens."""

    history_length: int  # tokens in the session's history
    next_global_position: int  # == history_length (INV-2)
    tokens: tuple[int, ...] = ()  # the tokens this call appended


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed piece of a Generate call."""

    tokens: tuple[int, ...]  # new tokens (may be empty on the final chunk)
    stop_reason: StopReason | None = None  # set on the final chunk only
    history_length: int = 0  # final chunk only
    drafted: int = 0  # final chunk only: draft tokens verified in this call
    accepted: int = 0  # final chunk only: draft tokens accepted in this call
    text: str = ""  # text of the tokens (and, on the final chunk, held-back text)
    logprobs: tuple[TokenLogprobs, ...] = ()  # per token, when asked for
    usage: Usage | None = None  # final chunk only
    seed: int = 0  # final chunk only: the seed the call sampled with


@dataclass(frozen=True)
class SessionInfo:
    """Result of GetSessionInfo."""

    session_id: str  # id
    history_length: int  # tokens in history
    next_global_position: int  # position of the next token
    cached_tokens: int  # tokens the next query attends to
    sink: int  # sink tokens
    window: int  # window tokens
    eos_token_ids: tuple[int, ...]  # effective EOS ids
    client_label: str  # label
    created_ns: int  # creation wall time
    last_used_ns: int  # last use wall time
    state_digest: str  # hex SHA-256 of the exact state
    is_exact: bool  # probed bit-exact path
    kv_bytes: int  # KV storage held
