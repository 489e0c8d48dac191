"""A small synchronous RuntimeService client for the CLI (imports grpc, protobuf and the stubs only)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import grpc

from inference_engine.client.connect_errors import explain, is_connection_failure
from inference_engine.security.credentials import open_sync_channel
from inference_engine.security.settings import ClientSecurity
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

RPC_TIMEOUT_S = 60.0  # unary calls; a Generate stream has no deadline (it may be long)
BUSY_WAIT_S = 10.0  # an append finding the session busy retries this long (a cancelled reply still ending)


class ServerUnavailable(Exception):
    """The server at the target address cannot be reached or used (the message says why)."""


@dataclass(frozen=True)
class GenerateSettings:
    """The Generate fields the CLI sets (0 / None keep the server's meaning: default or off)."""

    max_new_tokens: int = 0  # 0 = the server default
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = all tokens
    top_p: float = 0.0  # 0 = all tokens
    min_p: float = 0.0  # 0 = all tokens
    repetition_penalty: float = 0.0  # 0 = none
    seed: int | None = None  # None = the server picks one (reported on the last message)
    stop: tuple[str, ...] = ()  # stop strings
    top_logprobs: int | None = None  # None = no logprobs; N = logprobs with N alternatives
    ignore_eos: bool = False  # keep going past EOS
    mode: int = pb.DECODE_MODE_GREEDY  # plain decoding or a speculative mode
    json_schema: str | None = None  # the reply is JSON this schema (JSON text) validates
    regex: str | None = None  # the reply matches this regular expression

    def request(self, session_id: str) -> pb.GenerateRequest:
        """The GenerateRequest for a session."""
        req = pb.GenerateRequest(
            session_id=session_id, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            stop=self.stop, ignore_eos=self.ignore_eos, mode=self.mode,
            logprobs=self.top_logprobs is not None, top_logprobs=self.top_logprobs or 0,
        )
        if self.seed is not None:
            req.seed = self.seed
        if self.json_schema is not None:
            req.constraint.json_schema = self.json_schema
        elif self.regex is not None:
            req.constraint.regex = self.regex
        return req


class RuntimeClient:
    """One channel to a server; sessions, appends and streamed generation."""

    def __init__(self, target: str, connect_timeout_s: float = 5.0, security: ClientSecurity | None = None):
        """
        Args:
            target: HOST:PORT of the server.
            connect_timeout_s: how long `connect` waits for a server that answers but is not ready.
            security: TLS files and bearer token to present (None: plaintext, no token).
        Raises:
            ValueError: a token would travel in clear to a non-loopback address.
            OSError: a TLS file cannot be read.
        """
        self.target = target
        self.connect_timeout_s = connect_timeout_s
        self.security = security or ClientSecurity()
        self.channel = open_sync_channel(target, self.security)
        self.stub = pb_grpc.RuntimeServiceStub(self.channel)

    def connect(self) -> pb.GetModelInfoResponse:
        """Describe the server's model, failing at once where nothing can be reached.

        A refused connection, a failed TLS handshake or refused credentials end it at once; a server
        that answers UNAVAILABLE (still loading its model) is asked again until the timeout.

        Raises:
            ServerUnavailable: the server cannot be reached or used; the message says why.
        """
        give_up = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=max(0.1, give_up - time.monotonic()))
            except grpc.RpcError as exc:
                waiting = exc.code() == grpc.StatusCode.UNAVAILABLE and not is_connection_failure(exc)
                if not waiting or time.monotonic() + 0.2 > give_up:
                    what = explain(self.target, exc, self.security)
                    if waiting:
                        what = f"{what} (still not ready after {self.connect_timeout_s:g} s; --connect-timeout)"
                    raise ServerUnavailable(what) from None
            time.sleep(0.2)

    def create_session(self) -> str:
        """A new session's id."""
        return self.stub.CreateSession(pb.CreateSessionRequest(client_label="cli"), timeout=RPC_TIMEOUT_S).session_id

    def append_chat(self, session_id: str, messages: list[tuple[str, str]]) -> pb.AppendTokensResponse:
        """Append chat turn(s) (role, content) ending with the assistant's header."""
        req = pb.AppendTokensRequest(session_id=session_id, add_generation_prompt=True,
                                     messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])
        return self._append(req)

    def append_text(self, session_id: str, text: str) -> pb.AppendTokensResponse:
        """Append text as it is (no template)."""
        return self._append(pb.AppendTokensRequest(session_id=session_id, text=text))

    def _append(self, req: pb.AppendTokensRequest) -> pb.AppendTokensResponse:
        """AppendTokens, retried while the session is busy (ABORTED: the call before it, a reply just
        cancelled with Ctrl-C, ends at its next step) for up to BUSY_WAIT_S; a busy session appends
        nothing, so the retry is safe."""
        give_up, pause = time.monotonic() + BUSY_WAIT_S, 0.02
        while True:
            try:
                return self.stub.AppendTokens(req, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.ABORTED or time.monotonic() + pause > give_up:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    def generate(self, session_id: str, settings: GenerateSettings) -> Iterator[pb.GenerateResponse]:
        """The Generate stream (cancel it with `.cancel()`)."""
        return self.stub.Generate(settings.request(session_id))

    def close_session(self, session_id: str) -> None:
        """Close a session; an already-gone session, or a server going away (draining, stopped), is fine."""
        try:
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()
