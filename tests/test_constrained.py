"""Constrained output (GenerateRequest.constraint) on the packaged real model over a real grpc.aio server.

Every output parses and validates against its schema (jsonschema), matches its regex or grammar, ends
with its own stop reason, and is the same bits whatever the bursts, speculation or batch companions.
"""

import asyncio
import json
import re

import grpc
import jsonschema
import pytest

from inference_engine.model.loader import load_model
from inference_engine.runtime.engine import Engine
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.kernel_guard import assert_full_tile

pytestmark = pytest.mark.real_model

S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"price": {"type": "integer", "minimum": 0, "maximum": 1000},
                                      "currency": {"enum": ["USD", "EUR"]}},
     "required": ["price", "currency"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                               "name": S},
                                               "required": ["id", "name"]}}, "required": ["user"]},
    {"type": "object", "properties": {"city": S, "country": S}, "required": ["city"]},  # optional country
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 1}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "maximum": 99}, "y": {"type": "integer", "maximum": 99}},
        "required": ["x", "y"]}}}, "required": ["points"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}, "note": S},
     "required": ["n"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {"enum": [1, 2, 3]}},
                                      "total": {"type": "integer"}}, "required": ["items", "total"]},
    {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                      "rating": {"type": "number"}}, "required": ["title", "year"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "active": {"type": "boolean"}}, "required": ["id", "active"],
     "additionalProperties": False},
]


