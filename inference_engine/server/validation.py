"""Request validation at the edge, from one table of fields and bounds."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from inference_engine.config import ServerConfig
from inference_engine.decoding.logprobs import MAX_TOP_LOGPROBS
from inference_engine.errors import InvalidRequest
from inference_engine.runtime.types import DecodeMode

MAX_MESSAGES = 256  # messages in one request
MAX_STOP_STRINGS = 8  # stop strings in one Generate
MAX_CHOICES = 8  # `n` of one OpenAI-compatible request (each choice holds a session while it runs)
DEFAULT = "the server default"  # what 0 means in most numeric fields


@dataclass(frozen=True)
class Bound:
    """Inclusive range of a numeric field, and 0 besides it where 0 has a meaning of its own."""

    low: int | float
    high: int | float
    zero: str = ""  # what 0 means where it is admitted outside the range ("" = not admitted)
    flag: str = ""  # the server flag that sets the bound, named in the message ("" = a fixed bound)


def bounds_table(cfg: ServerConfig, vocab_size: int) -> dict[str, Bound]:
    """Every bounded request field, by `Message.field` name.

    Text is bounded in characters before it is tokenized (--max-text-chars): a text, or a
    conversation's contents together (`*.messages.content#`), so no request makes the tokenizer or
    the chat template run for long.
    """
    text = Bound(1, cfg.max_text_chars, flag="--max-text-chars")
    contents = Bound(0, cfg.max_text_chars, flag="--max-text-chars")
    return {
        "CreateSessionRequest.sink_tokens": Bound(1, cfg.max_sink, DEFAULT),
        "CreateSessionRequest.window_tokens": Bound(1, cfg.max_window, DEFAULT),
        "CreateSessionRequest.eos_token_ids[]": Bound(0, vocab_size - 1),
        "CreateSessionRequest.eos_token_ids#": Bound(0, 64),
        "CreateSessionRequest.client_label#": Bound(0, 256),
        "AppendTokensRequest.tokens[]": Bound(0, vocab_size - 1),
        "AppendTokensRequest.tokens#": Bound(1, cfg.max_tokens_per_request, flag="--max-tokens-per-request"),
        "AppendTokensRequest.text#": text,
        "AppendTokensRequest.messages#": Bound(1, MAX_MESSAGES),
        "AppendTokensRequest.messages.content#": contents,
        "ChatMessage.role#": Bound(1, 64),
        "GenerateRequest.max_new_tokens": Bound(1, cfg.max_new_tokens, DEFAULT),
        "GenerateRequest.num_draft_tokens": Bound(1, cfg.max_rollback, DEFAULT),
        "GenerateRequest.mode": Bound(min(m.value for m in DecodeMode), max(m.value for m in DecodeMode)),
        "GenerateRequest.temperature": Bound(0.0, 100.0),  # 0 = greedy
        "GenerateRequest.top_k": Bound(1, vocab_size, "all tokens"),
        "GenerateRequest.top_p": Bound(0.0, 1.0),  # 0 or 1 = all tokens
        "GenerateRequest.min_p": Bound(0.0, 1.0),  # 0 = all tokens
        "GenerateRequest.repetition_penalty": Bound(0.0, 10.0),  # 0 or 1 = none
        "GenerateRequest.stop#": Bound(0, MAX_STOP_STRINGS),
        "GenerateRequest.stop[]#": Bound(1, 256),
        "GenerateRequest.eos_token_ids#": Bound(0, 64),
        "GenerateRequest.eos_token_ids[]": Bound(0, vocab_size - 1),
        "GenerateRequest.top_logprobs": Bound(1, MAX_TOP_LOGPROBS, "no alternatives"),
        # A constraint's source (schema, regex, grammar) is text the compiler reads: bounded as text.
        "GenerateRequest.constraint.json_schema#": text,
        "GenerateRequest.constraint.regex#": text,
        "GenerateRequest.constraint.grammar#": text,
        "TokenizeRequest.text#": dataclasses.replace(text, low=0),
        "TokenizeRequest.messages#": Bound(0, MAX_MESSAGES),
        "TokenizeRequest.messages.content#": contents,
        "DetokenizeRequest.tokens#": Bound(0, 1 << 16),
        "DetokenizeRequest.tokens[]": Bound(0, vocab_size - 1),
        "*.session_id#": Bound(1, 128),
        # The OpenAI-compatible HTTP API's body fields (server/openai_api), named as OpenAI names them.
        "body.max_tokens": Bound(1, cfg.max_new_tokens),
        "body.n": Bound(1, MAX_CHOICES),
        "body.temperature": Bound(0.0, 2.0),  # OpenAI's range; 0 = greedy
        "body.top_p": Bound(0.0, 1.0),
        "body.top_k": Bound(1, vocab_size, "all tokens"),
        "body.min_p": Bound(0.0, 1.0),
        "body.repetition_penalty": Bound(0.0, 10.0),
        "body.top_logprobs": Bound(1, MAX_TOP_LOGPROBS, "no alternatives"),
        "body.logprobs": Bound(1, MAX_TOP_LOGPROBS, "no alternatives"),  # completions: alternatives per token
        "body.stop#": Bound(0, MAX_STOP_STRINGS),
        "body.stop[]#": Bound(1, 256),
        "body.prompt#": Bound(1, cfg.max_tokens_per_request),  # tokens, the prompt's or the rendered messages'
        "body.prompt[]": Bound(0, vocab_size - 1),
        "body.messages#": Bound(1, MAX_MESSAGES),
        "body.content#": contents,
        "body.response_format#": text,  # a response_format's or the tools' schema, as JSON text
        "body.user#": Bound(0, 256),
    }


def field_path(field: str) -> str:
    """The request-relative path of a table field (`AppendTokensRequest.tokens#` -> `tokens`)."""
    return field.split(".", 1)[-1].rstrip("#")


class Validator:
    """Checks values against the table; messages name the field, the value and the range."""

    def __init__(self, cfg: ServerConfig, vocab_size: int):
        self.table = bounds_table(cfg, vocab_size)

    def value(self, field: str, value: int) -> int:
        """Check one integer field. Raises InvalidRequest."""
        b = self.table[field]
        if (value == 0 and b.zero) or b.low <= value <= b.high:
            return value
        zero = f" (or 0: {b.zero})" if b.zero else ""
        raise InvalidRequest(f"{field.rstrip('#')} = {value} is out of range; allowed {b.low}..{b.high}{zero}",
                             field_path(field))

    def real(self, field: str, value: float) -> float:
        """Check one floating-point field (finite, in range). Raises InvalidRequest."""
        b = self.table[field]
        if math.isfinite(value) and b.low <= value <= b.high:
            return float(value)
        raise InvalidRequest(f"{field} = {value} is out of range; allowed {b.low}..{b.high}", field_path(field))

    def length(self, field: str, n: int, unit: str = "elements") -> None:
        """Check a repeated field's length, or a string's (`unit` "characters"); table key `Field#`.
        Raises InvalidRequest."""
        b = self.table[field + "#"]
        if not b.low <= n <= b.high:
            flag = f" ({b.flag})" if b.flag else ""
            raise InvalidRequest(f"{field.removeprefix('*.')} has {n} {unit}; allowed {b.low}..{b.high}{flag}",
                                 field_path(field))

    def items(self, field: str, values: list[int]) -> tuple[int, ...]:
        """Check a repeated integer field's length and every element. Raises InvalidRequest."""
        self.length(field, len(values))
        b = self.table[field + "[]"]
        for i, v in enumerate(values):
            if not b.low <= v <= b.high:
                raise InvalidRequest(f"{field}[{i}] = {v} is out of range; allowed {b.low}..{b.high} (vocab size {b.high + 1})",
                                     f"{field_path(field)}[{i}]")
        return tuple(values)

    def strings(self, field: str, values: list[str]) -> tuple[str, ...]:
        """Check a repeated string field's length and every string's length. Raises InvalidRequest."""
        self.length(field, len(values))
        b = self.table[field + "[]#"]
        for i, v in enumerate(values):
            if not b.low <= len(v) <= b.high:
                raise InvalidRequest(f"{field}[{i}] has {len(v)} characters; allowed {b.low}..{b.high}",
                                     f"{field_path(field)}[{i}]")
        return tuple(values)

    @staticmethod
    def one_of(message: str, present: dict[str, bool]) -> str:
        """The one field of `present` that is set. Raises InvalidRequest unless exactly one is."""
        given = [name for name, is_set in present.items() if is_set]
        if len(given) != 1:
            names = ", ".join(present)
            raise InvalidRequest(f"{message} needs exactly one of {names}; got {' and '.join(given) or 'none'}",
                                 ",".join(present))
        return given[0]

    def session_id(self, sid: str) -> str:
        """Check a session id's shape. Raises InvalidRequest."""
        self.length("*.session_id", len(sid), "characters")
        return sid
