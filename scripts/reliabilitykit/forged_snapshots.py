"""Sound snapshots with a forged constraint run: what a restore must refuse (SNAPSHOT_CORRUPT) though the
file's SHA-256 and state digest hold (the digest does not cover the run, and the SHA-256 is recomputed).

Built from a real snapshot of a live session, so every other check (fingerprint, shapes, digest) passes
and the constraint is what is judged: its kind, where it starts, its size and whether it compiles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

from inference_engine.session import snapshot_format as fmt
from inference_engine.text.constraint import Constraint, ConstraintRun


def with_constraint(snapshot: bytes | fmt.SessionSnapshot, run: ConstraintRun | None) -> bytes:
    """`snapshot` (bytes, or decoded) with its constraint run replaced, encoded with a valid SHA-256."""
    snap = fmt.decode(snapshot) if isinstance(snapshot, bytes) else snapshot
    return fmt.encode(dataclasses.replace(snap, constraint=run))


def with_section_shape(snapshot: bytes, name: str, shape: list[int]) -> bytes:
    """`snapshot` with section `name`'s declared shape changed (its bytes as they were), SHA-256 recomputed."""
    _, version, head_len = struct.unpack_from("<8sII", snapshot)
    header = json.loads(snapshot[16 : 16 + head_len])
    for section in header["sections"]:
        if section["name"] == name:
            section["shape"] = shape
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob = struct.pack("<8sII", fmt.MAGIC, version, len(head)) + head + snapshot[16 + head_len : -32]
    return blob + hashlib.sha256(blob).digest()


def forged_constraint_snapshots(snapshot: bytes, max_text_chars: int) -> dict[str, tuple[bytes, str]]:
    """What is wrong -> (the forged snapshot, the ErrorInfo reason its restore must get)."""
    snap = fmt.decode(snapshot)
    n = snap.history_length
    runs = {
        "a constraint regex that does not compile": ConstraintRun(Constraint("regex", "[a-"), n),
        "a constraint grammar with an unknown rule": ConstraintRun(Constraint("grammar", "start: nowhere"), n),
        "a constraint json_schema that is not JSON": ConstraintRun(Constraint("json_schema", "{not json"), n),
        "a constraint json_schema with type 3": ConstraintRun(Constraint("json_schema", '{"type": 3}'), n),
        "a constraint over --max-text-chars": ConstraintRun(Constraint("regex", "a" * (max_text_chars + 1)), n),
        "a constraint of an unknown kind": ConstraintRun(Constraint("lark", "start: x"), n),  # type: ignore[arg-type]  # forged
        "a constraint run starting past the history": ConstraintRun(Constraint("regex", "[0-9]+"), n + 1),
    }
    cases = {what: (with_constraint(snap, run), "SNAPSHOT_CORRUPT") for what, run in runs.items()}
    valid = with_constraint(snap, ConstraintRun(Constraint("regex", "[0-9]+"), n))
    cases["a constraint section declaring 10**12 bytes"] = (with_section_shape(valid, "constraint", [10**12]), "INVALID_REQUEST")
    cases["a constraint section declaring a MiB it does not hold"] = (with_section_shape(valid, "constraint", [1 << 20]),
                                                           "SNAPSHOT_CORRUPT")  # under --max-snapshot-bytes
    return cases
