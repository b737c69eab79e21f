#!/usr/bin/env bash
# Test hosts on one machine: N hosts made of network namespaces, joined by a bridge, and a
# command run under mpirun across them (RANKS_PER_HOST ranks each), then everything removed.
#
#   scripts/hosts.sh N RANKS_PER_HOST [--timeout S] [--rate RATE] [--loss PCT] -- COMMAND [ARGS...]
#   scripts/hosts.sh 2 2 -- build/bin/moed run --world mpi --preset tiny
#   scripts/hosts.sh --cleanup            # remove what an earlier run left behind
#
# Each host is a namespace moedh-<i> with one veth to a bridge in a switch namespace
# (moedh-sw), an address 10.213.77.<i> on a private /24 that exists only inside these
# namespaces, its own hostname (UTS namespace) and its own /dev/shm (a tmpfs in the mount
# namespace `ip netns exec` makes), so hosts share no memory and OpenMPI's per-host files never
# collide. mpirun runs in a head namespace (moedh-head, 10.213.77.254) and starts one orted per
# host through an rsh agent that enters the host's namespaces (no ssh). Between hosts OpenMPI
# uses TCP; inside a host shared memory (vader).
#
# NOTE: nothing is added to the machine's own network namespace, and no traffic is sent to a
# test address from it (there it is not local and would leave the machine).
#
# Options: --timeout S ends the job after S seconds (mpirun --timeout, then teardown kills what
# is left by PID); --rate RATE limits every link (tc tbf, e.g. 10gbit, 1gbit); --loss PCT drops
# PCT percent of the packets crossing the switch (nftables, bridge family; needs nft).
# Environment for the command: MOED_HOSTS (the host list), MOED_HOSTS_NS_PREFIX.
# Exit status: the command's (mpirun's), or 2 for bad arguments / a failed set-up.
set -uo pipefail

prefix=moedh
subnet=10.213.77
switch=${prefix}-sw
head=${prefix}-head
here=$(cd "$(dirname "$0")" && pwd)

usage() {
  echo "usage: scripts/hosts.sh N RANKS_PER_HOST [--timeout S] [--rate RATE] [--loss PCT] -- COMMAND [ARGS...]" >&2
  echo "       scripts/hosts.sh --cleanup" >&2
  exit 2
}

# Kills every process left in our namespaces, then deletes them (an `ip netns del` on a
# namespace that still has a process would leave it alive, unnamed, holding its address).
cleanup() {
  local ns pids
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${prefix}-"); do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${prefix}-"); do
    for _ in 1 2 3 4 5; do
      [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break
      sleep 0.2
    done
    ip netns del "$ns" 2>/dev/null
  done
  [ -n "${tmp_dir:-}" ] && rm -rf "$tmp_dir"
  return 0
}

# --enter NS HOSTNAME COMMAND_LINE: run inside a host (used by the rsh agent and for mpirun).
if [ "${1:-}" = --enter ]; then
  [ $# -eq 4 ] || usage
  exec ip netns exec "$2" unshare --uts -- sh -c \
    'hostname "$1" && mount -t tmpfs -o size=50% tmpfs /dev/shm && exec sh -c "$2"' sh "$3" "$4"
fi
if [ "${1:-}" = --cleanup ]; then
  cleanup
  exit 0
fi
[ $# -ge 4 ] || usage
num_hosts=$1
ranks_per_host=$2
shift 2
[[ "$num_hosts" =~ ^[0-9]+$ ]] && [ "$num_hosts" -ge 1 ] && [ "$num_hosts" -le 200 ] || {
  echo "hosts.sh: N = '$num_hosts' must be a number in [1, 200]" >&2
  exit 2
}
[[ "$ranks_per_host" =~ ^[0-9]+$ ]] && [ "$ranks_per_host" -ge 1 ] || {
  echo "hosts.sh: RANKS_PER_HOST = '$ranks_per_host' must be a number >= 1" >&2
  exit 2
}
timeout_s=0
rate=""
loss=""
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  case "$1" in
    --timeout) timeout_s=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --loss) loss=$2; shift 2 ;;
    *) echo "hosts.sh: unknown option '$1'" >&2; usage ;;
  esac
