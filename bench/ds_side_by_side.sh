#!/usr/bin/env bash
# Runs bench/ds_side_by_side.py (tier.torch beside DeepSpeed ZeRO-3, params and optimizer state on
# NVMe, forward/backward/step times as ratios), installing deepspeed into the project's .venv when
# it is missing. DeepSpeed runs on its CPU accelerator where there is no GPU.
#   bench/ds_side_by_side.sh [--steps 6] [--rounds 2] [--swap-dir DIR] [--json] ...
set -euo pipefail
cd "$(dirname "$0")/.."
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
"$py" -c 'import tier.torch' 2>/dev/null || export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c 'import deepspeed' 2>/dev/null || "$py" -m pip install -q deepspeed
export DS_ACCELERATOR=cpu
exec "$py" bench/ds_side_by_side.py "$@"
