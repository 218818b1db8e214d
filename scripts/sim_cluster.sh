#!/usr/bin/env bash
# A simulated cluster on this machine: N "nodes", each its own network namespace and its own
# UTS namespace (its own hostname, so MPI sees separate hosts and talks TCP between them),
# wired by veth links to a bridge that lives in a namespace of its own ("the switch"), every
# link shaped by tc to a chosen bandwidth (tbf), and latency and loss (netem, where the kernel
# has it), in both directions.
#
#   scripts/sim_cluster.sh up     [--name NAME] [--nodes N] [--rate RATE] [--delay DELAY] [--loss PCT] [--own-cores]
#   scripts/sim_cluster.sh shape  [--name NAME] [--node HOST] [--rate RATE] [--delay DELAY] [--loss PCT]
#   scripts/sim_cluster.sh link   HOST up|down
#   scripts/sim_cluster.sh exec   HOST COMMAND [ARGS...]
#   scripts/sim_cluster.sh bytes  HOST            # "TX_BYTES RX_BYTES" of HOST's link
#   scripts/sim_cluster.sh hosts  [--name NAME]   # the node names, one a line (a hostfile)
#   scripts/sim_cluster.sh mpirun [--name NAME] MPIRUN_ARGS...
#   scripts/sim_cluster.sh down   [--name NAME]
#
# NAME defaults to "sim"; node k is called NAME-nK (hostname and namespace alike) and has
# address 10.213.0.(k+1) on its eth0. RATE and DELAY are tc's units (10gbit, 50us); no
# --rate means unshaped (as fast as the kernel moves veth traffic). With --own-cores each node
# gets its own physical cores (node k the k-th of N equal slices of this machine's cores, with
# their hyperthreads; N must not exceed the cores) and everything `exec` starts on it is bound
# there, as a real node's processes have its cores to themselves; without it every node sees
# every CPU. Addresses exist only on interfaces inside the namespaces created here: the node namespaces have no route but their
# subnet and the switch has no address, so nothing can leave the machine. Needs root and
# iproute2 (ip, tc) and util-linux (unshare, nsenter).
#
# MPI launches ranks into the nodes through scripts/sim_launch.sh, which stands in for ssh:
#   scripts/sim_cluster.sh exec sim-n0 mpiexec -f HOSTFILE -launcher ssh \
#       -launcher-exec "$PWD/scripts/sim_launch.sh" -n 4 -ppn 2 target/release/sprtrain ...
# (Intel MPI: mpiexec.hydra -bootstrap ssh -bootstrap-exec ...). mpiexec runs on node 0, as a
# user logged into the first node would run it. `mpirun` does just that, with a hostfile of
# the cluster's nodes and MPI told to use their network (UCX_TLS=tcp and UCX_NET_DEVICES=eth0
# for MPICH over UCX, which would otherwise see the other "nodes" as reachable by shared
# memory, all being one kernel; FI_PROVIDER=tcp for Intel MPI); $SPRTRAIN_MPIRUN picks the MPI:
#   scripts/sim_cluster.sh mpirun -n 4 -ppn 2 target/release/sprtrain --config X.toml
set -euo pipefail

state=/run/sprsim
subnet=10.213.0

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//' >&2
  exit 2
}

need_root() {
  [ "$(id -u)" = 0 ] || { echo "sim_cluster.sh: needs root (network namespaces)" >&2; exit 1; }
  for tool in ip tc unshare nsenter taskset; do
    command -v "$tool" >/dev/null || { echo "sim_cluster.sh: $tool not found (apt-get install iproute2 util-linux)" >&2; exit 1; }
  done
}

# RATE (tc units: 25gbit, 800mbit, ...) in bytes per second.
rate_bytes() {
  local r=${1,,} n unit
  [[ "$r" =~ ^([0-9]+(\.[0-9]+)?)([kmg]?)(bit|bps)$ ]] || { echo "sim_cluster.sh: --rate \"$1\" is not NUMBER[k|m|g]bit or NUMBER[k|m|g]bps" >&2; exit 2; }
  n=${BASH_REMATCH[1]} unit=${BASH_REMATCH[3]}
  awk -v n="$n" -v u="$unit" -v b="${BASH_REMATCH[4]}" 'BEGIN {
    m = (u == "k") ? 1e3 : (u == "m") ? 1e6 : (u == "g") ? 1e9 : 1
    printf "%d\n", n * m / (b == "bit" ? 8 : 1) }'
}

# Whether the kernel has netem (delay and loss); some don't (CONFIG_NET_SCH_NETEM unset).
have_netem() {
  local host=$1
  tc -n "$host" qdisc add dev lo root netem delay 1us 2>/dev/null || return 1
  tc -n "$host" qdisc del dev lo root 2>/dev/null || true
}

