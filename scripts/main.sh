#!/usr/bin/env bash
# The main job: installs everything, builds tier's Python package, and fine-tunes a small
# Llama-architecture model (built from a transformers config: nothing is downloaded) with its
# parameters and optimizer state offloaded to NVMe under ./tier-swap and a device budget smaller
# than the model (the emulated device when there is no GPU). Arguments go to the fine-tuning
# script (python -m tier.examples.finetune_llama --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
# The main job needs the Python package only: pip builds the library and the native module once,
# without the test binaries and tools (scripts/build.sh release builds those: tier-bench, ctest).
.venv/bin/python -m pip install -q --disable-pip-version-check .
exec .venv/bin/python -m tier.examples.finetune_llama "$@"