def _closed(schema: object) -> object:
    """`schema` with additionalProperties false on every object (as OpenAI's strict mode requires): a small
    model otherwise invents keys until max_new_tokens."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


SCHEMAS = [_closed(s) for s in SCHEMAS]
SEEDED = dict(temperature=0.6, top_k=40, seed=7)


async def _session(stub, prompt: str) -> str:
    sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, messages=[pb.ChatMessage(role="user", content=prompt)],
                                                   add_generation_prompt=True))
    return sid


async def _fork(stub, sid: str) -> str:
    return (await stub.ForkSession(pb.ForkSessionRequest(session_id=sid))).session_id


async def _forked_bursts(stub, base: str, *args, **kw) -> tuple[list[int], int]:
    """`_bursts` on a fork of `base`, closed after."""
    sid = await _fork(stub, base)
    try:
        return await _bursts(stub, sid, *args, **kw)
    finally:
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


async def _generate(stub, sid: str, n: int, constraint: pb.Constraint | None, **kw) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, **kw)
    if constraint is not None:  # None: free text
        req.constraint.CopyFrom(constraint)
    return [m async for m in stub.Generate(req)]


async def _bursts(stub, sid: str, n: int, width: int, constraint: pb.Constraint | None, **kw) -> tuple[list[int], int]:
    """Tokens of bursts of `width` until the constraint completes (or `n` tokens), and the last stop reason."""
    tokens: list[int] = []
    while len(tokens) < n:
        msgs = await _generate(stub, sid, min(width, n - len(tokens)), constraint, **kw)
        tokens += [t for m in msgs for t in m.tokens]
        if msgs[-1].stop_reason != pb.STOP_REASON_MAX_TOKENS:
            return tokens, msgs[-1].stop_reason
    return tokens, pb.STOP_REASON_MAX_TOKENS


async def test_json_schemas_parse_and_validate_greedy_and_seeded(real_engine):
    async with running_server(real_engine) as (stub, _):
        base = await _session(stub, "Reply with a short JSON value for a test record.")
        failures = []
        for i, schema in enumerate(SCHEMAS):
            constraint = pb.Constraint(json_schema=json.dumps(schema))
            for label, kw in (("greedy", {}), ("seeded", SEEDED)):
                sid = await _fork(stub, base)
                msgs = await _generate(stub, sid, 64, constraint, **kw)
                text = "".join(m.text for m in msgs)
                try:
                    jsonschema.validate(json.loads(text), schema)
                except (ValueError, jsonschema.ValidationError) as exc:
                    failures.append((i, label, text, repr(exc)[:120]))
                if msgs[-1].stop_reason != pb.STOP_REASON_CONSTRAINT_COMPLETE:
                    failures.append((i, label, text, pb.StopReason.Name(msgs[-1].stop_reason)))
                await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        assert failures == [], '\n'.join(map(repr, failures))


async def test_json_object_regex_and_grammar(real_engine):
    cases = [
        (pb.Constraint(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (pb.Constraint(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (pb.Constraint(regex=r"(yes|no), because [a-z ]{1,20}\."),
         lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t)),
        (pb.Constraint(grammar='start: answer " " answer\nanswer: "yes" | "no" | "maybe"'),
         lambda t: re.fullmatch(r"(yes|no|maybe) (yes|no|maybe)", t)),
        (pb.Constraint(grammar='start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[0-9]{1,3}/'),
         lambda t: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", t)),
    ]
    async with running_server(real_engine) as (stub, _):
        base = await _session(stub, "Answer the question: is the sky blue? Then a phone number.")
        for constraint, check in cases:
            for kw in ({}, SEEDED):
                sid = await _fork(stub, base)
                msgs = await _generate(stub, sid, 48, constraint, **kw)
                text = "".join(m.text for m in msgs)
                assert check(text), (constraint, kw, text)
                assert msgs[-1].stop_reason in (pb.STOP_REASON_CONSTRAINT_COMPLETE, pb.STOP_REASON_MAX_TOKENS)
                await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


async def test_stop_strings_cut_a_constrained_stream_and_a_model_without_tokenizer_refuses(real_engine, tiny_engine):
    constraint = pb.Constraint(regex=r"[a-z]{1,6}(, [a-z]{1,6}){0,6}")
    async with running_server(real_engine) as (stub, _):
        base = await _session(stub, "List some colors, separated by commas.")
        whole, reason = await _forked_bursts(stub, base, 48, 48, constraint)
        assert reason == pb.STOP_REASON_CONSTRAINT_COMPLETE or len(whole) == 48
        sid = await _fork(stub, base)
        msgs = await _generate(stub, sid, 48, constraint, stop=[","], mode=pb.DECODE_MODE_SPECULATIVE_LOOKUP)
        cut = [t for m in msgs for t in m.tokens]
        assert msgs[-1].stop_reason == pb.STOP_REASON_STOP_STRING and whole[: len(cut)] == cut
        rest, _ = await _bursts(stub, sid, 48 - len(cut), 48, constraint)  # continues the same output
        assert cut + rest == whole
        # A stream cancelled after its first message keeps exactly the sent tokens; the next call continues them.
        sid = await _fork(stub, base)
        call = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=48, constraint=constraint))
        first = list((await call.read()).tokens)
        call.cancel()
        length = lambda s: stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=s))  # noqa: E731
        kept = (await length(sid)).history_length - (await length(base)).history_length
        assert len(first) <= kept and whole[: len(first)] == first
        rest, _ = await _bursts(stub, sid, 48 - kept, 48, constraint)
        assert rest == whole[kept:]
    async with running_server(tiny_engine) as (stub, _):
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1, 2, 3]))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _generate(stub, sid, 4, constraint)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "needs one" in e.value.details()


async def test_constrained_streams_are_the_same_bits_for_every_burst_mode_and_companion(real_engine):
    schema = {"type": "object", "properties": {"name": S, "tags": {"type": "array", "items": S, "maxItems": 3},
                                               "score": {"type": "number"}}, "required": ["name", "tags", "score"]}
    constraint = pb.Constraint(json_schema=json.dumps(schema))
    async with running_server(real_engine, max_sessions=8) as (stub, _):
        base = await _session(stub, "Describe a fruit as JSON with name, tags and score.")
        for kw in ({}, SEEDED):
            ref, reason = await _forked_bursts(stub, base, 80, 80, constraint, **kw)
            assert reason == pb.STOP_REASON_CONSTRAINT_COMPLETE
            jsonschema.validate(json.loads(real_engine.loaded.tokenizer.decode(ref)), schema)
            unconstrained, _ = await _forked_bursts(stub, base, len(ref), 80, None, **kw)
            assert unconstrained != ref  # the mask changed the output: a real constraint
            lookup, plain = pb.DECODE_MODE_SPECULATIVE_LOOKUP, pb.DECODE_MODE_GREEDY
            for width, mode in ((1, lookup), (4, plain), (4, lookup), (32, lookup)):  # K = 4
                got = await _forked_bursts(stub, base, 80, width, constraint, mode=mode, num_draft_tokens=4, **kw)
                assert got == (ref, reason), (width, mode, kw)
            # A fork part-way through continues the same output (the fork carries the constraint's start).
            half = await _fork(stub, base)
            head, _ = await _bursts(stub, half, 10, 10, constraint, **kw)
            fork = await _fork(stub, half)
            assert head + (await _bursts(stub, fork, 80, 80, constraint, **kw))[0] == ref
            for sid in (half, fork):
                await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            # Batch companions: a free-text stream and another constrained one in the same forwards.
            together = await asyncio.gather(
                _forked_bursts(stub, base, 80, 5, constraint, mode=pb.DECODE_MODE_SPECULATIVE_LOOKUP, **kw),
                _forked_bursts(stub, base, 40, 40, None, ignore_eos=True),
                _forked_bursts(stub, base, 80, 7, pb.Constraint(json_object=True), **kw),
            )
            assert together[0] == (ref, reason)


async def _counted_bursts(stub, sid: str, n: int, width: int, constraint: pb.Constraint,
                          **kw) -> tuple[list[int], int, int, int]:
    """Tokens of bursts of `width` (as `_bursts`), the last stop reason, and the drafts drafted and accepted."""
    tokens, drafted, accepted = [], 0, 0
    while len(tokens) < n:
        msgs = await _generate(stub, sid, min(width, n - len(tokens)), constraint, **kw)
        tokens += [t for m in msgs for t in m.tokens]
        drafted, accepted = drafted + msgs[-1].drafted_tokens, accepted + msgs[-1].accepted_tokens
        if msgs[-1].stop_reason != pb.STOP_REASON_MAX_TOKENS:
            return tokens, msgs[-1].stop_reason, drafted, accepted
    return tokens, pb.STOP_REASON_MAX_TOKENS, drafted, accepted


async def test_draft_model_speculation_under_a_constraint_is_the_plain_constrained_stream(real_model, real_model_path):
    """The packaged q4 model drafts for the fp32 target: drafts (unconstrained proposals cut to what the constraint
    allows) are verified against the masked draw, so the stream is the plain constrained one, greedy and seeded."""
    schema = {"type": "object", "properties": {"name": S, "colors": {"type": "array", "items": S, "maxItems": 3}},
              "required": ["name", "colors"], "additionalProperties": False}
    constraint = pb.Constraint(json_schema=json.dumps(schema))
    draft = load_model(real_model_path.parent / "q4")
    engine = assert_full_tile(Engine(real_model, exact=True, max_tile=16, plain_block=64, max_rollback=8, draft=draft))
    counts = []  # (drafted, accepted) per speculative stream
    try:
        async with running_server(engine) as (stub, _):
            base = await _session(stub, "Describe a fruit as JSON with its name and colors.")
            for kw in ({}, SEEDED):
                sid = await _fork(stub, base)
                plain, reason, drafted, _ = await _counted_bursts(stub, sid, 48, 48, constraint, **kw)
                await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
                assert reason == pb.STOP_REASON_CONSTRAINT_COMPLETE and drafted == 0
                jsonschema.validate(json.loads(real_model.tokenizer.decode(plain)), schema)
                for width in (48, 5):  # one call, and bursts (drafts never cross a burst edge)
                    sid = await _fork(stub, base)
                    spec = dict(mode=pb.DECODE_MODE_SPECULATIVE_DRAFT, num_draft_tokens=4, **kw)
                    *got, drafted, accepted = await _counted_bursts(stub, sid, 48, width, constraint, **spec)
                    assert got == [plain, reason], (width, kw)
                    assert drafted > 0 and accepted > 0, (width, kw, drafted, accepted)
                    counts.append((drafted, accepted))
                    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    finally:
        engine.close()
    assert any(accepted < drafted for drafted, accepted in counts), counts  # the reject path ran too


async def test_bad_constraints_are_invalid_argument_and_leave_the_session_intact(real_engine):
    bad = [
        (pb.Constraint(json_schema="{not json"), "constraint.json_schema is not JSON"),
        (pb.Constraint(json_schema="[1, 2]"), "constraint.json_schema must be a JSON object"),
        (pb.Constraint(json_schema='{"type": 3}'), "constraint.json_schema is invalid"),
        (pb.Constraint(json_schema='{"type": "string", "pattern": "(("}'), "unclosed group"),
        (pb.Constraint(regex="[a-"), "unclosed character class"),
        (pb.Constraint(grammar="start: missing_rule"), "unknown name"),
        (pb.Constraint(json_object=False), "json_object must be true"),
        (pb.Constraint(), "needs one of json_schema, json_object, regex, grammar"),
    ]
    async with running_server(real_engine) as (stub, _):
        sid = await _session(stub, "Hello")
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        for constraint, words in bad:
            req = pb.GenerateRequest(session_id=sid, max_new_tokens=4)
            req.constraint.CopyFrom(constraint)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [m async for m in stub.Generate(req)]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, constraint
            assert words in e.value.details(), (constraint, e.value.details())
            after = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
            assert (after.history_length, after.state_digest) == (info.history_length, info.state_digest)
        msgs = await _generate(stub, sid, 8, pb.Constraint(regex="[a-z]+"))
        assert re.fullmatch("[a-z]+", "".join(m.text for m in msgs))


async def test_masks_are_computed_beside_the_forward_and_are_the_same_bits(real_engine, monkeypatch):
    """Every mask but a call's first comes from the prefetch run while the block is forwarded (drafts
    accepted or not, a stop string's cut), and the stream is the one computed with every mask on demand."""
    from inference_engine.runtime import jobs
    from inference_engine.text.constraint import TokenMatcher

    counts = {"computed": 0, "prefetched": 0}
    compute, prefetch = TokenMatcher._compute, TokenMatcher.prefetch

    def counted_compute(self):
        counts["computed"] += 1
        return compute(self)

    def counted_prefetch(self, *args, **kw):
        prefetch(self, *args, **kw)
        counts["prefetched"] += len(self._masks)

    monkeypatch.setattr(TokenMatcher, "_compute", counted_compute)
    monkeypatch.setattr(TokenMatcher, "prefetch", counted_prefetch)
    constraint = pb.Constraint(regex=r"[a-z]{1,6}(, [a-z]{1,6}){0,6}")
    lookup = dict(mode=pb.DECODE_MODE_SPECULATIVE_LOOKUP, num_draft_tokens=4)
    async with running_server(real_engine) as (stub, _):
        base = await _session(stub, "List some colors, separated by commas.")
        runs = {}
        for label, kw in (("greedy", {}), ("lookup", lookup), ("seeded", SEEDED), ("cut", dict(stop=[","], **lookup))):
            counts.update(computed=0, prefetched=0)
            runs[label] = await _forked_bursts(stub, base, 48, 48, constraint, **kw)
            assert counts["computed"] - counts["prefetched"] == 1, (label, counts)  # the call's first mask alone
        monkeypatch.setattr(jobs, "prefetch_masks", lambda *a, **kw: None)  # every mask on demand
        for label, kw in (("greedy", {}), ("lookup", lookup), ("seeded", SEEDED), ("cut", dict(stop=[","], **lookup))):
            counts.update(computed=0, prefetched=0)
            assert await _forked_bursts(stub, base, 48, 48, constraint, **kw) == runs[label], label
            assert counts["prefetched"] == 0 and counts["computed"] >= len(runs[label][0])
