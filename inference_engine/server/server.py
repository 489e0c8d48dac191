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
import contextlib
import logging
import time
from typing import Callable

import grpc

from inference_engine.blas import active_blas
from inference_engine.serving_path import kernels_in_use, use_cpu_stream
from inference_engine.config import ServerConfig
from inference_engine.errors import RuntimeServiceError
from inference_engine.gc_freeze import freeze_startup_objects
from inference_engine.model.gguf_blocks import has_blocks
from inference_engine.server.model_info import blocks_label, engine_weights, serving_label
from inference_engine.model.loader import LoadedModel, load_model, model_fingerprint
from inference_engine.model.packaged import DRAFT_MODEL, resolve_model_path
from inference_engine.process_exit import exit_now, stop_event, wait_for_stop_signal
from inference_engine.readiness import announce
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.persistence import open_persistence
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.session_transfer import SessionTransfer
from inference_engine.runtime.verify_row_cost import CHEAP_ROW, measure_verify_row_cost
from inference_engine.server.frontend import Frontend, open_frontend, start_frontend
from inference_engine.server.openai_api.http_server import HttpFrontend
from inference_engine.served_model import load_served_model, release_start_up_memory
from inference_engine.server.metrics_http import MetricsEndpoint
from inference_engine.shard.client.route import ShardRoute
from inference_engine.shard.client.route_backend import RouteBackend
from inference_engine.shard.client.supervisor import WorkerFlags, WorkerSupervisor, check_layer_ranges
from inference_engine.shard.protocol.errors import ShardUnavailable
from inference_engine.execution.tile_probe import fp32_mismatches

log = logging.getLogger(__name__)


def build_engine(cfg: ServerConfig, loaded: LoadedModel | None = None) -> Engine:
    """Load the configured model (unless given) from `cfg.weights` and probe its exact tile.

    A model served from GGUF blocks (`--weights q4_1`) whose kernel the probe finds unequal to the fp32 kernel is replaced by the
    fp32 model (logged as an error): the weights never change the bits.
    """
    use_cpu_stream(cfg.exact)  # macOS: exact on MLX's CPU stream, plain on Metal
    served = load_served_model(cfg.model, cfg.weights, cfg.cache_dir) if loaded is None else None
    packaged_draft: LoadedModel | None = None  # loaded once, if ever needed

    def draft_for(target: LoadedModel) -> LoadedModel | None:
        nonlocal packaged_draft
        if cfg.draft_model == DRAFT_MODEL and has_blocks(target.model):
            log.info("draft model %s: the target's own Q4_1/Q8_0 blocks", DRAFT_MODEL)
            # the packaged draft is this model at 4 bits; its Q4_1 blocks already are, on the exact kernel
            return target  # (MLX's own 4-bit matmul runs scalar here): share them, no second copy
        if cfg.draft_model is not None and packaged_draft is None:
            path = resolve_model_path(cfg.draft_model, cfg.cache_dir)
            log.info("loading draft model from %s", path)
            packaged_draft = load_model(path)
        return packaged_draft

    def engine_for(model: LoadedModel) -> Engine:
        return Engine(model, cfg.exact, cfg.max_tile, cfg.plain_block, cfg.max_rollback, draft=draft_for(model),
                      max_batch_rows=cfg.max_batch_rows, append_rows=cfg.append_rows)

    engine = engine_for(loaded or served.loaded)
    mismatches = engine.probe.mismatches if engine.probe is not None else fp32_mismatches(engine.loaded.model)
    if mismatches:
        log.error("the GGUF block kernel differs from the fp32 kernel (%s); serving fp32 weights", "; ".join(mismatches))
        engine.close()
        engine = engine_for(load_served_model(cfg.model, "fp32", cfg.cache_dir).loaded)
    elif served is not None and served.weights == "q4_1":
        log.info("weights: the GGUF's blocks as stored (%s; --weights q4_1), the probe found them bitwise equal to "
                 "the fp32 kernel", blocks_label(served.loaded.spec.weight_formats))
    if engine.is_exact and engine.block == 1:
        log.warning("DEGRADED: exact at block size 1, one token per forward (slow prefill): %s is not row-invariant "
                    "beyond one row. The exact-gemm kernel is: install a C and C++ compiler (apt-get install g++; "
                    "macOS: xcode-select --install) so the exact kernels build", kernels_in_use())
    cost = engine.verify_row_cost = measure_verify_row_cost(engine)
    log.info("a verification row costs %.2f of a one-row step: prompt lookup %s single-token matches", cost,
             "proposes" if cost <= CHEAP_ROW else "skips")
    release_start_up_memory()
    return engine