# The qdisc of one direction of a link on DEV in namespace NS: a token bucket at RATE (tbf,
# with a 4 ms burst, at least 256 KB so that 64 KB GSO segments pass, and up to 50 ms of
# queue), under netem for DELAY and LOSS where given.
shape_dev() {
  local ns=$1 dev=$2 rate=$3 delay=$4 loss=$5 bytes burst limit parent=root
  tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
  if [ -n "$delay$loss" ]; then
    local netem=(netem limit 100000)
    [ -n "$delay" ] && netem+=(delay "$delay")
    [ -n "$loss" ] && netem+=(loss "$loss%")
    tc -n "$ns" qdisc add dev "$dev" root handle 1: "${netem[@]}"
    parent="parent 1:1"
  fi
  if [ -n "$rate" ]; then
    bytes=$(rate_bytes "$rate")
    burst=$((bytes / 250)); [ "$burst" -ge 262144 ] || burst=262144
    limit=$((bytes / 20)); [ "$limit" -ge $((4 * burst)) ] || limit=$((4 * burst))
    # shellcheck disable=SC2086
    tc -n "$ns" qdisc add dev "$dev" $parent handle 10: tbf rate "$rate" burst "$burst" limit "$limit"
  fi
}

# Shapes both directions of HOST's link: egress of its eth0 (what it sends) and egress of
# its switch port (what it receives).
shape_node() {
  local name=$1 host=$2 rate=$3 delay=$4 loss=$5 k
  k=${host##*-n}
  if [ -n "$delay$loss" ] && ! have_netem "$host"; then
    echo "sim_cluster.sh: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so --delay and --loss are unavailable; --rate works (tbf), and \`link HOST down\` fails a link" >&2
    exit 1
  fi
  shape_dev "$host" eth0 "$rate" "$delay" "$loss"
  shape_dev "$name-sw" "p$k" "$rate" "$delay" "$loss"
}

nodes_of() {
  local name=$1
  [ -f "$state/$name.nodes" ] || { echo "sim_cluster.sh: no cluster \"$name\" (run: scripts/sim_cluster.sh up --name $name)" >&2; exit 1; }
  cat "$state/$name.nodes"
}

cluster_of() {
  local host=$1
  [ -e "$state/$host.uts" ] || { echo "sim_cluster.sh: no simulated node \"$host\"" >&2; exit 1; }
  echo "${host%-n*}"
}

# The physical cores this script may run on, one a line, each as its CPUs ("0,4"): the
# allowed CPUs grouped by (package, core id), in order.
physical_cores() {
  taskset -cp $$ | sed 's/.*: //' | tr ',' '\n' \
    | awk -F- '{ for (c = $1; c <= ($2 == "" ? $1 : $2); c++) print c }' \
    | while read -r c; do
        t=/sys/devices/system/cpu/cpu$c/topology
        echo "$(cat "$t/physical_package_id" 2>/dev/null || echo 0) $(cat "$t/core_id" 2>/dev/null || echo "$c") $c"
      done \
    | sort -n -k1,1 -k2,2 -k3,3 \
    | awk '{ key = $1 " " $2; if (NR > 1 && key != prev) { print line; line = "" }
             line = line (line == "" ? "" : ",") $3; prev = key } END { if (NR) print line }'
}

