"""The HTTP API's server: uvicorn on the gRPC server's event loop, its TLS and tokens.

uvicorn runs embedded (no signal handlers of its own: the server process owns SIGTERM) on
a socket bound here, exclusively like the gRPC port. It starts with the gRPC port, before
the model is loaded (503 until `attach`), and drains with it: `begin_drain` makes /health
503 and refuses new requests, `stop` lets running ones finish within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import uvicorn

from inference_engine.config import ServerConfig
from inference_engine.runtime.runtime import Runtime
from inference_engine.security.authenticator import Authenticator
from inference_engine.server.openai_api.app import ApiState, Serving, build_app

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers (they would replace the server's own SIGTERM handling)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port, bound exclusively (no SO_REUSEPORT)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; a listener still refuses
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class HttpFrontend:
    """The OpenAI-compatible API on its own port, over the server's runtime."""

    def __init__(self, cfg: ServerConfig, authenticator: Authenticator | None = None):
        """
        Args:
            cfg: the server's config (TLS files, grace).
            authenticator: who callers are (the gRPC port's; built from cfg.security if None).
        Raises:
            OSError, ValueError: the token file cannot be read or is malformed.
        """
        self.cfg = cfg
        self.state = ApiState(authenticator or Authenticator.from_security(cfg.security))
        self.app = build_app(self.state, cfg.http_allow_origins)
        self.port = 0
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None

    @property
    def serving(self) -> Serving | None:
        """The attached runtime's serving state (None while the model loads)."""
        return self.state.serving

    async def start(self, host: str, port: int) -> int:
        """Bind and serve (503 until `attach`); returns the bound port.

        Raises:
            OSError: the address cannot be bound (in use, not local).
        """
        s = self.cfg.security
        sock = _bind(host, port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_config=None, log_level="warning", access_log=False, lifespan="off", server_header=False,
            ssl_certfile=str(s.tls_cert) if s.tls_cert else None, ssl_keyfile=str(s.tls_key) if s.tls_key else None,
            ssl_ca_certs=str(s.tls_client_ca) if s.tls_client_ca else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if s.is_mtls else ssl.CERT_NONE,
            timeout_graceful_shutdown=max(0.1, self.cfg.grace_s), timeout_keep_alive=5,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP API did not start on {host}:{self.port}")
            await asyncio.sleep(0.01)
        return self.port

    def attach(self, runtime: Runtime) -> Serving:
        """Serve `runtime` from now on."""
        return self.state.attach(runtime)

    def begin_drain(self) -> None:
        """Shutting down: /health 503, new requests 503 (running ones go on)."""
        self.state.is_draining = True

    def close_cache(self) -> None:
        """Close the prefix cache's kept sessions (after the running requests drained)."""
        if self.state.serving is not None:
            self.state.serving.service.cache.clear()

    async def stop(self, grace_s: float) -> None:
        """Stop taking connections; running requests get `grace_s` to finish, then are cancelled."""
        if self._server is None or self._task is None:
            return
        self.begin_drain()
        self._server.config.timeout_graceful_shutdown = max(0.1, grace_s)
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._task), grace_s + 2.0)
        if not self._task.done():
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        self._server = self._task = None
        if self.state.serving is not None:  # forks still being built are closed as they land (draining)
            await self.state.serving.service.cache.forks_built(max(0.1, grace_s))
        self.close_cache()
