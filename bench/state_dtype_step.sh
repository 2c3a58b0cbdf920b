#!/usr/bin/env bash
# The offloaded optimizer step with fp32, bf16 and int8 moments on one directory, in one run:
# `tier-bench step --state-dtype T --json` for each format, in two rounds of opposite order
# (fp32 bf16 int8, then int8 bf16 fp32) so that a disk whose speed drifts favours none, and the
# Markdown table of docs/benchmarks-optimizer.md: each format's step time (mean of its two
# medians), its NVMe bytes per parameter, its bounds, and its step time as a ratio to fp32's
# measured beside it. Targets (issue #16): int8 <= 0.55 x fp32, bf16 <= 0.75 x fp32.
#
# usage: bench/state_dtype_step.sh --dir DIR [--params 250M] [--steps 3] [--out DIR]
#                                  [--bench build/bin/tier-bench] [-- extra tier-bench step options]
set -euo pipefail
cd "$(dirname "$0")/.."

dir=""
params=250M
steps=3
out="$(mktemp -d "${TMPDIR:-/tmp}/tier-sd-XXXXXX")"
bench=build/bin/tier-bench
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) dir="$2"; shift 2 ;;
    --params) params="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --bench) bench="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: bench/state_dtype_step.sh --dir DIR [--params 250M] [--steps N] [--out DIR] [--bench PATH]" >&2
       exit 2 ;;
  esac
done
[[ -n "$dir" ]] || { echo "state_dtype_step.sh: --dir is required (a directory on the SSD)" >&2; exit 2; }
[[ -x "$bench" ]] || { echo "state_dtype_step.sh: $bench not found; build first (ninja -C build)" >&2; exit 2; }
mkdir -p "$dir" "$out"

round=0
for order in "fp32 bf16 int8" "int8 bf16 fp32"; do
  round=$((round + 1))
  for sd in $order; do
    echo "round $round: --state-dtype $sd ..." >&2
    "$bench" step --params "$params" --nvme "$dir" --steps "$steps" --state-dtype "$sd" --json "${extra[@]}" \
      > "$out/$sd-$round.json"
  done
done

python3 - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
runs = {sd: [json.load(open(os.path.join(out, f"{sd}-{r}.json"))) for r in (1, 2)] for sd in ("fp32", "bf16", "int8")}
mean = lambda sd, k: sum(j[k] for j in runs[sd]) / 2
base = mean("fp32", "step_seconds")
target = {"fp32": "", "bf16": "<= 0.75", "int8": "<= 0.55"}
print(f"{runs['fp32'][0]['params'] / 1e6:.0f}M parameters, {runs['fp32'][0]['engine']}, "
      f"{'O_DIRECT' if runs['fp32'][0]['direct'] else 'buffered'}; raw JSON in {out}")
print()
print("| state dtype | records | NVMe bytes / param / step | step s (two medians) | io bound s | compute bound s "
      "| step / max(bounds) | **step / fp32 step** | target |")
print("|---|---|---|---|---|---|---|---|---|")
for sd in ("fp32", "bf16", "int8"):
    j = runs[sd]
    step = mean(sd, "step_seconds")
    print(f"| {sd} | {j[0]['state_bytes'] / 1e9:.2f} GB | {j[0]['bytes_per_param_io']:.2f} "
          f"| {step:.3f} ({j[0]['step_seconds']:.3f}, {j[1]['step_seconds']:.3f}) "
          f"| {mean(sd, 'io_bound_seconds'):.3f} | {mean(sd, 'compute_bound_seconds'):.3f} "
          f"| {mean(sd, 'ratio_to_bound'):.2f} | **{step / base:.2f}** | {target[sd]} |")
EOF
