"""The one thread that runs a worker's engine calls, so MLX stays off the event loop."""

from __future__ import annotations

from inference_engine.runtime.compute_thread import ComputeThread
from inference_engine.shard.errors import ShardUnavailable


class EngineThread(ComputeThread):
    """The worker's compute thread; calls after `close` raise ShardUnavailable."""

    def __init__(self) -> None:
        super().__init__("shard-engine", lambda: ShardUnavailable("the shard worker is shutting down"))
