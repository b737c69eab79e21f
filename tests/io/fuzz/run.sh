#!/usr/bin/env bash
# Builds the .npy header fuzzer with clang (libFuzzer + ASan + UBSan) and runs it briefly,
# seeded with the NumPy fixtures in tests/io/data.
# Usage: tests/io/fuzz/run.sh [seconds, default 20] [extra libFuzzer flags...]
# Exit status: 0 when no crash was found; the crashing input is left in build-fuzz/.
set -euo pipefail
cd "$(dirname "$0")/../../.."
seconds=${1:-20}
shift || true
command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (apt-get install clang)"; exit 1; }
out=build-fuzz
mkdir -p "$out/corpus"
clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -Iinclude -Isrc src/io/npy.cc src/core/status.cc tests/io/fuzz/npy_fuzz.cc -o "$out/npy_fuzz"
cp tests/io/data/*.npy "$out/corpus/"
cd "$out"
./npy_fuzz -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 "$@" corpus
