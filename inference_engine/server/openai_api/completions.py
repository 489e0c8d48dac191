"""Running one OpenAI-compatible request over the runtime: prompt -> session -> n streams.

The prompt's session comes from the exact prefix cache (a kept session whose history is a
prefix of the prompt: only the rest is appended) or is created and prefilled. `n` choices
are forks of that one prefilled session (bitwise copies, `ForkSession`), generated
concurrently and batched with every other session's work by the engine. Choice i samples
with seed + i, so each choice is the same completion alone or under any load. When the
request ends, however it ends, choice 0's session goes back to the cache (its history is
exactly the tokens it holds: the runtime undoes anything unsent) and the other forks close.
A request whose reply may outgrow --max-rollback also leaves a fallback fork of its prompt in
the cache (fallback_fork.py: its state copied before the first token, built beside the decoding),
discarded at the end if the reply stayed within reach of a rollback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from inference_engine import metrics
from inference_engine.errors import InvalidConstraint, SessionNotFound
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.session_transfer import SessionTransfer
from inference_engine.runtime.types import AppendParams, CreateSessionParams, GenerateChunk, GenerateParams
from inference_engine.server.openai_api.fallback_fork import FallbackFork
from inference_engine.server.openai_api.params import CompletionJob, seed_of_choice
from inference_engine.server.openai_api.prefix_cache import PrefixCache, common_prefix
from inference_engine.server.validation import Validator
from inference_engine.text.chat import ChatInput, TextInput
from inference_engine.text.codec import ChatMessage, require
from inference_engine.text.text_pool import run_text

log = logging.getLogger(__name__)
CLIENT_LABEL = "openai-http"  # the label of the sessions this API creates


@dataclass(frozen=True)
class ChoiceChunk:
    """One streamed piece of one choice."""

    index: int  # the choice
    chunk: GenerateChunk  # its tokens, text, logprobs; the final one has stop_reason


@dataclass(frozen=True)
class CompletionUsage:
    """What the request cost, OpenAI's `usage`."""

    prompt_tokens: int  # tokens of the prompt (rendered messages)
    completion_tokens: int  # tokens generated over all choices
    cached_tokens: int  # prompt tokens served by the prefix cache (not prefilled)


@dataclass
class _Choice:
    index: int
    session_id: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)


