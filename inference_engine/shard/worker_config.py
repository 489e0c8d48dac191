"""Shard worker configuration: one frozen dataclass built at start-up from CLI flags and env.

Kept free of MLX imports: the launcher parses flags before it re-executes with OpenBLAS.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from inference_engine.config import default_cache_dir
from inference_engine.model.packaged import DEFAULT_MODEL
from inference_engine.shard.fault_config import FaultConfig
from inference_engine.shard.types import LayerRange


@dataclass(frozen=True)
class ShardWorkerConfig:
    """Every knob of a shard worker process."""

    layers: LayerRange  # blocks [start, end) this worker runs
    host: str = "127.0.0.1"  # address to bind
    port: int = 50061  # 0 picks a free port
    model: str = DEFAULT_MODEL  # packaged model name or mlx-lm folder
    cache_dir: Path = Path("~/.cache/inference_engine")  # converted-model cache
    block: int = 0  # rows per forward chunk; 0 = probe the exact tile at start-up
    max_tile: int = 64  # largest block size the probe tries
    max_rollback: int = 8  # deepest trim a session may ask for
    max_sessions: int = 8  # sessions held at once
    max_sink: int = 64  # largest sink a session may ask for
    max_window: int = 8192  # largest window a session may ask for
    max_credits: int = 8  # most work frames in flight per session
    grace_s: float = 5.0  # drain time for in-flight RPCs at shutdown
    faults: FaultConfig | None = None  # TEST FIXTURE: injected faults (None = a normal worker)
    parent_pid: int = 0  # shut down when this process is gone (the supervising server); 0 = never


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """Register the flags that build a ShardWorkerConfig."""
    d = ShardWorkerConfig(layers=LayerRange(0, 1))
    parser.add_argument("--layers", required=True, help="blocks START:END this worker runs, e.g. 0:10")
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port, help="0 = pick a free port")
    parser.add_argument("--model", default=d.model, help="packaged model name or an mlx-lm folder")
    parser.add_argument("--block", type=int, default=d.block, help="rows per chunk; 0 = probe the exact tile")
    parser.add_argument("--max-tile", type=int, default=d.max_tile)
    parser.add_argument("--max-rollback", type=int, default=d.max_rollback)
    parser.add_argument("--max-sessions", type=int, default=d.max_sessions)
    parser.add_argument("--max-sink", type=int, default=d.max_sink)
    parser.add_argument("--max-window", type=int, default=d.max_window)
    parser.add_argument("--max-credits", type=int, default=d.max_credits)
    parser.add_argument("--grace", type=float, default=d.grace_s, help="seconds to drain RPCs on SIGTERM")
    parser.add_argument("--parent-pid", type=int, default=d.parent_pid,
                        help="shut down (as on SIGTERM) once this process is gone; the supervising server passes its own")
    parser.add_argument("--inject-faults", default="", metavar="SPEC",
                        help="TEST FIXTURE ONLY: "
                             "delay=S,memory_budget=BYTES,malformed=rows|width|nan|position,crash_after=N")


def worker_config_from_args(args: argparse.Namespace) -> ShardWorkerConfig:
    """Build the ShardWorkerConfig from parsed flags (and the cache-dir environment variable).

    Raises:
        ValueError: a flag is malformed or out of range.
    """
    cfg = ShardWorkerConfig(
        layers=LayerRange.parse(args.layers), host=args.host, port=args.port, model=args.model,
        cache_dir=default_cache_dir(), block=args.block, max_tile=args.max_tile, max_rollback=args.max_rollback,
        max_sessions=args.max_sessions, max_sink=args.max_sink, max_window=args.max_window,
        max_credits=args.max_credits, grace_s=args.grace,
        faults=FaultConfig.parse(args.inject_faults) if args.inject_faults else None, parent_pid=args.parent_pid,
    )
    checks = {
        "--port": 0 <= cfg.port <= 65535,
        "--block": cfg.block >= 0,
        "--max-tile": cfg.max_tile >= 1,
        "--max-rollback": cfg.max_rollback >= 0,
        "--max-sessions": cfg.max_sessions >= 1,
        "--max-window": cfg.max_window >= 1,
        "--max-sink": cfg.max_sink >= 0,
        "--max-credits": cfg.max_credits >= 1,
        "--grace": cfg.grace_s >= 0,
        "--parent-pid": cfg.parent_pid >= 0,
    }
    bad = [flag for flag, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"out-of-range flags: {', '.join(bad)}")
    return cfg
