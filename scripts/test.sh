#!/usr/bin/env bash
# The test command: installs everything, builds, and runs every test — the release build's ctest,
# the same tests under ASan+UBSan, the concurrent modules under TSan, a bounded fuzzing run, and the
# Python tests. This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
./scripts/install-deps.sh

./scripts/build.sh release
(cd build && ctest --output-on-failure -j "$(nproc)")

./scripts/build.sh asan
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
(cd build-asan && ctest --output-on-failure -j "$(nproc)" -LE lint)

# ThreadSanitizer over the modules with threads of their own: the engine's scheduler (and its
# model-based give-up tests), the I/O engines, the device layer, the C ABI, the optimizer's
# pipeline and the communicators (ranks as threads). Two numeric tests are left out (16 threads
# over a million elements, and the SIMD gradient kernels per target): they take minutes under
# TSan, their threads are oneTBB's, and the release and ASan runs cover their results. tests/tsan.supp says why oneTBB's reports are set aside.
./scripts/build.sh tsan
TSAN_OPTIONS="halt_on_error=1:history_size=7:suppressions=$PWD/tests/tsan.supp" \
  bash -c 'cd build-tsan && ctest --output-on-failure -j "$(nproc)" -L "engine|nvme|gpu|bindings|optim|comm" -E "LowPrecisionOutputsAreTheRoundedMasters|GradAccumulate"'

# libFuzzer targets (config parser, checkpoint reader, C ABI tensor import, engine operations),
# each for a bounded time; scripts/fuzz.sh 3600 is the longer campaign.
./scripts/fuzz.sh "${TIER_FUZZ_SECONDS:-20}"

# The Python package as users get it: `pip install .` from the repo root, then its tests, run from
# outside the source tree so that the installed package is the one imported.
.venv/bin/python -m pip install -q --disable-pip-version-check .
# tier-bench is not part of the Python package: the tests that run it (config --check, plan) use
# the release build's.
(cd tests/python && TIER_BENCH="$PWD/../../build/bin/tier-bench" ../../.venv/bin/python -m pytest -q -p no:cacheprovider .)
echo "test.sh: every test passed in $(( $(date +%s) - start )) s"
