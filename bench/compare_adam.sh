#!/usr/bin/env bash
# Runs bench/compare_adam.py (tier vs DeepSpeed CPU Adam vs torch.optim.AdamW), installing
# torch and deepspeed with pip when they are missing. Builds tier-bench first if needed.
#   bench/compare_adam.sh [--params 100M] [--threads 1,2] [--markdown out.md] ...
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c 'import torch' 2>/dev/null || python3 -m pip install torch
python3 -c 'import deepspeed' 2>/dev/null || python3 -m pip install deepspeed
if [[ ! -f build/lib/libtier_cpu.a ]]; then
  cmake -S . -B build -G Ninja -DTIER_WERROR=ON
  ninja -C build tier_cpu tier-bench
fi
exec python3 bench/compare_adam.py --build build "$@"
