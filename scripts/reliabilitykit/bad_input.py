"""The bad-input table: every request field out of bounds, raw corrupt bytes, oversize messages.

Each row names the request, the code it must get, the ErrorInfo reason and (on
INVALID_ARGUMENT) the BadRequest field. After every row the sessions it could touch must
be exactly as before (history length and digest), and the server must still answer.
Bounds not reported by GetModelInfo are the documented ones (docs/serving.md, proto comments).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import grpc

from reliabilitykit.forged_snapshots import forged_constraint_snapshots
from reliabilitykit.outcomes import Outcome, call_outcome, outcome_of, typing_problem
from reliabilitykit.report import SectionReport
from reliabilitykit.sessions import (
    RPC_TIMEOUT_S,
    Limits,
    close_quietly,
    limits_of,
    open_session,
    state_of,
)
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

SERVICE = "/inference_engine.v1.RuntimeService/"
U32_MAX = (1 << 32) - 1
MAX_TEXT_CHARS = 65536  # characters of text in one request (the default --max-text-chars)
MAX_MESSAGES = 256  # messages in one request
MAX_LABEL = 256  # CreateSessionRequest.client_label characters
MAX_EOS_IDS = 64  # eos_token_ids of a session or a call
MAX_STOP = 8  # stop strings, each 1..MAX_STOP_CHARS characters
MAX_STOP_CHARS = 256
MAX_ROLE = 64  # ChatMessage.role characters
MAX_SESSION_ID = 128  # session id characters
MAX_DETOKENIZE = 1 << 16  # tokens in one Detokenize
GRPC_MAX_MESSAGE = 4 << 20  # gRPC's default receive limit
PROMPT = (5, 17, 33, 2, 250, 9, 9, 120, 64, 3)
IA, NF, FP, AB = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.ABORTED)
STREAMING = {"Generate", "SnapshotSession"}  # server-streaming; RestoreSession is client-streaming
# Bytes that do not decode as any of the request messages (each breaks the wire format).
CORRUPT = {
    "a length-delimited field cut short": b"\x0a\x05ab",
    "a varint of 12 bytes": b"\x08" + b"\xff" * 11,
    "an end-group tag without a start": b"\x0c",
    "a group that never ends": b"\x0b",
    "wire type 6": b"\x0e",
    "wire type 7": b"\x0f",
}
STRING_FIELD = {  # a string field number per method, to carry invalid UTF-8
    "CreateSession": 2, "AppendTokens": 1, "Generate": 1, "CloseSession": 1, "GetSessionInfo": 1, "Tokenize": 1,
    "SnapshotSession": 1, "ForkSession": 1,
}
METHODS = ("CreateSession", "AppendTokens", "Generate", "CloseSession", "GetSessionInfo", "GetModelInfo",
           "Tokenize", "Detokenize", "SnapshotSession", "ForkSession")


@dataclass(frozen=True)
class BadCase:
    """One row of the table."""

    name: str  # what is wrong
    method: str  # the RPC
    request: object  # the request message, or raw bytes sent as they are
    code: grpc.StatusCode  # the code it must get
    reason: str = "INVALID_REQUEST"  # the ErrorInfo reason it must carry ("" = a transport code, no details)
    field: str | None = None  # the BadRequest field it must name (None = not checked)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _request_cases(lim: Limits, victim: str, fresh: str) -> list[BadCase]:
    v, n = lim.vocab_size, lim.max_tokens_per_request
    cs, ap, gen = pb.CreateSessionRequest, pb.AppendTokensRequest, pb.GenerateRequest
    msg = pb.ChatMessage
    rows = [
        BadCase("sink_tokens over --max-sink", "CreateSession", cs(sink_tokens=lim.max_sink + 1), IA, field="sink_tokens"),
        BadCase("sink_tokens = 2^32-1", "CreateSession", cs(sink_tokens=U32_MAX), IA, field="sink_tokens"),
        BadCase("window_tokens over --max-window", "CreateSession", cs(window_tokens=lim.max_window + 1), IA,
                field="window_tokens"),
        BadCase("eos_token_ids[1] = vocab size", "CreateSession", cs(eos_token_ids=[0, v]), IA, field="eos_token_ids[1]"),
        BadCase("eos_token_ids[0] = 2^32-1", "CreateSession", cs(eos_token_ids=[U32_MAX]), IA, field="eos_token_ids[0]"),
        BadCase("65 eos_token_ids", "CreateSession", cs(eos_token_ids=[0] * (MAX_EOS_IDS + 1)), IA, field="eos_token_ids"),
        BadCase("client_label of 257 characters", "CreateSession", cs(client_label="é" * (MAX_LABEL + 1)), IA,
                field="client_label"),
        BadCase("no tokens, text or messages", "AppendTokens", ap(session_id=victim), IA, field="tokens,text,messages"),
        BadCase("tokens and text", "AppendTokens", ap(session_id=victim, tokens=[1], text="x"), IA,
                field="tokens,text,messages"),
        BadCase("text and messages", "AppendTokens", ap(session_id=victim, text="x", messages=[msg(role="user")]), IA,
                field="tokens,text,messages"),
        BadCase("tokens[2] = vocab size", "AppendTokens", ap(session_id=victim, tokens=[1, 2, v]), IA, field="tokens[2]"),
        BadCase("tokens[0] = 2^32-1", "AppendTokens", ap(session_id=victim, tokens=[U32_MAX]), IA, field="tokens[0]"),
        BadCase("tokens over --max-tokens-per-request", "AppendTokens", ap(session_id=victim, tokens=[1] * (n + 1)), IA,
                field="tokens"),
        BadCase("add_generation_prompt without messages", "AppendTokens",
                ap(session_id=victim, tokens=[1], add_generation_prompt=True), IA),
        BadCase("text over --max-text-chars characters", "AppendTokens", ap(session_id=victim, text="x" * (MAX_TEXT_CHARS + 1)), IA,
                field="text"),
        BadCase("a message with an empty role", "AppendTokens", ap(session_id=victim, messages=[msg(role="", content="x")]),
                IA, field="role"),
        BadCase("a role of 65 characters", "AppendTokens",
                ap(session_id=victim, messages=[msg(role="r" * (MAX_ROLE + 1), content="x")]), IA, field="role"),
        BadCase("257 messages", "AppendTokens",
                ap(session_id=victim, messages=[msg(role="user", content="x")] * (MAX_MESSAGES + 1)), IA, field="messages"),
        BadCase("messages content over --max-text-chars characters", "AppendTokens",
                ap(session_id=victim, messages=[msg(role="user", content="x" * (MAX_TEXT_CHARS + 1))]), IA,
                field="messages.content"),
        BadCase("expected_history_length off by one", "AppendTokens",
                ap(session_id=victim, tokens=[1], expected_history_length=len(PROMPT) + 1), FP, "FAILED_PRECONDITION"),
        BadCase("expected_history_length = 2^64-1", "AppendTokens",
                ap(session_id=victim, tokens=[1], expected_history_length=(1 << 64) - 1), FP, "FAILED_PRECONDITION"),
        BadCase("Generate before any AppendTokens", "Generate", gen(session_id=fresh, max_new_tokens=1), FP,
                "FAILED_PRECONDITION"),
        BadCase("max_new_tokens over --max-new-tokens", "Generate", gen(session_id=victim, max_new_tokens=lim.max_new_tokens + 1),
                IA, field="max_new_tokens"),
        BadCase("max_new_tokens = 2^32-1", "Generate", gen(session_id=victim, max_new_tokens=U32_MAX), IA,
                field="max_new_tokens"),
        BadCase("mode = 3 (no such mode)", "Generate", gen(session_id=victim, mode=3), IA, field="mode"),
        BadCase("mode = -1", "Generate", gen(session_id=victim, mode=-1), IA, field="mode"),
        BadCase("num_draft_tokens over the limit", "Generate",
                gen(session_id=victim, mode=2, num_draft_tokens=lim.max_draft_tokens + 1), IA, field="num_draft_tokens"),
        BadCase("top_k = vocab size + 1", "Generate", gen(session_id=victim, temperature=1, top_k=v + 1), IA, field="top_k"),
        BadCase("top_logprobs over the limit", "Generate",
                gen(session_id=victim, logprobs=True, top_logprobs=lim.max_top_logprobs + 1), IA, field="top_logprobs"),
        BadCase("top_logprobs without logprobs", "Generate", gen(session_id=victim, top_logprobs=1), IA),
        BadCase("9 stop strings", "Generate", gen(session_id=victim, stop=["a"] * (MAX_STOP + 1)), IA, field="stop"),
        BadCase("an empty stop string", "Generate", gen(session_id=victim, stop=[""]), IA, field="stop[0]"),
        BadCase("a stop string of 257 characters", "Generate", gen(session_id=victim, stop=["s", "s" * (MAX_STOP_CHARS + 1)]),
                IA, field="stop[1]"),
        BadCase("eos_token_ids[0] = vocab size", "Generate", gen(session_id=victim, eos_token_ids=[v]), IA,
                field="eos_token_ids[0]"),
        BadCase("65 eos_token_ids", "Generate", gen(session_id=victim, eos_token_ids=[0] * (MAX_EOS_IDS + 1)), IA,
                field="eos_token_ids"),
        BadCase("Tokenize with text and messages", "Tokenize",
                pb.TokenizeRequest(text="x", messages=[msg(role="user")]), IA),
        BadCase("Tokenize add_special_tokens with messages", "Tokenize",
                pb.TokenizeRequest(messages=[msg(role="user")], add_special_tokens=True), IA),
        BadCase("Tokenize add_generation_prompt with text", "Tokenize",
                pb.TokenizeRequest(text="x", add_generation_prompt=True), IA),
        BadCase("Tokenize text over --max-text-chars characters", "Tokenize", pb.TokenizeRequest(text="x" * (MAX_TEXT_CHARS + 1)), IA,
                field="text"),
        BadCase("Tokenize 257 messages", "Tokenize",
                pb.TokenizeRequest(messages=[msg(role="user")] * (MAX_MESSAGES + 1)), IA, field="messages"),
        BadCase("Detokenize tokens[1] = vocab size", "Detokenize", pb.DetokenizeRequest(tokens=[1, v]), IA, field="tokens[1]"),
        BadCase("Detokenize 2^16+1 tokens", "Detokenize", pb.DetokenizeRequest(tokens=[1] * (MAX_DETOKENIZE + 1)), IA,
                field="tokens"),
    ]
    for name, value in (("-1", -1.0), ("NaN", math.nan), ("+inf", math.inf), ("101", 101.0)):
        rows.append(BadCase(f"temperature = {name}", "Generate", gen(session_id=victim, temperature=value), IA,
                            field="temperature"))
    for fname, bad in (("top_p", (-0.1, 1.5, math.nan)), ("min_p", (-0.5, 1.01, -math.inf)),
                       ("repetition_penalty", (-1.0, 10.5, math.inf))):
        for value in bad:
            rows.append(BadCase(f"{fname} = {value}", "Generate", gen(session_id=victim, **{fname: value}), IA, field=fname))
    for method, make in (("AppendTokens", lambda s: ap(session_id=s, tokens=[1])),
                         ("Generate", lambda s: gen(session_id=s, max_new_tokens=1)),
                         ("CloseSession", lambda s: pb.CloseSessionRequest(session_id=s)),
                         ("GetSessionInfo", lambda s: pb.GetSessionInfoRequest(session_id=s)),
                         ("SnapshotSession", lambda s: pb.SnapshotSessionRequest(session_id=s)),
                         ("ForkSession", lambda s: pb.ForkSessionRequest(session_id=s))):
        rows += [
            BadCase(f"{method} with an empty session_id", method, make(""), IA, field="session_id"),
            BadCase(f"{method} with a 129-character session_id", method, make("s" * (MAX_SESSION_ID + 1)), IA,
                    field="session_id"),
            BadCase(f"{method} with an unknown session_id", method, make(victim[:-2] + ("xy" if victim[-2:] != "xy" else "yz")),
                    NF, "SESSION_NOT_FOUND"),
            BadCase(f"{method} with an odd-unicode session_id", method, make("\u202e\u0000\U0001F600\ufeff"), NF,
                    "SESSION_NOT_FOUND"),
        ]
    return rows + _feature_cases(lim, victim) + _restore_cases()


def _restore_cases() -> list[BadCase]:
    """RestoreSession streams that are not one snapshot (the request is a list of messages)."""
    rs = pb.RestoreSessionRequest
    return [
        BadCase("no message", "RestoreSession", [], IA, field="data"),
        BadCase("bytes that are not a snapshot", "RestoreSession", [rs(data=b"not a snapshot at all")], IA,
                "SNAPSHOT_CORRUPT"),
        BadCase("a file and data together", "RestoreSession", [rs(file="a.snap"), rs(data=b"x")], IA, field="file"),
        BadCase("a file that escapes the snapshot folder", "RestoreSession", [rs(file="../escape.snap")], IA,
                field="file"),
    ]


def _forged_snapshot_cases(snapshot: bytes) -> list[BadCase]:
    """Sound snapshots of the victim with a forged constraint run (forged_snapshots.py): refused, nothing restored."""
    rs = pb.RestoreSessionRequest
    return [BadCase(f"a snapshot with {what}", "RestoreSession", [rs(data=blob)], IA, reason,
                    field="data")
            for what, (blob, reason) in forged_constraint_snapshots(snapshot, MAX_TEXT_CHARS).items()]


def _feature_cases(lim: Limits, victim: str) -> list[BadCase]:
    """Requests a model without a tokenizer (or chat template, or draft model) cannot serve."""
    rows = []
    unavailable = (FP, "FEATURE_UNAVAILABLE")
    user = [pb.ChatMessage(role="user", content="hi")]
    if not lim.has_tokenizer:
        rows += [
            BadCase("text without a tokenizer", "AppendTokens", pb.AppendTokensRequest(session_id=victim, text="hi"),
                    *unavailable),
            BadCase("stop strings without a tokenizer", "Generate", pb.GenerateRequest(session_id=victim, stop=["x"]),
                    *unavailable),
            BadCase("Tokenize without a tokenizer", "Tokenize", pb.TokenizeRequest(text="hi"), *unavailable),
            BadCase("Detokenize without a tokenizer", "Detokenize", pb.DetokenizeRequest(tokens=[1]), *unavailable),
        ]
    else:
        rows.append(BadCase("text encoding to more tokens than allowed", "AppendTokens",
                            pb.AppendTokensRequest(session_id=victim, text=" 7" * (lim.max_tokens_per_request + 1)), IA))
        rows += _constraint_cases(victim)
    if not lim.has_chat_template:
        rows += [BadCase("messages without a chat template", "AppendTokens",
                         pb.AppendTokensRequest(session_id=victim, messages=user), *unavailable),
                 BadCase("Tokenize messages without a chat template", "Tokenize", pb.TokenizeRequest(messages=user),
                         *unavailable)]
    if not lim.has_draft_model:
        rows.append(BadCase("SPECULATIVE_DRAFT without a draft model", "Generate",
                            pb.GenerateRequest(session_id=victim, mode=1), FP, "FAILED_PRECONDITION"))
    return rows


def _constraint_cases(victim: str) -> list[BadCase]:
    """Constraints that do not compile: INVALID_ARGUMENT at request time, naming the constraint's field."""
    c, bad = pb.Constraint, (IA, "INVALID_CONSTRAINT")
    rows = [
        BadCase(f"constraint {what}", "Generate", pb.GenerateRequest(session_id=victim, constraint=constraint), *bad,
                field=field)
        for what, constraint, field in (
            ("json_schema that is not JSON", c(json_schema="{not json"), "constraint.json_schema"),
            ("json_schema that is a list", c(json_schema="[1]"), "constraint.json_schema"),
            ("json_schema with type 3", c(json_schema='{"type": 3}'), "constraint.json_schema"),
            ("json_schema with a bad pattern", c(json_schema='{"type": "string", "pattern": "(("}'),
             "constraint.json_schema"),
            ("regex with an unclosed class", c(regex="[a-"), "constraint.regex"),
            ("grammar with an unknown rule", c(grammar="start: nowhere"), "constraint.grammar"),
            ("grammar that does not parse", c(grammar="start: (("), "constraint.grammar"),
        )
    ]
    return rows + [
        BadCase("constraint json_object = false", "Generate",
                pb.GenerateRequest(session_id=victim, constraint=c(json_object=False)), IA, field="constraint.json_object"),
        BadCase("constraint with no kind", "Generate", pb.GenerateRequest(session_id=victim, constraint=c()), IA,
                field="constraint"),
        BadCase("constraint regex over --max-text-chars characters", "Generate",
                pb.GenerateRequest(session_id=victim, constraint=c(regex="a" * (MAX_TEXT_CHARS + 1))), IA,
                field="constraint.regex"),
    ]


