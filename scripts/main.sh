#!/usr/bin/env bash
# The main job: installs everything, builds tier and its Python package, and fine-tunes a small
# Llama-architecture model (built from a transformers config: nothing is downloaded) with its
# parameters and optimizer state offloaded to NVMe under ./tier-swap and a device budget smaller
# than the model (the emulated device when there is no GPU). Arguments go to the fine-tuning
# script (python -m tier.examples.finetune_llama --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh release
.venv/bin/python -m pip install -q --disable-pip-version-check .
exec .venv/bin/python -m tier.examples.finetune_llama "$@"
