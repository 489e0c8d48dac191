#!/usr/bin/env bash
# Runs the test suite with coverage (>= 95 % of inference_engine, generated stubs excluded).
# Tests run with Debian's OpenBLAS and the selected sgemm kernel (INFERENCE_ENGINE_KERNEL, default
# exact_gemm) preloaded, as the server does (see inference_engine/blas.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
LIB=$($PY -m inference_engine.blas)  # [kernel interposer:]OpenBLAS, as the launcher preloads
if [[ -n "$LIB" && "${INFERENCE_ENGINE_NO_OPENBLAS:-0}" != 1 ]]; then export LD_PRELOAD="$LIB${LD_PRELOAD:+:$LD_PRELOAD}"; fi
mkdir -p results/platform-tests
rm -f .coverage .coverage.*
$PY -m pytest -p no:cacheprovider --cov=inference_engine --cov-config=.coveragerc --cov-report=term \
  --cov-fail-under=95 --junitxml=results/platform-tests/junit.xml "$@"
