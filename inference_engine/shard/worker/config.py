"""Shard worker configuration: one frozen dataclass built at start-up from CLI flags and env.

Kept free of MLX imports: the launcher parses flags before it re-executes with OpenBLAS.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from inference_engine.config import DEFAULT_MAX_TILE, add_weights_flag, default_cache_dir
from inference_engine.flag_ranges import FlagRange, check_ranges
from inference_engine.model.packaged import DEFAULT_MODEL
from inference_engine.security.flags import add_server_security_flags, check_exposure, server_security_from_args
from inference_engine.security.settings import ServerSecurity
from inference_engine.shard.protocol.types import LayerRange


@dataclass(frozen=True)
class ShardWorkerConfig:
    """Every knob of a shard worker process."""

    layers: LayerRange  # blocks [start, end) this worker runs
    host: str = "127.0.0.1"  # address to bind
    port: int = 50061  # 0 picks a free port
    model: str = DEFAULT_MODEL  # packaged model name, mlx-lm folder or .gguf file
    weights: str = "q4_1"  # q4_1 (the GGUF's blocks, exact q4 kernel) or fp32: bitwise the same activations
    cache_dir: Path = field(default_factory=default_cache_dir)  # converted-model cache
    block: int = 0  # rows per forward chunk; 0 = probe the exact tile at start-up
    max_tile: int = DEFAULT_MAX_TILE  # largest block size the probe tries (as the server's)
    max_rollback: int = 64  # deepest trim a session may ask for (covers any server's --max-rollback + 1 up to 63)
    max_sessions: int = 8  # sessions held at once
    max_sink: int = 64  # largest sink a session may ask for
    max_window: int = 8192  # largest window a session may ask for
    max_credits: int = 8  # most work frames in flight per session
    grace_s: float = 5.0  # drain time for in-flight RPCs at shutdown
    parent_pid: int = 0  # shut down when this process is gone (the supervising server); 0 = never
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, mTLS, bearer tokens of the port


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """Register the flags that build a ShardWorkerConfig."""
    d = ShardWorkerConfig(layers=LayerRange(0, 1))
    parser.add_argument("--layers", required=True, help="blocks START:END this worker runs, e.g. 0:10")
    parser.add_argument("--host", default=d.host, help="address to bind")
    parser.add_argument("--port", type=int, default=d.port, help="port to bind, 0..65535; 0 = pick a free port")
    parser.add_argument("--model", default=d.model,
                        help="packaged model name (`python -m inference_engine models`), mlx-lm folder or .gguf file")
    add_weights_flag(parser, d.weights)
    parser.add_argument("--block", type=int, default=d.block, help="rows per chunk; 0 = probe the exact tile")
    parser.add_argument("--max-tile", type=int, default=d.max_tile, help="largest block size the probe tries")
    parser.add_argument("--max-rollback", type=int, default=d.max_rollback,
                        help="most trailing tokens a verification may drop (the front server's --max-rollback)")
    parser.add_argument("--max-sessions", type=int, default=d.max_sessions, help="sessions' caches this worker holds")
    parser.add_argument("--max-sink", type=int, default=d.max_sink, help="largest sink a session may have")
    parser.add_argument("--max-window", type=int, default=d.max_window, help="largest window a session may have")
    parser.add_argument("--max-credits", type=int, default=d.max_credits,
                        help="most work frames in flight per session (flow control, 1 or more)")
    parser.add_argument("--grace", type=float, default=d.grace_s, help="seconds to drain RPCs on SIGTERM")
    parser.add_argument("--parent-pid", type=int, default=d.parent_pid,
                        help="shut down (as on SIGTERM) once this process is gone; the supervising server passes its own")
    add_server_security_flags(parser)


def worker_config_from_args(args: argparse.Namespace) -> ShardWorkerConfig:
    """Build the ShardWorkerConfig from parsed flags (and the cache-dir environment variable).

    Raises:
        ValueError: a flag is malformed or out of range, security flags are incomplete, or a
            non-loopback --host lacks TLS and authentication without --insecure-public.
    """
    cfg = ShardWorkerConfig(
        layers=LayerRange.parse(args.layers), host=args.host, port=args.port, model=args.model, weights=args.weights,
        cache_dir=default_cache_dir(), block=args.block, max_tile=args.max_tile, max_rollback=args.max_rollback,
        max_sessions=args.max_sessions, max_sink=args.max_sink, max_window=args.max_window,
        max_credits=args.max_credits, grace_s=args.grace, parent_pid=args.parent_pid,
        security=server_security_from_args(args),
    )
    check_ranges([
        FlagRange("--port", cfg.port, 0, 65535),
        FlagRange("--block", cfg.block, 0),
        FlagRange("--max-tile", cfg.max_tile, 1),
        FlagRange("--max-rollback", cfg.max_rollback, 0),
        FlagRange("--max-sessions", cfg.max_sessions, 1),
        FlagRange("--max-window", cfg.max_window, 1),
        FlagRange("--max-sink", cfg.max_sink, 0),
        FlagRange("--max-credits", cfg.max_credits, 1),
        FlagRange("--grace", cfg.grace_s, 0),
        FlagRange("--parent-pid", cfg.parent_pid, 0),
    ])
    check_exposure(cfg.host, cfg.security)
    return cfg
