#!/usr/bin/env bash
# Runs the test suite with coverage (>= 95 % of inference_engine, generated stubs excluded).
# Tests run with Debian's OpenBLAS and the selected sgemm kernel (INFERENCE_ENGINE_KERNEL, default
# exact_gemm) preloaded, as the server does (see inference_engine/blas.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
LIB=$($PY -m inference_engine.blas)  # [kernel interposer:]OpenBLAS, as the launcher preloads
if [[ -n "$LIB" && "${INFERENCE_ENGINE_NO_OPENBLAS:-0}" != 1 ]]; then export LD_PRELOAD="$LIB${LD_PRELOAD:+:$LD_PRELOAD}"; fi
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
