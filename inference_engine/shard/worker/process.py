"""The shard worker process: load a layer range, serve ShardRuntime, exit 0 on SIGTERM.

`python -m inference_engine shard-worker --layers A:B --host H --port P [--model ...]`
prints the same readiness line as the server (`listening on HOST:PORT`) once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING, Callable

from inference_engine.blas import active_blas
from inference_engine.gc_freeze import freeze_startup_objects
from inference_engine.model.packaged import resolve_model_path
from inference_engine.process_exit import wait_for_stop_signal
from inference_engine.readiness import announce
from inference_engine.served_model import (
    is_gguf_file, load_q4_1_model, load_served_model, q4_1_unavailable, release_start_up_memory, use_native_kernels,
)
from inference_engine.shard.worker.config import ShardWorkerConfig, worker_config_from_args

if TYPE_CHECKING:
    from inference_engine.shard.worker.mlx_engine import MlxShardEngine

log = logging.getLogger(__name__)


EngineWrapper = Callable[["MlxShardEngine"], "MlxShardEngine"]  # the test fixture's fault injector


def build_engine(cfg: ShardWorkerConfig) -> MlxShardEngine:
    """The worker's engine, loaded (weights read, tile probed unless `cfg.block` is set)."""
    from inference_engine.shard.worker.mlx_engine import MlxShardEngine

    use_native_kernels(cfg.cache_dir)  # as the server does: the same block arithmetic on every hop
    path = resolve_model_path(cfg.model, cfg.cache_dir)
    source: object = path  # fp32: the folder, of which only this worker's layers are read
    weights = "fp32"
    if is_gguf_file(path):  # the server's own loader, so every hop computes with the weights one process would
        served = load_served_model(cfg.model, cfg.weights, cfg.cache_dir)
        source, weights = served.loaded.model, served.weights
    elif cfg.weights == "q4_1":
        why_not = q4_1_unavailable(cfg.model, cfg.cache_dir)
        if why_not:
            log.warning("DEGRADED: serving fp32 weights, not the GGUF's blocks (same bits, slower): %s", why_not)
        else:
            source, weights = load_q4_1_model(cfg.model, cfg.cache_dir).model, "q4_1"
    log.info("loading layers %s of %s (%s)", cfg.layers, path, weights)
    engine = MlxShardEngine(
        source, cfg.layers, block=cfg.block, max_tile=cfg.max_tile, max_rollback=cfg.max_rollback,
        max_sessions=cfg.max_sessions, max_sink=cfg.max_sink, max_window=cfg.max_window, name=path.name,
    )
    engine.load()
    release_start_up_memory()
    caps = engine.capabilities()
    log.info("layers %s of %d, block %d, head=%s tail=%s, weights %s", caps.layers, caps.num_layers, caps.max_block,
             caps.is_head, caps.is_tail, weights)
    return engine


async def serve_worker(cfg: ShardWorkerConfig, wrap: EngineWrapper | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight RPCs for `grace_s`.

    Args:
        wrap: applied to the loaded engine before serving (the test fixture's fault injector).
    """
    from inference_engine.shard.worker.servicer import start_shard_server

    log.info("BLAS in use: %s", active_blas())
    engine = build_engine(cfg)
    if wrap is not None:
        engine = wrap(engine)
    server, port, servicer = await start_shard_server(engine, cfg.host, cfg.port, max_credits=cfg.max_credits,
                                                      security=cfg.security)
    try:
        freeze_startup_objects()  # a full collection would stall every session's step
        announce(cfg.host, port)
        await wait_for_stop_signal(cfg.parent_pid)
        log.info("shutting down: failing open sessions, draining RPCs for up to %.1fs", cfg.grace_s)
        servicer.fail_sessions("the shard worker is shutting down")
        await server.stop(cfg.grace_s)
    finally:
        servicer.close()  # join the engine thread before the interpreter exits
    log.info("stopped")


def run_worker(args: argparse.Namespace, parser: argparse.ArgumentParser, wrap: EngineWrapper | None = None) -> int:
    """The `shard-worker` command; returns the exit status (2: bad flags, layer range or address)."""
    try:
        cfg = worker_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        asyncio.run(serve_worker(cfg, wrap))
    except (ValueError, OSError) as exc:
        log.error("cannot start the shard worker: %s", exc)
        return 2
    return 0
