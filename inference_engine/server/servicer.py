"""RuntimeService over grpc.aio: protobuf in, frozen dataclasses down, errors mapped once."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable

import grpc

from inference_engine.errors import RuntimeServiceError
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.types import CreateSessionParams, GenerateChunk
from inference_engine.server import convert  # issue 13: text, sampling, model info
from inference_engine.server.model_info import describe_model
from inference_engine.server.status_codes import status_of
from inference_engine.server.validation import Validator
from inference_engine.text.chat import ChatInput
from inference_engine.text.codec import require
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def _mapped(method: Callable) -> Callable:
    """Abort with the mapped status code on runtime errors; log unexpected ones."""

    @functools.wraps(method)
    async def wrapper(self: "RuntimeServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except RuntimeServiceError as exc:
            await context.abort(status_of(exc), str(exc))
        except Exception as exc:  # noqa: BLE001 - the INTERNAL catch-all, logged
            log.exception("unexpected error in %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    return wrapper


class RuntimeServicer(pb_grpc.RuntimeServiceServicer):
    """Converts and validates requests, then delegates to the Runtime."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.validate = Validator(runtime.config, runtime.engine.spec.vocab_size)
        self.model_info = describe_model(runtime.engine, runtime.config, runtime.text)

    @_mapped
    async def CreateSession(self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext) -> pb.CreateSessionResponse:
        v = self.validate
        v.length("CreateSessionRequest.client_label", len(request.client_label))
        params = CreateSessionParams(
            eos_token_ids=v.items("CreateSessionRequest.eos_token_ids", list(request.eos_token_ids)),
            client_label=request.client_label,
            sink=v.value("CreateSessionRequest.sink_tokens", request.sink_tokens),
            window=v.value("CreateSessionRequest.window_tokens", request.window_tokens),
        )
        created = await self.runtime.create_session(params)
        return pb.CreateSessionResponse(session_id=created.session_id, sink_tokens=created.sink, window_tokens=created.window)

    @_mapped
    async def AppendTokens(self, request: pb.AppendTokensRequest, context: grpc.aio.ServicerContext) -> pb.AppendTokensResponse:
        result = await self.runtime.append_tokens(convert.append_params(self.validate, request))
        return pb.AppendTokensResponse(history_length=result.history_length, next_global_position=result.next_global_position,
                                       tokens=result.tokens)

    @_mapped
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        params = convert.generate_params(self.validate, self.runtime.config, request)

        async def emit(chunk: GenerateChunk) -> None:
            await context.write(convert.generate_response(chunk))

        await self.runtime.generate(params, emit)

    @_mapped
    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext) -> pb.CloseSessionResponse:
        n = await self.runtime.close_session(self.validate.session_id(request.session_id))
        return pb.CloseSessionResponse(history_length=n)

    @_mapped
    async def GetSessionInfo(self, request: pb.GetSessionInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetSessionInfoResponse:
        i = await self.runtime.session_info(self.validate.session_id(request.session_id))
        return pb.GetSessionInfoResponse(
            session_id=i.session_id, history_length=i.history_length, next_global_position=i.next_global_position,
            cached_tokens=i.cached_tokens, sink_tokens=i.sink, window_tokens=i.window,
            eos_token_ids=i.eos_token_ids, client_label=i.client_label, created_unix_nanos=i.created_ns,
            last_used_unix_nanos=i.last_used_ns, state_digest=i.state_digest, exact=i.is_exact, kv_bytes=i.kv_bytes,
        )

    @_mapped
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        return convert.model_info_response(self.model_info)

    @_mapped
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        what = convert.tokenize_input(self.validate, request)
        codec = require(self.runtime.text)

        def tokenize() -> tuple[list[int], str]:  # off the event loop: templates and long texts take a while
            if isinstance(what, ChatInput):
                text = codec.render(what.messages, what.add_generation_prompt)
                return codec.encode(text), text
            return codec.encode(what.text, request.add_special_tokens), what.text

        tokens, text = await asyncio.to_thread(tokenize)
        return pb.TokenizeResponse(tokens=tokens, text=text)

    @_mapped
    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        tokens = self.validate.items("DetokenizeRequest.tokens", list(request.tokens))
        codec = require(self.runtime.text)
        text = await asyncio.to_thread(codec.decode, tokens, request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)