up() {
  local name=$1 nodes=$2 rate=$3 delay=$4 loss=$5 own_cores=$6 k host cores
  need_root
  [[ "$name" =~ ^[a-z][a-z0-9]{0,11}$ ]] || { echo "sim_cluster.sh: --name must be 1-12 lower-case letters or digits, starting with a letter" >&2; exit 2; }
  [[ "$nodes" =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 64 ] || { echo "sim_cluster.sh: --nodes must be 1..64" >&2; exit 2; }
  if [ -n "$own_cores" ]; then
    mapfile -t cores < <(physical_cores)
    [ "$nodes" -le "${#cores[@]}" ] || { echo "sim_cluster.sh: --own-cores needs a core per node: $nodes nodes, ${#cores[@]} cores" >&2; exit 2; }
  fi
  [ ! -e "$state/$name.nodes" ] || { echo "sim_cluster.sh: cluster \"$name\" is already up (scripts/sim_cluster.sh down --name $name)" >&2; exit 1; }
  mkdir -p "$state"
  # Anything half-made is removed if a step fails.
  trap 'down "$name" >/dev/null 2>&1 || true' EXIT
  ip netns add "$name-sw"
  ip -n "$name-sw" link set lo up
  ip -n "$name-sw" link add br0 type bridge
  ip -n "$name-sw" link set br0 up
  local hosts="127.0.0.1 localhost"$'\n'
  for ((k = 0; k < nodes; k++)); do
    hosts+="$subnet.$((k + 1)) $name-n$k"$'\n'
  done
  : >"$state/$name.nodes"
  for ((k = 0; k < nodes; k++)); do
    host="$name-n$k"
    echo "$host" >>"$state/$name.nodes"
    ip netns add "$host"
    ip link add eth0 netns "$host" type veth peer name "p$k" netns "$name-sw"
    ip -n "$host" link set lo up
    # A peer that stops answering fails a TCP connection after ~13 s of retransmissions
    # (the default, 15 retries, takes ~15 min), as a cluster's failure detection would: the
    # launcher then learns that a node whose link died is gone instead of waiting for it.
    ip netns exec "$host" sysctl -q -w net.ipv4.tcp_retries2=5
    ip -n "$host" addr add "$subnet.$((k + 1))/24" dev eth0
    ip -n "$host" link set eth0 up
    ip -n "$name-sw" link set "p$k" master br0 up
    # The node's hostname: a persistent UTS namespace, bind-mounted on a file.
    touch "$state/$host.uts"
    unshare --uts="$state/$host.uts" hostname "$host"
    # `ip netns exec` bind-mounts /etc/netns/HOST/hosts over /etc/hosts: names resolve in-node.
    mkdir -p "/etc/netns/$host"
    printf '%s' "$hosts" >"/etc/netns/$host/hosts"
    shape_node "$name" "$host" "$rate" "$delay" "$loss"
    if [ -n "$own_cores" ]; then
      local first=$((k * ${#cores[@]} / nodes)) last=$(((k + 1) * ${#cores[@]} / nodes))
      (IFS=,; echo "${cores[*]:first:last-first}") >"$state/$host.cpus"
    fi
  done
  trap - EXIT
  echo "cluster $name: $nodes nodes ($(paste -sd' ' "$state/$name.nodes")) on $subnet.0/24, links ${rate:-unshaped}${delay:+, $delay latency}${loss:+, $loss% loss}${own_cores:+, each node on its own cores}"
}

down() {
  local name=$1 host
  need_root
  local hosts
  hosts=$( (cat "$state/$name.nodes" 2>/dev/null; ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$name-n[0-9]+$") | sort -u)
  for host in $hosts; do
    ip netns pids "$host" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$host" 2>/dev/null || true
    umount "$state/$host.uts" 2>/dev/null || true
    rm -f "$state/$host.uts" "$state/$host.cpus"
    rm -rf "/etc/netns/$host"
  done
  rm -f "$state/$name.hostfile"
  ip netns del "$name-sw" 2>/dev/null || true
  rm -f "$state/$name.nodes"
  echo "cluster $name: down"
}

cmd=${1:-}
[ -n "$cmd" ] || usage
shift
name=sim nodes=2 rate="" delay="" loss="" node="" own_cores=""
case "$cmd" in
  up | down | shape | hosts)
    while [ $# -gt 0 ]; do
      case "$1" in
        --name) name=$2; shift 2 ;;
        --nodes) nodes=$2; shift 2 ;;
        --rate) rate=$2; shift 2 ;;
        --delay) delay=$2; shift 2 ;;
        --loss) loss=$2; shift 2 ;;
        --node) node=$2; shift 2 ;;
        --own-cores) own_cores=1; shift ;;
        *) usage ;;
      esac
    done ;;
esac
case "$cmd" in
  up) up "$name" "$nodes" "$rate" "$delay" "$loss" "$own_cores" ;;
  down) down "$name" ;;
  shape)
    need_root
    for host in $( [ -n "$node" ] && echo "$node" || nodes_of "$name"); do
      shape_node "$(cluster_of "$host")" "$host" "$rate" "$delay" "$loss"
    done ;;
  link)
    need_root
    [ $# = 2 ] && { [ "$2" = up ] || [ "$2" = down ]; } || usage
    c=$(cluster_of "$1")
    # The switch side: the node keeps its address and its view of eth0, as when a cable or
    # a switch port fails.
    ip -n "$c-sw" link set "p${1##*-n}" "$2" ;;
  exec)
    need_root
    [ $# -ge 2 ] || usage
    host=$1
    shift
    cluster_of "$host" >/dev/null
    bind=()
    [ -f "$state/$host.cpus" ] && bind=(taskset -c "$(cat "$state/$host.cpus")")
    exec ip netns exec "$host" nsenter --uts="$state/$host.uts" -- "${bind[@]}" "$@" ;;
  bytes)
    [ $# = 1 ] || usage
    cluster_of "$1" >/dev/null
    echo "$(ip netns exec "$1" cat /sys/class/net/eth0/statistics/tx_bytes) $(ip netns exec "$1" cat /sys/class/net/eth0/statistics/rx_bytes)" ;;
  hosts) nodes_of "$name" ;;
  mpirun)
    need_root
    [ "${1:-}" = --name ] && { name=$2; shift 2; }
    hostfile="$state/$name.hostfile"
    nodes_of "$name" >"$hostfile"
    launcher=$(cd "$(dirname "$0")" && pwd)/sim_launch.sh
    cmd=("${SPRTRAIN_MPIRUN:-mpirun}" -f "$hostfile" -bootstrap ssh -bootstrap-exec "$launcher"
      -genv UCX_TLS tcp -genv UCX_NET_DEVICES eth0 -genv FI_PROVIDER tcp -genv FI_TCP_IFACE eth0 "$@")
    echo "+ (on $(head -n 1 "$hostfile")) ${cmd[*]}" >&2
    exec "$0" exec "$(head -n 1 "$hostfile")" "${cmd[@]}" ;;
  *) usage ;;
esac
