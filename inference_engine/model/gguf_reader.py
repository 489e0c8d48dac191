"""A GGUF file's metadata and tensor directory, read fast (gguf-py's reader took ~2 min on a 262k vocabulary).

Scalars and strings are decoded; arrays of numbers come back as numpy arrays; string arrays
(the vocabulary, the merges) as lists of str. Tensors are described, not read: their bytes are
sliced from the file when a loader wants them.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "|b1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are in a GGUF file."""

    name: str  # GGUF tensor name, e.g. blk.3.attn_q.weight
    kind: int  # ggml type id (0 F32, 1 F16, 12 Q4_K, ...)
    shape: tuple[int, ...]  # numpy order (rows first): the reverse of GGUF's ne
    offset: int  # byte offset of the data in the file
    nbytes: int  # bytes of the data

    @property
    def type_name(self) -> str:
        """The ggml type's name (e.g. "Q4_K")."""
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.kind).name
        except ValueError:
            return f"type {self.kind}"


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file's metadata and tensor directory."""

    path: Path  # the file
    metadata: dict[str, Any]  # key -> value (numbers, str, numpy arrays, lists of str)
    tensors: tuple[TensorInfo, ...]  # in file order

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (a numpy scalar becomes a Python number)."""
        v = self.metadata.get(key, default)
        return v.item() if isinstance(v, np.generic) else v

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """The raw bytes of tensor `t` (uint8, a copy)."""
        return np.fromfile(self.path, np.uint8, t.nbytes, offset=t.offset)


def _type_size(kind: int) -> tuple[int, int] | None:
    """(elements, bytes) per block of a ggml type; None for a type gguf-py does not know (the
    loader's type check then names the tensor)."""
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        return None


def read_gguf(path: Path) -> GgufFile:
    """Parse a GGUF v2/v3 (little-endian) file's header.

    Raises:
        ValueError: not a GGUF file, or a malformed header.
    """
    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF v2+ file")
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

        def value(kind: int, at: int) -> tuple[Any, int]:
            if kind == _STRING:
                return string(at)
            if kind == _ARRAY:
                item, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if item in _SCALARS:
                    dt = np.dtype(_SCALARS[item])
                    return np.frombuffer(buf, dt, count, at).copy(), at + count * dt.itemsize
                out = []
                for _ in range(count):
                    v, at = value(item, at)
                    out.append(v)
                return out, at
            dt = np.dtype(_SCALARS[kind])
            return np.frombuffer(buf, dt, 1, at)[0], at + dt.itemsize

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = value(kind, pos + 4)
        alignment = int(metadata.get("general.alignment", 32))
        infos = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            ne = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, kind, tuple(int(n) for n in reversed(ne)), offset))
        data = (pos + alignment - 1) // alignment * alignment
        tensors = []
        for name, kind, shape, offset in infos:
            per, size = _type_size(kind) or (1, 0)
            tensors.append(TensorInfo(name, kind, shape, data + offset, int(np.prod(shape)) // per * size))
        return GgufFile(path, metadata, tuple(tensors))
    except struct.error as exc:
        raise ValueError(f"{path}: the GGUF header is truncated ({exc})") from None
    finally:
        buf.close()