def _raw_cases() -> list[BadCase]:
    rows = []
    for method in METHODS:
        rows += [BadCase(f"{method}: {what}", method, raw, IA, "MALFORMED_REQUEST") for what, raw in CORRUPT.items()]
        if method in STRING_FIELD:
            raw = _field_bytes(STRING_FIELD[method], b"ok\xc3\x28\xff")
            rows.append(BadCase(f"{method}: invalid UTF-8 in string field {STRING_FIELD[method]}", method, raw, IA,
                                "MALFORMED_REQUEST"))
        oversize = _field_bytes(1000, b"\0" * GRPC_MAX_MESSAGE)  # an unknown field over gRPC's 4 MiB limit
        rows.append(BadCase(f"{method}: a message over 4 MiB", method, oversize, grpc.StatusCode.RESOURCE_EXHAUSTED, ""))
    return rows


def bad_cases(lim: Limits, victim: str, fresh: str) -> list[BadCase]:
    """The whole table for a server with `lim`, aimed at the sessions `victim` (holds PROMPT) and `fresh` (empty)."""
    return _request_cases(lim, victim, fresh) + _raw_cases()


async def _send(channel: grpc.aio.Channel, case: BadCase) -> Outcome:
    is_raw = isinstance(case.request, bytes)
    codec = {} if is_raw else {"request_serializer": pb.RestoreSessionRequest.SerializeToString
                               if isinstance(case.request, list) else type(case.request).SerializeToString,
                               "response_deserializer": None}
    path = SERVICE + case.method
    if isinstance(case.request, list):  # client-streaming (RestoreSession)
        return (await call_outcome(channel.stream_unary(path, **codec)(iter(case.request), timeout=RPC_TIMEOUT_S)))[0]
    if case.method in STREAMING:
        call = channel.unary_stream(path, **codec)(case.request, timeout=RPC_TIMEOUT_S)
        try:
            async for _ in call:
                pass
            return Outcome("OK")
        except grpc.RpcError as err:
            return outcome_of(err)
    return (await call_outcome(channel.unary_unary(path, **codec)(case.request, timeout=RPC_TIMEOUT_S)))[0]


