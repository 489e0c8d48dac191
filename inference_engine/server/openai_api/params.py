"""OpenAI request bodies -> one typed `CompletionJob`, checked against the one bounds table.

Everything a request may set is checked here, before a session is touched: unsupported
fields are refused with a 400 naming them, numbers against server/validation.py's table
(`body.*` keys), and the model against the served one.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

from inference_engine.config import ServerConfig
from inference_engine.decoding.options import GenerationOptions
from inference_engine.decoding.sampler import SamplingParams
from inference_engine.errors import InvalidRequest, UnknownModel
from inference_engine.server.openai_api.schema import ChatCompletionRequest, CompletionRequest, SamplingFields
from inference_engine.server.openai_api.tools import ToolPlan, message_text, response_constraint, tool_plan, with_tools
from inference_engine.server.validation import Validator
from inference_engine.text.chat import ChatInput, TextInput
from inference_engine.text.codec import ChatMessage

_UINT64 = 1 << 64
Prompt = tuple[int, ...] | TextInput | ChatInput  # token ids, a text, or messages to render


@dataclass(frozen=True)
class CompletionJob:
    """A validated /v1/chat/completions or /v1/completions request."""

    is_chat: bool  # chat.completion objects (else text_completion)
    prompt: Prompt  # tokens, text or messages (tokenized by the service, off the event loop)
    n: int  # choices: forks of the one prefilled prompt
    max_tokens: int  # tokens to generate per choice
    options: GenerationOptions  # sampling (choice 0's seed), stop strings, logprobs
    ignore_eos: bool  # keep going past EOS
    stream: bool  # SSE chunks instead of one JSON response
    include_usage: bool  # streamed: a last chunk with usage
    owner: str = ""  # the caller's identity (sessions and cache entries belong to it)
    tools: ToolPlan | None = None  # chat: the functions the reply may call (None: a text or JSON reply)


def _refuse(field: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{field} {why}", field)


def _check_unsupported(body: SamplingFields) -> None:
    """A clear 400 for every OpenAI field this server does not implement."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            raise _refuse(name, f"= {value} is not supported: the exact sampler implements temperature, top_p, top_k, "
                          "min_p and repetition_penalty; send 0 or leave it out")
    if body.logit_bias:
        raise _refuse("logit_bias", "is not supported; leave it out")
    if body.stream_options is not None and not body.stream:
        raise _refuse("stream_options", "is only allowed when stream is true")
    if isinstance(body, ChatCompletionRequest):
        for name in ("functions", "function_call"):
            if getattr(body, name) is not None:
                raise _refuse(name, "is not supported (the deprecated form of tools); send tools and tool_choice")
    else:
        assert isinstance(body, CompletionRequest)
        if body.echo:
            raise _refuse("echo", "is not supported; leave it out")
        if body.suffix:
            raise _refuse("suffix", "is not supported; leave it out")
        if body.best_of not in (None, 1):
            raise _refuse("best_of", f"= {body.best_of} is not supported; only 1 (use n for several choices)")


def _seed(seed: int | None) -> int:
    if seed is None:
        return secrets.randbits(64)
    if not -(1 << 63) <= seed < _UINT64:
        raise InvalidRequest(f"seed = {seed} is out of range; allowed -2^63..2^64-1", "seed")
    return seed % _UINT64


def seed_of_choice(seed: int, index: int) -> int:
    """The seed choice `index` samples with (choice 0: the request's, so n=1 and n=2 share their first)."""
    return (seed + index) % _UINT64


def _options(v: Validator, body: SamplingFields, top_logprobs: int | None) -> GenerationOptions:
    real = lambda name, default: v.real(f"body.{name}", default if getattr(body, name) is None else getattr(body, name))  # noqa: E731
    sampling = SamplingParams(
        temperature=real("temperature", 1.0),
        top_k=v.value("body.top_k", body.top_k or 0),
        top_p=real("top_p", 0.0),
        min_p=real("min_p", 0.0),
        repetition_penalty=real("repetition_penalty", 0.0),
        seed=_seed(body.seed),
    )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return GenerationOptions(
        sampling=sampling, stop=v.strings("body.stop", stop), logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs or 0,
    )


