"""The fuzz's strategies for the session-transfer RPCs: SnapshotSession, ForkSession, RestoreSession.

RestoreSession is client-streaming, so its drawn request is a list of messages (or of raw
byte strings): a valid snapshot of the live session cut into random chunks, the same with a
byte changed, cut short, extended or replaced by random bytes, the same resealed with a drawn
constraint run (a kind, known or not; a source, valid or random text; a start up to past the
history: forged_snapshots.py), `file` names that try to leave --snapshot-dir, and both `file`
and `data` together. The property (fuzz.py) holds as for the
other methods, and also for the calls that succeed: the live session is never changed, and a
session that a fork or restore creates reports the digest its response promised.
"""

from __future__ import annotations

from typing import Callable

from reliabilitykit.forged_snapshots import with_constraint
from inference_engine.session import snapshot_format as fmt
from inference_engine.text.constraint import CONSTRAINT_KINDS, Constraint, ConstraintRun
from inference_engine.v1 import runtime_pb2 as pb

# Names under --snapshot-dir a client may try: absent, escaping, absolute, odd.
ODD_FILES = ["", "missing.snap", "../escape.snap", "/etc/passwd", "a/../../b", ".", "..", "x" * 300, "nul\0byte"]
RESTORE_SHAPES = ["valid", "flip", "cut", "extend", "random", "constraint", "file", "file and data", "no message"]
# Constraint sources a drawn run may carry besides random text: valid and invalid, of every kind.
SOURCES = ["[0-9]+", "[a-", '{"type": "object"}', '{"type": 3}', "{not json", 'start: "yes" | "no"', "start: nowhere"]


def snapshot_strategies(st: object, Fuzzed: Callable, victim: str, wild_ids: object, text: object,  # noqa: N803
                        snapshot: bytes) -> dict[str, object]:
    """One hypothesis strategy per transfer RPC (drawing `Fuzzed` records); `snapshot` is a valid one of `victim`."""
    ids = st.one_of(st.just(victim), st.just(victim), wild_ids)
    decoded = fmt.decode(snapshot)
    n = decoded.history_length

    @st.composite
    def snapshot_or_fork(draw: Callable) -> Fuzzed:
        if draw(st.booleans()):
            return Fuzzed("ForkSession", pb.ForkSessionRequest(session_id=draw(ids)))
        return Fuzzed("SnapshotSession", pb.SnapshotSessionRequest(session_id=draw(ids), to_dir=draw(st.booleans())))

    def chunks(data: bytes, draw: Callable) -> list[pb.RestoreSessionRequest]:
        cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=4))))
        edges = [0, *cuts, len(data)]
        return [pb.RestoreSessionRequest(data=data[a:b]) for a, b in zip(edges, edges[1:])]

    @st.composite
    def restore(draw: Callable) -> Fuzzed:
        shape = draw(st.sampled_from(RESTORE_SHAPES))
        data = snapshot
        if shape == "flip":
            i = draw(st.one_of(st.integers(0, len(data) - 1), st.integers(0, min(63, len(data) - 1))))  # often the header
            data = data[:i] + bytes([(data[i] + draw(st.integers(1, 255))) % 256]) + data[i + 1 :]
        elif shape == "cut":
            data = data[: draw(st.integers(1, len(data) - 1))]
        elif shape == "extend":
            data = data + draw(st.binary(min_size=1, max_size=16))
        elif shape == "random":
            data = draw(st.binary(min_size=1, max_size=256))
        elif shape == "constraint":
            kind = draw(st.sampled_from([*CONSTRAINT_KINDS, "lark", ""]))
            source = draw(st.one_of(st.sampled_from(SOURCES), text))
            data = with_constraint(decoded, ConstraintRun(Constraint(kind, source), draw(st.integers(0, n + 2))))
        if shape in ("file", "file and data"):
            name = draw(st.one_of(st.sampled_from(ODD_FILES), text))
            messages = [pb.RestoreSessionRequest(file=name)]
            if shape == "file and data":
                messages.append(pb.RestoreSessionRequest(data=snapshot[:64]))
            return Fuzzed("RestoreSession", messages)
        if shape == "no message":
            return Fuzzed("RestoreSession", [])
        return Fuzzed("RestoreSession", chunks(data, draw))

    return {"SnapshotSession/ForkSession": snapshot_or_fork(), "RestoreSession": restore()}


def read_snapshot(stub: object, session_id: str, timeout_s: float) -> bytes:
    """A snapshot of `session_id`, streamed back whole."""
    return b"".join(m.data for m in stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=session_id),
                                                         timeout=timeout_s))
