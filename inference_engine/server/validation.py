"""Request validation at the edge, from one table of fields and bounds."""

from __future__ import annotations

from dataclasses import dataclass

from inference_engine.config import ServerConfig
from inference_engine.errors import InvalidRequest
from inference_engine.runtime.types import DecodeMode


@dataclass(frozen=True)
class Bound:
    """Inclusive range of an integer field; `zero_ok` admits 0 as 'server default'."""

    low: int
    high: int
    zero_ok: bool = False


def bounds_table(cfg: ServerConfig, vocab_size: int) -> dict[str, Bound]:
    """Every bounded request field, by `Message.field` name."""
    return {
        "CreateSessionRequest.sink_tokens": Bound(1, cfg.max_sink, zero_ok=True),
        "CreateSessionRequest.window_tokens": Bound(1, cfg.max_window, zero_ok=True),
        "CreateSessionRequest.eos_token_ids[]": Bound(0, vocab_size - 1),
        "CreateSessionRequest.eos_token_ids#": Bound(0, 64),
        "CreateSessionRequest.client_label#": Bound(0, 256),
        "AppendTokensRequest.tokens[]": Bound(0, vocab_size - 1),
        "AppendTokensRequest.tokens#": Bound(1, cfg.max_tokens_per_request),
        "GenerateRequest.max_new_tokens": Bound(1, cfg.max_new_tokens),
        "GenerateRequest.num_draft_tokens": Bound(1, cfg.max_rollback, zero_ok=True),
        "GenerateRequest.mode": Bound(min(m.value for m in DecodeMode), max(m.value for m in DecodeMode)),
        "*.session_id#": Bound(1, 128),
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
        if (value == 0 and b.zero_ok) or b.low <= value <= b.high:
            return value
        zero = " (or 0 for the server default)" if b.zero_ok else ""
        raise InvalidRequest(f"{field.rstrip('#')} = {value} is out of range; allowed {b.low}..{b.high}{zero}",
                             field_path(field))

    def length(self, field: str, n: int) -> None:
        """Check a repeated/string field's length (table key `Field#`). Raises InvalidRequest."""
        b = self.table[field + "#"]
        if not b.low <= n <= b.high:
            raise InvalidRequest(f"{field} has {n} elements/characters; allowed {b.low}..{b.high}", field_path(field))

    def items(self, field: str, values: list[int]) -> tuple[int, ...]:
        """Check a repeated integer field's length and every element. Raises InvalidRequest."""
        self.length(field, len(values))
        b = self.table[field + "[]"]
        for i, v in enumerate(values):
            if not b.low <= v <= b.high:
                raise InvalidRequest(f"{field}[{i}] = {v} is out of range; allowed {b.low}..{b.high} (vocab size {b.high + 1})",
                                     f"{field_path(field)}[{i}]")
        return tuple(values)

    def session_id(self, sid: str) -> str:
        """Check a session id's shape. Raises InvalidRequest."""
        self.length("*.session_id", len(sid))
        return sid
