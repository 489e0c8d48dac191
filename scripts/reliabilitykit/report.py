"""What a battery section found: named checks, the numbers it measured, and the JSON of a run."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_FAILURES_LISTED = 20  # failed checks kept verbatim per section (the count is always exact)


@dataclass
class SectionReport:
    """One section's outcome: every check counted, failures kept with their detail."""

    name: str  # the section (`bad_input`, `cancels`, ...)
    checks: int = 0  # checks made
    failures: list[str] = field(default_factory=list)  # "what: detail" of each failed check (the first few)
    failed: int = 0  # failed checks
    numbers: dict[str, Any] = field(default_factory=dict)  # what the section measured (counts, RSS, codes)
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0  # wall time, set by `finish`

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        """Count one check; keep its description if it failed. Returns `ok`."""
        self.checks += 1
        if not ok:
            self.failed += 1
            if len(self.failures) < MAX_FAILURES_LISTED:
                self.failures.append(f"{what}: {detail}" if detail else what)
        return ok

    def count(self, key: str, by: int = 1) -> None:
        """Add to a counter among `numbers`."""
        self.numbers[key] = self.numbers.get(key, 0) + by

    @property
    def passed(self) -> bool:
        """Every check passed (and there was at least one)."""
        return self.failed == 0 and self.checks > 0

    def finish(self) -> "SectionReport":
        """Stamp the wall time; returns self."""
        self.seconds = round(time.monotonic() - self.started, 2)
        return self

    def as_dict(self) -> dict[str, Any]:
        """The section as JSON-ready data."""
        return {"passed": self.passed, "checks": self.checks, "failed": self.failed, "failures": self.failures,
                "seconds": self.seconds, "numbers": self.numbers}


def battery_json(sections: list[SectionReport], meta: dict[str, Any]) -> dict[str, Any]:
    """A whole run: `meta` (plan, server, host), each section, and the totals."""
    return {
        **meta,
        "passed": all(s.passed for s in sections),
        "checks": sum(s.checks for s in sections),
        "failed": sum(s.failed for s in sections),
        "sections": {s.name: s.as_dict() for s in sections},
    }


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write `data` as indented JSON (folders created); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path