async def connect_shards(cfg: ServerConfig, engine: Engine) -> tuple[ShardRoute | None, WorkerSupervisor | None]:
    """Spawn (`--spawn-shards`) or reach (`--shards`) the shard route and make it the engine's backend.

    Returns:
        The connected route and the supervisor (None when not configured / not spawning).
    Raises:
        ValueError: --spawn-shards ranges that do not cover the model's layers in order (nothing is spawned).
        OSError: a worker did not start or cannot be reached, or the route cannot serve
            this engine (another model, kernels, block or rollback room).
    """
    supervisor = route = None
    addresses = list(cfg.shards)
    if cfg.spawn_shards:
        check_layer_ranges(cfg.spawn_shards, engine.spec.num_layers)  # now, not after seconds of spawning
        flags = WorkerFlags(host="127.0.0.1", model=cfg.model, block=engine.block, max_sessions=2 * cfg.max_sessions,
                            max_sink=cfg.max_sink, max_window=cfg.max_window, weights=engine_weights(engine))
        supervisor = WorkerSupervisor(cfg.spawn_shards, flags)
    elif not addresses:
        return None, None
    try:
        if supervisor is not None:
            addresses = await supervisor.start()
        # Spawned workers: mTLS with the supervisor's own CA and its token; --shards workers: the --shard-* flags.
        security = supervisor.client_security if supervisor is not None else cfg.shard_security
        route = ShardRoute(addresses, cfg.shard_recovery_timeout_s, step_timeout_s=cfg.shard_step_timeout_s,
                           channel_security=security)
        await _reach(route, cfg.shard_recovery_timeout_s)
        g = engine.geometry(1, 1)
        route.check_serves(model_fingerprint(engine.loaded.model), kernels_in_use(), g.max_block, g.max_rollback)
        engine.use_backend(RouteBackend(route, engine.spec, engine.block))
        if supervisor is not None:  # a spawned worker that hangs is ended, so that it restarts
            route.pipeline.on_silent = _ender(supervisor, route.pipeline.step_timeout_s)
    except BaseException as exc:  # a failed or interrupted start leaves no worker and no token file behind
        if route is not None:
            await route.stop()
        if supervisor is not None:
            await supervisor.stop()
        if isinstance(exc, RuntimeServiceError):
            raise OSError(f"shard route {','.join(addresses)}: {exc}") from exc
        raise
    log.info("layers run on the shard route %s (block %d)", ",".join(addresses), engine.block)
    return route, supervisor


REACH_LOG_EVERY_S = 10.0  # how often start-up says it still waits for --shards workers


def _ender(supervisor: WorkerSupervisor, deadline_s: float) -> Callable[[str], None]:
    """What the route (on its own thread) calls with a spawned worker that missed a deadline: the supervisor's
    `stop_silent`, on this loop (once it is closed, nothing is left to end)."""
    loop = asyncio.get_running_loop()

    def end(address: str) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(supervisor.stop_silent, address, deadline_s)

    return end


async def _reach(route: ShardRoute, wait_s: float) -> None:
    """Connect the route, waiting up to `wait_s` for workers still starting: `--shards` workers
    started with the server (docs/shards.md's example) may load their layers longer than it does."""
    start = time.monotonic()
    said = start - REACH_LOG_EVERY_S
    while True:
        try:
            await route.start()
            return
        except ShardUnavailable as exc:
            now = time.monotonic()
            if now >= start + wait_s:
                raise
            if now - said >= REACH_LOG_EVERY_S:  # one line, then one every REACH_LOG_EVERY_S (it retries every 0.5 s)
                log.info("waiting for the shard route (%.0f s of --shard-recovery-timeout %g s): %s", now - start,
                         wait_s, exc)
                said = now
            await asyncio.sleep(0.5)


