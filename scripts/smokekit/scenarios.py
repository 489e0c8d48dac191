"""The smoke scenarios, each recording expected and observed gRPC codes."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import grpc

from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc
from smokekit.common import (CheckFailed, FOLLOW_UP, Generated, PROMPT, RPC_TIMEOUT_S, SAMPLING, COPY, ScenarioResult,
                             VOCAB_SIZE)


class Smoke:
    """Runs the scenarios in order against one channel and collects their results."""

    def __init__(self, stub: pb_grpc.RuntimeServiceStub):
        self.stub = stub
        self.results: list[ScenarioResult] = []
        self.open_sessions: set[str] = set()  # created here and not yet closed
        self.sid = ""  # the main session
        self.history = 0  # tokens the main session should hold
        self.default_new_tokens = 0  # GetModelInfo.limits.default_new_tokens

    # ---- plumbing -------------------------------------------------------------------------

    async def scenario(self, name: str, expected: str, body: Callable[[dict[str, Any]], Awaitable[str]]) -> None:
        """Run one scenario; an AioRpcError escaping `body` is its observed code."""
        data: dict[str, Any] = {}
        passed_checks = True
        t0 = time.perf_counter()
        try:
            details = await body(data) or ""
            observed = "OK"
        except grpc.aio.AioRpcError as exc:
            observed, details = exc.code().name, exc.details() or ""
        except CheckFailed as exc:
            observed, details, passed_checks = exc.observed, f"check failed: {exc}", False
        except Exception as exc:  # noqa: BLE001 - a client-side crash fails only this scenario
            observed, details = "CLIENT_ERROR", f"{type(exc).__name__}: {exc}"
        ms = (time.perf_counter() - t0) * 1e3
        self.record(ScenarioResult(name, expected, observed, details, round(ms, 1), passed_checks and observed == expected, data))

    def record(self, result: ScenarioResult) -> None:
        self.results.append(result)
        mark = "PASS" if result.passed else "FAIL"
        print(f"{mark} {result.name:<24} expected={result.expected:<19} observed={result.observed:<19} "
              f"{result.duration_ms:8.1f} ms  {result.details}", flush=True)

    async def create(self, label: str) -> str:
        resp = await self.stub.CreateSession(pb.CreateSessionRequest(client_label=label), timeout=RPC_TIMEOUT_S)
        self.open_sessions.add(resp.session_id)
        return resp.session_id

    async def close(self, sid: str) -> int:
        resp = await self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=RPC_TIMEOUT_S)
        self.open_sessions.discard(sid)
        return resp.history_length

    async def info(self, sid: str) -> pb.GetSessionInfoResponse:
        return await self.stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid), timeout=RPC_TIMEOUT_S)

    async def append(self, sid: str, tokens: list[int]) -> pb.AppendTokensResponse:
        return await self.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=tokens), timeout=RPC_TIMEOUT_S)

    async def append_user(self, sid: str, text: str) -> pb.AppendTokensResponse:
        """A user turn as chat messages: the server renders it as a continuation of the session."""
        req = pb.AppendTokensRequest(session_id=sid, messages=[pb.ChatMessage(role="user", content=text)],
                                     add_generation_prompt=True)
        return await self.stub.AppendTokens(req, timeout=RPC_TIMEOUT_S)

    async def generate(self, sid: str, n: int, ignore_eos: bool = False, first_token: asyncio.Event | None = None,
                       **fields: Any) -> Generated:
        """Consume a whole Generate stream; sets `first_token` when the first token arrives."""
        t0 = time.perf_counter()
        tokens: list[int] = []
        text, logprobs, usage = [], 0, {}
        stop, history, drafted, accepted = "", 0, 0, 0
        req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=ignore_eos, **fields)
        async for msg in self.stub.Generate(req, timeout=RPC_TIMEOUT_S):
            tokens.extend(msg.tokens)
            text.append(msg.text)
            logprobs += len(msg.logprobs)
            if tokens and first_token is not None:
                first_token.set()
            if msg.stop_reason != pb.STOP_REASON_UNSPECIFIED:
                stop, history = pb.StopReason.Name(msg.stop_reason), msg.history_length
                drafted, accepted = msg.drafted_tokens, msg.accepted_tokens
                usage = {f.name: getattr(msg.usage, f.name) for f in msg.usage.DESCRIPTOR.fields}
        return Generated(tokens, stop, history, time.perf_counter() - t0, "".join(text), logprobs, usage, drafted, accepted)

    def expect_history(self, what: str, got: int) -> None:
        """Compare the main session's history with the count kept here; resync on mismatch."""
        want, self.history = self.history, got
        if got != want:
            raise CheckFailed(f"{what}: history_length {got}, expected {want}")

    def record_generation(self, data: dict[str, Any], gen: Generated) -> str:
        data.update(tokens=gen.tokens, text=gen.text, stop_reason=gen.stop_reason, history_length=gen.history_length,
                    tokens_per_s=round(gen.tokens_per_s, 2), seconds=round(gen.seconds, 3), usage=gen.usage)
        return f"{len(gen.tokens)} tokens, {gen.tokens_per_s:.1f} tok/s, {gen.stop_reason}: {gen.text!r}"

    async def wait_until_settled(self, sid: str, settle_s: float = 0.5, limit_s: float = 30.0) -> int:
        """History length once it has stopped changing for `settle_s` (a cancelled stream winds down)."""
        deadline = time.monotonic() + limit_s
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            n = (await self.info(sid)).history_length
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= settle_s:
                return n
            await asyncio.sleep(0.05)
        return last

    # ---- scenarios ------------------------------------------------------------------------

    async def create_session(self, data: dict[str, Any]) -> str:
        self.sid = await self.create("smoke-main")
        data["session_id"] = self.sid
        return f"session {self.sid}"

    async def get_info(self, data: dict[str, Any]) -> str:
        i = await self.info(self.sid)
        data.update(history_length=i.history_length, sink_tokens=i.sink_tokens, window_tokens=i.window_tokens,
                    kv_bytes=i.kv_bytes, exact=i.exact, eos_token_ids=list(i.eos_token_ids), client_label=i.client_label)
        if i.session_id != self.sid or i.client_label != "smoke-main":
            raise CheckFailed(f"info describes {i.session_id!r} labelled {i.client_label!r}")
        self.expect_history("fresh session", i.history_length)
        return f"history 0, sink {i.sink_tokens}, window {i.window_tokens}, exact {i.exact}, kv_bytes {i.kv_bytes}"

    async def model_info(self, data: dict[str, Any]) -> str:
        i = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
        data.update(model_name=i.model_name, vocab_size=i.vocab_size, eos_token_ids=list(i.eos_token_ids),
                    has_chat_template=i.has_chat_template, exact=i.exact, block_size=i.block_size, kernels=i.kernels,
                    default_new_tokens=i.limits.default_new_tokens, max_new_tokens=i.limits.max_new_tokens)
        if i.vocab_size != VOCAB_SIZE or not (i.has_tokenizer and i.has_chat_template):
            raise CheckFailed(f"vocab {i.vocab_size}, tokenizer {i.has_tokenizer}, template {i.has_chat_template}")
        self.default_new_tokens = i.limits.default_new_tokens
        return f"{i.model_name}: vocab {i.vocab_size}, EOS {list(i.eos_token_ids)}, block {i.block_size}, {i.kernels}"

    async def tokenize_round_trip(self, data: dict[str, Any]) -> str:
        text = "Héllo, 日本語 🎉 <|im_start|>"
        tokens = list((await self.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=RPC_TIMEOUT_S)).tokens)
        back = (await self.stub.Detokenize(pb.DetokenizeRequest(tokens=tokens), timeout=RPC_TIMEOUT_S)).text
        data.update(text=text, tokens=tokens, detokenized=back)
        if back != text:
            raise CheckFailed(f"Detokenize(Tokenize(text)) = {back!r}")
        return f"{len(tokens)} tokens round-trip"

    async def append_prompt(self, data: dict[str, Any]) -> str:
        resp = await self.append_user(self.sid, PROMPT)
        self.history += len(resp.tokens)
        data.update(prompt=PROMPT, tokens=list(resp.tokens), history_length=resp.history_length,
                    next_global_position=resp.next_global_position)
        self.expect_history("after the prompt", resp.history_length)
        return f"{len(resp.tokens)} prompt tokens (chat template), history {resp.history_length}"

    async def generate_16(self, data: dict[str, Any]) -> str:
        gen = await self.generate(self.sid, 16)
        details = self.record_generation(data, gen)
        self.history += len(gen.tokens)
        ended = gen.stop_reason == "STOP_REASON_EOS"
        if not (len(gen.tokens) == 16 and gen.stop_reason == "STOP_REASON_MAX_TOKENS") and not ended:
            raise CheckFailed(f"{len(gen.tokens)} tokens with {gen.stop_reason or 'no stop reason'}")
        if not gen.text or gen.usage.get("generated_tokens") != len(gen.tokens):
            raise CheckFailed(f"streamed text {gen.text!r}, usage {gen.usage}")
        self.expect_history("stream's last message", gen.history_length)
        return details

    async def append_and_continue(self, data: dict[str, Any]) -> str:
        resp = await self.append_user(self.sid, FOLLOW_UP)  # the server closes the reply's turn as the template does
        self.history += len(resp.tokens)
        self.expect_history("after the follow-up", resp.history_length)
        gen = await self.generate(self.sid, 16)
        self.history += len(gen.tokens)
        data.update(follow_up=FOLLOW_UP, follow_up_tokens=list(resp.tokens))
        details = self.record_generation(data, gen)
        if not gen.tokens:
            raise CheckFailed("the continuation generated nothing")
        self.expect_history("stream's last message", gen.history_length)
        return details

    async def sampled_session(self, label: str, prompt: str = PROMPT, **fields: Any) -> Generated:
        sid = await self.create(label)
        try:
            await self.append_user(sid, prompt)
            return await self.generate(sid, 16, ignore_eos=True, **fields)
        finally:
            await self.close(sid)

    async def seeded_sampling(self, data: dict[str, Any]) -> str:
        """The same seed twice, and under prompt lookup with K=4 (drafts proposed and accepted): the same tokens;
        greedy differs."""
        runs = {
            "plain": await self.sampled_session("smoke-seed-a", COPY, **SAMPLING),
            "again": await self.sampled_session("smoke-seed-b", COPY, **SAMPLING),
            "lookup K=4": await self.sampled_session("smoke-seed-c", COPY, mode=pb.DECODE_MODE_SPECULATIVE_LOOKUP,
                                                     num_draft_tokens=4, **SAMPLING),
            "greedy": await self.sampled_session("smoke-greedy", COPY),
        }
        lookup = runs["lookup K=4"]
        data.update(prompt=COPY, sampling=SAMPLING, drafted=lookup.drafted, accepted=lookup.accepted,
                    **{k: {"tokens": g.tokens, "text": g.text} for k, g in runs.items()})
        same = [k for k in ("again", "lookup K=4") if runs[k].tokens != runs["plain"].tokens]
        if same:
            raise CheckFailed(f"seed {SAMPLING['seed']} gave other tokens in: {', '.join(same)}")
        if runs["greedy"].tokens == runs["plain"].tokens:
            raise CheckFailed("sampling gave the greedy tokens: no draw happened")
        if lookup.accepted == 0:  # "equal under lookup" compared plain sampling with itself
            raise CheckFailed(f"prompt lookup had {lookup.accepted} of {lookup.drafted} drafts accepted")
        return (f"seed {SAMPLING['seed']}: plain, again and lookup K=4 ({lookup.accepted}/{lookup.drafted} drafts "
                f"accepted) equal: {runs['plain'].text!r}")

    async def stop_string(self, data: dict[str, Any]) -> str:
        gen = await self.sampled_session("smoke-stop", stop=["."], temperature=0.0)
        data.update(tokens=gen.tokens, text=gen.text, stop_reason=gen.stop_reason)
        if gen.stop_reason != "STOP_REASON_STOP_STRING" or "." in gen.text:
            raise CheckFailed(f"{gen.stop_reason}: {gen.text!r}")
        return f"stopped at '.': {gen.text!r}"

    async def logprobs(self, data: dict[str, Any]) -> str:
        gen = await self.sampled_session("smoke-logprobs", logprobs=True, top_logprobs=3)
        data.update(tokens=len(gen.tokens), logprobs=gen.logprobs)
        if gen.logprobs != len(gen.tokens):
            raise CheckFailed(f"{gen.logprobs} logprob entries for {len(gen.tokens)} tokens")
        return f"{gen.logprobs} tokens with logprobs and 3 alternatives"

    async def info_after_generate(self, data: dict[str, Any]) -> str:
        i = await self.info(self.sid)
        data.update(history_length=i.history_length, next_global_position=i.next_global_position,
                    cached_tokens=i.cached_tokens, state_digest=i.state_digest)
        self.expect_history("GetSessionInfo", i.history_length)
        if i.cached_tokens > min(i.history_length, i.sink_tokens + i.window_tokens):
            raise CheckFailed(f"cached_tokens {i.cached_tokens} exceeds history/sink+window")
        return f"history {i.history_length}, next position {i.next_global_position}, cached {i.cached_tokens}"

    async def out_of_vocab(self, data: dict[str, Any]) -> str:
        try:
            await self.append(self.sid, [VOCAB_SIZE])
        except grpc.aio.AioRpcError as exc:
            n = (await self.info(self.sid)).history_length
            data["history_after"] = n
            if n != self.history:
                self.history = n
                raise CheckFailed(f"a rejected append changed history to {n}", exc.code().name) from exc
            raise
        self.history += 1
        return "token id 49152 was accepted"

    async def max_new_tokens_zero(self, data: dict[str, Any]) -> str:
        """0 means the server default (GetModelInfo.limits.default_new_tokens)."""
        await self.append_user(self.sid, "Say one word.")
        self.history = (await self.info(self.sid)).history_length
        gen = await self.generate(self.sid, 0)
        self.history += len(gen.tokens)
        data.update(tokens=len(gen.tokens), stop_reason=gen.stop_reason)
        limit = self.default_new_tokens
        if not gen.tokens or len(gen.tokens) > limit or gen.stop_reason not in ("STOP_REASON_EOS", "STOP_REASON_MAX_TOKENS"):
            raise CheckFailed(f"{len(gen.tokens)} tokens (server default {limit}), {gen.stop_reason}")
        self.expect_history("stream's last message", gen.history_length)
        return f"{len(gen.tokens)} tokens (server default {limit}), {gen.stop_reason}"

    async def bad_sampling(self, data: dict[str, Any]) -> str:
        await self.generate(self.sid, 4, temperature=-1.0)
        return "temperature -1 was accepted"

    async def overlap_generate_append(self, data: dict[str, Any]) -> str:
        """A 64-token Generate streams while AppendTokens arrives on the same session."""
        first = asyncio.Event()
        task = asyncio.create_task(self.generate(self.sid, 64, ignore_eos=True, first_token=first))
        waiter = asyncio.create_task(first.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        append_error: grpc.aio.AioRpcError | None = None
        try:
            resp = await self.append(self.sid, [198])
            self.history += 1
            data["append_history_length"] = resp.history_length
        except grpc.aio.AioRpcError as exc:
            append_error = exc
        gen = await task  # the stream must finish unharmed
        self.history += len(gen.tokens)
        data.update(generate_tokens=len(gen.tokens), generate_stop=gen.stop_reason, generate_seconds=round(gen.seconds, 3))
        if len(gen.tokens) != 64:
            raise CheckFailed(f"the overlapped Generate delivered {len(gen.tokens)} of 64 tokens",
                              append_error.code().name if append_error else "OK")
        self.expect_history("after the overlapped Generate", gen.history_length)
        if append_error is not None:
            raise append_error
        return "AppendTokens was accepted while Generate streamed"

    async def cancel_mid_stream(self, data: dict[str, Any]) -> str:
        """Cancel after 5 tokens: history must hold exactly the tokens received, and generation go on."""
        before = (await self.info(self.sid)).history_length
        received: list[int] = []
        call = self.stub.Generate(pb.GenerateRequest(session_id=self.sid, max_new_tokens=64, ignore_eos=True), timeout=RPC_TIMEOUT_S)
        async for msg in call:
            received.extend(msg.tokens)
            if len(received) >= 5:
                call.cancel()
                break
        after = await self.wait_until_settled(self.sid)
        data.update(history_before=before, tokens_received=len(received), history_after_cancel=after)
        self.history = after
        if after != before + len(received):
            raise CheckFailed(f"history {after} after cancel, expected {before} + {len(received)} received")
        gen = await self.generate_when_free(self.sid, 4)
        self.history += len(gen.tokens)
        data.update(tokens_after_cancel=gen.tokens, history_after_generate=gen.history_length)
        if len(gen.tokens) != 4:
            raise CheckFailed(f"generation after cancel delivered {len(gen.tokens)} of 4 tokens")
        self.expect_history("generation after cancel", gen.history_length)
        return f"history {before} + {len(received)} received = {after}; then 4 more tokens -> {gen.history_length}"

    async def generate_when_free(self, sid: str, n: int, limit_s: float = 10.0) -> Generated:
        """Generate, retrying while the session is still ABORTED-busy winding down a cancelled call."""
        deadline = time.monotonic() + limit_s
        while True:
            try:
                return await self.generate(sid, n, ignore_eos=True)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.ABORTED or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def close_main(self, data: dict[str, Any]) -> str:
        n = await self.close(self.sid)
        data["history_length"] = n
        self.expect_history("CloseSession", n)
        return f"closed with history {n}"

    async def double_close(self, data: dict[str, Any]) -> str:
        await self.close(self.sid)
        return "closed twice"

    async def info_after_close(self, data: dict[str, Any]) -> str:
        await self.info(self.sid)
        return "a closed session was described"

    async def append_after_close(self, data: dict[str, Any]) -> str:
        await self.append(self.sid, [198])
        return "a closed session took tokens"

    async def generate_before_append(self, data: dict[str, Any]) -> str:
        sid = await self.create("smoke-empty")
        data["session_id"] = sid
        try:
            gen = await self.generate(sid, 4)
            return f"generated {len(gen.tokens)} tokens from an empty session"
        finally:
            await self.close(sid)

    async def full_pool(self, data: dict[str, Any], limit: int = 256) -> str:
        """Create sessions until the server refuses, then close them all."""
        created: list[str] = []
        try:
            for _ in range(limit):
                created.append(await self.create("smoke-pool"))
            return f"{limit} sessions created without refusal"
        except grpc.aio.AioRpcError as exc:
            data["created_before_refusal"] = len(created)
            if not created:
                raise CheckFailed("the very first session was refused", exc.code().name) from exc
            raise
        finally:
            data["created"] = len(created)
            await asyncio.gather(*(self.close(sid) for sid in created))  # a failed close fails the scenario

    async def run_all(self) -> None:
        await self.scenario("get_model_info", "OK", self.model_info)
        await self.scenario("tokenize_round_trip", "OK", self.tokenize_round_trip)
        await self.scenario("create_session", "OK", self.create_session)
        await self.scenario("get_info", "OK", self.get_info)
        await self.scenario("append_chat_prompt", "OK", self.append_prompt)
        await self.scenario("generate_16", "OK", self.generate_16)
        await self.scenario("append_and_continue", "OK", self.append_and_continue)
        await self.scenario("info_after_generate", "OK", self.info_after_generate)
        await self.scenario("seeded_sampling", "OK", self.seeded_sampling)
        await self.scenario("stop_string", "OK", self.stop_string)
        await self.scenario("logprobs", "OK", self.logprobs)
        await self.scenario("out_of_vocab_token", "INVALID_ARGUMENT", self.out_of_vocab)
        await self.scenario("max_new_tokens_zero", "OK", self.max_new_tokens_zero)
        await self.scenario("bad_sampling_field", "INVALID_ARGUMENT", self.bad_sampling)
        await self.scenario("overlap_generate_append", "ABORTED", self.overlap_generate_append)
        await self.scenario("cancel_mid_stream", "OK", self.cancel_mid_stream)
        await self.scenario("close_session", "OK", self.close_main)
        await self.scenario("double_close", "NOT_FOUND", self.double_close)
        await self.scenario("info_after_close", "NOT_FOUND", self.info_after_close)
        await self.scenario("append_after_close", "NOT_FOUND", self.append_after_close)
        await self.scenario("generate_before_append", "FAILED_PRECONDITION", self.generate_before_append)
        await self.scenario("full_pool", "RESOURCE_EXHAUSTED", self.full_pool)

    async def close_leftovers(self) -> list[str]:
        """Close every session this run created and did not close; returns the ones that failed."""
        failed = []
        for sid in sorted(self.open_sessions):
            try:
                await self.close(sid)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    failed.append(f"{sid}: {exc.code().name}")
        return failed
