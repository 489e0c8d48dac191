#!/usr/bin/env bash
# The native kernels' bits on arm64 (Apple Silicon's instruction set) against x86-64's.
#
# Installs Debian's aarch64 cross compilers and qemu-user when missing, builds the kernel
# harness (tests/native/kernel_harness.cpp: every product shape and block type, exp/tanh,
# RMSNorm, RoPE, SiLU, GELU and attention rows on fixed, seeded inputs) for x86-64 and for
# aarch64, and runs every variant: x86-64 AVX-512, AVX2+FMA (EXACT_GEMM_NO_AVX512=1) and
# portable (EXACT_GEMM_PORTABLE=1) natively, arm64 NEON and portable under
# qemu-aarch64-static -L /usr/aarch64-linux-gnu. One line per variant; exit 1 if any
# variant differs in one bit from the committed tests/golden/digests.json, 2 if one could not be
# built or run.
#
# Correctness only: qemu emulates the instructions, so its run time says nothing about an
# arm64 CPU's speed. .ci/run runs it: cold (Debian's packages downloaded and installed, ~1 min;
# both builds, compiled in parallel, ~35 s of CPU) it takes about 1.5 min on an idle 2-core
# machine, warm (packages there, harnesses cached by source hash) a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu)
command -v aarch64-linux-gnu-g++ >/dev/null || missing+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  echo "[check_arm64] installing ${missing[*]}" >&2
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
exec python3 -m tests.kernel_harness --arm64 "$@"
