#!/usr/bin/env bash
# The tests: set up, build, run the whole suite (CTest: unit, threads-world and MPI tests),
# then again under AddressSanitizer + UndefinedBehaviorSanitizer, and the threads-world tests
# under ThreadSanitizer. MOED_QUICK=1 skips the sanitizer passes.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
scripts/setup.sh
(cd build && ctest --output-on-failure -j "$jobs")

if [ "${MOED_QUICK:-0}" != 1 ]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer =="
  MOED_BUILD_DIR=build-asan scripts/setup.sh -DMOED_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
  (cd build-asan && ASAN_OPTIONS=detect_leaks=0 ctest --output-on-failure -j "$jobs" -LE no_asan)
  echo "== ThreadSanitizer (threads world) =="
  MOED_BUILD_DIR=build-tsan scripts/setup.sh -DMOED_TSAN=ON -DMOED_WITH_MPI=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
  (cd build-tsan && TSAN_OPTIONS=halt_on_error=1 ctest --output-on-failure -j "$jobs" -L tsan)
fi