def _judge(report: SectionReport, case: BadCase, got: Outcome) -> None:
    what = f"{case.method} {case.name}"
    report.count(f"code {got.code}")
    report.numbers.setdefault("table", []).append([case.method, case.name, got.code, got.reason, list(got.fields)])
    problem = typing_problem(got)
    report.check(not problem, f"{what}: typed", problem)
    expected = f"{case.code.name} [{case.reason or 'no details'}]"
    report.check(got.code == case.code.name and got.reason == case.reason, f"{what}: expected {expected}", str(got))
    if case.field is not None:
        report.check(case.field in got.fields, f"{what}: BadRequest names {case.field!r}", f"fields {got.fields}")
    if got.code == "INVALID_ARGUMENT" and got.reason == "INVALID_REQUEST":
        report.check(bool(got.fields), f"{what}: INVALID_ARGUMENT names a field (BadRequest)", str(got))


async def _busy_cases(stub: pb_grpc.RuntimeServiceStub, lim: Limits, report: SectionReport) -> None:
    """Calls that overlap a running Generate on the same session: ABORTED, and the stream goes on."""
    sid = await open_session(stub, PROMPT, lim.max_tokens_per_request)
    stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=lim.max_new_tokens, ignore_eos=True))
    try:
        started, _ = await call_outcome(stream.read())
        if not report.check(started.is_ok, "a long Generate starts (to overlap calls with it)", str(started)):
            return
        overlapping = {
            "Generate": stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=1)).read(),
            "AppendTokens": stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1]), timeout=RPC_TIMEOUT_S),
        }
        for method, call in overlapping.items():
            got = (await call_outcome(call))[0]
            _judge(report, BadCase("overlapping a running Generate", method, b"", AB, "SESSION_BUSY"), got)
        report.check(bool((await stream.read()).tokens), "the running Generate goes on after the overlapping calls")
    finally:
        stream.cancel()
        await close_quietly(stub, sid)


