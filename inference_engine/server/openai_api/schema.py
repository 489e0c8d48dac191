"""The OpenAI-compatible request bodies, as pydantic models (what /docs shows).

Types and shapes are checked here; bounds that depend on the server's configuration
(max_tokens, token ids, lengths) are checked from the one table in server/validation.py
by `params.py`. Fields OpenAI defines that this server does not implement are declared,
so a request that sets them gets a clear 400 instead of being silently ignored; fields
no OpenAI client sends are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator


class Body(BaseModel):
    """A part of a request body; fields no OpenAI client sends are ignored."""

    model_config = ConfigDict(extra="ignore")


class TextPart(Body):
    """One part of a message's content (only text parts are servable)."""

    type: Literal["text"] = Field(description="only 'text' parts are supported")
    text: str


class MessageFunction(Body):
    """An assistant's call: the function's name and its arguments, JSON text as OpenAI sends them (an object is
    taken as it is)."""

    name: str
    arguments: str | dict[str, Any] | None = Field(default=None, description="JSON text of the arguments")


class MessageToolCall(Body):
    """One entry of an assistant message's tool_calls."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunction


class Message(Body):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="'developer' is rendered as 'system'; a 'tool' result is rendered as a user turn")
    content: str | list[TextPart] | None = Field(default=None, description="a string or text parts")
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, description="an assistant turn's calls (rendered as "
                                              "their JSON)")
    tool_call_id: str | None = Field(default=None, description="a tool result's call (rendered with its result)")

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

    @model_validator(mode="before")
    @classmethod
    def _is_unicode(cls, data: Any) -> Any:
        """Refuse a string that is not Unicode text (JSON's "\\ud800" escapes decode to lone surrogates)."""
        where = _lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where or 'body'} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); "
                             "strings must be valid Unicode")
        return data


def _lone_surrogate(data: Any) -> str | None:
    """The path of the first string (key or value) in a decoded JSON body that cannot be encoded as UTF-8, else
    None (walked without recursion: as deep as the JSON decoder allowed)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return path
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in reversed(list(items)):  # in document order
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _encodes(key):
                return inner
            stack.append((inner, item))
    return None


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


class JsonSchemaFormat(Body):
    """response_format.json_schema: the schema the reply's JSON must validate."""

    name: str = Field(description="the schema's name (1..64 characters)")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="a JSON schema (default: "
                                           "any JSON object)")
    description: str | None = None
    strict: bool | None = Field(default=None, description="accepted; the output always follows the schema")


class ResponseFormat(Body):
    """response_format: free text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, description="with type json_schema")


class FunctionDef(Body):
    """A tool's function: its name and the JSON schema of its arguments."""

    name: str = Field(description="1..64 characters: letters, digits, '_' and '-'")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="JSON schema of the arguments "
                                              "(default: an object without properties)")
    strict: bool | None = Field(default=None, description="accepted; arguments always follow the schema")


class Tool(Body):
    """One tool the model may call."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    """tool_choice's function."""

    name: str


class NamedToolChoice(Body):
    """tool_choice naming one function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, description="alias of max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, description="alternatives per token, 0..20 (needs logprobs)")
    response_format: ResponseFormat | None = Field(default=None, description="text, json_object or json_schema")
    tools: list[Tool] | None = Field(default=None, description="functions the model may call (up to 64)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="default auto with tools; none, required, or a named function")
    functions: Any = Field(default=None, description="not supported")
    function_call: Any = Field(default=None, description="not supported")
    parallel_tool_calls: StrictBool | None = Field(default=None, description="true or false: accepted; a reply "
                                                   "makes at most one call")


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string or a list of token ids (one prompt per request)")
    logprobs: int | None = Field(default=None, description="alternatives per token, 0..20 (0: the chosen token's only)")
    echo: bool | None = Field(default=False, description="not supported")
    suffix: str | None = Field(default=None, description="not supported")
    best_of: int | None = Field(default=None, description="1 only")
