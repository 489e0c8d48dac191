"""Snapshots and forks carry a session's constraint run: on the packaged SmolLM2-135M, a JSON-schema output
cut by max_new_tokens continues on a restore from bytes, a restore from a file, a fork and a
`--persist-sessions` restart exactly as on the original (the same tokens, greedy and seeded), while a copy
without the run starts the output afresh. A snapshot whose constraint cannot run here is SNAPSHOT_CORRUPT."""

import dataclasses
import json

import grpc
import jsonschema
import pytest

from inference_engine.client.snapshots import restore_bytes, snapshot_bytes
from inference_engine.runtime.persistence import open_persistence
from inference_engine.runtime.session_transfer import SessionTransfer
from inference_engine.session import snapshot_format as fmt
from inference_engine.text.constraint import Constraint, ConstraintRun
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.test_constrained import SEEDED, _bursts, _fork, _generate, _session
from tests.test_snapshots import _error, _reason

S = {"type": "string", "maxLength": 12}
SCHEMA = {"type": "object", "properties": {"name": S, "tags": {"type": "array", "items": S, "maxItems": 3},
                                           "score": {"type": "number"}},
          "required": ["name", "tags", "score"], "additionalProperties": False}
CONSTRAINT = pb.Constraint(json_schema=json.dumps(SCHEMA))
HEAD = 9  # tokens of the first burst: it stops inside the JSON
MODES = {"greedy": {}, "seeded": SEEDED}


async def _rest(stub, sid: str, kw: dict) -> list[int]:
    """The rest of the constrained output on `sid` (bursts of 16 until the constraint completes)."""
    tokens, reason = await _bursts(stub, sid, 80, 16, CONSTRAINT, **kw)
    assert reason == pb.STOP_REASON_CONSTRAINT_COMPLETE, (tokens, reason)
    return tokens


async def _restore_file(stub, sid: str) -> str:
    taken = [m async for m in stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid, to_dir=True))]
    return (await stub.RestoreSession(iter([pb.RestoreSessionRequest(file=taken[0].file)]))).session_id


@pytest.mark.real_model
async def test_copies_continue_a_constrained_output_as_the_original(real_engine, tmp_path):
    persisted = tmp_path / "sessions"
    halves, heads, want = {}, {}, {}  # per mode: the session cut inside its JSON, its tokens so far, the rest
    async with running_server(real_engine, max_sessions=12, snapshot_dir=tmp_path / "snaps") as (stub, runtime):
        persistence = await open_persistence(SessionTransfer(runtime), persisted, 1, 0)
        base = await _session(stub, "Describe a fruit as JSON with name, tags and score.")
        start = (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=base))).history_length
        for mode, kw in MODES.items():
            halves[mode] = await _fork(stub, base)
            msgs = await _generate(stub, halves[mode], HEAD, CONSTRAINT, **kw)
            heads[mode] = [t for m in msgs for t in m.tokens]
            assert msgs[-1].stop_reason == pb.STOP_REASON_MAX_TOKENS and len(heads[mode]) == HEAD
        await persistence.close()  # every file holds its session as it is now: cut inside the JSON
        for mode, kw in MODES.items():
            half = halves[mode]
            data = await snapshot_bytes(stub, half)
            run = fmt.decode(data).constraint
            assert run == ConstraintRun(Constraint("json_schema", CONSTRAINT.json_schema), start)
            copies = {"bytes": (await restore_bytes(stub, data)).session_id, "fork": await _fork(stub, half)}
            if mode == "greedy":  # the file path differs from the bytes' only in where the bytes come from
                copies["file"] = await _restore_file(stub, half)
                # Negative control: the same state without the run (what a version 2 file holds) starts afresh.
                stripped = await restore_bytes(stub, fmt.encode(dataclasses.replace(fmt.decode(data), constraint=None)))
            want[mode] = await _rest(stub, half, kw)
            jsonschema.validate(json.loads(real_engine.loaded.tokenizer.decode(heads[mode] + want[mode])), SCHEMA)
            for name, sid in copies.items():
                assert await _rest(stub, sid, kw) == want[mode], (mode, name)
            if mode == "greedy":
                afresh, _ = await _bursts(stub, stripped.session_id, 80, 16, CONSTRAINT, **kw)
                assert afresh != want[mode] and real_engine.loaded.tokenizer.decode(afresh).startswith("{")
    async with running_server(real_engine, max_sessions=12) as (stub, runtime):  # a restart
        persistence = await open_persistence(SessionTransfer(runtime), persisted, 1, 0)
        for mode, kw in MODES.items():
            assert await _rest(stub, halves[mode], kw) == want[mode], mode
        await persistence.close()


