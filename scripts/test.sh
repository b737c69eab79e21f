#!/usr/bin/env bash
# The tests: set up, build, run the whole suite (CTest: unit, threads-world and MPI tests),
# then again under AddressSanitizer + UndefinedBehaviorSanitizer, and the threads-world tests
# (label tsan) under ThreadSanitizer. MOED_QUICK=1 skips the sanitizer passes (and with them the
# Python suites on torch 1.13, which are the ASan pass's). Ends with each phase's wall time (also
# when a phase fails).
#
# NOTE: each sanitizer build runs beside the tests before it, at the lowest CPU priority
# (in_background): the tests spend much of their time waiting (on peers, timeouts, processes
# starting, the test hosts' network, MPI ranks handing the cores to each other), and the build
# takes only the cores they leave idle (the MPI tests, label mpi, too: their ranks hand the
# cores to each other, and a build at this priority takes only what is left between).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

phases=()
# phase NAME SECONDS: one line of the report.
phase() { phases+=("$(printf '%-46s %5d s' "$1" "$2")"); }
report() {
  echo "== phase times (wall, $jobs cores) =="
  if [ ${#phases[@]} -gt 0 ]; then printf '  %s\n' "${phases[@]}"; fi
  printf '  %-46s %5d s\n' total "$SECONDS"
}

# timed NAME command...: runs the command, then records NAME's time.
timed() {
  local name=$1 start=$SECONDS
  shift
  "$@"
  phase "$name" $((SECONDS - start))
}

# in_background NAME LOG command...: starts the command at the lowest priority (in a session of
# its own, ended with the script), its output in LOG; finish_background waits for it, records
# NAME's time and fails, with LOG's end, if it did.
# NOTE: where the kernel groups processes by session (autogroup, Linux's default), a session's
# share of the CPU is set by its group's nice value, not its processes': nice -n 19 alone
# leaves the build an equal share of the cores beside the tests.
bg_name="" bg_log="" bg_pid=""
in_background() {
  bg_name=$1 bg_log=$2
  shift 2
  setsid bash -c '{ echo 19 >/proc/self/autogroup; } 2>/dev/null
                  start=$SECONDS; rc=0; nice -n 19 "${@:2}" >"$1" 2>&1 || rc=$?
                  echo "$((SECONDS - start)) $rc" >"$1.done"' _ "$bg_log" "$@" &
  bg_pid=$!
}
finish_background() {
  local start=$SECONDS secs rc
  wait "$bg_pid" || true
  bg_pid=""
  read -r secs rc <"$bg_log.done"
  phase "$bg_name" "$secs"
  if [ $((SECONDS - start)) -gt 0 ]; then
    phase "  (then waited for it)" $((SECONDS - start))
  fi
  if [ "$rc" != 0 ]; then
    tail -n 50 "$bg_log"
    echo "$bg_name failed (exit $rc); the whole log is $bg_log"
    exit "$rc"
  fi
}
on_exit() {
  # The session's group, or the process itself while it has not made the session yet.
  if [ -n "$bg_pid" ]; then kill -- "-$bg_pid" 2>/dev/null || kill "$bg_pid" 2>/dev/null || true; fi
  report
}
trap on_exit EXIT

sanitizers=1
[ "${MOED_QUICK:-0}" = 1 ] && sanitizers=0
# Each build here starts from nothing, so each compiles a target's files in batches (unity
# builds): the templates they share (CLI11, fmt, nlohmann-json, gtest, the standard library)
# are then compiled once per batch instead of once per file, about half the CPU in all.
unity=(-DCMAKE_UNITY_BUILD=ON)
# -O1 keeps sanitizer builds quick to compile on small machines and still inlines enough.
sanitizer_flags=("${unity[@]}" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1")

timed "setup + Release build" scripts/setup.sh "${unity[@]}"
if [ $sanitizers = 1 ]; then
  mkdir -p build-asan
  in_background "ASan+UBSan build (beside the Release tests)" build-asan/build.log \
    env MOED_BUILD_DIR=build-asan scripts/setup.sh -DMOED_SANITIZE=ON "${sanitizer_flags[@]}"
fi
timed "Release MPI tests" bash -c "cd build && ctest --output-on-failure -L mpi"
timed "Release tests" bash -c "cd build && ctest --output-on-failure -j $jobs -LE mpi"
echo "== .npy header parser under libFuzzer (20 s) =="
# A fixed seed keeps this pass deterministic, so a clean main never fails here by luck; run
# tests/io/fuzz/run.sh without one (random seed) to look for new inputs.
timed "fuzz" tests/io/fuzz/run.sh 20 -seed=1
[ $sanitizers = 1 ] || exit 0

echo "== AddressSanitizer + UndefinedBehaviorSanitizer =="
finish_background
# Only what the tests labelled tsan run is built (the target moed_tsan_tests).
mkdir -p build-tsan
in_background "TSan build (beside the ASan+UBSan tests)" build-tsan/build.log \
  env MOED_BUILD_DIR=build-tsan MOED_BUILD_TARGET=moed_tsan_tests scripts/setup.sh \
  -DMOED_TSAN=ON -DMOED_WITH_MPI=OFF "${sanitizer_flags[@]}"
# Leak detection on; OpenMPI's own allocations are not leaks (src/comm/mpi/process.h, and
# scripts/lsan.supp says which others). The multi-host tests (label hosts) run once, in the
# Release pass above.
# NOTE: intercept_tls_get_addr=0: in 8-rank MPI runs (not at 6) ASan records a dynamic TLS block
# of some loaded library with a bogus range ("DTLS 7 at 0x000000000d20-0x000400002a22"), and
# LeakSanitizer's scan at exit crashes on it ("Tracer caught signal 11", every rank, after every
# test passed). Without the interception LSan scans no dynamic TLS: it can only report more,
# never hide a leak of moed's (whose TLS is static).
supp="$PWD/scripts/lsan.supp"
asan() {
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1:intercept_tls_get_addr=0 LSAN_OPTIONS=suppressions="$supp" \
    ctest --output-on-failure "$@")
}
timed "ASan+UBSan tests" asan -j "$jobs" -LE "mpi|hosts"
timed "ASan+UBSan MPI tests" asan -L mpi
finish_background

echo "== ThreadSanitizer (threads world) =="
timed "TSan tests" bash -c "cd build-tsan && TSAN_OPTIONS=halt_on_error=1 ctest --output-on-failure -j $jobs -L tsan"
