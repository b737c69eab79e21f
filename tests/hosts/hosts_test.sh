#!/usr/bin/env bash
# Multi-host tests: moed across test hosts made by scripts/hosts.sh (network namespaces, TCP
# between hosts, shared memory inside one), and faults (a stalled rank, a killed rank, a cut
# link) that must end every rank with an error naming the culprit within the timeout.
#
#   tests/hosts/hosts_test.sh CASE MOED_BINARY
#
# Cases: run HOSTS DISPATCHER   moed run across HOSTS hosts x 2 ranks, PASS = bitwise equal to
#                               the single-process reference of the same seed
#        bench HOSTS            moed bench dispatch: network bytes over TCP == the analytic count
#        stall | kill | cut     a fault on host 2's first rank in the middle of a run
#        stall-local            the stall on one host (plain mpirun, no namespaces)
# Exit 0 pass, 1 fail, 77 skip (not root, or no iproute2).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
hosts_sh=$root/scripts/hosts.sh
case_name=${1:?case}
shift
moed=${!#}
[ -x "$moed" ] || { echo "hosts_test: no moed binary at '$moed'"; exit 1; }

if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null; then
  echo "hosts_test: needs root and iproute2 (network namespaces); skipped"
  exit 77
fi
log=$(mktemp /tmp/moed-hosts-test.XXXXXX)
trap 'rm -f "$log"' EXIT

fail() {
  echo "FAIL: $*"
  echo "---- output ----"
  cat "$log"
  exit 1
}

# How long a fault may take to reach every rank: the world timeout plus start-up and slack.
world_timeout=8
fault_slack=12

# first_rank_pid NS: the pid of a moed rank process inside namespace NS (empty if none yet).
first_rank_pid() {
  local pid
  for pid in $(ip netns pids "$1" 2>/dev/null); do
    [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = moed ] && { echo "$pid"; return; }
  done
}

# wait_for_rank NS: waits (10 s at most) until a moed rank runs in NS; prints its pid.
wait_for_rank() {
  local pid
  for _ in $(seq 100); do
    pid=$(first_rank_pid "$1")
    [ -n "$pid" ] && { echo "$pid"; return 0; }
    sleep 0.1
  done
  return 1
}

# A run long enough that a fault lands in the middle of it.
long_run=(run --world mpi --preset small --steps 400 --timeout "$world_timeout")

# check_fault RC ELAPSED CULPRIT_PATTERN: the job failed, in time, and the survivors said who.
check_fault() {
  local rc=$1 elapsed=$2 pattern=$3
  [ "$rc" -ne 0 ] || fail "the job exited 0 after the fault"
  [ "$elapsed" -le $((world_timeout + fault_slack)) ] ||
    fail "the job took ${elapsed}s after the fault (timeout ${world_timeout}s + ${fault_slack}s)"
  grep -Eq "$pattern" "$log" || fail "no rank named the culprit (/$pattern/)"
  if ip netns list 2>/dev/null | grep -q '^moedh-'; then fail "namespaces left behind"; fi
  if pgrep -x moed >/dev/null; then fail "moed processes left behind: $(pgrep -x moed | xargs)"; fi
}

case "$case_name" in
  run)
    hosts=$1 dispatcher=$2
    "$hosts_sh" "$hosts" 2 --timeout 300 -- "$moed" run --world mpi --preset tiny \
      --dispatcher "$dispatcher" --steps 2 >"$log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || fail "moed run across $hosts hosts exited $rc"
    grep -q "verify: PASS" "$log" || fail "no bitwise PASS"
    # Node structure from the real hosts: one node per host, two hops between them.
    grep -Eq "$((hosts * 2)) ranks \(2 per node\)" "$log" || fail "nodes are not the hosts"
    if [ "$dispatcher" = flex ]; then
      grep -Eq "network [1-9][0-9.]* MB" "$log" || fail "no network traffic between hosts"
    fi
    cat "$log"
    ;;
  bench)
    hosts=$1
    "$hosts_sh" "$hosts" 2 --timeout 300 -- "$moed" bench dispatch --world mpi \
      --dispatcher alltoall,flex --shape tiny --iters 2 --json >"$log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || fail "moed bench dispatch across $hosts hosts exited $rc"
    /usr/bin/python3 - "$log" <<'EOF' || fail "network bytes differ from the analytic count"
import json, sys
records = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
records = [r for r in records if "network_bytes" in r] or sys.exit("no records with network_bytes")
for r in records:
    print(r.get("dispatcher"), "network_bytes", r["network_bytes"], "expected",
          r.get("expected_network_bytes"), "verified", r.get("verified"))
    if r.get("verified") is False: sys.exit("not verified")
    if "expected_network_bytes" in r and r["network_bytes"] != r["expected_network_bytes"]:
        sys.exit("mismatch")
EOF
    cat "$log"
    ;;
  stall | kill | cut)
    "$hosts_sh" 2 2 --timeout 120 -- "$moed" "${long_run[@]}" >"$log" 2>&1 &
    job=$!
    pid=$(wait_for_rank moedh-2) || { kill $job; wait $job; fail "no rank started on host 2"; }
    sleep 3  # in the middle of the steps
    start=$(date +%s)
    case "$case_name" in
      stall) kill -STOP "$pid"; pattern="rank [23]|timeout|DeadlineExceeded|waited" ;;
      kill) kill -KILL "$pid"; pattern="rank [23]|exited|signal|killed" ;;
      cut) ip -n moedh-2 link set eth0 down; pattern="rank [23]|lost communication|unreachable|10\.213\.77\.2" ;;
    esac
    wait $job
    rc=$?
    elapsed=$(( $(date +%s) - start ))
    check_fault $rc $elapsed "$pattern"
    echo "fault '$case_name': job exited $rc after ${elapsed}s"
    grep -E "moed|rank" "$log" | head -20
    ;;
  stall-local)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 4 \
      "$moed" "${long_run[@]}" >"$log" 2>&1 &
    job=$!
    pid=""
    for _ in $(seq 100); do
      pid=$(pgrep -x moed | sort -n | sed -n 3p)
      [ -n "$pid" ] && break
      sleep 0.1
    done
    [ -n "$pid" ] || { kill $job; wait $job; fail "ranks did not start"; }
    sleep 3
    start=$(date +%s)
    kill -STOP "$pid"
    wait $job
    rc=$?
    elapsed=$(( $(date +%s) - start ))
    kill -KILL "$pid" 2>/dev/null
    check_fault $rc $elapsed "rank [0-3]|timeout|waited"
    echo "fault 'stall-local': job exited $rc after ${elapsed}s"
    grep -E "moed|rank" "$log" | head -20
    ;;
  *)
    echo "hosts_test: unknown case '$case_name'"
    exit 1
    ;;
esac
echo "hosts_test $case_name: PASS"
