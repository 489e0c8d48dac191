"""Protobuf <-> typed data for the ShardRuntime protocol, validated once from one table.

The servicer and the client both convert here; engines never see protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from inference_engine.errors import InvalidRequest, RuntimeServiceError
from inference_engine.status_codes import shard_code_of
from inference_engine.shard.protocol.tensor_codec import decode_tensor, encode_tensor, wire_dtype
from inference_engine.shard.protocol.types import (
    LayerRange,
    ShardCapabilities,
    ShardHealth,
    ShardMetrics,
    ShardOutput,
    ShardWork,
)
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.execution.kv_cache import CacheGeometry

MAX_ROWS = 1 << 16  # rows in one ActivationChunk
MAX_MESSAGE_BYTES = 256 << 20  # activations of long blocks and all-row logits are large
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# Clients reconnect with a short backoff: a restarted worker is used again within a second.
CLIENT_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200),
                          ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
_U63 = (1 << 63) - 1
# Every bounded field, by name: inclusive (low, high).
BOUNDS: dict[str, tuple[int, int]] = {
    "route_session_id#": (1, 128),
    "route_epoch": (1, _U63),
    "idempotency_step": (1, _U63),
    "work_id": (0, _U63),
    "rows": (1, MAX_ROWS),
    "trim.tokens": (0, 1 << 16),
}


def check(field: str, value: int) -> int:
    """Check one field against `BOUNDS`. Raises InvalidRequest naming the field and the range."""
    low, high = BOUNDS[field]
    if not low <= value <= high:
        raise InvalidRequest(f"{field.rstrip('#')} = {value} is out of range; allowed {low}..{high}")
    return value


@dataclass(frozen=True)
class OpenRequest:
    """A validated SessionOpen."""

    route_session_id: str  # the coordinator's session id
    epoch: int  # route epoch (>= 1)
    deadline_ns: int  # unix nanos, 0 = none
    geometry: CacheGeometry  # checked against capabilities by the engine
    credits: int  # requested credits, 0 = the worker's default


@dataclass(frozen=True)
class FrameHeader:
    """The admission fields of a work frame (checked before its payload is decoded)."""

    kind: str  # "chunk", "decode", "trim", "digest", "kv_export" or "kv_import"
    epoch: int  # route epoch
    deadline_ns: int  # unix nanos, 0 = none
    step: int  # idempotency_step (>= 1)
    route_session_id: str  # chunks only; "" elsewhere


def open_request(msg: pb.SessionOpen) -> OpenRequest:
    """Validate a SessionOpen. Raises InvalidRequest."""
    check("route_session_id#", len(msg.route_session_id))
    geometry = CacheGeometry(sink=msg.sink_tokens, window=msg.window_tokens,
                             max_block=msg.max_block, max_rollback=msg.max_rollback)
    return OpenRequest(msg.route_session_id, check("route_epoch", msg.route_epoch), msg.deadline_unix_nanos,
                       geometry, msg.requested_credits)


def frame_header(frame: pb.ShardRequestFrame) -> FrameHeader:
    """Admission fields of a work frame (chunk, decode, trim, digest, kv_export, kv_import). Raises InvalidRequest."""
    kind = frame.WhichOneof("frame")
    msg = getattr(frame, kind)
    rsid = msg.route_session_id if kind == "chunk" else ""
    return FrameHeader(kind, check("route_epoch", msg.route_epoch), msg.deadline_unix_nanos,
                       check("idempotency_step", msg.idempotency_step), rsid)


def step_of(frame: pb.ShardRequestFrame) -> int:
    """The frame's idempotency_step, unchecked (0 for a frame without one): what its error answer names."""
    kind = frame.WhichOneof("frame")
    return getattr(getattr(frame, kind), "idempotency_step", 0) if kind else 0


