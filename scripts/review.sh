#!/usr/bin/env bash
# The reviewer's one command (macOS or Linux): set up, run the test suite with coverage,
# smoke-test a spawned gRPC server, and write results/platform-tests/summary.json.
# Every step runs even when an earlier one fails; the exit status is non-zero if the
# tests (or the coverage gate) or the smoke test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TESTS_DIR=results/platform-tests
SMOKE_DIR=results/smoke
STAMP=$(date -u +%Y%m%dT%H%M%SZ)

if ! bash scripts/dev.sh setup; then
  echo "[review] scripts/dev.sh setup failed; nothing else can run" >&2
  exit 2
fi
mkdir -p "$TESTS_DIR" "$SMOKE_DIR"

echo "[review] test suite with coverage" >&2
bash scripts/run_tests.sh 2>&1 | tee "$TESTS_DIR/pytest.log"
tests_rc=${PIPESTATUS[0]}
# Kept as evidence; the summary reads the JSON form. Both exit non-zero under the gate.
rm -f "$TESTS_DIR/coverage.txt" "$TESTS_DIR/coverage.json"  # never summarise a stale run
$PY -m coverage report >"$TESTS_DIR/coverage.txt" 2>&1
$PY -m coverage json -q -o "$TESTS_DIR/coverage.json" >/dev/null 2>&1

echo "[review] smoke test against a spawned server" >&2
smoke_json="$SMOKE_DIR/smoke-$STAMP.json"
$PY scripts/smoke_grpc_runtime.py --spawn --out "$smoke_json" 2>&1 | tee "$SMOKE_DIR/smoke-$STAMP.log"
smoke_rc=${PIPESTATUS[0]}

$PY - "$TESTS_DIR" "$smoke_json" "$SMOKE_DIR/smoke-$STAMP.log" "$tests_rc" "$smoke_rc" <<'PY'
"""Write summary.json from the JUnit XML, coverage and smoke report; exit 1 if anything failed."""
from __future__ import annotations

import json
import platform
import re
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

tests_dir, smoke_json, smoke_log = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
tests_rc, smoke_rc = int(sys.argv[4]), int(sys.argv[5])
junit = tests_dir / "junit.xml"
COUNTS = ("tests", "failures", "errors", "skipped")


def junit_counts(path: Path) -> dict:
    """Sum the counts of every <testsuite>, whatever wraps them (<testsuites> or nothing).

    A suite that contains suites is skipped: by JUnit convention its counts already
    include its children's, and adding both would count tests twice.
    """
    totals = dict.fromkeys(COUNTS, 0)
    if not path.is_file():
        return {**totals, "suites": 0, "error": f"{path} is missing"}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return {**totals, "suites": 0, "error": f"{path} is not valid XML: {exc}"}
    suites = [s for s in root.iter("testsuite") if s.find(".//testsuite") is None]
    for suite in suites:
        for key in COUNTS:
            totals[key] += int(float(suite.get(key, "0") or 0))
    totals["suites"] = len(suites)
    return totals


def coverage_percent(dir_: Path) -> float | None:
    """Total coverage from `coverage json`, else from the TOTAL line of `coverage report`."""
    try:
        return round(json.loads((dir_ / "coverage.json").read_text())["totals"]["percent_covered"], 2)
    except (OSError, ValueError, KeyError):
        pass
    try:
        match = re.search(r"^TOTAL\s.*?(\d+(?:\.\d+)?)%\s*$", (dir_ / "coverage.txt").read_text(), re.M)
    except OSError:
        return None
    return float(match.group(1)) if match else None


def smoke_counts(path: Path) -> dict:
    try:
        summary = json.loads(path.read_text())["summary"]
        return {"passed": summary["passed"], "failed": summary["failed"]}
    except (OSError, ValueError, KeyError) as exc:
        return {"passed": 0, "failed": 0, "error": f"no smoke report at {path}: {exc}"}


tests = junit_counts(junit)
smoke = smoke_counts(smoke_json)
evidence = [junit, tests_dir / "pytest.log", tests_dir / "coverage.txt", tests_dir / "coverage.json",
            smoke_json, smoke_json.with_suffix(".server.log"), smoke_log]
tests_ok = tests_rc == 0 and "error" not in tests and tests["failures"] == 0 and tests["errors"] == 0
smoke_ok = smoke_rc == 0 and "error" not in smoke and smoke["failed"] == 0
uname = platform.uname()
summary = {
    "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    "platform": {"system": uname.system, "release": uname.release, "machine": uname.machine,
                 "node": uname.node, "python": platform.python_version(), "uname": " ".join(uname)},
    "tests": {**tests, "exit_code": tests_rc, "ok": tests_ok},
    "coverage_percent": coverage_percent(tests_dir),
    "smoke": {**smoke, "exit_code": smoke_rc, "ok": smoke_ok},
    "evidence": [str(p) for p in evidence if p.is_file()],
    "ok": tests_ok and smoke_ok,
}
out = tests_dir / "summary.json"
out.write_text(json.dumps(summary, indent=2) + "\n")
print(f"[review] tests {tests['tests']} (failures {tests['failures']}, errors {tests['errors']}, "
      f"skipped {tests['skipped']}, exit {tests_rc}); coverage {summary['coverage_percent']}%; "
      f"smoke {smoke['passed']} passed, {smoke['failed']} failed; summary: {out}", file=sys.stderr)
sys.exit(0 if summary["ok"] else 1)
PY
summary_rc=$?
if (( tests_rc != 0 || smoke_rc != 0 || summary_rc != 0 )); then
  echo "[review] FAILED (tests exit $tests_rc, smoke exit $smoke_rc, summary exit $summary_rc)" >&2
  exit 1
fi
echo "[review] all passed" >&2