async def run_bad_input(channel: grpc.aio.Channel) -> SectionReport:
    """Send the whole table over `channel`; every row must get its typed code and change nothing."""
    report = SectionReport("bad_input")
    stub = pb_grpc.RuntimeServiceStub(channel)
    lim = await limits_of(stub)
    victim = await open_session(stub, PROMPT, lim.max_tokens_per_request)
    fresh = await open_session(stub, (), 1)
    try:
        before = {victim: await state_of(stub, victim), fresh: await state_of(stub, fresh)}
        snapshot = b"".join([m.data async for m in stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=victim),
                                                                        timeout=RPC_TIMEOUT_S)])
        cases = bad_cases(lim, victim, fresh) + _forged_snapshot_cases(snapshot)
        for case in cases:
            _judge(report, case, await _send(channel, case))
            for sid, state in before.items():
                after = await state_of(stub, sid)
                report.check(after == state, f"{case.method} {case.name}: session unchanged", f"{state} -> {after}")
        await _busy_cases(stub, lim, report)
        created = await stub.CreateSession(pb.CreateSessionRequest(), timeout=RPC_TIMEOUT_S)
        report.check(bool(created.session_id), "the server still opens sessions after the table")
        await close_quietly(stub, created.session_id)
    finally:
        await asyncio.gather(close_quietly(stub, victim), close_quietly(stub, fresh))
    report.numbers["rows"] = len(report.numbers.get("table", []))
    return report.finish()
