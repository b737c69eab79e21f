#!/usr/bin/env bash
# make_mpi_world with a late rank: every rank returns kDeadlineExceeded within its timeout
# (see mpi_bootstrap_probe.cc). Usage: mpi_bootstrap_test.sh MPIEXEC PROBE
set -uo pipefail
mpiexec=$1 probe=$2 np=3
out=$(timeout 120 "$mpiexec" --oversubscribe -np $np "$probe" 2>&1)
echo "$out"
for r in $(seq 0 $((np - 1))); do
  if ! grep -q "^bootstrap rank $r: DEADLINE_EXCEEDED: make_mpi_world: rank $r in .*not every rank answered within 500 ms" <<<"$out"; then
    echo "FAIL: rank $r did not report the bounded bootstrap wait"
    exit 1
  fi
done
echo PASS
