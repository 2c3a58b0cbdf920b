#!/usr/bin/env bash
# Runs `tier-bench step` for several model sizes on one directory and prints the Markdown table of
# docs/benchmarks-optimizer.md: step time beside the I/O bound (a mixed read/write pass of the same
# bytes on the same path and engine) and the compute bound (CPU Adam on data in RAM), all measured
# in the same run, with the ratio to the larger bound and the per-stream busy times of the median
# step. A size whose state (24 bytes per parameter: two slots of 12) does not fit in the free space
# of --dir (keeping 8 GB spare) is skipped with a note. tier-bench removes its swap file when it
# exits; the raw JSON of each run is kept in --out.
#
# usage: bench/optimizer_step.sh --dir DIR [--sizes "100M 1G 2G"] [--steps 3] [--out DIR]
#                                [--bench build/bin/tier-bench] [-- extra tier-bench step options]
set -euo pipefail
cd "$(dirname "$0")/.."

dir=""
sizes="100M 1G 2G"
steps=3
out="$(mktemp -d "${TMPDIR:-/tmp}/tier-step-XXXXXX")"
bench=build/bin/tier-bench
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) dir="$2"; shift 2 ;;
    --sizes) sizes="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --bench) bench="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: bench/optimizer_step.sh --dir DIR [--sizes \"100M 1G 2G\"] [--steps N] [--out DIR] [--bench PATH]" >&2
       exit 2 ;;
  esac
done
[[ -n "$dir" ]] || { echo "optimizer_step.sh: --dir is required (a directory on the SSD)" >&2; exit 2; }
[[ -x "$bench" ]] || { echo "optimizer_step.sh: $bench not found; build first (ninja -C build)" >&2; exit 2; }
mkdir -p "$dir" "$out"

to_params() {  # 100M -> 100000000
  python3 -c "import sys; s=sys.argv[1].upper(); m={'K':1e3,'M':1e6,'G':1e9}; print(int(float(s[:-1])*m[s[-1]]) if s[-1] in m else int(s))" "$1"
}

echo "| params | state (fp32, 12 B/param) | chunks x elements | pinned | step s (median) | io bound s | compute bound s | step / max(bounds) | read / write / update busy s | update waited s | peak RSS |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for size in $sizes; do
  params="$(to_params "$size")"
  need=$((params * 24 + 8 * 1000 * 1000 * 1000))
  free=$(( $(df --output=avail -B1 "$dir" | tail -1) ))
  if (( need > free )); then
    echo "| $size | | | | skipped: needs $((params * 24 / 1000000000)) GB on $dir (+8 GB spare), $((free / 1000000000)) GB free | | | | | | |"
    continue
  fi
  json="$out/step-$size.json"
  "$bench" step --params "$size" --nvme "$dir" --steps "$steps" --json "${extra[@]}" > "$json"
  python3 - "$json" "$size" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); m = j["median_step"]
gb = lambda b: f"{b / 1e9:.2f} GB"
print(f"| {sys.argv[2]} | {gb(j['state_bytes'])} | {j['chunks']} x {j['chunk_elements']} | {j['pinned_bytes'] / 2**20:.0f} MiB "
      f"| {j['step_seconds']:.2f} | {j['io_bound_seconds']:.2f} | {j['compute_bound_seconds']:.2f} | **{j['ratio_to_bound']:.3f}** "
      f"| {m['read_busy_seconds']:.2f} / {m['write_busy_seconds']:.2f} / {m['update_busy_seconds']:.2f} "
      f"| {m['update_wait_seconds']:.2f} | {j['max_rss_bytes'] / 2**30:.2f} GiB |")
PY
done
echo
echo "raw JSON: $out"
