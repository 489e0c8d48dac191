"""A property-based fuzz of the request surface (hypothesis), over a blocking channel.

For every request message, hypothesis draws each field from values that matter: ids (the
live session's, forged ones of its shape, empty, over-long, odd unicode), integers at and
past every bound up to 2^32-1, floats including NaN, infinities and -0.0, strings of odd
unicode (combining marks, RTL overrides, NUL, astral planes), repeated fields of every
size around their limits, and raw bytes (random, or a valid request with a byte changed
or cut). The property, for every example:
- the answer is one of the method's documented codes and typed (outcomes.typing_problem);
- a call that fails changes nothing: the live session's history length and digest are as
  before (a Generate that streams is read for one message, then cancelled);
- sessions a fuzzed CreateSession opened are closed again.
Every call carries a gRPC deadline and every example a hypothesis deadline, so a run is
bounded by `examples` x the number of message kinds.
"""

from __future__ import annotations

import datetime
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import grpc

from reliabilitykit.bad_input import (
    MAX_DETOKENIZE,
    MAX_EOS_IDS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TEXT_CHARS,
    METHODS,
    PROMPT,
    SERVICE,
    STREAMING,
    U32_MAX,
)
from reliabilitykit.fuzz_snapshots import read_snapshot, snapshot_strategies
from reliabilitykit.outcomes import OK, Outcome, outcome_of, sync_outcome, typing_problem
from reliabilitykit.report import SectionReport
from reliabilitykit.sessions import Limits, SessionState
from inference_engine.security.credentials import open_sync_channel
from inference_engine.security.settings import ClientSecurity
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

# The codes each method may answer a fuzzed request with (docs/serving.md "Errors"); DEADLINE_EXCEEDED is our own deadline.
DOCUMENTED: dict[str, frozenset[str]] = {
    "CreateSession": frozenset({"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
    "AppendTokens": frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ABORTED", "DEADLINE_EXCEEDED",
                               "RESOURCE_EXHAUSTED"}),  # over gRPC's 4 MiB message limit
    "Generate": frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ABORTED", "DEADLINE_EXCEEDED"}),
    "CloseSession": frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND"}),
    "GetSessionInfo": frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND"}),
    "GetModelInfo": frozenset({"OK", "INVALID_ARGUMENT"}),
    "Tokenize": frozenset({"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}),
    "Detokenize": frozenset({"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "DEADLINE_EXCEEDED"}),
    "SnapshotSession": frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ABORTED",
                                  "DEADLINE_EXCEEDED"}),
    "ForkSession": frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "ABORTED", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}),
    "RestoreSession": frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
                                 "DEADLINE_EXCEEDED"}),
}
MAKES_SESSION = {"CreateSession": pb.CreateSessionResponse, "ForkSession": pb.ForkSessionResponse,
                 "RestoreSession": pb.RestoreSessionResponse}  # an OK call opened a session the fuzz closes again
LEAVES_SESSION = {"SnapshotSession", "ForkSession", "RestoreSession"}  # the live session is unchanged even when OK
RESPONSES = {"CreateSession": pb.CreateSessionResponse, "AppendTokens": pb.AppendTokensResponse}
CURRENT = "current"  # expected_history_length: the live session's length at call time


@dataclass(frozen=True)
class FuzzPlan:
    """How much to fuzz."""

    examples: int = 150  # examples per message kind (9 kinds)
    call_timeout_s: float = 60.0  # gRPC deadline of each call
    example_deadline_s: float = 300.0  # hypothesis deadline of one example (a few calls)
    seed: int = 0  # hypothesis seed (a run is reproducible)
    shrink: bool = True  # shrink a failing example to a minimal one


@dataclass(frozen=True)
class Fuzzed:
    """One drawn request."""

    method: str
    request: object  # a request message, or raw bytes (RestoreSession: a list of either)
    expected_length: object = None  # AppendTokens: CURRENT, an int, or None (unset)

    def __repr__(self) -> str:  # a falsifying example's report stays readable (texts can be 1 MiB)
        text = repr(self.request) if isinstance(self.request, bytes) else str(self.request).replace("\n", " ")
        short = text if len(text) <= 600 else f"{text[:300]} ...[{len(text)} chars]... {text[-200:]}"
        return f"Fuzzed({self.method}, {short}, expected_length={self.expected_length!r})"


