#!/usr/bin/env bash
# bench/gpu_check.sh — proves the device layer on a machine with an NVIDIA GPU, in one call
# (about 2-3 minutes on 16 cores; the budget is 5):
#   1. builds tier with CUDA (only what the check needs: gpu_tests and tier-bench);
#   2. runs the device tests with TIER_REQUIRE_CUDA=1, so the CUDA entries of the conformance suite
#      (the same suite the emulated device passes) must run and pass rather than skip;
#   3. runs `tier-bench copy` on the CUDA device: host-to-device and device-to-host bandwidth from
#      the pinned arena through the device layer, beside plain cudaMemcpyAsync from cudaHostAlloc'd
#      memory measured in the same run (target: a ratio of at least 0.9 each way);
#   4. prints a short table last and exits non-zero when a step failed or a target was missed.
#
# usage: bench/gpu_check.sh [--no-gpu] [--deps DIR] [--build-dir DIR] [--skip-build] [--size N] [--out DIR]
#        bench/gpu_check.sh --fetch-deps DIR
#   --no-gpu        everything that needs no GPU: the CUDA build, the tests (CUDA entries skip), and
#                   the copy benchmark on the emulated device, paced (target: within 5% of the limit)
#   --fetch-deps D  on a Debian machine with apt: download the .deb files of tier's build
#                   dependencies into D and exit (for a GPU machine that has a compiler, CMake and
#                   the CUDA toolkit but not these libraries, and no network)
#   --deps D        unpack the .deb files in D into D/root and build against them
#   --build-dir D   build directory (default build-gpu)
#   --skip-build    use the binaries already in the build directory
#   --size N        bytes per copy pass (default 1G)
#   --out D         also keep the logs and copy.json in D
#
# In this workplace, with the device tool: here `bench/gpu_check.sh --fetch-deps build-gpu-deps`,
# then run `bench/gpu_check.sh --deps build-gpu-deps --out $OUT` there with carry=["build-gpu-deps"].
set -uo pipefail
cd "$(dirname "$0")/.."
root_dir=$PWD

no_gpu=0 deps="" fetch="" build_dir=build-gpu skip_build=0 size=1G out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-gpu) no_gpu=1 ;;
    --deps) deps="$2"; shift ;;
    --fetch-deps) fetch="$2"; shift ;;
    --build-dir) build_dir="$2"; shift ;;
    --skip-build) skip_build=1 ;;
    --size) size="$2"; shift ;;
    --out) out="$2"; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# Debian packages (bookworm names) that tier's CMake finds; the GPU image has the compiler, CMake,
# ninja and the CUDA toolkit already.
DEB_PACKAGES=(liburing-dev liburing2 libaio-dev libaio1 libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5
              libhwy-dev libhwy1 nlohmann-json3-dev libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian
              pkgconf-bin libpkgconf3)

if [ -n "$fetch" ]; then
  mkdir -p "$fetch"
  if ! (cd "$fetch" && apt-get download -qq "${DEB_PACKAGES[@]}"); then
    apt-get update -qq && (cd "$fetch" && apt-get download -qq "${DEB_PACKAGES[@]}") || {
      echo "gpu_check: apt-get download failed; on Debian bookworm or later, with apt sources reachable" >&2
      exit 1
    }
  fi
  echo "gpu_check: $(ls "$fetch"/*.deb | wc -l) packages ($(du -sh "$fetch" | cut -f1)) in $fetch"
  exit 0
fi

log_dir="${out:-$build_dir/gpu-check}"
mkdir -p "$log_dir"
log_dir=$(cd "$log_dir" && pwd)
start=$(date +%s)
declare -a rows=()
failed=0
row() { rows+=("$(printf '%-28s %s' "$1" "$2")"); }
fail() { row "$1" "FAILED: $2"; failed=1; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }

finish() {
  echo
  echo "== gpu_check ($(elapsed "$start"), logs in $log_dir) =="
  printf '%s\n' "${rows[@]}"
  if [ "$failed" = 0 ]; then echo "gpu_check: PASSED"; else echo "gpu_check: FAILED"; fi
  exit "$failed"
}

# ---------------------------------------------------------------- 0. is there a GPU?
if [ "$no_gpu" = 0 ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$log_dir/nvidia-smi.txt" 2>&1 \
     || ! grep -q '^GPU ' "$log_dir/nvidia-smi.txt"; then
    echo "gpu_check: no NVIDIA GPU usable here ($(head -c 200 "$log_dir/nvidia-smi.txt" 2>/dev/null || echo 'nvidia-smi not found'))." >&2
    echo "gpu_check: run it on a machine with a GPU, or with --no-gpu to check everything that needs none." >&2
    exit 2
  fi
  row "gpu" "$(head -1 "$log_dir/nvidia-smi.txt" | cut -c1-70)"
else
  row "gpu" "none asked for (--no-gpu): CUDA entries skip, copies run on the emulated device"
fi

# ---------------------------------------------------------------- 1. dependencies and build
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DTIER_WITH_CUDA=ON -DTIER_WITH_NCCL=OFF -DTIER_BUILD_TESTS=ON
            -DTIER_BUILD_BENCH=ON)
