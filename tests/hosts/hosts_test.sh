#!/usr/bin/env bash
# Multi-host tests: moed across test hosts made by scripts/hosts.sh (network namespaces, TCP
# between hosts, shared memory inside one), and faults (a stalled rank, a killed rank, a cut
# link) that must end every rank with an error naming the culprit within the timeout.
#
#   tests/hosts/hosts_test.sh CASE MOED_BINARY
#
# Cases: run HOSTS DISPATCHER [HOSTS_SH_OPTIONS]
#                               moed run across HOSTS hosts x 2 ranks, PASS = bitwise equal to
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
# What the program itself reports (--json-out): the log mixes its output with mpirun's lines.
records=$(mktemp /tmp/moed-hosts-records.XXXXXX)
trap 'rm -f "$log" "$records"' EXIT

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

# check_fault JOB START CULPRIT_PATTERN PID: waits for JOB (the fault came at START, in
# seconds); it failed, in time, the survivors said who, and the culprit process PID is gone.
check_fault() {
  local job=$1 start=$2 pattern=$3 pid=$4 rc elapsed
  wait "$job"
  rc=$?
  elapsed=$(( $(date +%s) - start ))
  [ "$rc" -ne 0 ] || fail "the job exited 0 after the fault"
  [ "$elapsed" -le $((world_timeout + fault_slack)) ] ||
    fail "the job took ${elapsed}s after the fault (timeout ${world_timeout}s + ${fault_slack}s)"
  grep -Eq "$pattern" "$log" || fail "no rank named the culprit (/$pattern/)"
  if ip netns list 2>/dev/null | grep -q '^moedh-'; then fail "namespaces left behind"; fi
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then fail "the faulty rank (pid $pid) was left behind"; fi
  echo "fault '$case_name': job exited $rc after ${elapsed}s"
  grep -E "moed|rank|host|daemon" "$log" | head -20
}

case "$case_name" in
  run)
    hosts=$1 dispatcher=$2
    shift 2
    # Further arguments go to hosts.sh: a slower network (--rate 1gbit, --loss 1).
    net=("$@")
    unset 'net[${#net[@]}-1]'  # the moed binary
    dtype=f32
    [ "$dispatcher" = low-latency ] && dtype=bf16  # the mode moves bf16 only
    "$hosts_sh" "$hosts" 2 --timeout 300 "${net[@]}" -- "$moed" run --world mpi --preset tiny \
      --dispatcher "$dispatcher" --dtype "$dtype" --experts $((hosts * 4)) --steps 2 >"$log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || fail "moed run across $hosts hosts exited $rc"
    grep -q "verify: PASS" "$log" || fail "no bitwise PASS"
    # Node structure from the real hosts: one node per host, two hops between them.
    grep -Eq "$((hosts * 2)) ranks \(2 per node\)" "$log" || fail "nodes are not the hosts"
    if [ "$dispatcher" = flex ]; then
      grep -Eq "network [0-9.]+ MB" "$log" && ! grep -q "network 0.00 MB" "$log" ||
        fail "no network traffic between hosts"
    fi
    cat "$log"
    ;;
  bench)
    # Every figure verified against the reference, nodes = the hosts, and Flex's two hops
    # beside a flat all-to-all of the same routing. (The exact network byte count over TCP is
    # moed_hosts_flex_network_bytes: the C++ analytic-count test across 4 hosts.) The records
    # are read from the file rank 0 writes, never from the log, where OpenMPI's launcher may
    # print a line of its own (a `plm:rsh` warning) anywhere.
    hosts=$1
    "$hosts_sh" "$hosts" 2 --timeout 300 -- "$moed" bench dispatch --world mpi \
      --dispatcher alltoall,flex --shape tiny --iters 2 --json-out "$records" >"$log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || fail "moed bench dispatch across $hosts hosts exited $rc"
    /usr/bin/python3 - "$records" <<'EOF' || fail "bench records"
import json, sys
records = json.load(open(sys.argv[1]))
if not records: sys.exit("no records")
for r in records:
    print(r["dispatcher"], r["phase"], "network_bytes", r["network_bytes"],
          "network_vs_flat", r.get("network_vs_flat"), "verified", r["verified"])
    if not r["verified"]: sys.exit("not verified")
    if r["ranks_per_node"] != 2: sys.exit("ranks_per_node %s, not the hosts' 2" % r["ranks_per_node"])
    if r["network_bytes"] <= 0: sys.exit("no network bytes between hosts")
    if r["phase"] == "dispatch" and "flat_network_bytes" not in r: sys.exit("no flat count")
EOF
    ;;
  stall | kill | cut)
    "$hosts_sh" 2 2 --timeout 120 -- "$moed" "${long_run[@]}" >"$log" 2>&1 &
    job=$!
    pid=$(wait_for_rank moedh-2) || { kill $job; wait $job; fail "no rank started on host 2"; }
    sleep 3  # in the middle of the steps
    start=$(date +%s)
    case "$case_name" in
      stall) kill -STOP "$pid"; pattern="no sign of life .* from rank [23]" ;;
      kill) kill -KILL "$pid"; pattern="rank [23]|exited|signal|killed" ;;
      cut) ip -n moedh-2 link set eth0 down; pattern="rank [23]|lost communication|unreachable|10\.213\.77\.2" ;;
    esac
    check_fault $job $start "$pattern" "$pid"
    ;;
  stall-local)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 4 \
      "$moed" "${long_run[@]}" >"$log" 2>&1 &
    job=$!
    pid=""
    for _ in $(seq 100); do
      # The job's own ranks only (mpirun's children): another moed on the machine is not ours.
      pid=$(pgrep -P "$job" -x moed | sort -n | sed -n 3p)
      [ -n "$pid" ] && break
      sleep 0.1
    done
    [ -n "$pid" ] || { kill $job; wait $job; fail "ranks did not start"; }
    sleep 3
    start=$(date +%s)
    kill -STOP "$pid"
    check_fault $job $start "no sign of life .* from rank [0-3]" "$pid"
    ;;
  *)
    echo "hosts_test: unknown case '$case_name'"
    exit 1
    ;;
esac
echo "hosts_test $case_name: PASS"
