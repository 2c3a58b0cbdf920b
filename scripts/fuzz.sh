#!/usr/bin/env bash
# Builds tier's libFuzzer targets with clang (ASan + UBSan, in build-fuzz/) and runs each for a
# bounded time: scripts/fuzz.sh [seconds per target, default 30] [target ...]. A longer campaign is
# the same command with a bigger number. Each target starts from its seed corpus in
# tests/fuzz/corpus/<target>/ (read only) and keeps what it finds in build-fuzz/corpus/<target>/.
# A crash stops the script with a non-zero status; libFuzzer writes the input that caused it to
# build-fuzz/artifacts/ (reproduce: build-fuzz/bin/<target> <that file>).
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache (when CMake finds it) shares objects between clones of the tree: paths relative to here.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
seconds="${1:-30}"
shift || true
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then targets=(fuzz_config fuzz_checkpoint fuzz_c_api_tensor fuzz_engine_ops); fi
case "$seconds" in '' | *[!0-9]*) echo "usage: scripts/fuzz.sh [seconds per target] [target ...]" >&2; exit 2 ;; esac
if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: clang++ not found; scripts/install-deps.sh installs clang" >&2
  exit 1
fi
jobs="${FUZZ_BUILD_JOBS:-$(nproc)}"
start=$(date +%s)
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DTIER_SANITIZER=asan -DTIER_BUILD_FUZZERS=ON -DTIER_BUILD_TESTS=OFF \
  -DTIER_BUILD_BENCH=OFF -DTIER_WITH_CUDA=OFF -DTIER_BUILD_PYTHON=OFF \
  -DCMAKE_CXX_FLAGS=-DHWY_COMPILE_ONLY_STATIC=1 >/dev/null  # the fuzzed code is not SIMD: one target
cmake --build build-fuzz -j "$jobs" --target "${targets[@]}"
built=$(date +%s)
echo "fuzz.sh: built ${targets[*]} in $((built - start)) s"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
mkdir -p build-fuzz/artifacts build-fuzz/tmp
for t in "${targets[@]}"; do
  mkdir -p "build-fuzz/corpus/$t"
  echo "fuzz.sh: $t for ${seconds} s"
  # New inputs go to the first (writable) corpus folder; the seeds in the repo are only read.
  seeds=()
  if [ -d "tests/fuzz/corpus/$t" ]; then seeds=("tests/fuzz/corpus/$t"); fi
  rc=0
  TMPDIR="$PWD/build-fuzz/tmp" "build-fuzz/bin/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$t-" \
    "build-fuzz/corpus/$t" "${seeds[@]+"${seeds[@]}"}" >"build-fuzz/$t.log" 2>&1 || rc=$?
  grep -E '^(#[0-9]+[[:space:]]+DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::new_units_added)' \
    "build-fuzz/$t.log" || true
  if [ "$rc" -ne 0 ]; then
    tail -n 60 "build-fuzz/$t.log" >&2
    echo "fuzz.sh: $t FAILED (exit $rc); the input is in build-fuzz/artifacts/, the log in build-fuzz/$t.log" >&2
    exit 1
  fi
done
echo "fuzz.sh: every target ran ${seconds} s without a crash; $(( $(date +%s) - start )) s in all"
