"""OpenAI tools and response_format as constraints on the reply (llguidance compiles them).

Tools are rendered into the conversation as one system message (documented in docs/openai.md;
the packaged models' chat templates have no tool syntax), and the reply is generated under a
constraint chosen by tool_choice:
- `none`: free text (no tools rendered);
- `required` or a named function: one JSON call object `{"name": ..., "arguments": {...}}` whose
  arguments validate against the function's `parameters` schema;
- `auto` (the default): either free text not starting with `{`, or such a call object.
A reply that is a complete call object is returned as `tool_calls` (finish_reason `tool_calls`),
its arguments the model's own text, streamed as they come (call_reader.py). A reply makes at most
one call: `parallel_tool_calls` true or false is accepted, and false is what the constraint does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inference_engine.errors import InvalidRequest
from inference_engine.server.openai_api.schema import (
    ChatCompletionRequest, MessageToolCall, NamedToolChoice, ResponseFormat, Tool,
)
from inference_engine.text.codec import ChatMessage
from inference_engine.text.constraint import ANY_JSON_OBJECT, Constraint

MAX_TOOLS = 64  # tools in one request
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_COMPACT = {"whitespace_flexible": False}  # as text/constraint.JSON_DEFAULTS: a call is compact JSON
TOOLS_PROMPT = ("You can call these tools (JSON schemas of their arguments):\n{tools}\n"
                'To call one, reply with only a JSON object: {{"name": <the tool\'s name>, "arguments": <its arguments>}}.')


@dataclass(frozen=True)
class ToolCall:
    """One call the reply makes."""

    id: str  # call_ + random hex
    name: str  # the function
    arguments: str  # its arguments, as JSON text


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools shape its prompt and its reply."""

    system: str | None  # the tools' system message (None: tools not rendered)
    constraint: Constraint | None  # the reply's constraint (None: free text)
    names: tuple[str, ...]  # the functions the reply may call (() = none)


def _call_schema(tools: list[Tool]) -> dict[str, Any]:
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": t.function.parameters or {"type": "object", "properties": {}}}}
             for t in tools]
    return {"anyOf": calls, "x-guidance": _COMPACT}


def response_constraint(fmt: ResponseFormat | None) -> Constraint | None:
    """response_format -> the reply's constraint (None: free text).

    Raises:
        InvalidRequest: json_schema without its `json_schema` object, or with a bad name.
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object", ANY_JSON_OBJECT)
    if fmt.json_schema is None:
        raise InvalidRequest("response_format.json_schema is required with type json_schema", "response_format")
    if not TOOL_NAME.fullmatch(fmt.json_schema.name):  # OpenAI's rule for the name, as for a function's
        raise InvalidRequest(f"response_format.json_schema.name {fmt.json_schema.name[:80]!r} is not 1..64 letters, "
                             "digits, '_' or '-'", "response_format")
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else json.loads(ANY_JSON_OBJECT)
    return Constraint("json_schema", json.dumps(schema))


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools and tool_choice as a plan (None: no tools, tool_choice unset or none).

    Raises:
        InvalidRequest: tool_choice without tools, a named function not among them, a bad or repeated
            name, too many tools, or tools together with response_format.
    """
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools has {len(tools)} elements; allowed 1..{MAX_TOOLS}", "tools")
    names = [t.function.name for t in tools]
    for name in names:
        if not TOOL_NAME.fullmatch(name):
            raise InvalidRequest(f"tools: function name {name[:80]!r} is not 1..64 letters, digits, '_' or '-'", "tools")
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: function names must be unique", "tools")
    if choice == "none":
        return None
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequest("response_format and tools cannot be combined (the reply is either JSON or a call)",
                             "response_format")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names {choice.function.name[:80]!r}, which is not among tools "
                                 f"({', '.join(names)})", "tool_choice")
        tools = [t for t in tools if t.function.name == choice.function.name]
    listing = json.dumps([{"name": t.function.name, "description": t.function.description or "",
                           "parameters": t.function.parameters or {}} for t in tools])
    call = json.dumps(_call_schema(tools))
    if choice is None or choice == "auto":  # a call object, or text that does not start like one
        constraint = Constraint("grammar", f"start: call | text\ncall: %json {call}\ntext: /[^{{](.|\\n)*/")
    else:
        constraint = Constraint("json_schema", call)
    return ToolPlan(TOOLS_PROMPT.format(tools=listing), constraint, tuple(t.function.name for t in tools))


def with_tools(messages: list[ChatMessage], plan: ToolPlan | None) -> list[ChatMessage]:
    """The conversation with the tools' system message first (merged into a leading system message)."""
    if plan is None or plan.system is None:
        return messages
    if messages and messages[0].role == "system":
        return [ChatMessage("system", f"{messages[0].content}\n\n{plan.system}"), *messages[1:]]
    return [ChatMessage("system", plan.system), *messages]


def message_text(role: str, content: str, tool_calls: list[MessageToolCall] | None, tool_call_id: str | None) -> \
        tuple[str, str]:
    """A message as the chat template gets it: an assistant's calls as their call objects, a tool's
    result as a user turn naming its call."""
    if role == "tool":
        return "user", f"Tool result ({tool_call_id or 'call'}): {content}"
    if role == "assistant" and tool_calls:
        calls = []
        for c in tool_calls:
            args: Any = c.function.arguments
            if isinstance(args, str) or args is None:
                try:
                    args = json.loads(args or "{}")
                except ValueError:
                    pass  # not JSON: rendered as the text it is
            # as the model wrote it (compact, characters unescaped): the next turn reuses the cached reply
            calls.append(json.dumps({"name": c.function.name, "arguments": args}, separators=(",", ":"),
                                    ensure_ascii=False))
        return role, "\n".join([content, *calls]) if content else "\n".join(calls)
    return role, content
