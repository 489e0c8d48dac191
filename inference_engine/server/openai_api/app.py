"""The OpenAI-compatible HTTP API as a FastAPI app over the server's one Runtime.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions
(/docs and /openapi.json describe them). Callers are identified as on the gRPC port:
the bearer token's identity (`Authorization: Bearer <token>`), or anonymous without
--auth-token-file. Until a runtime is attached (the model is loading) and while draining,
/health is 503 and every other call is 503 too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference_engine.errors import EngineUnavailable, RuntimeServiceError, Unauthenticated
from inference_engine.runtime.runtime import Runtime
from inference_engine.security.authenticator import AUTHORIZATION, MISSING_TOKEN, Authenticator
from inference_engine.security.settings import ANONYMOUS
from inference_engine.server.model_info import ModelInfo, describe_model
from inference_engine.server.openai_api.completions import ChoiceChunk, CompletionService, CompletionUsage
from inference_engine.server.openai_api import observer
from inference_engine.server.openai_api.errors_http import error_body, error_of, error_response, validation_response
from inference_engine.server.openai_api.params import CompletionJob, chat_job, completion_job
from inference_engine.server.openai_api.render import ResponseWriter, system_fingerprint
from inference_engine.server.openai_api.schema import ChatCompletionRequest, CompletionRequest
from inference_engine.server.validation import Validator


@dataclass
class Serving:
    """What the app serves with once the model is loaded."""

    runtime: Runtime  # the server's one runtime
    service: CompletionService  # sessions, the prefix cache, choices
    validate: Validator  # the one bounds table
    info: ModelInfo  # the served model
    fingerprint: str  # system_fingerprint


class ApiState:
    """The app's mutable state: its runtime once attached, and whether it is draining."""

    def __init__(self, authenticator: Authenticator):
        self.authenticator = authenticator
        self.serving: Serving | None = None
        self.is_draining = False

    def attach(self, runtime: Runtime) -> Serving:
        """Serve `runtime` from now on."""
        validate = Validator(runtime.config, runtime.engine.spec.vocab_size)
        info = describe_model(runtime.engine, runtime.config, runtime.text)
        self.serving = Serving(runtime, CompletionService(runtime, validate), validate, info, system_fingerprint(info))
        return self.serving

    def ready(self) -> Serving:
        """The serving state. Raises EngineUnavailable: loading or draining."""
        if self.is_draining:
            raise EngineUnavailable("the server is shutting down; retry against a live server")
        if self.serving is None:
            raise EngineUnavailable("the server is starting (the model is still loading); retry shortly")
        return self.serving


def build_app(state: ApiState) -> FastAPI:
    """The FastAPI app over `state`."""
    app = FastAPI(title="inference_engine OpenAI-compatible API", version="1",
                  description="Exact sessions behind OpenAI's chat and completions endpoints; see docs/openai.md.")
    app.add_middleware(observer.RequestObserver)

    async def identity(request: Request) -> str:
        auth = state.authenticator
        if auth.tokens is None:
            return ANONYMOUS
        who = auth.identity_of_metadata([(AUTHORIZATION, request.headers.get(AUTHORIZATION, ""))])
        if who is None:
            raise Unauthenticated(MISSING_TOKEN.replace("metadata `authorization: Bearer <token>`",
                                                        "the header `Authorization: Bearer <token>`"))
        observer.current().identity = who
        return who

    app.add_exception_handler(RuntimeServiceError, lambda request, exc: error_response(exc))
    app.add_exception_handler(RequestValidationError, lambda request, exc: validation_response(exc))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, exc.status_code, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    app.add_exception_handler(StarletteHTTPException, http_error)  # unexpected errors: observer.RequestObserver

    @app.get("/health", summary="200 when serving; 503 while the model loads or the server drains")
    async def health() -> JSONResponse:
        status = "draining" if state.is_draining else "loading" if state.serving is None else "ok"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models", summary="The served model")
    async def models(owner: str = Depends(identity)) -> dict:
        s = state.ready()
        return {"object": "list", "data": [{"id": s.info.model_name, "object": "model", "created": 0,
                                            "owned_by": "inference_engine"}]}

    @app.post("/v1/chat/completions", summary="Chat completion (streamed with stream: true)")
    async def chat_completions(body: ChatCompletionRequest, owner: str = Depends(identity)):
        s = state.ready()
        return await _respond(s, replace(chat_job(s.validate, s.runtime.config, body, s.info.model_name), owner=owner))

    @app.post("/v1/completions", summary="Text completion of a string or token ids (streamed with stream: true)")
    async def completions(body: CompletionRequest, owner: str = Depends(identity)):
        s = state.ready()
        job = completion_job(s.validate, s.runtime.config, body, s.info.model_name)
        return await _respond(s, replace(job, owner=owner))

    return app


async def _respond(s: Serving, job: CompletionJob):
    """One JSON object, or an SSE stream whose first chunk is already computed (errors before it are JSON)."""
    writer = ResponseWriter(job.is_chat, s.info.model_name, s.fingerprint, s.runtime.text, job.n, job.tools)
    wants_logprobs = job.options.logprobs
    record = observer.current()
    events = s.service.run(job)

    def account(item: ChoiceChunk | CompletionUsage) -> None:
        if isinstance(item, CompletionUsage):
            record.prompt_tokens, record.completion_tokens = item.prompt_tokens, item.completion_tokens
            record.cached_tokens = item.cached_tokens
        elif item.chunk.stop_reason:
            record.stop_reason = item.chunk.stop_reason.name

    if not job.stream:
        usage = None
        async for item in events:
            account(item)
            if isinstance(item, CompletionUsage):
                usage = item
            else:
                writer.add(item)
        assert usage is not None
        return JSONResponse(writer.final(usage, wants_logprobs))
    try:
        first = await events.__anext__()  # prefill done: errors so far get their status
    except BaseException:
        await events.aclose()
        raise

    async def sse() -> AsyncIterator[str]:
        try:
            item = first
            while True:
                account(item)
                if isinstance(item, CompletionUsage):
                    if job.include_usage:
                        yield _data(writer.usage_chunk(item))
                else:
                    for chunk in writer.chunks(item, wants_logprobs):
                        yield _data(chunk)
                try:
                    item = await events.__anext__()
                except StopAsyncIteration:
                    break
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - mid-stream: the status is sent; the error goes in the stream
            yield _data(error_of(exc)[1])
        finally:
            await events.aclose()

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
