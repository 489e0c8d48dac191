"""One rule for numeric flags: a value outside its range is reported with the value and the range allowed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlagRange:
    """The range a numeric flag's value must lie in (bounds inclusive)."""

    flag: str  # e.g. "--max-sessions"
    value: float  # what was given
    low: float | None = None  # smallest allowed (None: unbounded)
    high: float | None = None  # largest allowed (None: unbounded)
    high_from: str = ""  # the flag the upper bound comes from, if any (e.g. "--max-window")
    exclusive_low: bool = False  # the value must be above `low`, not equal to it

    def is_ok(self) -> bool:
        """The value lies in the range."""
        if self.low is not None and (self.value <= self.low if self.exclusive_low else self.value < self.low):
            return False
        return self.high is None or self.value <= self.high

    def allowed(self) -> str:
        """The range in words: "1 or more", "0..65535", "1..1024 (--max-window)", "more than 0"."""
        high = f"{self.high:g}" + (f" ({self.high_from})" if self.high_from else "") if self.high is not None else ""
        if self.low is None:
            return f"at most {high}"
        if self.exclusive_low:
            return f"more than {self.low:g}" + (f" and at most {high}" if high else "")
        return f"{self.low:g}..{high}" if high else f"{self.low:g} or more"


def check_ranges(ranges: list[FlagRange]) -> None:
    """Raise one error naming every flag out of its range, with its value and the range allowed.

    Raises:
        ValueError: e.g. "out-of-range flags: --max-sessions 0 (allowed: 1 or more)".
    """
    bad = [f"{r.flag} {r.value:g} (allowed: {r.allowed()})" for r in ranges if not r.is_ok()]
    if bad:
        raise ValueError(f"out-of-range flags: {'; '.join(bad)}")
