#!/usr/bin/env bash
# The tests: set up, build, run the whole suite (CTest: unit, threads-world and MPI tests),
# then again under AddressSanitizer + UndefinedBehaviorSanitizer, and the threads-world tests
# under ThreadSanitizer. MOED_QUICK=1 skips the sanitizer passes.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
scripts/setup.sh
(cd build && ctest --output-on-failure -j "$jobs")
echo "== .npy header parser under libFuzzer (20 s) =="
# A fixed seed keeps this pass deterministic, so a clean main never fails here by luck; run
# tests/io/fuzz/run.sh without one (random seed) to look for new inputs.
tests/io/fuzz/run.sh 20 -seed=1

if [ "${MOED_QUICK:-0}" != 1 ]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer =="
  # -O1 keeps sanitizer builds quick to compile on small machines and still inlines enough.
  MOED_BUILD_DIR=build-asan scripts/setup.sh -DMOED_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1"
  # Leak detection on. OpenMPI's own allocations in MPI_Init / MPI_Finalize are suppressed
  # (scripts/lsan.supp says why); matching them needs full stacks, which are slow, so only the
  # MPI tests get fast_unwind_on_malloc=0. The multi-host tests (label hosts) run once, in the
  # Release pass above.
  supp="$PWD/scripts/lsan.supp"
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS=suppressions="$supp" \
    ctest --output-on-failure -j "$jobs" -LE "mpi|hosts")
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0 \
    LSAN_OPTIONS=suppressions="$supp" ctest --output-on-failure -j "$jobs" -L mpi)
  echo "== ThreadSanitizer (threads world) =="
  MOED_BUILD_DIR=build-tsan scripts/setup.sh -DMOED_TSAN=ON -DMOED_WITH_MPI=OFF -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1"
  (cd build-tsan && TSAN_OPTIONS=halt_on_error=1 ctest --output-on-failure -j "$jobs" -L tsan)
fi
