#!/usr/bin/env bash
# Runs the test suite with coverage (>= 95 % of inference_engine, generated stubs excluded).
# Tests run without LD_PRELOAD, as the server does where the exact kernels build: every exact
# product goes through their MLX primitives (inference_engine/quant_kernel.py). Tests of the
# OpenBLAS interposers (the launcher's fallback) preload them in subprocesses of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
unset LD_PRELOAD
# INFERENCE_ENGINE_TEST_HOG=N starts N busy loops for the whole run (killed on exit): the suite must
# pass under load, since no test may depend on the machine's speed (issue 33).
HOGS=()
stop_hogs() { for pid in "${HOGS[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_hogs EXIT
for ((i = 0; i < ${INFERENCE_ENGINE_TEST_HOG:-0}; i++)); do
  (while :; do :; done) &
  HOGS+=($!)
done
mkdir -p results/platform-tests
rm -f .coverage .coverage.*
$PY -m pytest -p no:cacheprovider --cov=inference_engine --cov-config=.coveragerc --cov-report=term \
  --cov-fail-under=95 --junitxml=results/platform-tests/junit.xml "$@"
