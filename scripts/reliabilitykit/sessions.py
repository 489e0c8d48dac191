"""A session as its client knows it: the state GetSessionInfo reports, and a replay to compare it with.

The exact path makes a session's `state_digest` (next-token logits, cached tokens, K/V,
position) a function of its history alone, however it was chunked, so "the server holds
what the client saw" is checkable: a fresh session fed the client's view must report the
same history length and digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import grpc

from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

RPC_TIMEOUT_S = 600.0  # calls the battery does not mean to interrupt (a replay prefills a whole history)


@dataclass(frozen=True)
class SessionState:
    """What GetSessionInfo says of a session (after its running call's clean point)."""

    history_length: int  # tokens in the history
    digest: str  # state_digest


@dataclass(frozen=True)
class Limits:
    """The server's limits and model facts the battery plans with (from GetModelInfo)."""

    vocab_size: int
    max_tokens_per_request: int
    max_new_tokens: int
    max_sink: int
    max_window: int
    max_draft_tokens: int
    max_top_logprobs: int
    max_sessions: int
    has_tokenizer: bool
    has_chat_template: bool
    has_draft_model: bool

    @classmethod
    def of(cls, info: pb.GetModelInfoResponse) -> "Limits":
        """The limits in a GetModelInfoResponse."""
        lim = info.limits
        return cls(info.vocab_size, lim.max_tokens_per_request, lim.max_new_tokens, lim.max_sink_tokens,
                   lim.max_window_tokens, lim.max_draft_tokens, lim.max_top_logprobs, lim.max_sessions,
                   info.has_tokenizer, info.has_chat_template, info.has_draft_model)


async def limits_of(stub: pb_grpc.RuntimeServiceStub) -> Limits:
    """The served model's limits."""
    return Limits.of(await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S))


async def state_of(stub: pb_grpc.RuntimeServiceStub, sid: str) -> SessionState:
    """The session's state as GetSessionInfo reports it."""
    info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid), timeout=RPC_TIMEOUT_S)
    return SessionState(info.history_length, info.state_digest)


async def open_session(stub: pb_grpc.RuntimeServiceStub, tokens: Sequence[int], chunk: int, sink: int = 0,
                       window: int = 0, label: str = "reliability") -> str:
    """A new session fed `tokens` (in appends of at most `chunk`); returns its id."""
    created = await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=sink, window_tokens=window,
                                                               client_label=label), timeout=RPC_TIMEOUT_S)
    for i in range(0, len(tokens), chunk):
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=created.session_id, tokens=tokens[i : i + chunk]),
                                timeout=RPC_TIMEOUT_S)
    return created.session_id


async def close_quietly(stub: pb_grpc.RuntimeServiceStub, sid: str) -> None:
    """Close a session; one already gone (or a server gone) is fine."""
    try:
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=RPC_TIMEOUT_S)
    except grpc.RpcError:
        pass


async def replay_state(stub: pb_grpc.RuntimeServiceStub, tokens: Sequence[int], chunk: int, sink: int,
                       window: int) -> SessionState:
    """The state of a fresh session fed `tokens` (what a replay of a client's view gives); closed afterwards."""
    sid = await open_session(stub, tokens, chunk, sink, window, label="replay")
    try:
        return await state_of(stub, sid)
    finally:
        await close_quietly(stub, sid)
