"""The snapshot file format on synthetic states: deterministic bytes, exact round trips, and every
malformation refused as SnapshotCorrupt (or SnapshotIncompatible for a sound file of another version)."""

import dataclasses
import hashlib
import json
import struct

import numpy as np
import pytest

from inference_engine.errors import SnapshotCorrupt, SnapshotIncompatible
from inference_engine.session import snapshot_format as fmt
from inference_engine.execution.kv_cache import CanonicalKV

FP = fmt.Fingerprint("a" * 64, "b" * 64, "openblas: x", 16, True, 2, 3)


def _snapshot(n: int = 7, dtype: str = "float32", identity: fmt.PersistedIdentity | None = None) -> fmt.SessionSnapshot:
    rng = np.random.default_rng(n)
    kept = fmt.retained_count(n, FP.sink, FP.window)
    kv = CanonicalKV(n, rng.standard_normal((2, 1, kept, 4)).astype(dtype),
                     rng.standard_normal((2, 1, kept, 4)).astype(dtype))
    logits = rng.standard_normal(10).astype(dtype) if n else None
    return fmt.SessionSnapshot(FP, (1, 2), "label é", np.arange(n, dtype=np.uint32), logits, kv, "c" * 64, identity)


def _round_trip(**fields: object) -> tuple[bytes, fmt.SessionSnapshot]:
    """`_snapshot()` with `fields` replaced, as a file (checked deterministic, and re-encoded to the same bytes
    after a decode), and what it decodes to (checked to hold the same history)."""
    data = fmt.encode(dataclasses.replace(_snapshot(), **fields))
    assert data == fmt.encode(dataclasses.replace(_snapshot(), **fields))  # deterministic
    back = fmt.decode(data)
    assert fmt.encode(back) == data and back.history_length == _snapshot().history_length
    return data, back


def _parts(data: bytes) -> tuple[dict, bytes]:
    _, _, head_len = struct.unpack_from("<8sII", data)
    return json.loads(data[16 : 16 + head_len]), data[16 + head_len : -32]


def _build(header: dict | bytes, body: bytes, version: int = fmt.FORMAT_VERSION, head_len: int | None = None) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    blob = struct.pack("<8sII", fmt.MAGIC, version, len(head) if head_len is None else head_len) + head + body
    return blob + hashlib.sha256(blob).digest()


@pytest.mark.parametrize("n,dtype", [(0, "float32"), (1, "float32"), (7, "float32"), (7, "float16")])
def test_round_trip_is_exact_and_deterministic(n, dtype):
    ident = fmt.PersistedIdentity("sid", "owner", 123) if n == 7 else None
    snap = _snapshot(n, dtype, ident)
    data = fmt.encode(snap)
    assert data == fmt.encode(_snapshot(n, dtype, ident)) and data.startswith(fmt.MAGIC)
    back = fmt.decode(data)
    assert back.fingerprint == FP and back.eos_token_ids == (1, 2) and back.client_label == "label é"
    assert back.tokens.tobytes() == snap.tokens.tobytes() and back.history_length == n
    assert back.kv.keys.tobytes() == snap.kv.keys.tobytes() and back.kv.values.dtype == np.dtype(dtype)
    assert (back.logits is None) == (n == 0) and (n == 0 or back.logits.tobytes() == snap.logits.tobytes())
    assert back.identity == ident and back.state_digest == "c" * 64
    assert back.kv.layer_digests() == snap.kv.layer_digests()


def test_fingerprint_differences_name_each_field():
    import dataclasses

    other = dataclasses.replace(FP, model="d" * 64, block_size=12, is_exact=False, sink=9)
    diffs = FP.differences(other)
    assert [d.split()[0] for d in diffs] == ["model", "block_size", "is_exact"]
    assert "aaaaaaaaaaaa… (this server: dddddddddddd…)" in diffs[0]
    with pytest.raises(SnapshotIncompatible, match="block_size 16 \\(this server: 12\\)"):
        fmt.check_compatible(_snapshot(), other)
    fmt.check_compatible(_snapshot(), dataclasses.replace(FP, sink=0, window=0))  # sink/window: not compared


def test_malformations_are_corrupt():
    data = fmt.encode(_snapshot())
    header, body = _parts(data)

    def edited(path: list, value: object) -> dict:
        h = json.loads(json.dumps(header))
        target = h
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return h

    cases = {
        "no snapshot header": b"",
        "does not match": data[:-1] + bytes([data[-1] ^ 1]),
        "header length": _build(header, body, head_len=10**6),
        "header length (over the cap)": _build(header, body, head_len=fmt.MAX_HEADER_BYTES + 1),
        "malformed": _build(b"{not json", body),
        "expected a string": _build(edited(["fingerprint", "model"], 5), body),
        "non-negative integer": _build(edited(["fingerprint", "block_size"], -1), body),
        "boolean": _build(edited(["fingerprint", "exact"], 1), body),
        "unexpected snapshot section": _build(edited(["sections", 0, "name"], "extra"), body),
        "runs past": _build(edited(["sections", 3, "shape"], [2, 1, 99, 4]), body),
        "bytes after": _build(header, body + b"\0"),
        "do not describe": _build(edited(["state", "history_length"], 6), body),
        "KeyError": _build(edited(["state"], {}), body),
    }
    for fragment, blob in cases.items():
        with pytest.raises(SnapshotCorrupt, match=fragment.split(' (')[0]):
            fmt.decode(blob)
    with pytest.raises(SnapshotIncompatible, match="format version 7; this server reads versions 1, 2, 3"):
        fmt.decode(_build(header, body, version=7))
    nested = b"[" * 100000 + b"]" * 100000
    with pytest.raises(SnapshotCorrupt):
        fmt.decode(_build(nested, body))


@pytest.mark.parametrize("sink", [0, 1, 2, 5])
@pytest.mark.parametrize("window", [0, 1, 3, 8])
def test_retained_count_is_the_visible_positions_less_the_query(sink, window):
    from inference_engine.execution.kv_cache import CacheGeometry

    for n in range(20):
        visible = CacheGeometry(sink, window, 1, 0).visible_positions(n)[:-1] if n else []
        assert fmt.retained_count(n, sink, window) == len(visible)
    # header numbers no server allows: answered by arithmetic (a list of them would need petabytes)
    assert fmt.retained_count(10**15, 10**12, 10**13) == 10**12 + 10**13


def test_a_forged_huge_window_and_history_is_refused_without_building_them():
    """A small file with a valid checksum claiming window = history = 10**12: refused as corrupt (its
    sections hold 7 tokens), before anything proportional to the claim exists (the old decode built a
    list of 10**12 positions: MemoryError or minutes)."""
    header, body = _parts(fmt.encode(_snapshot()))
    header["fingerprint"]["window"] = header["state"]["history_length"] = 10**12
    with pytest.raises(SnapshotCorrupt, match="do not describe a session of 1000000000000 tokens"):
        fmt.decode(_build(header, body))
    # consistent sections and an absurd window: decoded at once (the server's limits are check_fits' job)
    wide = dataclasses.replace(FP, window=10**12)
    kv = CanonicalKV(7, np.zeros((2, 1, 7, 4), np.float32), np.zeros((2, 1, 7, 4), np.float32))
    snap = fmt.SessionSnapshot(wide, (), "", np.arange(7, dtype=np.uint32), np.zeros(10, np.float32), kv, "c" * 64)
    assert fmt.decode(fmt.encode(snap)).fingerprint.window == 10**12