done
[ "${1:-}" = -- ] || usage
shift
[ $# -ge 1 ] || usage
[ "$(id -u)" -eq 0 ] || { echo "hosts.sh: needs root (network namespaces)" >&2; exit 2; }
command -v ip >/dev/null || { echo "hosts.sh: needs iproute2 (ip)" >&2; exit 2; }
if [ -n "$loss" ] && ! command -v nft >/dev/null; then
  echo "hosts.sh: --loss needs nftables (nft)" >&2
  exit 2
fi

cleanup  # a previous run may have left namespaces behind
tmp_dir=$(mktemp -d /tmp/moed-hosts.XXXXXX)
trap 'cleanup' EXIT
trap 'exit 130' INT TERM

fail_setup() {
  echo "hosts.sh: set-up failed: $*" >&2
  exit 2
}

# The switch: a bridge in a namespace of its own.
ip netns add "$switch" || fail_setup "ip netns add $switch"
ip -n "$switch" link set lo up
ip -n "$switch" link add br0 type bridge || fail_setup "bridge"
ip -n "$switch" link set br0 up

# add_host NS INDEX: a namespace with one veth to the switch and address subnet.INDEX.
add_host() {
  local ns=$1 i=$2
  ip netns add "$ns" || fail_setup "ip netns add $ns"
  ip -n "$ns" link set lo up
  ip -n "$ns" link add eth0 type veth peer name "p$i" netns "$switch" || fail_setup "veth $ns"
  ip -n "$ns" addr add "$subnet.$i/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$switch" link set "p$i" master br0
  ip -n "$switch" link set "p$i" up
  if [ -n "$rate" ]; then
    tc -n "$switch" qdisc add dev "p$i" root tbf rate "$rate" burst 256kb latency 50ms ||
      fail_setup "tc tbf rate $rate"
    tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms ||
      fail_setup "tc tbf rate $rate"
  fi
}

hosts=()
for i in $(seq 1 "$num_hosts"); do
  add_host "${prefix}-$i" "$i"
  hosts+=("$subnet.$i:$ranks_per_host")
done
add_host "$head" 254

if [ -n "$loss" ]; then
  # Random loss on every frame the bridge forwards (bridge family, so it sees host-to-host
  # traffic). nftables' numgen gives a uniform draw per packet.
  ip netns exec "$switch" nft -f - <<EOF || fail_setup "nft loss rule"
table bridge moedloss {
  chain forward {
    type filter hook forward priority 0; policy accept;
    numgen random mod 1000 < $(awk "BEGIN{print int($loss * 10)}") drop
  }
}
EOF
fi

# The rsh agent: mpirun calls it like ssh (`agent [options] HOST word...`); it runs the words
# as one shell command inside HOST's namespaces with the host's own hostname and /dev/shm.
agent=$tmp_dir/agent
cat >"$agent" <<EOF
#!/usr/bin/env bash
while [ \$# -gt 0 ] && [ "\${1#-}" != "\$1" ]; do
  case "\$1" in -l|-p|-i|-o|-F) shift 2 ;; *) shift ;; esac
done
host=\$1; shift
i=\${host##*.}
ns=${prefix}-\$i
[ "\$i" = 254 ] && ns=$head
exec "$here/hosts.sh" --enter "\$ns" "h\$i" "\$*"
EOF
chmod +x "$agent"

host_list=$(IFS=,; echo "${hosts[*]}")
mpirun_args=(--allow-run-as-root --host "$host_list" -np $((num_hosts * ranks_per_host))
  --mca plm_rsh_agent "$agent" --mca plm_rsh_no_tree_spawn 1
  --mca btl tcp,self,vader --mca btl_tcp_if_include "$subnet.0/24"
  --mca oob_tcp_if_include "$subnet.0/24"
  --mca orte_tmpdir_base "$tmp_dir"
  --bind-to none --mca mpi_yield_when_idle 1
  # A dead link is noticed in ~5 s instead of OpenMPI's default ~8 minutes.
  --mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 3
  -x MOED_HOSTS="$host_list" -x OMPI_ALLOW_RUN_AS_ROOT=1 -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
[ "$timeout_s" != 0 ] && mpirun_args+=(--timeout "$timeout_s")
for v in MOED_ISA MOED_TENSOR_CACHE_BYTES PYTHONPATH; do
  [ -n "${!v:-}" ] && mpirun_args+=(-x "$v")
done

cmd=$(printf '%q ' mpirun "${mpirun_args[@]}" "$@")
"$here/hosts.sh" --enter "$head" head "cd $(printf '%q' "$PWD") && $cmd"
rc=$?
exit $rc
