"""The OpenAI-compatible HTTP API as a FastAPI app over the server's one Runtime.

Routes: GET /health, GET /v1/models (and /v1/models/{id}), POST /v1/chat/completions, POST /v1/completions
(/docs and /openapi.json describe them). Callers are identified as on the gRPC port:
the bearer token's identity (`Authorization: Bearer <token>`), or anonymous without
--auth-token-file. Until a runtime is attached (the model is loading) and while draining,
/health is 503 and every other call is 503 too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from typing import TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference_engine.errors import EngineUnavailable, RuntimeServiceError, Unauthenticated, UnknownModel
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

T = TypeVar("T")
log = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # the status logged for a request whose client hung up first (nginx's "client closed request")


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


def build_app(state: ApiState, allow_origins: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI app over `state`.

    Args:
        allow_origins: web origins whose pages may call it from a browser (CORS; () = none, "*" = any).
    """
    app = FastAPI(title="inference_engine OpenAI-compatible API", version="1",
                  description="Exact sessions behind OpenAI's chat and completions endpoints; see docs/openai.md.")
    app.add_middleware(observer.RequestObserver)
    if allow_origins:  # outside the observer: a preflight is answered here (a bearer token needs no cookies)
        app.add_middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)

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
    app.add_exception_handler(RequestValidationError,
                              lambda request, exc: validation_response(exc, request.headers.get("content-type", "")))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, exc.status_code, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    app.add_exception_handler(StarletteHTTPException, http_error)  # unexpected errors: observer.RequestObserver

    @app.head("/health", include_in_schema=False)  # load balancers' probes
    @app.get("/health", summary="200 when serving; 503 while the model loads or the server drains")
    async def health() -> JSONResponse:
        status = "draining" if state.is_draining else "loading" if state.serving is None else "ok"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    def model_object(s: Serving) -> dict:
        return {"id": s.info.model_name, "object": "model", "created": 0, "owned_by": "inference_engine"}

    @app.get("/v1/models", summary="The served model")
    async def models(owner: str = Depends(identity)) -> dict:
        return {"object": "list", "data": [model_object(state.ready())]}

    @app.get("/v1/models/{model:path}", summary="The served model, by its id (404 for any other)")
    async def model(model: str, owner: str = Depends(identity)) -> dict:
        s = state.ready()
        if model != s.info.model_name:
            raise UnknownModel(f"model {model!r} is not served here; GET /v1/models lists {s.info.model_name!r}")
        return model_object(s)

    @app.post("/v1/chat/completions", summary="Chat completion (streamed with stream: true)")
    async def chat_completions(body: ChatCompletionRequest, request: Request, owner: str = Depends(identity)):
        s = state.ready()
        job = chat_job(s.validate, s.runtime.config, body, s.info.model_name)
        return await _respond(s, replace(job, owner=owner), request)

    @app.post("/v1/completions", summary="Text completion of a string or token ids (streamed with stream: true)")
    async def completions(body: CompletionRequest, request: Request, owner: str = Depends(identity)):
        s = state.ready()
        job = completion_job(s.validate, s.runtime.config, body, s.info.model_name)
        return await _respond(s, replace(job, owner=owner), request)

    return app


async def _respond(s: Serving, job: CompletionJob, request: Request):
    """One JSON object, or an SSE stream whose first chunk is already computed (errors before it are JSON).

    A client that hangs up before the object or the first chunk is sent cancels the request there
    (its prefill or its generation: the sessions are given back at once), logged as 499.
    """
    wants_logprobs = job.options.logprobs
    token_bytes = await s.service.token_bytes() if wants_logprobs else None
    writer = ResponseWriter(job.is_chat, s.info.model_name, s.fingerprint, s.runtime.text, job.n, job.tools,
                            token_bytes)
    record = observer.current()
    events = s.service.run(job)

    def account(item: ChoiceChunk | CompletionUsage) -> None:
        if isinstance(item, CompletionUsage):
            record.prompt_tokens, record.completion_tokens = item.prompt_tokens, item.completion_tokens
            record.cached_tokens = item.cached_tokens
        elif item.chunk.stop_reason:
            record.stop_reason = item.chunk.stop_reason.name

    if not job.stream:
        async def collect() -> CompletionUsage:
            usage = None
            async for item in events:
                account(item)
                if isinstance(item, CompletionUsage):
                    usage = item
                else:
                    writer.add(item)
            assert usage is not None
            return usage

        try:
            usage = await _unless_gone(request, collect())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            await events.aclose()
        return JSONResponse(writer.final(usage, wants_logprobs))
    try:
        first = await _unless_gone(request, events.__anext__())  # prefill done: errors so far get their status
    except ClientGone:
        await events.aclose()
        return Response(status_code=CLIENT_CLOSED)
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


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) when the client hangs up first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client left first (or this handler was cancelled): stop the work
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task not in done:
        observer.current().stop_reason = "CLIENT_GONE"
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body was read already: nothing else arrives)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a receive that cannot tell: never cut a request short on a guess
        log.debug("cannot watch the connection of an HTTP request", exc_info=True)
        await asyncio.Event().wait()


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
