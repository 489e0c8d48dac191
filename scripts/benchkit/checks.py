"""Speed and ratio bounds the bench judges (the tests assert no speed: a loaded machine is not a bug).

Each check is a figure of the report, the bound it should meet and whether it did. The bench
records them in its JSON (`checks`) and prints the ones that failed; it does not fail on them,
since one run on a shared machine is evidence, not a verdict.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

_OPS: dict[str, Callable[[float, float], bool]] = {">": operator.gt, ">=": operator.ge, "<": operator.lt,
                                                   "<=": operator.le}


def check(name: str, value: float, op: str, bound: float, why: str) -> dict[str, Any]:
    """One bound: `value op bound` (e.g. 1.7 > 1), recorded with whether it held.

    Raises:
        ValueError: `op` is not one of >, >=, <, <=.
    """
    if op not in _OPS:
        raise ValueError(f"check {name}: operator {op!r}; allowed: {', '.join(_OPS)}")
    return {"name": name, "value": value, "bound": f"{op} {bound:g}", "held": _OPS[op](value, bound), "why": why}


def speed_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The bounds of one bench report (its sections that are present)."""
    out: list[dict[str, Any]] = []
    bw = report.get("bandwidth")
    if bw is not None:
        out.append(check("bandwidth_gb_s_above", bw["gb_s"], ">", 0.5,
                         "a streaming read slower than this is a broken measure"))
        out.append(check("bandwidth_gb_s_below", bw["gb_s"], "<", 2000, "no machine here reads memory this fast"))
    for name, e in report.get("engines", {}).items():
        if e.get("available") and "fraction_of_limit" in e:
            out.append(check(f"{name}_fraction_of_limit", e["fraction_of_limit"], "<", 1.5,
                             "decode cannot read its weights faster than memory streams them"))
    s = report.get("snapshots")
    if s is not None:
        out.append(check("restore_over_replay", s["restore_over_replay"], ">", 1,
                         "restoring a snapshot beats replaying the history, even at the quick plan's"))
        r = s["restart"]
        out.append(check("restart_replay_over_restore", r["restore_all_over_replay_all"], ">", 1,
                         "a restart restores its persisted sessions faster than it would replay them"))
    return out


def print_failed(checks: list[dict[str, Any]]) -> None:
    """One line per check that did not hold (nothing when all did)."""
    for c in checks:
        if not c["held"]:
            print(f"check {c['name']}: {c['value']:.3g} is not {c['bound']} ({c['why']})")