if [ -n "$deps" ]; then
  deps=$(cd "$deps" && pwd)
  sysroot="$deps/root"
  if [ ! -d "$sysroot/usr" ]; then
    mkdir -p "$sysroot"
    for f in "$deps"/*.deb; do
      if command -v dpkg-deb >/dev/null; then
        dpkg-deb -x "$f" "$sysroot"
      else  # a .deb is an ar archive holding data.tar.*
        tmp=$(mktemp -d) && (cd "$tmp" && ar x "$f" && tar -xf data.tar.* -C "$sysroot") && rm -rf "$tmp"
      fi
    done
    # pkg-config files name /usr; point them at the unpacked tree.
    find "$sysroot" -name '*.pc' -exec sed -i -E "s#(^prefix=|^libdir=|^includedir=|-I|-L)/usr#\1$sysroot/usr#g" {} +
  fi
  multiarch="$sysroot/usr/lib/x86_64-linux-gnu"
  export CMAKE_PREFIX_PATH="$sysroot/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export PKG_CONFIG_PATH="$multiarch/pkgconfig:$sysroot/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export LD_LIBRARY_PATH="$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CPATH="$sysroot/usr/include${CPATH:+:$CPATH}"
  if ! command -v pkg-config >/dev/null && [ -x "$sysroot/usr/bin/pkgconf" ]; then
    cmake_args+=(-DPKG_CONFIG_EXECUTABLE="$sysroot/usr/bin/pkgconf")
  fi
  if [ -f "$sysroot/usr/include/libaio.h" ] && [ -e "$multiarch/libaio.so" ]; then
    cmake_args+=(-DTIER_AIO_INCLUDE_DIR="$sysroot/usr/include" -DTIER_AIO_LIBRARY="$multiarch/libaio.so")
  fi
  row "dependencies" "from $(ls "$deps"/*.deb | wc -l) .deb files in $deps"
fi
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi

if [ "$skip_build" = 0 ]; then
  t=$(date +%s)
  if cmake -S . -B "$build_dir" "${cmake_args[@]}" >"$log_dir/configure.log" 2>&1 &&
     cmake --build "$build_dir" --target gpu_tests tier-bench -j "$(nproc)" >"$log_dir/build.log" 2>&1; then
    if grep -q "CUDA=ON" "$log_dir/configure.log"; then row "build (CUDA)" "ok in $(elapsed "$t")"
    else fail "build (CUDA)" "configured without CUDA (see configure.log)"; fi
  else
    tail -30 "$log_dir/configure.log" "$log_dir/build.log" 2>/dev/null
    fail "build (CUDA)" "see $log_dir/configure.log and build.log"
    finish
  fi
fi
bin="$build_dir/bin"

# ---------------------------------------------------------------- 2. device tests
t=$(date +%s)
test_env=()
[ "$no_gpu" = 0 ] && test_env=(TIER_REQUIRE_CUDA=1)
env "${test_env[@]}" "$bin/gpu_tests" --gtest_color=no >"$log_dir/gpu_tests.log" 2>&1
rc=$?
passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$log_dir/gpu_tests.log")
skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$log_dir/gpu_tests.log")
nfailed=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$log_dir/gpu_tests.log")
cuda_ran=$(grep -c '^\[       OK \] .*\(/cuda\b\|CudaDevice\)' "$log_dir/gpu_tests.log")
summary="${passed:-0} passed (${cuda_ran} on CUDA), ${skipped:-0} skipped, ${nfailed:-0} failed in $(elapsed "$t")"
if [ "$rc" = 0 ] && { [ "$no_gpu" = 1 ] || [ "$cuda_ran" -gt 0 ]; }; then
  row "device tests" "ok: $summary"
else
  grep -E '^\[  FAILED  \]|Failure|error' "$log_dir/gpu_tests.log" | head -20
  fail "device tests" "$summary (see gpu_tests.log)"
fi

# ---------------------------------------------------------------- 3. copy bandwidth
check_copy() {  # $1: label, $2: json file, $3: lower bound of the ratio, $4: upper bound
  python3 - "$1" "$2" "$3" "$4" <<'EOF'
import json, sys
label, path, lo, hi = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
j = json.load(open(path))
ok = True
for d, name in (("h2d", "host->device"), ("d2h", "device->host")):
    got, ref, ratio = j[d + "_bytes_per_second"], j["reference_" + d + "_bytes_per_second"], j[d + "_ratio"]
    good = lo <= ratio <= hi
    ok &= good
    print(f"{label + ' ' + name:<28} {got / 1e9:7.2f} GB/s vs {j['reference']} {ref / 1e9:7.2f} GB/s: "
          f"ratio {ratio:.3f} ({'pass' if good else 'MISS'}, target {lo:g}..{hi:g})")
sys.exit(0 if ok else 1)
EOF
}
run_copy() {  # $1: label, $2: lower, $3: upper, rest: tier-bench copy options
  local label=$1 lo=$2 hi=$3
  shift 3
  local json="$log_dir/copy-${label}.json"
  if "$bin/tier-bench" copy --json "$@" >"$json" 2>"$log_dir/copy-${label}.log"; then
    local lines
    lines=$(check_copy "$label" "$json" "$lo" "$hi")
    local rc=$?
    while IFS= read -r l; do rows+=("$l"); done <<<"$lines"
    [ "$rc" = 0 ] || failed=1
  else
    cat "$log_dir/copy-${label}.log"
    fail "copy $label" "tier-bench copy $* (see copy-${label}.log)"
  fi
}
if [ "$no_gpu" = 0 ]; then
  run_copy cuda 0.9 100 --device cuda --size "$size" --chunk 64M --reps 5
  cp "$log_dir/copy-cuda.json" "$log_dir/copy.json" 2>/dev/null
else
  run_copy emulated-paced 0.95 1.05 --device emulated --h2d-gbps 1 --d2h-gbps 0.8 --chunk 16M --reps 2 --size 128M
  cp "$log_dir/copy-emulated-paced.json" "$log_dir/copy.json" 2>/dev/null
fi

finish