class CompletionService:
    """Prompt tokens, sessions (cached or new), concurrent choices, and giving sessions back."""

    def __init__(self, runtime: Runtime, validator: Validator):
        self.runtime = runtime
        self.validate = validator
        self.transfer = SessionTransfer(runtime)
        self.cache = PrefixCache(runtime.store, runtime.config.prefix_cache_bytes, runtime.config.max_rollback)

    async def token_bytes(self) -> Callable[[int], bytes] | None:
        """Each token's own bytes (logprobs' `bytes`), from llguidance's view of the tokenizer (built once, off
        the event loop); None on a model without a tokenizer."""
        if self.runtime.text is None:
            return None
        tokenizer = await asyncio.to_thread(self.runtime.constraints.tokenizer)
        return lambda token: tokenizer.decode_bytes([token])

    async def prompt_tokens(self, job: CompletionJob) -> tuple[int, ...]:
        """The prompt as tokens (messages rendered with the chat template), off the event loop.

        Raises:
            InvalidRequest: too many tokens. FeatureUnavailable: text on a model without a tokenizer.
        """
        if isinstance(job.prompt, tuple):
            tokens = job.prompt
        else:
            codec = require(self.runtime.text)
            prompt = job.prompt

            def encode() -> list[int]:
                if isinstance(prompt, ChatInput):
                    return codec.encode(codec.render(prompt.messages, prompt.add_generation_prompt))
                assert isinstance(prompt, TextInput)
                return codec.encode(prompt.text, add_special_tokens=True)  # a prompt starts a sequence (its BOS)

            tokens = tuple(await run_text(encode))  # a text thread, below the engine's priority
        self.validate.length("body.prompt", len(tokens), "tokens")
        return tokens

    async def run(self, job: CompletionJob) -> AsyncIterator[ChoiceChunk | CompletionUsage]:
        """The request's chunks, choices interleaved as they come, then its usage.

        Raises:
            RuntimeServiceError: from the runtime (pool full, draining, ...); nothing is left open.
        """
        self.runtime.check_serving()
        if job.options.stop:
            require(self.runtime.text)  # stop strings are matched on text: refused before any prefill
        if job.options.constraint is not None:  # a schema that does not compile: a 400 before any prefill
            try:
                await asyncio.to_thread(self.runtime.constraints.matcher, job.options.constraint)
            except InvalidConstraint as exc:  # named as this API's body names it
                where = "tools" if job.tools is not None and job.tools.constraint is not None else "response_format"
                raise InvalidConstraint(str(exc).replace(exc.field, where, 1), where) from None
        prompt = await self.prompt_tokens(job)
        session_id, cached = await self._open(job.owner, prompt)
        choices = [_Choice(0, session_id)]
        fallback: FallbackFork | None = None
        try:
            fallback = self._fallback_fork(job, session_id)  # set before its start: a cancel there still finishes it
            if fallback is not None:
                await fallback.start(session_id)
            for i in range(1, job.n):
                forked = await self.transfer.fork(session_id, job.owner)
                choices.append(_Choice(i, forked.session_id))
            queue: asyncio.Queue[ChoiceChunk | BaseException | None] = asyncio.Queue()
            tasks = [asyncio.ensure_future(self._generate(job, c, queue)) for c in choices]
            try:
                running = len(tasks)
                while running:
                    item = await queue.get()
                    if item is None:
                        running -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield item
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if job.is_chat and self.cache.is_enabled:
                await self._check_reply_reuse(job, prompt, choices[0])
            yield CompletionUsage(len(prompt), sum(len(c.tokens) for c in choices), cached)
        finally:
            self._give_back(job.owner, [c.session_id for c in choices])
            if fallback is not None:  # a reply within a rollback: the kept session serves the same prompt
                is_short = len(choices[0].tokens) <= self.cache.max_rollback and session_id in self.cache
                fallback.finish(is_wanted=not is_short)

    def _fallback_fork(self, job: CompletionJob, session_id: str) -> FallbackFork | None:
        """A fallback fork of the prompt (to start), if the reply may outgrow --max-rollback and the cache has
        room (`PrefixCache.has_room_for_fork`); never under --no-prefix-cache-forks."""
        if not self.runtime.config.prefix_cache_forks or job.max_tokens <= self.cache.max_rollback:
            return None
        if not self.cache.has_room_for_fork(self.runtime.store.get(session_id, job.owner), others=job.n - 1):
            return None
        return FallbackFork(self.cache, self.transfer, job.owner, lambda: self.runtime.is_draining)

    async def _open(self, owner: str, prompt: tuple[int, ...]) -> tuple[str, int]:
        """A session holding exactly `prompt`, and how many of its tokens the cache already held."""
        hit = None
        if self.cache.is_enabled:
            await self.cache.settled(owner)  # a fork the previous turn took may serve this one
            hit = self.cache.take(owner, prompt)
        if hit is not None:
            try:
                if hit.rollback:
                    await self.runtime.rollback(hit.session_id, hit.rollback, owner)
                rest = prompt[hit.reused:]
                if rest:
                    await self.runtime.append_tokens(AppendParams(hit.session_id, rest, owner=owner))
                return hit.session_id, hit.reused
            except SessionNotFound:  # expired or evicted meanwhile: prefill from scratch
                pass
            except BaseException:
                self._give_back(owner, [hit.session_id])
                raise
        created = await self.runtime.create_session(CreateSessionParams((), CLIENT_LABEL, 0, 0, owner=owner))
        try:
            await self.runtime.append_tokens(AppendParams(created.session_id, prompt, owner=owner))
        except BaseException:
            self._give_back(owner, [created.session_id])
            raise
        return created.session_id, 0

    async def _generate(self, job: CompletionJob, choice: _Choice, queue: asyncio.Queue) -> None:
        sampling = dataclasses.replace(job.options.sampling, seed=seed_of_choice(job.options.sampling.seed,
                                                                                   choice.index))
        params = GenerateParams(session_id=choice.session_id, max_new_tokens=job.max_tokens, ignore_eos=job.ignore_eos,
                                options=dataclasses.replace(job.options, sampling=sampling), owner=job.owner)

        if job.options.constraint is not None:  # each request's reply starts its constraint afresh
            self.runtime.store.get(choice.session_id, job.owner).constraint = None

        async def emit(chunk: GenerateChunk) -> None:
            choice.tokens.extend(chunk.tokens)
            choice.text.append(chunk.text)
            metrics.TOKENS_GENERATED.inc(len(chunk.tokens))
            queue.put_nowait(ChoiceChunk(choice.index, chunk))

        try:
            await self.runtime.generate(params, emit)
            queue.put_nowait(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the request's reader, which raises it
            queue.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _check_reply_reuse(self, job: CompletionJob, prompt: tuple[int, ...], choice: _Choice) -> None:
        """Count whether the next turn (this reply in its history) will find this session a prefix of its
        rendered tokens, or the template re-tokenizes the reply differently (the cache then reuses less)."""
        codec = require(self.runtime.text)
        assert isinstance(job.prompt, ChatInput)
        messages = (*job.prompt.messages, ChatMessage("assistant", "".join(choice.text)))
        history = [*prompt, *choice.tokens]

        def rendered() -> list[int]:
            return codec.encode(codec.render(messages, False))

        try:
            tokens = await run_text(rendered)
        except Exception:  # noqa: BLE001 - a measurement only; the template refusing an assistant turn is no error
            return
        is_reused = common_prefix(tokens, history) == len(history)
        metrics.REPLY_REUSE.labels("reused" if is_reused else "retokenized").inc()

    def _give_back(self, owner: str, session_ids: list[str]) -> None:
        """Keep the first session in the prefix cache (if it holds tokens and the cache is on); close the rest."""
        for i, sid in enumerate(session_ids):
            try:
                session = self.runtime.store.get(sid, owner)
            except SessionNotFound:
                continue
            if i == 0 and self.cache.is_enabled and len(session.history) and not self.runtime.is_draining \
                    and self.cache.keep(sid, owner):
                continue
            try:
                self.runtime.store.close(sid, owner)
            except SessionNotFound:  # keep() closed it (over the byte bound)
                pass
        self.runtime.engine.scheduler.wake()