class _Fuzzer:
    """The live session, the blocking stub and the property check."""

    def __init__(self, target: str, security: ClientSecurity | None, plan: FuzzPlan):
        self.plan = plan
        self.channel = open_sync_channel(target, security)
        self.stub = pb_grpc.RuntimeServiceStub(self.channel)
        self.lim = Limits.of(self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=plan.call_timeout_s))
        self.victim = self.stub.CreateSession(pb.CreateSessionRequest(sink_tokens=2, window_tokens=16),
                                              timeout=plan.call_timeout_s).session_id
        self.stub.AppendTokens(pb.AppendTokensRequest(session_id=self.victim, tokens=PROMPT), timeout=plan.call_timeout_s)
        self.snapshot = read_snapshot(self.stub, self.victim, plan.call_timeout_s)
        self.codes: Counter = Counter()

    def state(self) -> SessionState:
        info = self.stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=self.victim), timeout=self.plan.call_timeout_s)
        return SessionState(info.history_length, info.state_digest)

    def _send(self, f: Fuzzed) -> tuple[Outcome, object]:
        t = self.plan.call_timeout_s
        is_raw = isinstance(f.request, bytes) or (isinstance(f.request, list) and f.request
                                                   and isinstance(f.request[0], bytes))
        path = SERVICE + f.method
        if f.method == "RestoreSession":
            send = self.channel.stream_unary(path) if is_raw else self.stub.RestoreSession
            return sync_outcome(lambda: send(iter(f.request), timeout=t))
        if f.method in STREAMING:
            stream = (self.channel.unary_stream(path)(f.request, timeout=t) if is_raw
                      else getattr(self.stub, f.method)(f.request, timeout=t))
            try:
                first = next(stream)
            except StopIteration:
                return OK, None
            except grpc.RpcError as err:
                return outcome_of(err), None
            stream.cancel()  # one message is enough: the call was accepted
            return OK, first
        send = self.channel.unary_unary(path) if is_raw else getattr(self.stub, f.method)
        return sync_outcome(lambda: send(f.request, timeout=t))

    def _opened(self, f: Fuzzed, reply: object) -> list[str]:
        """Problems with the session an OK call opened (it reports what the reply said); closes it."""
        if f.method not in MAKES_SESSION or reply is None:
            return []
        if isinstance(reply, bytes):
            reply = MAKES_SESSION[f.method].FromString(reply)
        t = self.plan.call_timeout_s
        info = self.stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=reply.session_id), timeout=t)
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=reply.session_id), timeout=t)
        if f.method != "CreateSession" and (info.history_length, info.state_digest) != (
                reply.history_length, reply.state_digest):
            return [f"the session {f.method} opened reports {info.history_length}/{info.state_digest[:12]}, "
                    f"its reply said {reply.history_length}/{reply.state_digest[:12]}"]
        return []

    def exercise(self, f: Fuzzed) -> None:
        """Send one drawn request and check the property. Raises AssertionError naming what broke."""
        if f.expected_length == CURRENT:
            f.request.expected_history_length = self.state().history_length
        elif f.expected_length is not None:
            f.request.expected_history_length = f.expected_length
        before = self.state()
        got, reply = self._send(f)
        self.codes[f"{f.method} {got.code}"] += 1
        problems = [p for p in (typing_problem(got),) if p]
        if got.code not in DOCUMENTED[f.method]:
            problems.append(f"{got.code} is not a documented answer of {f.method}: {got}")
        problems += self._opened(f, reply if got.is_ok else None)
        after = self.state()
        if not got.is_ok and got.code != "DEADLINE_EXCEEDED" and after != before:
            problems.append(f"{f.method} failed with {got.code} and changed the session: {before} -> {after}")
        if got.is_ok and f.method in LEAVES_SESSION and after != before:
            problems.append(f"an OK {f.method} changed the live session: {before} -> {after}")
        if got.is_ok and f.method == "AppendTokens" and reply is not None and after != before:
            added = len((RESPONSES["AppendTokens"].FromString(reply) if isinstance(reply, bytes) else reply).tokens)
            if after.history_length != before.history_length + added:
                problems.append(f"an OK append of {added} tokens moved the history {before} -> {after}")
        if problems:
            raise AssertionError("; ".join(problems))

    def close(self) -> None:
        try:
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.victim), timeout=self.plan.call_timeout_s)
        finally:
            self.channel.close()


