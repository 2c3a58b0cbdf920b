#!/usr/bin/env bash
# The test command: installs everything, builds, and runs every test — the release build's ctest,
# the same tests under ASan+UBSan, and the Python tests when there are any. This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
./scripts/install-deps.sh

./scripts/build.sh release
(cd build && ctest --output-on-failure -j "$(nproc)")

./scripts/build.sh asan
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
(cd build-asan && ctest --output-on-failure -j "$(nproc)" -LE lint)

# The Python package as users get it: `pip install .` from the repo root, then its tests, run from
# outside the source tree so that the installed package is the one imported.
.venv/bin/python -m pip install -q --disable-pip-version-check .
(cd tests/python && ../../.venv/bin/python -m pytest -q -p no:cacheprovider .)
echo "test.sh: every test passed in $(( $(date +%s) - start )) s"
