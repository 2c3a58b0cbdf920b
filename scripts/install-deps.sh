#!/usr/bin/env bash
# Installs everything tier needs on a fresh Debian (bookworm or later) machine: the toolchain and
# libraries from apt, and the Python packages (into .venv, which sees packages already installed
# system-wide) from pip. Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git ccache clang
  liburing-dev libaio-dev libtbb-dev libhwy-dev nlohmann-json3-dev
  libdlpack-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang-format clang-tidy fio
  python3 python3-venv python3-pip
)

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# A pyenv or other non-Debian python3 on PATH is fine; do not ask apt for one.
if command -v python3 >/dev/null && python3 -m venv --help >/dev/null 2>&1; then
  filtered=()
  for p in "${missing[@]}"; do
    case "$p" in python3|python3-venv|python3-pip) ;; *) filtered+=("$p") ;; esac
  done
  missing=("${filtered[@]+"${filtered[@]}"}")
fi
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: apt packages already installed"
fi

if [ -f requirements.txt ]; then
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv --system-site-packages .venv
  fi
  # Only what is missing or too old is downloaded (torch alone is gigabytes: once per machine).
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  echo "install-deps: python packages ready in .venv"
fi
