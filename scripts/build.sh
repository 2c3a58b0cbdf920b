#!/usr/bin/env bash
# Configures and builds one flavour of tier: release (default, in build/), asan (ASan+UBSan, in
# build-asan/) or tsan (in build-tsan/). Extra arguments go to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache (when CMake finds it) shares objects between clones of the tree: paths relative to here.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
flavour="${1:-release}"
shift || true
jobs="$(nproc)"
case "$flavour" in
  release) dir=build;      args=(-DCMAKE_BUILD_TYPE=Release) ;;
  asan)    dir=build-asan; args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIER_SANITIZER=asan -DTIER_BUILD_BENCH=OFF -DTIER_WITH_CUDA=OFF) ;;
  # Every SIMD target, as in release: with only the baseline (EMU128, lanes as arrays) TSan
  # instruments each lane, and the optimizer's threaded tests take minutes instead of seconds.
  tsan)    dir=build-tsan; args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIER_SANITIZER=tsan -DTIER_BUILD_BENCH=OFF -DTIER_WITH_CUDA=OFF) ;;
  *) echo "usage: scripts/build.sh [release|asan|tsan] [cmake args...]" >&2; exit 2 ;;
esac
cmake -S . -B "$dir" -G Ninja -DTIER_WERROR=ON "${args[@]}" "$@" >/dev/null
cmake --build "$dir" -j "$jobs"
echo "build.sh: $flavour build ready in $dir/ (executables in $dir/bin/)"