def _common(v: Validator, cfg: ServerConfig, body: SamplingFields, served_model: str, max_tokens: int | None) -> tuple[int, int]:
    if body.model != served_model:
        raise UnknownModel(f"model {body.model!r} is not served here; GET /v1/models lists {served_model!r}")
    _check_unsupported(body)
    if body.user is not None:
        v.length("body.user", len(body.user), "characters")
    n = v.value("body.n", 1 if body.n is None else body.n)
    if n > cfg.max_sessions:  # never servable: a 429 would be retried for ever
        raise InvalidRequest(f"n = {n} choices need {n} sessions at once; this server holds {cfg.max_sessions} "
                             "(--max-sessions)", "n")
    return n, cfg.default_new_tokens if max_tokens is None else v.value("body.max_tokens", max_tokens)


def chat_job(v: Validator, cfg: ServerConfig, body: ChatCompletionRequest, served_model: str) -> CompletionJob:
    """A chat request's job.

    Raises:
        InvalidRequest: an unsupported field or a bound broken. UnknownModel: another model.
    """
    if body.max_tokens is not None and body.max_completion_tokens is not None and \
            body.max_tokens != body.max_completion_tokens:
        raise InvalidRequest("max_tokens and max_completion_tokens differ; send one of them", "max_completion_tokens")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    n, max_tokens = _common(v, cfg, body, served_model, max_tokens)
    v.length("body.messages", len(body.messages))
    messages = []
    for m in body.messages:
        role, text = message_text("system" if m.role == "developer" else m.role, m.text(), m.tool_calls,
                                  m.tool_call_id)
        messages.append(ChatMessage(role, text))
    plan = tool_plan(body)
    messages = with_tools(messages, plan)
    for m in messages:
        v.length("body.content", len(m.content), "characters")
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
    top = v.value("body.top_logprobs", body.top_logprobs or 0) if body.logprobs else None
    constraint = plan.constraint if plan is not None else response_constraint(body.response_format)
    if constraint is not None and constraint.kind != "json_object":
        v.length("body.response_format", len(constraint.source), "characters of schema")
    return CompletionJob(
        is_chat=True, prompt=ChatInput(tuple(messages), add_generation_prompt=True), n=n, max_tokens=max_tokens,
        options=replace(_options(v, body, top), constraint=constraint), ignore_eos=bool(body.ignore_eos),
        stream=bool(body.stream), include_usage=bool(body.stream_options and body.stream_options.include_usage),
        tools=plan,
    )


def completion_job(v: Validator, cfg: ServerConfig, body: CompletionRequest, served_model: str) -> CompletionJob:
    """A completions request's job (the prompt a string or token ids).

    Raises:
        InvalidRequest: several prompts, an unsupported field or a bound broken. UnknownModel: another model.
    """
    n, max_tokens = _common(v, cfg, body, served_model, body.max_tokens)
    prompt: Prompt
    if isinstance(body.prompt, str):
        v.length("body.content", len(body.prompt), "characters")
        if not body.prompt:
            raise InvalidRequest("prompt is empty; send at least one character or token", "prompt")
        prompt = TextInput(body.prompt)
    elif body.prompt and all(isinstance(t, int) for t in body.prompt):
        prompt = v.items("body.prompt", list(body.prompt))  # type: ignore[arg-type]
    elif not body.prompt:
        raise InvalidRequest("prompt is empty; send at least one character or token", "prompt")
    else:
        raise InvalidRequest("one prompt per request: send a string or a list of token ids (several prompts are "
                             "several requests)", "prompt")
    top = None if body.logprobs is None else v.value("body.logprobs", body.logprobs)
    return CompletionJob(
        is_chat=False, prompt=prompt, n=n, max_tokens=max_tokens, options=_options(v, body, top),
        ignore_eos=bool(body.ignore_eos), stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )
