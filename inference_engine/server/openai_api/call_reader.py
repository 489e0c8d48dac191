"""Reading a reply that may be a tool call as its text arrives, the same way streamed or not.

Under tools a reply is text (its first character is not `{`) or one call object
`{"name":"<name>","arguments":<object>}`: llguidance keeps a schema's properties in their
order, the name a literal and the JSON compact (tools.py), so the arguments are the text
between that prefix and the object's last `}`. The streamed chunks and the one final object
are both read by a `CallReader`, so the streamed argument fragments concatenate to the final
`arguments` bit for bit: the arguments are the model's own text, never re-serialized. The
text arrives in whole characters (text/detokenizer.py), so no fragment splits one.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from inference_engine.server.openai_api.tools import TOOL_NAME, ToolCall

_PREFIX = re.compile(r'\{"name":"(' + TOOL_NAME.pattern + r')","arguments":')  # a call, up to its arguments


@dataclass(frozen=True)
class ReplyPiece:
    """What one piece of a reply adds to the response."""

    content: str = ""  # more text, sent as `content` (a reply that is no call)
    call: ToolCall | None = None  # the call, on the piece where its name became known (its arguments "")
    arguments: str = ""  # more of the call's arguments text


class CallReader:
    """One reply under tools, read piece by piece: text, or a call whose arguments stream as they come."""

    def __init__(self, names: tuple[str, ...]):
        """
        Args:
            names: the functions the reply may call.
        """
        self._names = names
        self.text = ""  # the reply so far
        self.call: ToolCall | None = None  # once its name is known (arguments "": see `arguments`)
        self.is_complete = False  # the call object ended (set by `end`)
        self._is_call: bool | None = None  # None until the first character
        self._start = 0  # the call's arguments begin here in `text`
        self._sent = 0  # `text` up to here is sent (as content, or as arguments)

    @property
    def arguments(self) -> str:
        """The call's arguments text sent so far (all of it once the reply ended)."""
        return self.text[self._start:self._sent] if self.call is not None else ""

    def read(self, piece: str) -> ReplyPiece:
        """Take the next piece of the reply's text; returns what may be sent now."""
        self.text += piece
        if self._is_call is None and self.text:
            self._is_call = self.text.startswith("{")
        if self._is_call is False:
            return ReplyPiece(content=self._take(len(self.text)))
        started = None
        if self._is_call and self.call is None:
            m = _PREFIX.match(self.text)
            if m is None or m.group(1) not in self._names:
                return ReplyPiece()  # held until the name is known (or the reply ends)
            started = self.call = ToolCall("call_" + secrets.token_hex(12), m.group(1), "")
            self._start = self._sent = m.end()
        if self.call is None:
            return ReplyPiece()
        held = 1 if self.text.endswith("}") else 0  # the last `}` may close the call object, not the arguments
        return ReplyPiece(call=started, arguments=self._take(len(self.text) - held))

    def end(self) -> ReplyPiece:
        """The reply ended: what is left to send. A call is complete when its arguments are a whole JSON
        object closed by the call's `}`; one cut short (max_tokens, a stop string) keeps what it has."""
        if self.call is None:  # text, or a call cut short before its name: the rest as content
            self._is_call = False
            return ReplyPiece(content=self._take(len(self.text)))
        self.is_complete = self.text.endswith("}") and _is_object(self.text[self._start:-1])
        return ReplyPiece(arguments=self._take(len(self.text) - (1 if self.is_complete else 0)))

    def _take(self, upto: int) -> str:
        sent, self._sent = self._sent, max(self._sent, upto)
        return self.text[sent:self._sent]


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
