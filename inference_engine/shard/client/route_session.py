"""The route client's records: a route session as the pipeline tracks it, per-hop counters,
and the check every hop's answer passes before it is used."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from inference_engine.errors import RuntimeServiceError
from inference_engine.shard.client.hop_stream import HopStream
from inference_engine.shard.protocol.errors import MalformedShardOutput, PayloadCorrupt
from inference_engine.shard.protocol.tensor_codec import decode_tensor
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.execution.kv_cache import CacheGeometry


@dataclass(frozen=True)
class HopStats:
    """Round trips to one worker since the pipeline started."""

    address: str  # host:port
    layers: LayerRange  # blocks it runs
    calls: int  # work frames answered (forward blocks and trims)
    seconds: float  # total wall time from send to checked answer

    @property
    def mean_ms(self) -> float:
        """Mean per-hop latency in milliseconds (0 before any call)."""
        return 1e3 * self.seconds / self.calls if self.calls else 0.0


@dataclass
class RouteSession:
    """A route session as the pipeline tracks it."""

    session_id: str  # the caller's id (= route_session_id on the workers)
    epoch: int  # route epoch it was opened at
    geometry: CacheGeometry  # identical on every worker
    hops: list[HopStream]  # head first
    position: int = 0  # next global position (tokens in the cache)
    step: int = 0  # last idempotency_step used
    broken: str = ""  # why the session can no longer be used ("" = usable)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time


def check_positions(hop: HopStream, result: pb.ShardStepResult, start: int, end: int, did: str) -> None:
    """The answer must move the session from `start` to `end` (`did`: what the hop did, for the message)."""
    if (result.position, result.next_position) != (start, end):
        raise MalformedShardOutput(f"{hop.where} {did} {result.position}->{result.next_position}; "
                                   f"expected {start}->{end}")


def checked_output(hop: HopStream, result: pb.ShardStepResult, position: int, rows: int,
                   all_logits: bool) -> np.ndarray:
    """The answer's tensor, after checking it is what this hop must produce."""
    caps = hop.caps
    check_positions(hop, result, position, position + rows, "computed positions")
    if not result.HasField("output"):
        raise MalformedShardOutput(f"{hop.where} answered without an output tensor")
    try:
        tensor = decode_tensor(result.output)
    except (PayloadCorrupt, RuntimeServiceError) as exc:
        raise MalformedShardOutput(f"{hop.where} sent a bad tensor: {exc}") from exc
    if caps.is_tail:
        shape, dtype = (rows if all_logits else 1, caps.vocab_size), np.dtype("float32")
    else:
        shape, dtype = (rows, caps.hidden_size), np.dtype(caps.activation_dtype)
    if tensor.shape != shape or tensor.dtype != dtype:
        raise MalformedShardOutput(f"{hop.where} returned {tensor.dtype}{list(tensor.shape)}; "
                                   f"expected {dtype}{list(shape)}")
    if not np.isfinite(tensor).all():
        raise MalformedShardOutput(f"{hop.where} returned non-finite values")
    return tensor
