"""The route client's records and checks: a route session as the pipeline tracks it, per-hop
counters, the check that workers form one route, and the checks every hop's answer passes
before it is used (a wrong OK answer raises MalformedShardOutput)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from inference_engine.errors import InvalidRequest, RuntimeServiceError
from inference_engine.shard.client.hop_stream import HopStream
from inference_engine.shard.protocol.errors import MalformedShardOutput, PayloadCorrupt
from inference_engine.shard.protocol.tensor_codec import decode_tensor
from inference_engine.shard.protocol.types import LayerRange, ShardCapabilities
from inference_engine.shard.protocol.wire import LayerKV, layer_kv_of
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


def check_route(addresses: Sequence[str], caps: Sequence[ShardCapabilities]) -> None:
    """The workers (head first) must run one model with one BLAS set-up, their layers tiling it in order.

    Raises:
        InvalidRequest: the first worker that does not fit, and why.
    """
    head, expected_start = caps[0], 0
    for address, c in zip(addresses, caps):
        same = (c.model_fingerprint, c.num_layers, c.hidden_size, c.vocab_size, c.activation_dtype)
        if same != (head.model_fingerprint, head.num_layers, head.hidden_size, head.vocab_size, head.activation_dtype):
            raise InvalidRequest(f"shard worker {address} runs a different model ({c.model_name}, "
                                 f"fingerprint {c.model_fingerprint[:12]}) than {addresses[0]}")
        if c.kernels != head.kernels:
            raise InvalidRequest(f"shard worker {address} computes with {c.kernels!r}, {addresses[0]} with "
                                 f"{head.kernels!r}: a route must use one BLAS set-up to be bitwise one process")
        if c.layers.start != expected_start:
            raise InvalidRequest(f"shard worker {address} runs layers {c.layers}; the route needs layers "
                                 f"starting at {expected_start} next")
        expected_start = c.layers.end
    if expected_start != head.num_layers:
        raise InvalidRequest(f"the route ends at layer {expected_start}; the model its workers run ({head.model_name}, "
                             f"fingerprint {head.model_fingerprint[:12]}) has {head.num_layers}")


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


def checked_digests(hop: HopStream, result: pb.ShardStepResult, position: int) -> list[bytes]:
    """The hop's per-block K/V digests, after checking there is one SHA-256 per block it runs, at `position`."""
    got = list(result.layer_digests)
    if len(got) != len(hop.caps.layers) or any(len(d) != 32 for d in got) or result.next_position != position:
        raise MalformedShardOutput(f"{hop.where} reported {len(got)} digests at position {result.next_position}; "
                                   f"expected {len(hop.caps.layers)} SHA-256 digests at {position}")
    return got


def checked_kv(hop: HopStream, result: pb.ShardStepResult, position: int, n: int) -> LayerKV:
    """The hop's exported K/V, after checking there are (keys, values) of `n` retained positions per block."""
    try:
        got = layer_kv_of(result.keys, result.values)
    except RuntimeServiceError as exc:
        raise MalformedShardOutput(f"{hop.where} sent bad K/V tensors: {exc}") from exc
    shapes_ok = all(k.ndim == 3 and k.shape[1] == n and k.shape == v.shape and k.dtype == v.dtype for k, v in got)
    if len(got) != len(hop.caps.layers) or not shapes_ok or result.next_position != position:
        raise MalformedShardOutput(f"{hop.where} exported K/V of {len(got)} blocks at position {result.next_position}; "
                                   f"expected {len(hop.caps.layers)} blocks of {n} positions at {position}")
    return got
