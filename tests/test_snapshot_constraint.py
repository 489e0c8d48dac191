"""The constraint run in the snapshot file (format version 3): exact round trips, the version 2 layout
kept for a session without one, version 1 and 2 files read without one, and every constraint section a
forged file could carry refused as SnapshotCorrupt before anything is built from it."""

import dataclasses
import json

import numpy as np
import pytest

from inference_engine.errors import SnapshotCorrupt
from inference_engine.session import snapshot_format as fmt
from inference_engine.text.constraint import ANY_JSON_OBJECT, Constraint, ConstraintRun
from tests.test_snapshot_chat import _with_chat
from tests.test_snapshot_format import _build, _parts, _round_trip, _snapshot

N = 7  # `_snapshot()`'s history length
RUNS = [
    ConstraintRun(Constraint("json_schema", '{"type": "object", "properties": {"é": {"enum": ["日本", "\\"q\\""]}}}'), 3),
    ConstraintRun(Constraint("json_object", ANY_JSON_OBJECT), 0),
    ConstraintRun(Constraint("regex", r"[0-9]{3}-[0-9]{4}\n"), N),
    ConstraintRun(Constraint("grammar", 'start: "yes" | "no"'), 5),
]


def _with_constraint(section: bytes | None, version: int = fmt.FORMAT_VERSION, shape: list | None = None,
                     dtype: str = "|u1", base: bytes | None = None) -> bytes:
    """TEST FIXTURE: `base` (`_snapshot()`'s file) with a constraint section of these bytes last (None: none),
    resealed with a valid SHA-256."""
    header, body = _parts(base or fmt.encode(_snapshot()))
    if section is not None:
        width = np.dtype(dtype).itemsize
        header["sections"].append({"name": "constraint", "dtype": dtype, "shape": shape or [len(section) // width]})
        body += section
    return _build(header, body, version=version)


def _doc(kind: object = "regex", source: object = "[a-z]+", start: object = 2, **extra: object) -> bytes:
    return json.dumps({"kind": kind, "source": source, "start": start, **extra}).encode()


@pytest.mark.parametrize("run", RUNS, ids=[r.constraint.kind for r in RUNS])
def test_the_constraint_run_round_trips_exactly(run):
    data, back = _round_trip(constraint=run)
    assert back.constraint == run
    assert data[8:12] == b"\3\0\0\0"
    header, _ = _parts(data)
    assert header["sections"][-1]["name"] == "constraint"


def test_a_session_without_a_constraint_keeps_the_version_2_layout():
    """Only the version word differs from the file version 2 wrote (same header, same sections, same size),
    and that file, with its version word, reads as the same session without a constraint."""
    data = fmt.encode(_snapshot())
    header, body = _parts(data)
    assert "constraint" not in [s["name"] for s in header["sections"]]
    version_2 = _build(json.dumps(header, sort_keys=True, separators=(",", ":")).encode(), body, version=2)
    assert len(version_2) == len(data) and version_2[12:-32] == data[12:-32] and version_2[8:12] == b"\2\0\0\0"
    back = fmt.decode(version_2)
    assert back.constraint is None and back.chat == _snapshot().chat and back.state_digest == "c" * 64
    assert fmt.encode(back) == data  # re-encoded as version 3: the same bytes as a fresh snapshot
    assert fmt.decode(_with_chat(None, version=1)).constraint is None  # version 1: no chat, no constraint
    with_run = fmt.encode(dataclasses.replace(_snapshot(), constraint=RUNS[2]))
    section = len(fmt._constraint_bytes(RUNS[2]))
    assert len(with_run) - len(data) == section + len(',{"dtype":"|u1","name":"constraint","shape":[%d]}' % section)


@pytest.mark.parametrize("version", [1, 2])
def test_older_versions_never_carry_a_constraint_section(version):
    base = _with_chat(None, version=1) if version == 1 else None
    with pytest.raises(SnapshotCorrupt, match="unexpected snapshot section 'constraint'"):
        fmt.decode(_with_constraint(_doc(), version=version, base=base))


@pytest.mark.parametrize("section,fragment", [
    (_doc(kind="lark"), "constraint has kind 'lark'; the kinds are json_schema, json_object, regex, grammar"),
    (_doc(kind="x" * 10**5), "constraint has kind 'xxxx"),
    (_doc(start=N + 1), "starts at 8, past its history of 7 tokens"),
    (_doc(start=10**30), "past its history"),
    (_doc(start=-1), "non-negative integer"),
    (_doc(start=True), "non-negative integer"),
    (_doc(start="3"), "non-negative integer"),
    (_doc(source=5), "expected a string"),
    (_doc(source=None), "expected a string"),
    (_doc(kind=["regex"]), "expected a string"),
    (_doc(extra=1), "not an object {kind, source, start}"),
    (json.dumps({"kind": "regex", "source": "a"}).encode(), "not an object"),
    (json.dumps(["regex", "a", 0]).encode(), "not an object"),
    (b"null", "not an object"),
    (b"{not json", "malformed"),
    (b"\xff\xfe", "UnicodeDecodeError"),
    (b"[" * 100000 + b"]" * 100000, "malformed"),
])
def test_a_forged_constraint_section_is_corrupt(section, fragment):
    with pytest.raises(SnapshotCorrupt, match=fragment.replace("{", "\\{").replace("}", "\\}")):
        fmt.decode(_with_constraint(section))


def test_a_constraint_section_of_another_shape_size_or_dtype_is_corrupt():
    doc = _doc() + b" "  # an even length, viewed as two rows
    with pytest.raises(SnapshotCorrupt, match="expected one dimension"):
        fmt.decode(_with_constraint(doc, shape=[2, len(doc) // 2]))
    with pytest.raises(SnapshotCorrupt, match="unexpected snapshot section 'constraint' of dtype <u4"):
        fmt.decode(_with_constraint(doc[:8], dtype="<u4"))
    # A section declaring a terabyte (a small file): refused from the header's numbers, nothing of that size built.
    with pytest.raises(SnapshotCorrupt, match="section 'constraint' runs past the snapshot's end"):
        fmt.decode(_with_constraint(_doc(), shape=[10**12]))
    header, body = _parts(_with_constraint(_doc()))
    header["sections"].append(dict(header["sections"][-1]))  # twice
    with pytest.raises(SnapshotCorrupt, match="unexpected snapshot section 'constraint'"):
        fmt.decode(_build(header, body + _doc()))
    with pytest.raises(SnapshotCorrupt, match="bytes after the snapshot's last section"):
        fmt.decode(_build(*_parts(_with_constraint(None))[:1], _parts(_with_constraint(_doc()))[1]))
    # The head declares the section's bytes in the total a restore reserves for (read before the body).
    data = _with_constraint(_doc())
    assert fmt.read_head(data).total_bytes == len(data)