def work_of(frame: pb.ShardRequestFrame) -> ShardWork:
    """Decode a chunk or decode frame's payload into ShardWork.

    Raises:
        InvalidRequest: no input, or too many rows.
        PayloadCorrupt: the activation tensor fails its fragment or CRC32C checks.
    """
    if frame.HasField("chunk"):
        c = frame.chunk
        hidden = decode_tensor(c.hidden) if c.HasField("hidden") else None
        tokens = tuple(c.token_ids)
        work = ShardWork(c.idempotency_step, c.position, tokens, hidden, c.all_logits)
    else:
        d = frame.decode
        which = d.WhichOneof("input")
        if which is None:
            raise InvalidRequest("DecodeStep carries neither token_id nor hidden")
        hidden = decode_tensor(d.hidden) if which == "hidden" else None
        tokens = (d.token_id,) if which == "token_id" else ()
        work = ShardWork(d.idempotency_step, d.position, tokens, hidden, False)
    check("rows", work.rows)
    return work


# Per block of a worker: (keys, values), (n_kv, n, head_dim) each: its retained positions in order.
LayerKV = list[tuple[np.ndarray, np.ndarray]]


def layer_kv_of(keys: Sequence[pb.ActivationTensor], values: Sequence[pb.ActivationTensor]) -> LayerKV:
    """Decode per-layer K/V tensors (a ShardKvImport, or a ShardStepResult answering ShardKvExport).

    Raises:
        InvalidRequest: the key and value lists differ in length, or a tensor is unusable.
        PayloadCorrupt: a tensor fails its fragment or CRC32C checks.
    """
    if len(keys) != len(values):
        raise InvalidRequest(f"{len(keys)} key tensors but {len(values)} value tensors")
    return [(decode_tensor(k), decode_tensor(v)) for k, v in zip(keys, values)]


def kv_import_of(frame: pb.ShardRequestFrame) -> tuple[int, LayerKV]:
    """A ShardKvImport's target position and per-layer K/V. Raises InvalidRequest, PayloadCorrupt."""
    msg = frame.kv_import
    return msg.target_position, layer_kv_of(msg.keys, msg.values)


# -- server -> client -------------------------------------------------------------------


def step_result(step: int, position: int, next_position: int, flow: pb.FlowControl | None,
                **fields: object) -> pb.ShardResponseFrame:
    """A ShardStepResult answering work step `step` (moving the session from `position` to `next_position`)."""
    result = pb.ShardStepResult(idempotency_step=step, position=position, next_position=next_position, **fields)
    return pb.ShardResponseFrame(result=result, flow=flow)


def result_frame(out: ShardOutput, flow: pb.FlowControl | None) -> pb.ShardResponseFrame:
    """A ShardStepResult carrying the output tensor."""
    return step_result(out.work_id, out.position, out.next_position, flow, output=encode_tensor(out.tensor))


def kv_result(step: int, position: int, layers: LayerKV, flow: pb.FlowControl | None) -> pb.ShardResponseFrame:
    """The ShardStepResult answering a ShardKvExport."""
    return step_result(step, position, position, flow, keys=[encode_tensor(k) for k, _ in layers],
                       values=[encode_tensor(v) for _, v in layers])


def error_frame(exc: BaseException, step: int, session_closed: bool,
                flow: pb.FlowControl | None = None) -> pb.ShardResponseFrame:
    """A ShardError for `exc` (retryable only for retryable errors on a live session)."""
    retryable = bool(getattr(exc, "retryable", False)) and not session_closed
    message = str(exc) if isinstance(exc, RuntimeServiceError) else f"internal error: {type(exc).__name__}: {exc}"
    err = pb.ShardError(code=int(shard_code_of(exc)), message=message, retryable=retryable,
                        session_closed=session_closed, idempotency_step=step)
    return pb.ShardResponseFrame(error=err, flow=flow)


def capability_msg(caps: ShardCapabilities, max_credits: int) -> pb.ShardCapability:
    """ShardCapabilities (+ the servicer's credit limit) as protobuf."""
    return pb.ShardCapability(
        model_name=caps.model_name, model_fingerprint=caps.model_fingerprint, num_layers=caps.num_layers,
        layer_start=caps.layers.start, layer_end=caps.layers.end, hidden_size=caps.hidden_size,
        vocab_size=caps.vocab_size, activation_dtype=wire_dtype(caps.activation_dtype), max_block=caps.max_block,
        max_rollback=caps.max_rollback, max_sessions=caps.max_sessions, max_sink=caps.max_sink,
        max_window=caps.max_window, max_credits=max_credits, kernels=caps.kernels,
    )


