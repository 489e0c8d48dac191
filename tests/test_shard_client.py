"""The client against a scripted, misbehaving worker: protocol-level mistakes are caught.

The scripted worker answers GetCapability for a 1-layer model (head and tail at once)
and then plays one `mode` on every Session stream.
"""

import asyncio
import contextlib

import grpc
import numpy as np
import pytest

from inference_engine.errors import InvariantViolation
from inference_engine.shard.client import hop_stream
from inference_engine.shard.client.pipeline import ShardPipeline
from inference_engine.shard.protocol.errors import (
    FlowControlViolation,
    MalformedShardOutput,
    ShardError,
    ShardUnavailable,
)
from inference_engine.shard.protocol.tensor_codec import encode_tensor
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.v1 import shard_runtime_pb2_grpc as pb_grpc

VOCAB = 8


def _logits(rows: int) -> pb.ActivationTensor:
    return encode_tensor(np.zeros((rows, VOCAB), np.float32))


def _result(step: int, position: int, rows: int, **kw) -> pb.ShardResponseFrame:
    r = pb.ShardStepResult(idempotency_step=step, position=position, next_position=position + rows, **kw)
    return pb.ShardResponseFrame(result=r, flow=pb.FlowControl(credits_granted=1, credits_available=1))


class _Scripted(pb_grpc.ShardRuntimeServicer):
    def __init__(self, mode: str):
        self.mode = mode

    async def GetCapability(self, request, context):
        return pb.ShardCapability(model_name="scripted", model_fingerprint="f" * 64, num_layers=1, layer_start=0,
                                  layer_end=1, hidden_size=4, vocab_size=VOCAB,
                                  activation_dtype=pb.TENSOR_DTYPE_FLOAT32,
                                  max_block=4, max_rollback=2, max_sessions=1, max_sink=4, max_window=16, max_credits=1)

    async def Session(self, request_iterator, context):
        first = await context.read()
        o = first.open
        epoch = o.route_epoch + (1 if self.mode == "bad-accept" else 0)
        await context.write(pb.ShardResponseFrame(accepted=pb.SessionAccepted(
            route_session_id=o.route_session_id, route_epoch=epoch, credits=1, layer_start=0, layer_end=1)))
        if self.mode == "abort":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE: scripted worker went away")
        refused = False
        while (frame := await context.read()) is not grpc.aio.EOF:
            kind = frame.WhichOneof("frame")
            msg = getattr(frame, kind)
            step, position = msg.idempotency_step, msg.position
            rows = len(frame.chunk.token_ids) if kind == "chunk" else 1
            if self.mode == "eof":
                return
            if self.mode in ("refuse", "refuse-once") and not (refused and self.mode == "refuse-once"):
                refused = True
                await context.write(pb.ShardResponseFrame(error=pb.ShardError(
                    code=pb.SHARD_ERROR_FLOW_CONTROL_VIOLATION, retryable=True, idempotency_step=step)))
                continue
            answers = {
                "wrong-step": [_result(step + 1, position, rows, output=_logits(rows))],
                "dup-ack": [pb.ShardResponseFrame(ack=pb.ShardAck(idempotency_step=step, duplicate=True))],
                "double-accept": [pb.ShardResponseFrame(accepted=pb.SessionAccepted())],
                "unknown-code": [pb.ShardResponseFrame(error=pb.ShardError(
                    code=99, message="from the future", idempotency_step=step, session_closed=True))],
                "no-output": [_result(step, position, rows)],
                "bad-tensor": [_result(step, position, rows, output=pb.ActivationTensor(
                    dtype=pb.TENSOR_DTYPE_FLOAT32, shape=[rows, VOCAB]))],
                "bad-trim": [_result(step, position, 0)],
                "bad-digest": [_result(step, position, 0, layer_digests=[b"x" * 32, b"y" * 32])],
            }.get(self.mode)
            if answers is None:  # a well-behaved answer, after an unrelated ack
                answers = [pb.ShardResponseFrame(ack=pb.ShardAck(idempotency_step=77, cancelled=False)),
                           {"trim": _result(step, position, -getattr(msg, "tokens", 0)),
                            "digest": _result(step, position, 0, layer_digests=[b"z" * 32])}.get(
                               kind, _result(step, position, rows, output=_logits(rows)))]
            for a in answers:
                await context.write(a)


    async def Batch(self, request_iterator, context):
        async for request in request_iterator:
            if self.mode == "eof":
                return
            frames = []
            for e in request.entries:
                kind = e.frame.WhichOneof("frame")
                msg = getattr(e.frame, kind)
                step, position = msg.idempotency_step, msg.position
                rows = len(e.frame.chunk.token_ids) if kind == "chunk" else 1
                frames.append({
                    "wrong-step": _result(step + 1, position, rows, output=_logits(rows)),
                    "dup-ack": pb.ShardResponseFrame(ack=pb.ShardAck(idempotency_step=step, duplicate=True)),
                    "double-accept": pb.ShardResponseFrame(accepted=pb.SessionAccepted()),
                    "cancel-ack": pb.ShardResponseFrame(ack=pb.ShardAck(idempotency_step=step, cancelled=True)),
                    "unknown-code": pb.ShardResponseFrame(error=pb.ShardError(
                        code=99, message="from the future", idempotency_step=step, session_closed=True)),
                    "refuse-once": pb.ShardResponseFrame(error=pb.ShardError(  # every entry: resent on its stream
                        code=pb.SHARD_ERROR_FLOW_CONTROL_VIOLATION, retryable=True, idempotency_step=step)),
                }.get(self.mode, _result(step, position, rows, output=_logits(rows))))
            await context.write(pb.ShardBatchResponse(frames=frames[:1] if self.mode == "short-batch" else frames))


