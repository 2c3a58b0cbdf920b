#!/usr/bin/env bash
# Compares `tier-bench io` with fio on the same disk in the same run: for each engine, direction,
# block size and queue depth it runs fio with huge-page buffers (--mem=shmhuge), fio with ordinary
# buffers (--mem=malloc) and tier-bench io (swap space, pinned huge-page arena), all O_DIRECT on
# files in the same directory, and prints one Markdown table with the average device request size
# (from /proc/diskstats) beside every figure. A tensor-batch row (1000 tensors of 64 KiB..4 MiB)
# follows for each engine and direction.
#
# Before every timed run — fio's and tier's alike — the file is written once, untimed, so that both
# read and overwrite data written just before.
#
# It installs fio with apt-get when missing, raises vm.nr_hugepages only as far as fio's huge-page
# buffers need and restores the old value on exit (also on error or Ctrl-C), and removes its files.
#
# Each figure is the median of --reps runs (fio's two kinds alternate; tier-bench makes --reps timed
# passes over its file); the request size is averaged over all of them.
#
# usage: bench/compare_fio.sh [--dir DIR] [--size 4G] [--bs "1M 4M 16M"] [--qd "8 32 64"]
#                             [--engines "uring aio"] [--rw "read write"] [--tensors 1000] [--reps 3]
#                             [--bench build/bin/tier-bench] [--markdown FILE] [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."

dir="${TMPDIR:-/var/tmp}"
size=4G
bs_list="1M 4M 16M"
qd_list="8 32 64"
engines="uring aio"
rws="read write"
tensors=1000
reps=3
bench=build/bin/tier-bench
markdown=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) dir="$2"; shift 2 ;;
    --size) size="$2"; shift 2 ;;
    --bs) bs_list="$2"; shift 2 ;;
    --qd) qd_list="$2"; shift 2 ;;
    --engines) engines="$2"; shift 2 ;;
    --rw) rws="$2"; shift 2 ;;
    --tensors) tensors="$2"; shift 2 ;;
    --reps) reps="$2"; shift 2 ;;
    --bench) bench="$2"; shift 2 ;;
    --markdown) markdown="$2"; shift 2 ;;
    --quick) size=1G; bs_list="1M 16M"; qd_list="8 64"; tensors=300; reps=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "compare_fio.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

[[ -x "$bench" ]] || { echo "compare_fio.sh: $bench not found; build first (scripts/build.sh)" >&2; exit 2; }
if ! command -v fio >/dev/null; then
  echo "compare_fio.sh: installing fio" >&2
  if [[ $(id -u) -eq 0 ]]; then apt-get install -y fio >/dev/null; else sudo apt-get install -y fio >/dev/null; fi
fi

work="$(mktemp -d "$dir/tier-fio-cmp.XXXXXX")"
file="$work/fio.dat"
hp_old="$(cat /proc/sys/vm/nr_hugepages)"
hp_changed=0
cleanup() {
  local rc=$?
  rm -rf "$work"
  if [[ $hp_changed -eq 1 ]]; then
    echo "$hp_old" > /proc/sys/vm/nr_hugepages || true
    echo "compare_fio.sh: vm.nr_hugepages restored to $hp_old" >&2
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The disk under $dir, as /proc/diskstats names it.
read -r maj min < <(stat -c '%Hd %Ld' "$work")
device="$(awk -v a="$maj" -v b="$min" '$1==a && $2==b {print $3}' /proc/diskstats)"
[[ -n "$device" ]] || echo "compare_fio.sh: $dir is on no block device in /proc/diskstats; request sizes n/a" >&2
# Prints "requests sectors" of the device for reads or writes.
disk() { awk -v d="$device" -v rw="$1" '$3==d { if (rw=="read") print $4, $6; else print $8, $10 }' /proc/diskstats; }
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
to_bytes() { numfmt --from=iec "$1"; }

# fio's huge-page buffers: iodepth x bs, rounded up, for the largest combination.
max_bs=0; for b in $bs_list; do v=$(to_bytes "$b"); (( v > max_bs )) && max_bs=$v; done
max_qd=0; for q in $qd_list; do (( q > max_qd )) && max_qd=$q; done
need_pages=$(( (max_bs * max_qd) / (2 * 1024 * 1024) + 16 ))
if (( need_pages > hp_old )); then
  hp_changed=1
  echo "$need_pages" > /proc/sys/vm/nr_hugepages
  got="$(cat /proc/sys/vm/nr_hugepages)"
  echo "compare_fio.sh: vm.nr_hugepages $hp_old -> $got for fio's huge-page buffers (restored at exit)" >&2
  (( got >= need_pages )) || echo "compare_fio.sh: only $got of $need_pages huge pages; large fio runs may fail" >&2
fi

echo "compare_fio.sh: fio's $size file and tier's swap files go to $work (device $device)" >&2

# Rewrites the whole file, untimed. tier-bench io writes its fresh swap file before every timed
# run; fio gets the same, so that both measure a file written just before (a virtual disk's host
# caches and write-back backlog otherwise favour whichever ran second).
prefill() {
  fio --name=prefill --filename="$file" --size="$size" --bs=4M --rw=write --direct=1 --ioengine=libaio \
      --iodepth=16 --output=/dev/null
}

# run_fio engine rw bs qd mem -> prints "GB/s requests sectors" of one run
run_fio() {
  local eng=$1 rw=$2 bs=$3 qd=$4 mem=$5 fio_eng before after out
  fio_eng=$([[ $eng == uring ]] && echo io_uring || echo libaio)
  prefill
  before="$(disk "$rw")"
  out="$(fio --name=cmp --filename="$file" --size="$size" --bs="$bs" --iodepth="$qd" --ioengine="$fio_eng" \
      --direct=1 --rw="$rw" --mem="$mem" --output-format=terse --terse-version=3)"
  after="$(disk "$rw")"
  echo "$out" | awk -F';' -v rw="$rw" -v b="$before" -v a="$after" '{
    split(b, x, " "); split(a, y, " ");
    print (rw == "read" ? $7 : $48) * 1024 / 1e9, y[1] - x[1], y[2] - x[2] }'
}

