"""A real OpenAI-compatible HTTP server (uvicorn on 127.0.0.1:0) over a real runtime, and its clients."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator

import openai

from inference_engine.runtime.engine import Engine
from inference_engine.runtime.runtime import Runtime
from inference_engine.security.authenticator import Authenticator
from inference_engine.server.openai_api.http_server import HttpFrontend
from tests.conftest import make_config


@dataclass
class Served:
    """A running HTTP API and what a test needs of it."""

    runtime: Runtime
    http: HttpFrontend
    base_url: str
    model: str

    def client(self, api_key: str = "unused", **kw: object) -> openai.AsyncOpenAI:
        """The official async client (no retries: every error is seen as it is)."""
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)


@contextlib.asynccontextmanager
async def http_api(engine: Engine, authenticator: Authenticator | None = None, **overrides: object
                   ) -> AsyncIterator[Served]:
    """Serve `engine` over the HTTP API on 127.0.0.1:0 (config from make_config(**overrides))."""
    runtime = Runtime(engine, make_config(**overrides))
    http = HttpFrontend(runtime.config, authenticator or Authenticator())
    port = await http.start("127.0.0.1", 0)
    serving = http.attach(runtime)
    runtime.start()
    try:
        yield Served(runtime, http, f"http://127.0.0.1:{port}/v1", serving.info.model_name)
    finally:
        await http.stop(0.5)
        await runtime.stop()
        close_every_session(runtime)


async def forks_settled(s: Served) -> None:
    """Wait until every fallback fork being built is kept or closed: forks land beside the requests that took
    them (a reply's end does not wait), so pool accounting is read after them (a bound on a hang: 60 s)."""
    await s.http.serving.service.cache.forks_built(60.0)


def close_every_session(runtime: Runtime) -> None:
    """Close every session of `runtime` and free what is idle (the shared engine's slabs)."""
    for session in runtime.store.sessions():
        runtime.store.close(session.session_id, session.owner)