@contextlib.asynccontextmanager
async def _scripted(mode: str, **kw):
    server = grpc.aio.server()
    pb_grpc.add_ShardRuntimeServicer_to_server(_Scripted(mode), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with ShardPipeline([f"127.0.0.1:{port}"], **kw) as pipeline:
            yield pipeline
    finally:
        await server.stop(0)


@pytest.mark.parametrize("mode,match", [
    ("wrong-step", "answered step 2 while step 1"),
    ("dup-ack", "as a duplicate"),
    ("double-accept", "second SessionAccepted"),
    ("no-output", "without an output tensor"),
    ("bad-tensor", "bad tensor: fragments carry 0 bytes"),
])
async def test_protocol_mistakes_are_malformed_output(mode, match):
    async with _scripted(mode) as p:
        await p.open("s", 2, 8)
        with pytest.raises(MalformedShardOutput, match=match):
            await p.forward("s", [1, 2])
        with pytest.raises(InvariantViolation, match="failed"):
            await p.forward("s", [1, 2])


async def test_acceptance_must_match_the_open():
    async with _scripted("bad-accept") as p:
        with pytest.raises(MalformedShardOutput, match="answered SessionOpen"):
            await p.open("s", 2, 8)


async def test_unknown_error_code_is_a_shard_error():
    async with _scripted("unknown-code") as p:
        await p.open("s", 2, 8)
        with pytest.raises(ShardError, match="from the future") as err:
            await p.forward("s", [1])
        assert type(err.value) is ShardError


async def test_flow_control_refusals_are_retried_then_give_up(monkeypatch):
    monkeypatch.setattr(hop_stream, "FLOW_BACKOFF_S", 0.0)
    async with _scripted("refuse-once") as p:
        await p.open("s", 2, 8)
        assert (await p.forward("s", [1, 2])).shape == (2, VOCAB)
        assert await p.trim("s", 1) == 1
    async with _scripted("refuse") as p:
        await p.open("s", 2, 8)
        with pytest.raises(FlowControlViolation, match="7 times"):
            await p.forward("s", [1])


async def test_wrong_trim_answer_is_caught():
    async with _scripted("bad-trim") as p:
        await p.open("s", 2, 8)
        p._sessions["s"].position = 2  # as if two tokens had been forwarded
        with pytest.raises(MalformedShardOutput, match="trimmed 2->2; expected 2->1"):
            await p.trim("s", 1)


async def test_digests_are_checked():
    async with _scripted("refuse-once") as p:
        await p.open("s", 2, 8)
        assert await p.layer_digests("s") == [b"z" * 32]
    async with _scripted("bad-digest") as p:
        await p.open("s", 2, 8)
        with pytest.raises(MalformedShardOutput, match="reported 2 digests"):
            await p.layer_digests("s")
        with pytest.raises(InvariantViolation):
            await p.layer_digests("s")


async def test_a_stream_that_ends_is_unavailable():
    async with _scripted("eof") as p:
        await p.open("s", 2, 8)
        with pytest.raises(ShardUnavailable, match="ended the session stream"):
            await p.forward("s", [1])
    async with _scripted("abort") as p:
        await p.open("s", 2, 8)
        hop = p._sessions["s"].hops[0]
        for _ in range(100):
            if hop._pump_task.done():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ShardUnavailable, match="scripted worker went away"):
            await p.forward("s", [1])
        with pytest.raises(ShardUnavailable, match="scripted worker went away"):  # the end is sticky
            await hop.request(pb.ShardRequestFrame(), 9)


@pytest.mark.parametrize("mode,error,match", [
    ("wrong-step", MalformedShardOutput, "answered step 2 while step 1 was in flight"),
    ("dup-ack", MalformedShardOutput, "as a duplicate"),
    ("double-accept", MalformedShardOutput, "second SessionAccepted"),
    ("unknown-code", ShardError, "from the future"),
    ("cancel-ack", MalformedShardOutput, "answered a Batch entry with ack"),
    ("short-batch", MalformedShardOutput, "answered 1 frames to a Batch request of 2 entries"),
    ("eof", ShardUnavailable, "ended the Batch stream"),
])
async def test_batch_answers_are_checked(mode, error, match):
    async with _scripted(mode) as p:
        await p.open("s", 2, 8)
        await p.open("t", 2, 8)
        got = await p.forward_many([("s", [1], True), ("t", [2, 3], True)])
        assert all(isinstance(g, error) for g in got), got
        assert all(match in str(g) for g in got[: 1 if mode in ("wrong-step", "dup-ack") else 2]), got
        with pytest.raises(InvariantViolation, match="failed"):  # the sessions failed, as after a forward
            await p.forward("s", [1])


async def test_a_batch_refusal_for_credit_is_resent_on_the_session_stream(monkeypatch):
    monkeypatch.setattr(hop_stream, "FLOW_BACKOFF_S", 0.0)
    async with _scripted("refuse-once") as p:
        await p.open("s", 2, 8)
        await p.open("t", 2, 8)
        got = await p.forward_many([("s", [1], True), ("t", [2, 3], True)])
        assert [g.shape for g in got] == [(1, VOCAB), (2, VOCAB)]
        assert (p.position("s"), p.position("t")) == (1, 2)