def health_msg(health: ShardHealth, metrics: ShardMetrics) -> pb.ShardHealthResponse:
    """Health and counters as protobuf."""
    return pb.ShardHealthResponse(serving=health.is_serving, detail=health.detail, sessions=metrics.sessions,
                                  kv_bytes=metrics.kv_bytes, steps=metrics.steps, rows=metrics.rows,
                                  busy_seconds=metrics.busy_s, forwards=metrics.forwards)


# -- client side ------------------------------------------------------------------------


def capabilities_of(msg: pb.ShardCapability) -> ShardCapabilities:
    """A worker's GetCapability answer as ShardCapabilities."""
    dtype = {pb.TENSOR_DTYPE_FLOAT32: "float32", pb.TENSOR_DTYPE_FLOAT16: "float16"}.get(msg.activation_dtype, "?")
    return ShardCapabilities(
        model_name=msg.model_name, model_fingerprint=msg.model_fingerprint, num_layers=msg.num_layers,
        layers=LayerRange(msg.layer_start, msg.layer_end), hidden_size=msg.hidden_size, vocab_size=msg.vocab_size,
        activation_dtype=dtype, max_block=msg.max_block, max_rollback=msg.max_rollback,
        max_sessions=msg.max_sessions, max_sink=msg.max_sink, max_window=msg.max_window, kernels=msg.kernels,
    )


def open_frame(route_session_id: str, epoch: int, geometry: CacheGeometry, credits: int = 0,
               deadline_ns: int = 0) -> pb.ShardRequestFrame:
    """A SessionOpen frame."""
    return pb.ShardRequestFrame(open=pb.SessionOpen(
        route_session_id=route_session_id, route_epoch=epoch, deadline_unix_nanos=deadline_ns,
        sink_tokens=geometry.sink, window_tokens=geometry.window, max_block=geometry.max_block,
        max_rollback=geometry.max_rollback, requested_credits=credits,
    ))


_STEP_MESSAGES = {"trim": pb.ShardTrim, "digest": pb.ShardDigest, "kv_export": pb.ShardKvExport, "kv_import": pb.ShardKvImport,
            "decode": pb.DecodeStep, "chunk": pb.ActivationChunk}


def step_frame(kind: str, epoch: int, step: int, position: int, deadline_ns: int = 0,
                  **fields: object) -> pb.ShardRequestFrame:
    """A work frame of `kind` ("trim", "digest", "kv_export", "kv_import", "decode", "chunk") with its
    admission fields and `fields` (e.g. `tokens=n` for a trim)."""
    msg = _STEP_MESSAGES[kind](route_epoch=epoch, deadline_unix_nanos=deadline_ns, idempotency_step=step, position=position,
                         **fields)
    return pb.ShardRequestFrame(**{kind: msg})


def work_frame(route_session_id: str, epoch: int, step: int, position: int, tokens: list[int] | None,
               hidden: np.ndarray | None, all_logits: bool, deadline_ns: int = 0) -> pb.ShardRequestFrame:
    """A DecodeStep for one row, else an ActivationChunk (tokens for the head, hidden elsewhere)."""
    rows = hidden.shape[0] if hidden is not None else len(tokens)
    if rows == 1:
        payload = {"hidden": encode_tensor(hidden)} if hidden is not None else {"token_id": tokens[0]}
        return step_frame("decode", epoch, step, position, deadline_ns, **payload)
    payload = {"hidden": encode_tensor(hidden)} if hidden is not None else {"token_ids": tokens}
    return step_frame("chunk", epoch, step, position, deadline_ns, route_session_id=route_session_id,
                         all_logits=all_logits, **payload)


def kv_import_frame(epoch: int, step: int, position: int, target: int, layers: LayerKV,
                    deadline_ns: int = 0) -> pb.ShardRequestFrame:
    """A ShardKvImport frame carrying one worker's blocks' K/V."""
    return step_frame("kv_import", epoch, step, position, deadline_ns, target_position=target,
                         keys=[encode_tensor(k) for k, _ in layers], values=[encode_tensor(v) for _, v in layers])
