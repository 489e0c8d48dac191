"""The OpenAI-compatible request bodies, as pydantic models (what /docs shows).

Types and shapes are checked here; bounds that depend on the server's configuration
(max_tokens, token ids, lengths) are checked from the one table in server/validation.py
by `params.py`. Fields OpenAI defines that this server does not implement are declared,
so a request that sets them gets a clear 400 instead of being silently ignored; fields
no OpenAI client sends are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    """A part of a request body; fields no OpenAI client sends are ignored."""

    model_config = ConfigDict(extra="ignore")


class TextPart(Body):
    """One part of a message's content (only text parts are servable)."""

    type: Literal["text"] = Field(description="only 'text' parts are supported")
    text: str


class Message(Body):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="'developer' is rendered as 'system'; tool messages are not supported")
    content: str | list[TextPart] | None = Field(default=None, description="a string or text parts")
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts concatenated; none: empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(Body):
    """What a streamed response adds."""

    include_usage: bool = Field(default=False, description="a last chunk with `usage` and no choices")


class SamplingFields(Body):
    """Fields both endpoints share."""

    model: str = Field(description="the id GET /v1/models lists")
    max_tokens: int | None = Field(default=None, description="tokens to generate per choice (default: the "
                                   "server's --default-new-tokens)")
    temperature: float | None = Field(default=None, description="0..2; default 1 (0 = greedy)")
    top_p: float | None = Field(default=None, description="nucleus mass; default 1 (all tokens)")
    n: int | None = Field(default=None, description="choices, forks of one prefilled prompt (1..8)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, description="up to 8 stop strings")
    seed: int | None = Field(default=None, description="same seed and request: the same completion, alone or "
                             "under any load (choice i samples with seed + i)")
    user: str | None = Field(default=None, description="accepted and ignored (identities come from bearer tokens)")
    presence_penalty: float | None = Field(default=None, description="only 0 is supported")
    frequency_penalty: float | None = Field(default=None, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(default=None, description="not supported (empty or absent only)")
    # extensions (as vLLM and mlx-lm name them)
    top_k: int | None = Field(default=None, description="extension: keep the k most probable tokens")
    min_p: float | None = Field(default=None, description="extension: keep tokens at least min_p times the top one")
    repetition_penalty: float | None = Field(default=None, description="extension: CTRL-style penalty (1 = none)")
    ignore_eos: bool | None = Field(default=False, description="extension: keep going past EOS tokens")


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, description="alias of max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, description="alternatives per token, 0..20 (needs logprobs)")
    response_format: Any = Field(default=None, description="not supported yet")
    tools: Any = Field(default=None, description="not supported yet")
    tool_choice: Any = Field(default=None, description="not supported yet")
    functions: Any = Field(default=None, description="not supported")
    function_call: Any = Field(default=None, description="not supported")
    parallel_tool_calls: Any = Field(default=None, description="not supported")


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string or a list of token ids (one prompt per request)")
    logprobs: int | None = Field(default=None, description="alternatives per token, 0..20 (0: the chosen token's only)")
    echo: bool | None = Field(default=False, description="not supported")
    suffix: str | None = Field(default=None, description="not supported")
    best_of: int | None = Field(default=None, description="1 only")
