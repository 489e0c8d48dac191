"""A route session's canonical K/V out of the workers and back in: snapshots of routed sessions.

Mixed into `ShardPipeline` (it uses the pipeline's `_session`, `_round`, `_check_usable` and
`_connected`): each is one idempotency step through every hop, like a digest. What comes out
is exactly what a single process's caches hold at the retained positions, so a snapshot
taken on a route is the same file as one taken in one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable

from inference_engine.errors import InvalidRequest, InvariantViolation, RuntimeServiceError
from inference_engine.shard.client.hop_stream import HopStream
from inference_engine.shard.client.route_session import RouteSession
from inference_engine.shard.protocol.errors import MalformedShardOutput
from inference_engine.shard.protocol.types import ShardCapabilities
from inference_engine.shard.protocol.wire import LayerKV, kv_export_frame, kv_import_frame, layer_kv_of
from inference_engine.v1 import shard_runtime_pb2 as pb


class KvTransfer:
    """`export_kv` / `import_kv` of ShardPipeline."""

    if TYPE_CHECKING:  # provided by ShardPipeline
        def _session(self, session_id: str) -> RouteSession: ...
        def _connected(self) -> tuple[ShardCapabilities, ...]: ...
        @staticmethod
        def _check_usable(s: RouteSession) -> None: ...
        def _round(self, s: RouteSession, frame: Callable[[int, Any, int], pb.ShardRequestFrame],
                   check: Callable[[HopStream, pb.ShardStepResult, Any], Any], done: Callable[[], None] = ...,
                   count: bool = True) -> Awaitable[Any]: ...

    async def export_kv(self, session_id: str) -> LayerKV:
        """Every block's retained K/V, in layer order (head's blocks first): the session's canonical state.

        Equal to `SinkWindowKVCache.canonical_state()` of a single process fed the same tokens.

        Raises:
            InvariantViolation: the session failed earlier.
            MalformedShardOutput: a worker reported the wrong number, shape or dtype of tensors.
            any shard error a worker answered with (the session fails).
        """
        s = self._session(session_id)
        n = len(s.geometry.visible_positions(s.position)[:-1]) if s.position else 0

        def check(hop: HopStream, result: pb.ShardStepResult, layers: LayerKV | None) -> LayerKV:
            try:
                got = layer_kv_of(result.keys, result.values)
            except RuntimeServiceError as exc:
                raise MalformedShardOutput(f"{hop.where} sent bad K/V tensors: {exc}") from exc
            shapes_ok = all(k.ndim == 3 and k.shape[1] == n and k.shape == v.shape and k.dtype == v.dtype
                            for k, v in got)
            if len(got) != len(hop.caps.layers) or not shapes_ok or result.next_position != s.position:
                raise MalformedShardOutput(f"{hop.where} exported K/V of {len(got)} blocks at position "
                                           f"{result.next_position}; expected {len(hop.caps.layers)} blocks of {n} "
                                           f"positions at {s.position}")
            return (layers or []) + got

        return await self._round(s, lambda i, _, deadline: kv_export_frame(s.epoch, s.step, s.position, deadline),
                                 check, count=False)

    async def import_kv(self, session_id: str, position: int, layers: LayerKV) -> int:
        """Load a canonical state (as `export_kv` returns it) into a session just opened; returns `position`.

        Each worker gets its own blocks' K/V; the session then stands at `position`.

        Raises:
            InvalidRequest: `layers` is not one (keys, values) per model block (nothing is sent).
            InvariantViolation: the session is not at position 0, or failed earlier.
            any shard error a worker answered with (the session fails).
        """
        s = self._session(session_id)
        if len(layers) != self._connected()[0].num_layers:
            raise InvalidRequest(f"K/V of {len(layers)} blocks for a model of {self._connected()[0].num_layers}")
        if s.position != 0:
            self._check_usable(s)
            raise InvariantViolation(f"K/V import into session {session_id!r} at position {s.position}; it must be "
                                     "just opened (position 0)")

        def frame(i: int, _: object, deadline: int) -> pb.ShardRequestFrame:
            span = s.hops[i].caps.layers
            return kv_import_frame(s.epoch, s.step, 0, position, layers[span.start : span.end], deadline)

        def check(hop: HopStream, result: pb.ShardStepResult, _: object) -> None:
            if (result.position, result.next_position) != (0, position):
                raise MalformedShardOutput(f"{hop.where} imported K/V to positions {result.position}->"
                                           f"{result.next_position}; expected 0->{position}")

        def advance() -> None:
            s.position = position

        await self._round(s, frame, check, advance, count=False)
        return position