def _forged(data: bytes, run: ConstraintRun | None) -> bytes:
    """TEST FIXTURE: the snapshot `data` with its constraint run replaced (a sound file: the SHA-256 is recomputed;
    the state digest does not cover the run)."""
    return fmt.encode(dataclasses.replace(fmt.decode(data), constraint=run))


async def _refused(stub, runtime, blob: bytes) -> str:
    """Restore `blob`: INVALID_ARGUMENT SNAPSHOT_CORRUPT, no slab kept; returns the message."""
    slabs = runtime.store.slabs_in_use
    err = await _error(restore_bytes(stub, blob))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and _reason(err) == "SNAPSHOT_CORRUPT", err.details()
    assert runtime.store.slabs_in_use == slabs
    return err.details()


@pytest.mark.real_model
async def test_a_constraint_that_cannot_run_here_is_snapshot_corrupt(real_engine):
    async with running_server(real_engine, max_text_chars=64) as (stub, runtime):
        sid = await _session(stub, "Say yes.")
        data = await snapshot_bytes(stub, sid)
        n = fmt.decode(data).history_length
        cases = {
            "regex is invalid": Constraint("regex", "[a-"),
            "grammar is invalid": Constraint("grammar", "start: nowhere"),
            "json_schema is not JSON": Constraint("json_schema", "{not json"),
            "must be a JSON object": Constraint("json_schema", "[1, 2]"),
            "json_schema is invalid": Constraint("json_schema", '{"type": 3}'),
            "has 65 characters; a request's constraint may have at most 64 (--max-text-chars)":
                Constraint("regex", "a" * 65),
        }
        for fragment, c in cases.items():
            assert fragment in await _refused(stub, runtime, _forged(data, ConstraintRun(c, n))), fragment
        # A run whose tokens no longer match its constraint (as after free text) restores; the next call starts afresh.
        copy = await restore_bytes(stub, _forged(data, ConstraintRun(Constraint("regex", "[0-9]{3}"), 0)))
        msgs = await _generate(stub, copy.session_id, 8, pb.Constraint(regex="[0-9]{3}"))
        assert "".join(m.text for m in msgs).isdigit() and msgs[-1].stop_reason == pb.STOP_REASON_CONSTRAINT_COMPLETE
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert info.history_length == n and info.state_digest == fmt.decode(data).state_digest


async def test_a_constraint_on_a_model_without_tokenizer_is_refused_and_a_persisted_one_set_aside(tiny_engine,
                                                                                                 tmp_path):
    run = ConstraintRun(Constraint("regex", "[0-9]+"), 1)
    async with running_server(tiny_engine) as (stub, runtime):
        persistence = await open_persistence(SessionTransfer(runtime), tmp_path, 1, 0)
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[5, 6, 7]))
        await persistence.close()
        data = await snapshot_bytes(stub, sid)
        message = await _refused(stub, runtime, _forged(data, run))
        assert "regex constraint cannot run here: the served model has no tokenizer" in message, message
    path = persistence.path(sid)
    path.write_bytes(_forged(path.read_bytes(), run))  # a file written here, then tampered with
    async with running_server(tiny_engine) as (stub, runtime):
        persistence = await open_persistence(SessionTransfer(runtime), tmp_path, 1, 0)
        assert runtime.store.slabs_in_use == 0 and path.with_name(path.name + ".rejected").exists()
        await persistence.close()
