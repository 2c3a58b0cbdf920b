#!/usr/bin/env bash
# Formats every C/C++/CUDA source in place with the repository's .clang-format.
set -euo pipefail
cd "$(dirname "$0")/.."
find include src apps bench tests bindings examples \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' -o -name '*.c' \
  -o -name '*.cu' -o -name '*.cuh' \) -print0 | xargs -0 clang-format -i --style=file
