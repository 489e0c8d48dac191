"""The server process: bind, load the model, probe the tile, serve RuntimeService, drain on SIGTERM.

The port is bound first (TLS, tokens and the exposure rule are checked before the slow
part) and answers health checks with NOT_SERVING while the model loads on a helper thread.

With `--shards` (running workers) or `--spawn-shards` (workers this process supervises)
the target's layers run on a shard route: the server builds the engine's backend once
(`RouteBackend`) and nothing below knows. The block size is always this process's probed
tile (workers must accept it; spawned ones are started with it), so a route reproduces
the single-process results bit for bit.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import mlx.core as mx

from inference_engine.blas import active_blas
from inference_engine.config import ServerConfig
from inference_engine.errors import RuntimeServiceError
from inference_engine.model.loader import LoadedModel, load_model, model_fingerprint
from inference_engine.model.packaged import resolve_model_path
from inference_engine.process_exit import wait_for_stop_signal
from inference_engine.readiness import announce
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.persistence import open_persistence
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.session_transfer import SessionTransfer
from inference_engine.server.frontend import Frontend, open_frontend, start_frontend
from inference_engine.server.metrics_http import MetricsEndpoint
from inference_engine.shard.client.route import ShardRoute
from inference_engine.shard.client.route_backend import RouteBackend
from inference_engine.shard.client.supervisor import WorkerFlags, WorkerSupervisor

log = logging.getLogger(__name__)


def matmul_ms(n: int = 1024) -> float:
    """Median time of an n x n fp32 matmul: proves which BLAS is effectively in use."""
    a = mx.random.normal((n, n))
    mx.eval(a @ a)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        mx.eval(a @ a)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[1]


def build_engine(cfg: ServerConfig, loaded: LoadedModel | None = None) -> Engine:
    """Load the configured model (unless given) and probe its exact tile."""
    if loaded is None:
        path = resolve_model_path(cfg.model, cfg.cache_dir)
        log.info("loading model from %s", path)
        loaded = load_model(path)
    draft = None
    if cfg.draft_model is not None:
        path = resolve_model_path(cfg.draft_model, cfg.cache_dir)
        log.info("loading draft model from %s", path)
        draft = load_model(path)
    return Engine(loaded, cfg.exact, cfg.max_tile, cfg.plain_block, cfg.max_rollback, draft=draft,
                  max_batch_rows=cfg.max_batch_rows, append_rows=cfg.append_rows)


async def connect_shards(cfg: ServerConfig, engine: Engine) -> tuple[ShardRoute | None, WorkerSupervisor | None]:
    """Spawn (`--spawn-shards`) or reach (`--shards`) the shard route and make it the engine's backend.

    Returns:
        The connected route and the supervisor (None when not configured / not spawning).
    Raises:
        OSError: a worker did not start or cannot be reached, or the route cannot serve
            this engine (another model, kernels, block or rollback room).
    """
    supervisor = None
    addresses = list(cfg.shards)
    if cfg.spawn_shards:
        flags = WorkerFlags(host="127.0.0.1", model=cfg.model, block=engine.block, max_sessions=2 * cfg.max_sessions,
                            max_sink=cfg.max_sink, max_window=cfg.max_window)
        supervisor = WorkerSupervisor(cfg.spawn_shards, flags)
        addresses = await supervisor.start()
    if not addresses:
        return None, None
    # Spawned workers require the supervisor's own token; --shards workers get the --shard-tls-*/token flags.
    route = ShardRoute(addresses, cfg.shard_recovery_timeout_s,
                       channel_security=supervisor.client_security if supervisor is not None else cfg.shard_security)
    try:
        await route.start()
        g = engine.geometry(1, 1)
        route.check_serves(model_fingerprint(engine.loaded.model), active_blas(), g.max_block, g.max_rollback)
        engine.use_backend(RouteBackend(route, engine.spec, engine.block))
    except BaseException as exc:
        await route.stop()
        if supervisor is not None:
            await supervisor.stop()
        if isinstance(exc, RuntimeServiceError):
            raise OSError(f"shard route {','.join(addresses)}: {exc}") from exc
        raise
    log.info("layers run on the shard route %s (block %d)", ",".join(addresses), engine.block)
    return route, supervisor


async def start_server(runtime: Runtime, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server for `runtime` (security from `runtime.config`); returns it and the bound port."""
    frontend = await start_frontend(runtime, host, port)
    return frontend.server, frontend.port


async def serve(cfg: ServerConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight RPCs for `grace_s` and exit."""
    frontend = await open_frontend(cfg, cfg.host, cfg.port)
    endpoint = None
    try:
        log.info("bound %s:%d (%s); health NOT_SERVING until the model is loaded", cfg.host, frontend.port,
                 cfg.security.describe())
        if cfg.metrics_port:
            endpoint = MetricsEndpoint(cfg.metrics_host, cfg.metrics_port)
            log.info("metrics on http://%s:%d/metrics", endpoint.host, endpoint.port)
        log.info("BLAS in use: %s (1024x1024 fp32 matmul %.1f ms)", active_blas(), await asyncio.to_thread(matmul_ms))
        engine = await asyncio.to_thread(build_engine, cfg)  # the loop keeps answering health checks meanwhile
        await _serve_engine(cfg, engine, frontend)
    finally:
        await frontend.server.stop(None)  # already stopped unless start-up failed
        if endpoint is not None:
            endpoint.close()
    log.info("stopped")


async def _serve_engine(cfg: ServerConfig, engine: Engine, frontend: Frontend) -> None:
    route = supervisor = None
    try:
        route, supervisor = await connect_shards(cfg, engine)
        runtime = Runtime(engine, cfg)
        persistence = await open_persistence(SessionTransfer(runtime), cfg.persist_dir, cfg.persist_every,
                                             cfg.persist_interval_s)  # --persist-sessions: restored before SERVING
        await frontend.attach(runtime)
        announce(cfg.host, frontend.port)
        await wait_for_stop_signal()
        log.info("shutting down: NOT_SERVING, ending streams, draining in-flight RPCs for up to %.1fs", cfg.grace_s)
        started = time.monotonic()
        await frontend.health.drain()
        await runtime.drain(cfg.grace_s)  # streams finish, or end with their final message (CANCELLED)
        await frontend.drain(max(0.1, cfg.grace_s - (time.monotonic() - started)))
        if persistence is not None:
            await persistence.close()  # every live session, after its in-flight call drained
        await runtime.stop()
    finally:
        if route is not None:
            route.is_closed = True  # a call waiting for a silent route gives up now
        await asyncio.to_thread(engine.close)  # waits for the running item
        if route is not None:
            await route.stop()
        if supervisor is not None:
            await supervisor.stop()