async def start_server(runtime: Runtime, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server for `runtime` (security from `runtime.config`); returns it and the bound port."""
    frontend = await start_frontend(runtime, host, port)
    return frontend.server, frontend.port


async def serve(cfg: ServerConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight RPCs for `grace_s` and exit.

    A signal while the model loads ends the process at once (exit 0): a load cannot be interrupted,
    and there is nothing to drain yet.
    """
    stop = stop_event()  # from the very start: the default action would kill the process mid-load (143)
    frontend = await open_frontend(cfg, cfg.host, cfg.port)
    endpoint = http = None
    try:
        log.info("bound %s:%d (%s); health NOT_SERVING until the model is loaded", cfg.host, frontend.port,
                 cfg.security.describe())
        if cfg.http_port:
            http = HttpFrontend(cfg)
            await http.start(cfg.host, cfg.http_port)
            scheme = "https" if cfg.security.is_tls else "http"
            log.info("OpenAI-compatible API on %s://%s:%d/v1 (503 until the model is loaded)", scheme, cfg.host,
                     http.port)
        if cfg.metrics_port:
            endpoint = MetricsEndpoint(cfg.metrics_host, cfg.metrics_port)
            log.info("metrics on http://%s:%d/metrics", endpoint.host, endpoint.port)
        # What MLX's own matmul resolves (not the exact products: the exact kernels compute those, serving_path.py).
        log.info("BLAS in use: %s", active_blas())
        loading = asyncio.ensure_future(asyncio.to_thread(build_engine, cfg))  # health checks answered meanwhile
        if not await _done_before(loading, stop):
            log.info("shutting down while the model loads: nothing to drain")
            await frontend.server.stop(None)
            if http is not None:
                await http.stop(0.1)
            log.info("stopped")
            exit_now(0)  # not asyncio.run's wait for the loading thread
        await _serve_engine(cfg, loading.result(), frontend, stop, http)
    finally:
        await frontend.server.stop(None)  # already stopped unless start-up failed
        if http is not None:
            await http.stop(0.1)  # already stopped unless start-up failed
        if endpoint is not None:
            endpoint.close()
    log.info("stopped")


async def _done_before(task: asyncio.Future, stop: asyncio.Event) -> bool:
    """Wait for `task` or the stop signal, whichever comes first; whether `task` is done."""
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait((task, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    return task.done()


def _health_follows(frontend: Frontend) -> Callable[[bool], None]:
    """What persistence calls when "every session is on disk" changes: the PERSISTENCE health status."""
    pending: set[asyncio.Task] = set()  # referenced until done

    def tell(is_durable: bool) -> None:
        task = asyncio.get_running_loop().create_task(frontend.health.set_durable(is_durable))
        pending.add(task)
        task.add_done_callback(pending.discard)

    return tell


async def _serve_engine(cfg: ServerConfig, engine: Engine, frontend: Frontend, stop: asyncio.Event,
                        http: HttpFrontend | None = None) -> None:
    route = supervisor = runtime = None
    try:
        # Spawning or reaching workers can take minutes: a stop signal meanwhile ends it (connect_shards
        # then stops what it started, so no worker and no token file outlive the server).
        connecting = asyncio.ensure_future(connect_shards(cfg, engine))
        if not await _done_before(connecting, stop):
            log.info("shutting down while the shard route starts: stopping its workers")
            connecting.cancel()
            await asyncio.wait((connecting,))
            if not connecting.cancelled() and connecting.exception() is not None:
                log.warning("stopping the shard route's start failed: %s", connecting.exception())
            return
        route, supervisor = connecting.result()
        runtime = Runtime(engine, cfg)
        persistence = await open_persistence(SessionTransfer(runtime), cfg.persist_dir, cfg.persist_every,
                                             cfg.persist_interval_s)  # --persist-sessions: restored before SERVING
        if persistence is not None:
            persistence.on_durability = _health_follows(frontend)
        freeze_startup_objects()  # before SERVING: a full collection would stall every stream
        await frontend.attach(runtime)
        if http is not None:
            http.attach(runtime)
        log.info("serving %s", serving_label(frontend.servicer.model_info))
        announce(cfg.host, frontend.port)
        await wait_for_stop_signal(stop=stop)
        log.info("shutting down: NOT_SERVING, ending streams, draining in-flight RPCs for up to %.1fs", cfg.grace_s)
        started = time.monotonic()
        await frontend.health.drain()
        if http is not None:
            http.begin_drain()  # /health 503, new requests 503
        await runtime.drain(cfg.grace_s)  # streams finish, or end with their final message (CANCELLED)
        if http is not None:
            await http.stop(max(0.1, cfg.grace_s - (time.monotonic() - started)))  # also closes kept sessions
        await frontend.drain(max(0.1, cfg.grace_s - (time.monotonic() - started)))
        if persistence is not None:
            await persistence.close()  # every live session, after its in-flight call drained
    finally:
        if runtime is not None:  # also after a failed drain: the sweeper stops, the tokenizer processes are joined
            await runtime.stop()
        if route is not None:
            route.is_closed = True  # a call waiting for a silent route gives up now
        await asyncio.to_thread(engine.close)  # waits for the running item
        if route is not None:
            await route.stop()
        if supervisor is not None:
            await supervisor.stop()
