"""RuntimeService over grpc.aio: protobuf in, frozen dataclasses down, errors mapped once.

Every call acts for the caller's identity (security/authenticator.py): a session is
visible only to the identity that created it. Until a runtime is attached (the model is
still loading) every call is UNAVAILABLE.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import grpc

from inference_engine import metrics
from inference_engine.errors import EngineUnavailable, RuntimeServiceError
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.types import CreateSessionParams, GenerateChunk
from inference_engine.server import call_record, convert
from inference_engine.server.error_details import abort_with
from inference_engine.server.model_info import describe_model
from inference_engine.server.validation import Validator
from inference_engine.status_codes import mapped
from inference_engine.text.chat import ChatInput
from inference_engine.text.codec import require
from inference_engine.text.text_pool import run_text
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
Identify = Callable[[grpc.aio.ServicerContext], str]  # the caller's identity


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    message = None if isinstance(exc, RuntimeServiceError) else f"internal error: {type(exc).__name__}: {exc}"
    await abort_with(context, exc, message)


def _identify(self: "RuntimeServicer", context: grpc.aio.ServicerContext) -> tuple[str]:
    """The caller's identity (its sessions' owner), once the runtime is attached."""
    if self.runtime is None:
        raise EngineUnavailable("the server is starting (the model is still loading); retry shortly")
    owner = self.identify(context)
    call_record.current().identity = owner
    return (owner,)


_mapped = mapped(_abort, _identify)  # identify the caller, run the call for it; abort with the mapped status


class RuntimeServicer(pb_grpc.RuntimeServiceServicer):
    """Converts and validates requests, then delegates to the Runtime."""

    def __init__(self, identify: Identify):
        """
        Args:
            identify: the caller's identity from its call context (its sessions' owner;
                Authenticator.identity_of).
        """
        self.runtime: Runtime | None = None  # set by `attach`; calls are UNAVAILABLE until then
        self.identify = identify

    def attach(self, runtime: Runtime) -> None:
        """Start serving calls with `runtime`."""
        self.validate = Validator(runtime.config, runtime.engine.spec.vocab_size)
        self.model_info = describe_model(runtime.engine, runtime.config, runtime.text)
        self.runtime = runtime

    @_mapped
    async def CreateSession(self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext,
                            owner: str) -> pb.CreateSessionResponse:
        v = self.validate
        v.length("CreateSessionRequest.client_label", len(request.client_label), "characters")
        params = CreateSessionParams(
            eos_token_ids=v.items("CreateSessionRequest.eos_token_ids", list(request.eos_token_ids)),
            client_label=request.client_label,
            sink=v.value("CreateSessionRequest.sink_tokens", request.sink_tokens),
            window=v.value("CreateSessionRequest.window_tokens", request.window_tokens),
            owner=owner,
        )
        created = await self.runtime.create_session(params)
        call_record.current().session_id = created.session_id
        return pb.CreateSessionResponse(session_id=created.session_id, sink_tokens=created.sink, window_tokens=created.window)

    @_mapped
    async def AppendTokens(self, request: pb.AppendTokensRequest, context: grpc.aio.ServicerContext,
                           owner: str) -> pb.AppendTokensResponse:
        record = call_record.current()
        record.session_id = request.session_id
        params = dataclasses.replace(convert.append_params(self.validate, request), owner=owner)
        result = await self.runtime.append_tokens(params)
        record.tokens_in = len(result.tokens)
        metrics.TOKENS_APPENDED.inc(len(result.tokens))
        return pb.AppendTokensResponse(history_length=result.history_length, next_global_position=result.next_global_position,
                                       tokens=result.tokens)

    @_mapped
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, owner: str) -> None:
        record = call_record.current()
        record.session_id = request.session_id
        params = dataclasses.replace(convert.generate_params(self.validate, self.runtime.config, request), owner=owner)
        record.tokens_out = 0
        last = time.perf_counter()  # call start, then the previous step's hand-off

        async def emit(chunk: GenerateChunk) -> None:
            nonlocal last
            if chunk.tokens:
                now = time.perf_counter()
                (metrics.DECODE_STEP_SECONDS if record.tokens_out else metrics.TIME_TO_FIRST_TOKEN).observe(now - last)
                last = now
                record.tokens_out += len(chunk.tokens)
                metrics.TOKENS_GENERATED.inc(len(chunk.tokens))
            if chunk.stop_reason:
                record.stop_reason = chunk.stop_reason.name
            await context.write(convert.generate_response(chunk))

        await self.runtime.generate(params, emit)

    @_mapped
    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext,
                           owner: str) -> pb.CloseSessionResponse:
        call_record.current().session_id = request.session_id
        n = await self.runtime.close_session(self.validate.session_id(request.session_id), owner)
        return pb.CloseSessionResponse(history_length=n)

    @_mapped
    async def GetSessionInfo(self, request: pb.GetSessionInfoRequest, context: grpc.aio.ServicerContext,
                             owner: str) -> pb.GetSessionInfoResponse:
        call_record.current().session_id = request.session_id
        i = await self.runtime.session_info(self.validate.session_id(request.session_id), owner)
        return pb.GetSessionInfoResponse(
            session_id=i.session_id, history_length=i.history_length, next_global_position=i.next_global_position,
            cached_tokens=i.cached_tokens, sink_tokens=i.sink, window_tokens=i.window,
            eos_token_ids=i.eos_token_ids, client_label=i.client_label, created_unix_nanos=i.created_ns,
            last_used_unix_nanos=i.last_used_ns, state_digest=i.state_digest, exact=i.is_exact, kv_bytes=i.kv_bytes,
        )

    @_mapped
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext,
                           owner: str) -> pb.GetModelInfoResponse:
        return convert.model_info_response(self.model_info)

    @_mapped
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext,
                       owner: str) -> bytes:
        """The response comes serialized (sent as is: `service_registration`): a large text's ids are
        serialized in a tokenizer process, so this process never builds them (issue 28, defect 3)."""
        what = convert.tokenize_input(self.validate, request)
        codec = require(self.runtime.text)

        def tokenize() -> bytes:  # off the event loop: templates and long texts take a while
            if isinstance(what, ChatInput):
                text, special = codec.render(what.messages, what.add_generation_prompt), False
            else:
                text, special = what.text, request.add_special_tokens
            tokens = codec.encode_serialized(text, special, pb.TokenizeResponse, "tokens")
            return tokens + pb.TokenizeResponse(text=text).SerializeToString()  # fields concatenate

        return await run_text(tokenize)  # a text thread, below the engine's priority

    @_mapped
    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext,
                         owner: str) -> pb.DetokenizeResponse:
        tokens = self.validate.items("DetokenizeRequest.tokens", list(request.tokens))
        codec = require(self.runtime.text)
        text = await run_text(codec.decode, tokens, request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)