def _strategies(lim: Limits, victim: str, snapshot: bytes) -> dict[str, object]:
    """One hypothesis strategy of `Fuzzed` requests per message kind.

    Each example draws which fields (usually none, one or two) get wild values; the others
    get valid ones, so valid requests are exercised as well as every field's bad values.
    """
    from hypothesis import strategies as st

    v = lim.vocab_size
    u32 = st.one_of(st.integers(0, U32_MAX), st.sampled_from([0, 1, v - 1, v, v + 1, 1 << 31, U32_MAX]))

    def near(limit: int) -> object:
        return st.one_of(st.integers(0, limit + 2), st.sampled_from([limit, limit + 1, U32_MAX]), st.integers(0, U32_MAX))

    reals = st.one_of(st.floats(width=32), st.sampled_from([-0.0, 100.0, 100.001, math.nan, math.inf, -math.inf]))
    text = st.text(alphabet=st.characters(codec="utf-8"), max_size=120)  # combining marks, RTL, NUL, astral planes
    texts = st.one_of(text, text, st.just("x" * (MAX_TEXT_CHARS + 1)))
    forged = st.integers(0, max(0, len(victim) - 1)).map(lambda i: victim[:i] + "~" + victim[i + 1 :])
    wild_ids = st.one_of(forged, st.sampled_from(["", "s" * 128, "s" * 129]), text)
    small_tokens = st.lists(st.integers(0, v - 1), min_size=1, max_size=16)
    wild_tokens = st.one_of(st.lists(u32, max_size=6), st.just([]),
                            st.integers(lim.max_tokens_per_request + 1, lim.max_tokens_per_request + 2).map(lambda n: [1] * n))
    eos = st.lists(st.integers(0, v - 1), max_size=4)
    wild_eos = st.one_of(st.lists(u32, max_size=4), st.lists(st.integers(0, v - 1), min_size=MAX_EOS_IDS + 1,
                                                                  max_size=MAX_EOS_IDS + 2))
    roles = st.one_of(st.sampled_from(["user", "assistant", "system", "", "r" * 65]), text)
    messages = st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["user", "assistant", "system"]), content=text),
                        min_size=1, max_size=3)
    wild_messages = st.lists(st.builds(pb.ChatMessage, role=roles, content=texts), max_size=4)
    stops = st.lists(st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=8), max_size=2)
    wild_stops = st.lists(st.one_of(text, st.sampled_from(["", "s" * (MAX_STOP_CHARS + 1)])), max_size=MAX_STOP + 2)

    def pick(draw: Callable, wild: set[str], name: str, valid: object, bad: object) -> object:
        return draw(bad if name in wild else valid)

    def wild_set(draw: Callable, names: list[str]) -> set[str]:
        return draw(st.sets(st.sampled_from(names), max_size=2))

    @st.composite
    def create(draw: Callable) -> Fuzzed:
        w = wild_set(draw, ["eos", "label", "sink", "window"])
        return Fuzzed("CreateSession", pb.CreateSessionRequest(
            eos_token_ids=pick(draw, w, "eos", eos, wild_eos),
            client_label=pick(draw, w, "label", st.text(max_size=100), st.one_of(text, st.just("é" * 257))),
            sink_tokens=pick(draw, w, "sink", st.integers(0, lim.max_sink), near(lim.max_sink)),
            window_tokens=pick(draw, w, "window", st.integers(0, min(lim.max_window, 256)), near(lim.max_window))))

    @st.composite
    def append(draw: Callable) -> Fuzzed:
        w = wild_set(draw, ["session_id", "inputs", "tokens", "text", "messages", "flag", "expected"])
        usable = ["tokens"] + ["text"] * lim.has_tokenizer + ["messages"] * lim.has_chat_template
        given = pick(draw, w, "inputs", st.sampled_from(usable).map(lambda x: {x}),
                     st.sets(st.sampled_from(["tokens", "text", "messages"]), max_size=3))
        r = pb.AppendTokensRequest(session_id=pick(draw, w, "session_id", st.just(victim), wild_ids))
        if "tokens" in given:
            r.tokens.extend(pick(draw, w, "tokens", small_tokens, wild_tokens))
        if "text" in given:
            r.text = pick(draw, w, "text", text.filter(bool), texts)
        if "messages" in given:
            r.messages.extend(pick(draw, w, "messages", messages, wild_messages))
        r.add_generation_prompt = pick(draw, w, "flag", st.just("messages" in given) | st.just(False), st.booleans())
        expected = pick(draw, w, "expected", st.sampled_from([None, CURRENT]), st.integers(0, (1 << 64) - 1))
        return Fuzzed("AppendTokens", r, expected)

    @st.composite
    def generate(draw: Callable) -> Fuzzed:
        names = ["session_id", "max_new_tokens", "mode", "num_draft_tokens", "temperature", "top_k", "top_p", "min_p",
                 "repetition_penalty", "stop", "eos_token_ids", "top_logprobs"]
        w = wild_set(draw, names)
        modes = [0, 2] + [1] * lim.has_draft_model
        logprobs = draw(st.booleans())
        r = pb.GenerateRequest(
            session_id=pick(draw, w, "session_id", st.just(victim), wild_ids),
            max_new_tokens=pick(draw, w, "max_new_tokens", st.integers(1, 6), near(lim.max_new_tokens)),
            ignore_eos=draw(st.booleans()),
            mode=pick(draw, w, "mode", st.sampled_from(modes), st.one_of(st.integers(-2, 4),
                                                                      st.integers(-(1 << 31), (1 << 31) - 1))),
            num_draft_tokens=pick(draw, w, "num_draft_tokens", st.integers(0, lim.max_draft_tokens),
                                  near(lim.max_draft_tokens)),
            temperature=pick(draw, w, "temperature", st.sampled_from([0.0, 0.3, 1.0, 2.5]), reals),
            top_k=pick(draw, w, "top_k", st.integers(0, v), near(v)),
            top_p=pick(draw, w, "top_p", st.floats(0, 1, width=32), reals),
            min_p=pick(draw, w, "min_p", st.floats(0, 1, width=32), reals),
            repetition_penalty=pick(draw, w, "repetition_penalty", st.floats(0, 10, width=32), reals),
            stop=pick(draw, w, "stop", stops if lim.has_tokenizer else st.just([]), wild_stops),
            eos_token_ids=pick(draw, w, "eos_token_ids", eos, wild_eos), logprobs=logprobs,
            top_logprobs=pick(draw, w, "top_logprobs", st.integers(0, lim.max_top_logprobs if logprobs else 0),
                              near(lim.max_top_logprobs)))
        seed = draw(st.one_of(st.none(), st.integers(0, (1 << 64) - 1)))
        if seed is not None:
            r.seed = seed
        return Fuzzed("Generate", r)

    @st.composite
    def lookup(draw: Callable) -> Fuzzed:
        method = draw(st.sampled_from(["CloseSession", "GetSessionInfo"]))
        sid = draw(wild_ids if method == "CloseSession" else st.one_of(st.just(victim), wild_ids))
        make = pb.CloseSessionRequest if method == "CloseSession" else pb.GetSessionInfoRequest
        return Fuzzed(method, make(session_id=sid))

    @st.composite
    def tokenize(draw: Callable) -> Fuzzed:
        w = wild_set(draw, ["inputs", "text", "messages", "flags"])
        as_messages = lim.has_chat_template and draw(st.booleans())
        given = pick(draw, w, "inputs", st.just({"messages" if as_messages else "text"}),
                     st.sets(st.sampled_from(["text", "messages"]), max_size=2))
        r = pb.TokenizeRequest()
        if "text" in given:
            r.text = pick(draw, w, "text", text, texts)
        if "messages" in given:
            r.messages.extend(pick(draw, w, "messages", messages, wild_messages))
        if "flags" in w:
            r.add_special_tokens, r.add_generation_prompt = draw(st.booleans()), draw(st.booleans())
        elif "messages" in given:
            r.add_generation_prompt = draw(st.booleans())
        else:
            r.add_special_tokens = draw(st.booleans())
        return Fuzzed("Tokenize", r)

    @st.composite
    def detokenize(draw: Callable) -> Fuzzed:
        many = st.integers(MAX_DETOKENIZE + 1, MAX_DETOKENIZE + 2).map(lambda n: [1] * n)
        tokens = draw(st.one_of(st.lists(st.integers(0, v - 1), max_size=32), wild_tokens, many))
        return Fuzzed("Detokenize", pb.DetokenizeRequest(tokens=tokens, skip_special_tokens=draw(st.booleans())))

    valid = {  # a valid request per method, aimed at the live session: raw mutations start from these
        "CreateSession": pb.CreateSessionRequest(sink_tokens=2, window_tokens=16, client_label="fuzz"),
        "AppendTokens": pb.AppendTokensRequest(session_id=victim, tokens=[3, 4, 5]),
        "Generate": pb.GenerateRequest(session_id=victim, max_new_tokens=2, temperature=0.5, seed=1),
        "CloseSession": pb.CloseSessionRequest(session_id="not-the-live-session"),
        "GetSessionInfo": pb.GetSessionInfoRequest(session_id=victim),
        "GetModelInfo": pb.GetModelInfoRequest(),
        "Tokenize": pb.TokenizeRequest(text="héllo wörld"),
        "Detokenize": pb.DetokenizeRequest(tokens=[3, 4, 5]),
        "SnapshotSession": pb.SnapshotSessionRequest(session_id=victim),
        "ForkSession": pb.ForkSessionRequest(session_id=victim),
    }

    @st.composite
    def raw(draw: Callable) -> Fuzzed:
        method = draw(st.sampled_from(METHODS))
        base = valid[method].SerializeToString()
        how = draw(st.sampled_from(["random", "flip", "cut"] if base else ["random"]))
        if how == "random":
            data = draw(st.binary(max_size=64))
        elif how == "flip":
            i = draw(st.integers(0, len(base) - 1))
            data = base[:i] + bytes([draw(st.integers(0, 255))]) + base[i + 1 :]
        else:
            data = base[: draw(st.integers(0, len(base) - 1))]
        return Fuzzed(method, data)

    return {"CreateSession": create(), "AppendTokens": append(), "Generate": generate(), "Close/GetSessionInfo": lookup(),
            "Tokenize": tokenize(), "Detokenize": detokenize(), "raw bytes": raw(),
            **snapshot_strategies(st, Fuzzed, victim, wild_ids, text, snapshot)}


