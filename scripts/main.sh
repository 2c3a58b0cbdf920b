#!/usr/bin/env bash
# The main job: installs everything, builds, and runs tier-bench's summary of every link this
# machine has (host memory, NVMe through each I/O engine, the device, the CPU optimizer).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh release
exec build/bin/tier-bench summary "$@"
