"""Activation tensors on the wire: dtype, shape, offset-addressed fragments and a CRC32C.

Decoding fails closed: the fragments, sorted by offset, must tile the payload exactly
(no gap, no overlap, nothing past the end) and the CRC32C of the joined bytes must match.
"""

from __future__ import annotations

import math

import crc32c
import numpy as np

from inference_engine.errors import InvalidRequest
from inference_engine.shard.protocol.errors import PayloadCorrupt
from inference_engine.v1 import shard_runtime_pb2 as pb

FRAGMENT_BYTES = 1 << 20  # payload bytes per fragment when encoding
MAX_TENSOR_BYTES = 256 << 20  # largest tensor a peer may send
_DTYPES = {pb.TENSOR_DTYPE_FLOAT32: np.dtype("<f4"), pb.TENSOR_DTYPE_FLOAT16: np.dtype("<f2")}
_WIRE_DTYPE = {np.dtype("float32"): pb.TENSOR_DTYPE_FLOAT32, np.dtype("float16"): pb.TENSOR_DTYPE_FLOAT16}


def wire_dtype(name: str) -> int:
    """Proto `TensorDtype` of a numpy dtype name.

    Raises:
        InvalidRequest: a dtype the protocol cannot carry.
    """
    try:
        return _WIRE_DTYPE[np.dtype(name)]
    except (KeyError, TypeError):
        raise InvalidRequest(f"dtype {name!r} cannot be carried; allowed float32, float16") from None


def encode_tensor(array: np.ndarray, fragment_bytes: int = FRAGMENT_BYTES) -> pb.ActivationTensor:
    """Serialize a float32/float16 array into fragments of at most `fragment_bytes`."""
    dtype = wire_dtype(array.dtype.name)
    payload = np.ascontiguousarray(array, dtype=_DTYPES[dtype]).tobytes()
    fragments = [
        pb.TensorFragment(offset=i, data=payload[i : i + fragment_bytes])
        for i in range(0, max(len(payload), 1), fragment_bytes)
    ]
    return pb.ActivationTensor(dtype=dtype, shape=list(array.shape), fragments=fragments, crc32c=crc32c.crc32c(payload))


def decode_tensor(msg: pb.ActivationTensor, max_bytes: int = MAX_TENSOR_BYTES) -> np.ndarray:
    """Check and join a tensor's fragments.

    Returns:
        A read-only array of the message's dtype and shape.
    Raises:
        InvalidRequest: unknown dtype, empty shape, or larger than `max_bytes`.
        PayloadCorrupt: a fragment gap or overlap, a size mismatch, or a CRC32C mismatch.
    """
    if msg.dtype not in _DTYPES:
        raise InvalidRequest(f"tensor dtype {msg.dtype} is not supported; allowed FLOAT32, FLOAT16")
    if not msg.shape:
        raise InvalidRequest("tensor has no shape")
    dtype = _DTYPES[msg.dtype]
    nbytes = math.prod(msg.shape) * dtype.itemsize
    if nbytes > max_bytes:
        raise InvalidRequest(f"tensor of {nbytes} bytes exceeds the limit of {max_bytes}")
    parts, end = [], 0
    for frag in sorted(msg.fragments, key=lambda f: f.offset):
        if frag.offset > end:
            raise PayloadCorrupt(f"fragment gap: bytes {end}..{frag.offset} are missing")
        if frag.offset < end:
            raise PayloadCorrupt(f"fragment overlap: fragment at offset {frag.offset} starts before byte {end}")
        parts.append(frag.data)
        end += len(frag.data)
    if end != nbytes:
        raise PayloadCorrupt(f"fragments carry {end} bytes; dtype and shape {list(msg.shape)} need {nbytes}")
    payload = b"".join(parts)
    crc = crc32c.crc32c(payload)
    if crc != msg.crc32c:
        raise PayloadCorrupt(f"CRC32C mismatch: payload has {crc:#010x}, the frame says {msg.crc32c:#010x}")
    return np.frombuffer(payload, dtype=dtype).reshape(tuple(msg.shape))