def run_fuzz(target: str, plan: FuzzPlan = FuzzPlan(), security: ClientSecurity | None = None) -> SectionReport:
    """Fuzz every message kind with `plan.examples` examples each (blocking: run it off the event loop)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    report = SectionReport("fuzz")
    fuzzer = _Fuzzer(target, security, plan)
    phases = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if plan.shrink else ())
    config = settings(max_examples=plan.examples, deadline=datetime.timedelta(seconds=plan.example_deadline_s),
                      database=None, phases=phases, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                      print_blob=False)
    examples: Counter = Counter()
    try:
        for kind, strategy in _strategies(fuzzer.lim, fuzzer.victim, fuzzer.snapshot).items():

            @hypothesis_seed(plan.seed)
            @config
            @given(strategy)
            def prop(f: Fuzzed) -> None:
                examples[kind] += 1
                fuzzer.exercise(f)

            try:
                prop()
                report.check(True, kind)
            except Exception as exc:  # noqa: BLE001 - hypothesis re-raises the minimal failing example
                notes = " | ".join(getattr(exc, "__notes__", []))
                report.check(False, f"{kind}: the property holds", f"{type(exc).__name__}: {exc} | {notes}"[:2000])
    finally:
        fuzzer.close()
    report.numbers["examples"] = dict(examples)
    report.numbers["codes"] = dict(sorted(fuzzer.codes.items()))
    return report.finish()
