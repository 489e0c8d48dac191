#!/usr/bin/env bash
# Regenerates the committed Python stubs from proto/ (the source of truth).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
rm -rf inference_engine/v1
"$PY" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
  $(cd proto && find . -name '*.proto' | sed 's|^\./|proto/|' | sort | sed 's|^proto/||')
touch inference_engine/v1/__init__.py