# fio_kinds engine rw bs qd -> "huge GB/s|huge req|plain GB/s|plain req", medians over $reps runs
fio_kinds() {
  local huge=() plain=() hn=0 hs=0 pn=0 ps=0 r line
  for ((r = 0; r < reps; r++)); do
    read -r bw n sec <<< "$(run_fio "$@" shmhuge)"; huge+=("$bw"); hn=$((hn + n)); hs=$((hs + sec))
    if [[ $plain_too -eq 1 ]]; then
      read -r bw n sec <<< "$(run_fio "$@" malloc)"; plain+=("$bw"); pn=$((pn + n)); ps=$((ps + sec))
    fi
  done
  line="$(printf '%.2f|%s' "$(median "${huge[@]}")" "$(req_kib "$hn" "$hs")")"
  if [[ $plain_too -eq 1 ]]; then
    line+="$(printf '|%.2f|%s' "$(median "${plain[@]}")" "$(req_kib "$pn" "$ps")")"
  fi
  echo "$line"
}
req_kib() { awk -v n="$1" -v s="$2" 'BEGIN { if (n > 0) printf "%.0f KiB", s * 512 / n / 1024; else print "n/a" }'; }

# run_tier engine rw bs qd [extra args] -> "GB/s|avg request"
run_tier() {
  local eng=$1 rw=$2 bs=$3 qd=$4 out bw req
  shift 4
  out="$("$bench" io --path "$work" --size "$size" --block-size "$bs" --queue-depth "$qd" --engine "$eng" \
      --rw "$rw" --passes "$reps" --json --quiet "$@")"
  bw="$(echo "$out" | sed -n 's/.*"bytes_per_second": \([0-9.e+]*\).*/\1/p')"
  req="$(echo "$out" | sed -n 's/.*"avg_request_bytes": \([0-9.e+]*\).*/\1/p')"
  awk -v b="$bw" -v r="$req" 'BEGIN { printf "%.2f|%s", b / 1e9, (r > 0 ? sprintf("%.0f KiB", r / 1024) : "n/a") }'
}

rows=()
plain_too=1
header="| engine | rw | block | depth | tier GB/s (avg req) | fio huge pages GB/s (avg req) | fio ordinary GB/s (avg req) | tier / fio huge |"
rule="|---|---|---|---|---|---|---|---|"
echo "$header"
echo "$rule"
for eng in $engines; do
  for rw in $rws; do
    for bs in $bs_list; do
      for qd in $qd_list; do
        plain_too=1
        IFS='|' read -r hbw hreq pbw preq <<< "$(fio_kinds "$eng" "$rw" "$bs" "$qd")"
        tier="$(run_tier "$eng" "$rw" "$bs" "$qd")"
        ratio="$(awk -v t="${tier%%|*}" -v f="$hbw" 'BEGIN { printf "%.2f", (f > 0 ? t / f : 0) }')"
        row="| $eng | $rw | $bs | $qd | ${tier%%|*} (${tier#*|}) | $hbw ($hreq) | $pbw ($preq) | $ratio |"
        echo "$row"
        rows+=("$row")
      done
    done
    if (( tensors > 0 )); then
      plain_too=0
      IFS='|' read -r hbw hreq <<< "$(fio_kinds "$eng" "$rw" 1M 32)"
      tier="$(run_tier "$eng" "$rw" 1M 32 --tensors "$tensors")"
      ratio="$(awk -v t="${tier%%|*}" -v f="$hbw" 'BEGIN { printf "%.2f", (f > 0 ? t / f : 0) }')"
      row="| $eng | $rw, $tensors tensors 64K..4M | 1M | 32 | ${tier%%|*} (${tier#*|}) | $hbw ($hreq) | | $ratio |"
      echo "$row"
      rows+=("$row")
    fi
  done
done

if [[ -n "$markdown" ]]; then
  {
    echo "$header"
    echo "$rule"
    printf '%s\n' "${rows[@]}"
  } > "$markdown"
  echo "compare_fio.sh: table written to $markdown" >&2
fi
