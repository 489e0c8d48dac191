#!/usr/bin/env bash
# The reviewer's one command (macOS or Linux): set up, check the golden digests, run the test
# suite with coverage, smoke-test a spawned gRPC server, and write
# results/platform-tests/summary.json, which says which path served (CPU exact native, MLX ops,
# Metal) and, plainly, when it ran without a Mac.
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

# The golden digests first (their run writes junit.xml too, which the suite's then replaces).
echo "[review] golden digests (tests/test_golden_digests.py: the kernels and the packaged model's bits)" >&2
bash scripts/run_tests.sh --no-cov tests/test_golden_digests.py 2>&1 | tee "$TESTS_DIR/golden.log"
golden_rc=${PIPESTATUS[0]}
$PY -c "import mlx.core as mx; print(mx.default_device())" >"$TESTS_DIR/mlx_device.txt" 2>&1

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

$PY - "$TESTS_DIR" "$smoke_json" "$SMOKE_DIR/smoke-$STAMP.log" "$tests_rc" "$smoke_rc" "$golden_rc" <<'PY'
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
tests_rc, smoke_rc, golden_rc = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
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


def served_path(dir_: Path) -> dict:
    """Which arithmetic served (the test run's header line) on which MLX device, and whether this is a Mac."""
    try:
        header = re.search(r"^inference_engine arithmetic: (.*)$", (dir_ / "golden.log").read_text(), re.M)
    except OSError:
        header = None
    try:
        device = (dir_ / "mlx_device.txt").read_text().strip()
    except OSError:
        device = "unknown"
    arithmetic = header.group(1) if header else "unknown (no golden.log header)"
    kind = ("Metal" if "gpu" in device.lower() else
            "CPU exact native" if arithmetic.startswith("native") else "MLX ops")
    mac = platform.system() == "Darwin"
    return {"served": kind, "arithmetic": arithmetic, "mlx_device": device, "mac": mac,
            "note": "ran on macOS" if mac else
            f"ran WITHOUT a Mac ({platform.system()} {platform.machine()}): nothing here verifies Apple Silicon"}


tests = junit_counts(junit)
path = served_path(tests_dir)
golden_ok = golden_rc == 0
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
    "path": path,
    "golden_digests": {"exit_code": golden_rc, "ok": golden_ok, "log": str(tests_dir / "golden.log")},
    "evidence": [str(p) for p in evidence if p.is_file()],
    "ok": tests_ok and smoke_ok and golden_ok,
}
out = tests_dir / "summary.json"
out.write_text(json.dumps(summary, indent=2) + "\n")
print(f"[review] tests {tests['tests']} (failures {tests['failures']}, errors {tests['errors']}, "
      f"skipped {tests['skipped']}, exit {tests_rc}); coverage {summary['coverage_percent']}%; "
      f"smoke {smoke['passed']} passed, {smoke['failed']} failed; summary: {out}", file=sys.stderr)
print(f"[review] served by: {path['served']} ({path['arithmetic']}; MLX device {path['mlx_device']}); "
      f"golden digests {'match' if golden_ok else 'DIFFER (see ' + str(tests_dir / 'golden.log') + ')'}; "
      f"{path['note']}", file=sys.stderr)
sys.exit(0 if summary["ok"] else 1)
PY
summary_rc=$?
if (( tests_rc != 0 || smoke_rc != 0 || golden_rc != 0 || summary_rc != 0 )); then
  echo "[review] FAILED (tests exit $tests_rc, smoke exit $smoke_rc, golden exit $golden_rc, summary exit $summary_rc)" >&2
  exit 1
fi
echo "[review] all passed" >&2
