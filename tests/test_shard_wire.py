"""Wire-level units: tensor codec, error mapping, route table memory, engine thread, binding."""

import asyncio

import grpc
import numpy as np
import pytest

from inference_engine.errors import InvalidRequest, InvariantViolation, PoolExhausted, SessionNotFound
from inference_engine.shard.protocol.errors import (
    EpochStale,
    PayloadCorrupt,
    ShardErrorCode,
    ShardUnavailable,
    WorkCancelled,
    error_for,
    error_of_status,
)
from inference_engine.shard.protocol.tensor_codec import decode_tensor, encode_tensor, wire_dtype
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.shard.worker.route_table import RouteTable
from inference_engine.shard.worker.servicer import start_shard_server
from inference_engine.status_codes import shard_code_of as code_of
from inference_engine.status_codes import shard_status_of as grpc_status_of
from inference_engine.v1 import shard_runtime_pb2 as pb


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("fragment_bytes", [1, 7, 1 << 20])
def test_tensor_round_trip(dtype, fragment_bytes):
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(dtype)
    msg = encode_tensor(x, fragment_bytes=fragment_bytes)
    assert len(msg.fragments) == -(-x.nbytes // fragment_bytes)
    y = decode_tensor(pb.ActivationTensor.FromString(msg.SerializeToString()))
    assert y.dtype == x.dtype and y.tobytes() == x.tobytes()


def test_tensor_decode_is_validated():
    good = encode_tensor(np.zeros((2, 2), np.float32))
    with pytest.raises(InvalidRequest, match="dtype 0"):
        decode_tensor(pb.ActivationTensor(shape=[1]))
    with pytest.raises(InvalidRequest, match="no shape"):
        decode_tensor(pb.ActivationTensor(dtype=pb.TENSOR_DTYPE_FLOAT32))
    with pytest.raises(InvalidRequest, match="exceeds the limit of 8"):
        decode_tensor(good, max_bytes=8)
    with pytest.raises(InvalidRequest, match="'int64'"):
        wire_dtype("int64")
    with pytest.raises(InvalidRequest, match="cannot be carried"):
        encode_tensor(np.zeros(2, np.int32))
    good.fragments[0].data = b"\0" * 15 + b"\1"
    with pytest.raises(PayloadCorrupt, match="CRC32C"):
        decode_tensor(good)


def test_error_codes_round_trip():
    for exc in (EpochStale("x"), PoolExhausted("x"), SessionNotFound("x"), InvalidRequest("x"),
                InvariantViolation("x"), ShardUnavailable("x"), WorkCancelled("x"), PayloadCorrupt("x")):
        assert type(error_for(code_of(exc), "x")) is type(exc)
    assert code_of(ValueError("x")) == ShardErrorCode.INTERNAL
    assert grpc_status_of(ShardErrorCode.PAYLOAD_CORRUPT) == grpc.StatusCode.DATA_LOSS
    assert grpc_status_of(ShardErrorCode.UNSPECIFIED) == grpc.StatusCode.INTERNAL
    # A status without a code name in its details falls back to the status code.
    assert isinstance(error_of_status(grpc.StatusCode.NOT_FOUND, "gone", "w:1"), SessionNotFound)
    assert isinstance(error_of_status(grpc.StatusCode.UNAVAILABLE, "", "w:1"), ShardUnavailable)
    assert isinstance(error_of_status(grpc.StatusCode.UNKNOWN, "EPOCH_STALE: old", "w:1"), EpochStale)


class _Stream:
    def __init__(self, rsid, epoch):
        self.route_session_id, self.epoch, self.failed = rsid, epoch, None

    def fail(self, exc, step=0):
        self.failed = exc


def test_route_table_remembers_a_bounded_number_of_ids():
    table = RouteTable(remembered=2)
    for rsid in ("a", "b", "c"):
        table.admit(_Stream(rsid, 5))
    for rsid in ("a", "b", "c"):
        table.remove(table.live(rsid, 5, "Release"))
    with pytest.raises(EpochStale):
        table.admit(_Stream("c", 4))
    table.admit(_Stream("a", 4))  # "a" was forgotten: its old epoch is no longer known
    assert [s.route_session_id for s in table.all_live()] == ["a"]
    stale = _Stream("a", 3)
    table.remove(stale)  # not the live one: no-op
    assert table.live("a", 4, "Release") is not None
    with pytest.raises(EpochStale, match="^a Batch entry for 'a' at route epoch 3, but epoch 4 is current"):
        table.live("a", 3, "a Batch entry")


async def test_unbindable_address_is_an_os_error(tiny):
    with pytest.raises(OSError, match="could not bind"):
        await start_shard_server(MlxShardEngine(tiny.model, LayerRange(0, 2), block=4), "203.0.113.1", 0)
