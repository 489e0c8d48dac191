"""TEST FIXTURE: a ShardEngine that injects faults around a real engine.

Not for production traffic. It exists so the protocol's fail-closed paths and the
client's output checks can be exercised over real sockets and real processes
(`shard-worker --inject-faults ...`). With every fault off it is a transparent wrapper
and passes the same contract test as the engine it wraps.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from inference_engine.errors import PoolExhausted
from inference_engine.shard.engine import ShardEngine
from inference_engine.shard.errors import ShardUnavailable
from inference_engine.shard.fault_config import FaultConfig
from inference_engine.shard.types import ShardCapabilities, ShardHealth, ShardMetrics, ShardOutput, ShardWork
from inference_engine.verifier.kv_cache import CacheGeometry


class FaultInjectingEngine(ShardEngine):
    """TEST FIXTURE: wraps `inner` and injects the faults of `faults`."""

    def __init__(self, inner: ShardEngine, faults: FaultConfig = FaultConfig()):
        self.inner = inner
        self.faults = faults
        self._calls = 0
        self._lock = threading.Lock()

    @property
    def is_crashed(self) -> bool:
        """The injected crash has happened."""
        return bool(self.faults.crash_after) and self._calls >= self.faults.crash_after

    def _check_alive(self) -> None:
        if self.is_crashed:
            raise ShardUnavailable(f"fault injection: the engine crashed after {self.faults.crash_after} calls")

    def _count_call(self) -> None:
        self._check_alive()
        with self._lock:
            self._calls += 1

    def load(self) -> None:
        self.inner.load()

    def capabilities(self) -> ShardCapabilities:
        return self.inner.capabilities()

    def open_session(self, session_id: str, geometry: CacheGeometry) -> None:
        self._check_alive()
        self.inner.open_session(session_id, geometry)
        budget = self.faults.memory_budget_bytes
        held = self.inner.metrics().kv_bytes
        if budget and held > budget:
            self.inner.release(session_id)
            raise PoolExhausted(f"fault injection: KV memory budget of {budget} bytes exceeded (would hold {held})")

    def prefill(self, session_id: str, work: ShardWork) -> ShardOutput:
        return self._faulty(self.inner.prefill, session_id, work)

    def decode(self, session_id: str, work: ShardWork) -> ShardOutput:
        return self._faulty(self.inner.decode, session_id, work)

    def _faulty(self, fn: Callable[[str, ShardWork], ShardOutput], session_id: str, work: ShardWork) -> ShardOutput:
        self._count_call()
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        return self._malform(fn(session_id, work))

    def _malform(self, out: ShardOutput) -> ShardOutput:
        kind, t = self.faults.malformed, out.tensor
        if kind == "rows":
            return dataclasses.replace(out, tensor=t[:-1] if t.shape[0] > 1 else np.concatenate([t, t]))
        if kind == "width":
            return dataclasses.replace(out, tensor=t[:, :-1])
        if kind == "nan":
            bad = t.copy()
            bad.flat[0] = np.nan
            return dataclasses.replace(out, tensor=bad)
        if kind == "position":
            return dataclasses.replace(out, position=out.position + 1)
        return out

    def trim(self, session_id: str, n: int, position: int) -> int:
        self._count_call()
        return self.inner.trim(session_id, n, position)

    def layer_digests(self, session_id: str, position: int) -> list[bytes]:
        self._check_alive()
        return self.inner.layer_digests(session_id, position)

    def cancel(self, session_id: str, work_id: int | None = None) -> bool:
        return self.inner.cancel(session_id, work_id)

    def release(self, session_id: str) -> bool:
        return self.inner.release(session_id)

    def health(self) -> ShardHealth:
        if self.is_crashed:
            return ShardHealth(False, f"fault injection: crashed after {self.faults.crash_after} calls", 0)
        return self.inner.health()

    def metrics(self) -> ShardMetrics:
        return self.inner.metrics()
