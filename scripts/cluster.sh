#!/usr/bin/env bash
# A simulated cluster on one machine (issue 37): H hosts, each a network namespace with its own
# address and hostname, joined by veth pairs to one bridge, each link optionally rate-limited.
# Needs root (ip netns, tc). netem is not in this kernel: links have no injected latency or loss.
#
# INTERFACE (stable: other scripts and tests call it; change only by adding)
#
#   Settings (environment, or the flags --prefix P / --subnet A.B before the command):
#     KVC_PREFIX  name prefix (default "kv"; 1-8 of [a-z0-9], first and last a letter, so
#                 that no prefix's hosts are another's). Hosts are P0, P1, ... (namespace
#                 name = hostname), the bridge is Pbr, the root-side veths Pv0, Pv1, ...
#     KVC_SUBNET  first two octets (default "10.76"): host i is A.B.0.(i+1)/24.
#     KVC_MPIRUN  the mpirun that `mpirun` runs (default: the one on PATH). Open MPI 4 (ORTE)
#                 and 5 (PRRTE) are both understood.
#   Two clusters with different prefixes and subnets can run at once.
#
#   up H [RATE]        creates H hosts (removes an old cluster of this prefix first). RATE is a
#                      tc rate ("1gbit", "200mbit") set with tbf on BOTH ends of every host's
#                      veth (tbf shapes egress only), or "none" (default): unshaped.
#   down               removes everything of this prefix (namespaces, links, /etc/netns, state),
#                      and ends what still runs in its hosts (SIGTERM, SIGKILL after 2 s).
#   hosts              prints "NAME ADDRESS" per host, in order.
#   addr HOST          prints HOST's address.
#   exec HOST CMD...   runs CMD in HOST: its network namespace, its own UTS namespace with
#                      hostname HOST, and its own /etc/hosts naming every host. The PID stays
#                      CMD's (exec all the way), so a signal to it reaches CMD. Each exec (the
#                      agent's too) appends "HOST CMD..." to the file `log` prints.
#   log                prints the path of that record of execs.
#   cut HOST           takes HOST's link down (both ends); restore HOST brings it back up.
#   measure [SECONDS]  a TCP stream from each host to the next (default 2 s each); prints
#                      "HOST RATE MB/s ..." per host (MB = 10^6 bytes), and keeps "HOST RATE"
#                      lines for `measured`.
#   measured           prints the last measure's "HOST RATE" lines (for benchmarks' bounds).
#   place N            the layout of N ranks (see KVC_LAYOUTS): one line per rank,
#                      "RANK HOST ADDRESS LOCAL_RANK LOCAL_WORLD_SIZE".
#   hostfile N         writes the Open MPI hostfile for N ranks and prints its path.
#   agent              prints the path of the rsh agent for Open MPI (`agent HOST CMD...` runs
#                      CMD with sh in HOST).
#   mpirun ARGS...     runs KVC_MPIRUN inside the first host, with the hostfile for the -np (or
#                      -n) in ARGS, the rsh agent, TCP between hosts and shared memory within a
#                      host, on the cluster's subnet only, --map-by slot (ranks placed as
#                      `place` says) and --bind-to none (the hosts share this machine's cores);
#                      ARGS must not map or bind otherwise; ARGS follow.
#   ifname             prints the interface name inside every host ("eth0": NCCL_SOCKET_IFNAME).
#   cidr               prints the cluster's subnet ("A.B.0.0/24": btl_tcp_if_include).
#
#   Layout: KVC_LAYOUTS="4:2x2 3:3x1" says N ranks run as HxR (H hosts from the first, R ranks
#   on each, rank r on host r / R). Without an entry for N: N ranks over all hosts, as even as
#   whole hosts allow (ceil(N/H) per host). A layout needing more hosts than exist is an error.
#
#   Tests: `trap '"$cluster" down' EXIT` right after `up`, so a failing test leaves nothing
#   behind. tests/common/mpi_job.rs runs its jobs here when KVT_CLUSTER names this script (with
#   the KVC_* settings exported): mpirun through `mpirun`, torchrun-style ranks through `place`
#   and `exec`. scripts/cluster-tests.sh is the CI step.
#
# Exit codes: 0 ok; 2 bad usage or state; 77 the kernel refused network namespaces (printed as
# "SKIPPED: ..."; CI on a machine that has them must treat this as a failure).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
self="$here/$(basename "${BASH_SOURCE[0]}")"
PREFIX="${KVC_PREFIX:-kv}"
SUBNET="${KVC_SUBNET:-10.76}"
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX="$2"; shift 2 ;;
        --subnet) SUBNET="$2"; shift 2 ;;
        *) break ;;
    esac
done
export KVC_PREFIX="$PREFIX" KVC_SUBNET="$SUBNET"
STATE="/run/kvcluster/$PREFIX"
IFNAME=eth0

die() { echo "cluster.sh: $*" >&2; exit 2; }
# Not ending in a digit: the hosts of prefix "kv1" (kv10, kv11, ...) would be hosts of "kv" too,
# and `down` (or `up`) of one cluster would remove the other's.
[[ "$PREFIX" =~ ^[a-z]([a-z0-9]{0,6}[a-z])?$ ]] || die "KVC_PREFIX must be 1-8 lowercase letters/digits, starting and ending with a letter (got '$PREFIX')"
[[ "$SUBNET" =~ ^[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "KVC_SUBNET must be two octets such as 10.76 (got '$SUBNET')"

# The hosts of the running cluster, "NAME ADDRESS" per line.
hosts() {
    [ -f "$STATE/hosts" ] || die "no cluster with prefix '$PREFIX' is up (run: $0 up H)"
    cat "$STATE/hosts"
}

host_index() {
    local h="$1" i
    [[ "$h" =~ ^${PREFIX}([0-9]+)$ ]] || die "'$h' is not a host of cluster '$PREFIX' (hosts: $(hosts | cut -d' ' -f1 | tr '\n' ' '))"
    i="${BASH_REMATCH[1]}"
    grep -q "^$h " "$STATE/hosts" 2>/dev/null || die "'$h' is not a host of cluster '$PREFIX' (hosts: $(hosts | cut -d' ' -f1 | tr '\n' ' '))"
    echo "$i"
}

cmd_down() {
    local ns pids
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$" || true); do
        # What still runs in a host (a rank or daemon a failed test left) ends with it:
        # SIGTERM, then SIGKILL after 2 s.
        pids="$(ip netns pids "$ns" 2>/dev/null || true)"
        if [ -n "$pids" ]; then
            kill -TERM $pids 2>/dev/null || true
            for _ in 1 2 3 4 5 6 7 8 9 10; do
                pids="$(ip netns pids "$ns" 2>/dev/null || true)"
                [ -z "$pids" ] && break
                sleep 0.2
            done
            [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$ns" 2>/dev/null || true
        rm -rf "/etc/netns/$ns"
    done
    # What a run killed half-way left: a host's /etc/netns folder without its namespace, the
    # probe namespace of an `up`.
    for ns in $(ls /etc/netns 2>/dev/null | grep -E "^${PREFIX}[0-9]+$" || true); do
        rm -rf "/etc/netns/$ns"
    done
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}probe[0-9]+$" || true); do
        ip netns del "$ns" 2>/dev/null || true
    done
    # Deleting a namespace deletes its veth end, and with it the pair; a leftover root end
    # (from a half-built cluster) goes here.
    for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^${PREFIX}v[0-9]+$" || true); do
        ip link del "$l" 2>/dev/null || true
    done
    ip link del "${PREFIX}br" 2>/dev/null || true
    rm -rf "$STATE"
}

# tbf on one interface (egress only): RATE, with a burst of 10 ms at that rate (at least 64 KiB,
# above a 64 KiB GSO packet).
shape() {
    local dev="$1" rate="$2" ns="${3:-}"
    local tc=(tc)
    [ -n "$ns" ] && tc=(ip netns exec "$ns" tc)
    "${tc[@]}" qdisc replace dev "$dev" root tbf rate "$rate" burst "$(burst_of "$rate")" latency 100ms
}

burst_of() {
    local r="${1,,}" n unit bits
    [[ "$r" =~ ^([0-9]+)(bit|kbit|mbit|gbit)$ ]] || die "RATE must be like 1gbit, 200mbit, 500kbit (got '$1')"
    n="${BASH_REMATCH[1]}"; unit="${BASH_REMATCH[2]}"
    case "$unit" in
        bit) bits=$n ;; kbit) bits=$((n * 1000)) ;; mbit) bits=$((n * 1000000)) ;; gbit) bits=$((n * 1000000000)) ;;
    esac
    local b=$((bits / 8 / 100))
    [ "$b" -lt 65536 ] && b=65536
    [ "$b" -gt 67108864 ] && b=67108864
    echo "$b"
}

cmd_up() {
    local n="${1:-}" rate="${2:-none}" i ns addr
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "usage: up H [RATE] (1 <= H <= 200)"
    [ "$rate" = none ] || burst_of "$rate" >/dev/null
    if ! ip netns add "${PREFIX}probe$$" 2>/dev/null; then
        echo "SKIPPED: the kernel refused a network namespace (ip netns add failed; needs root and CONFIG_NET_NS)"
        exit 77
    fi
    ip netns del "${PREFIX}probe$$"
    cmd_down
    # A half-built cluster goes away if any step below fails (set -e ends the script there).
    UP_BUILT=0
    trap '[ "$UP_BUILT" = 1 ] || { cmd_down; echo "cluster.sh: up failed; removed what it made" >&2; }' EXIT
    mkdir -p "$STATE"
    ip link add "${PREFIX}br" type bridge
    ip link set "${PREFIX}br" up
    : >"$STATE/hosts.new"
    for ((i = 0; i < n; i++)); do
        ns="${PREFIX}$i"
        addr="$SUBNET.0.$((i + 1))"
        ip netns add "$ns"
        ip link add "${PREFIX}v$i" type veth peer name "$IFNAME" netns "$ns"
        ip link set "${PREFIX}v$i" master "${PREFIX}br" up
        ip -n "$ns" addr add "$addr/24" dev "$IFNAME"
        ip -n "$ns" link set "$IFNAME" up
        ip -n "$ns" link set lo up
        if [ "$rate" != none ]; then
            shape "${PREFIX}v$i" "$rate"
            shape "$IFNAME" "$rate" "$ns"
        fi
        echo "$ns $addr" >>"$STATE/hosts.new"
    done
    # Every host's own /etc/hosts (ip netns exec bind-mounts /etc/netns/NS/* over /etc/*).
    for ((i = 0; i < n; i++)); do
        ns="${PREFIX}$i"
        mkdir -p "/etc/netns/$ns"
        {
            echo "127.0.0.1 localhost"
            echo "::1 localhost ip6-localhost ip6-loopback"
            cat "$STATE/hosts.new" | awk '{print $2, $1}'
        } >"/etc/netns/$ns/hosts"
        echo "$ns" >"/etc/netns/$ns/hostname"
    done
    echo "$rate" >"$STATE/rate"
    # The rsh agent: Open MPI calls it as `agent [options] HOST COMMAND...`, COMMAND a shell line.
    cat >"$STATE/agent" <<EOF
#!/bin/sh
# Open MPI's rsh agent for cluster '$PREFIX' (written by scripts/cluster.sh): HOST CMD...
while [ \$# -gt 0 ] && [ "\${1#-}" != "\$1" ]; do shift; done
host="\$1"; shift
KVC_PREFIX='$PREFIX' KVC_SUBNET='$SUBNET' exec '$self' exec "\$host" /bin/sh -c "\$*"
EOF
    chmod +x "$STATE/agent"
    mv "$STATE/hosts.new" "$STATE/hosts"
    UP_BUILT=1
    hosts
}

cmd_exec() {
    local h="${1:-}"
    [ $# -ge 2 ] || die "usage: exec HOST CMD..."
    host_index "$h" >/dev/null
    shift
    # A record of what ran where (the tests check that their ranks really ran on each host).
    echo "$h $*" | cut -c1-300 >>"$STATE/exec.log"
    # unshare without --fork execs CMD itself; sh sets the name in the new UTS namespace.
    exec ip netns exec "$h" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$h" "$@"
}

cmd_link() {
    local h="$1" state="$2" i
    i="$(host_index "$h")"
    ip link set "${PREFIX}v$i" "$state"
    ip -n "$h" link set "$IFNAME" "$state"
}

# Prints "RANK HOST ADDRESS LOCAL_RANK LOCAL_WORLD_SIZE" for N ranks.
cmd_place() {
    local n="${1:-}" hcount r spec h per
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] || die "usage: place N"
    mapfile -t all < <(hosts)
    hcount=${#all[@]}
    h=""; per=""
    for spec in ${KVC_LAYOUTS:-}; do
        if [[ "$spec" =~ ^([0-9]+):([0-9]+)x([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" = "$n" ]; then
            h="${BASH_REMATCH[2]}"; per="${BASH_REMATCH[3]}"
        elif ! [[ "$spec" =~ ^([0-9]+):([0-9]+)x([0-9]+)$ ]]; then
            die "KVC_LAYOUTS entries are N:HxR, such as 4:2x2 (got '$spec')"
        fi
    done
    if [ -z "$h" ]; then
        per=$(((n + hcount - 1) / hcount))
        h=$(((n + per - 1) / per))
    elif [ $((h * per)) -ne "$n" ]; then
        die "KVC_LAYOUTS: $n ranks cannot run as ${h}x${per}"
    fi
    [ "$h" -le "$hcount" ] || die "$n ranks as ${h}x${per} need $h hosts; cluster '$PREFIX' has $hcount"
    for ((r = 0; r < n; r++)); do
        local hi=$((r / per)) lws=$per
        # The last host of an uneven layout holds the rest.
        [ $(((hi + 1) * per)) -gt "$n" ] && lws=$((n - hi * per))
        echo "$r ${all[$hi]} $((r % per)) $lws"
    done
}

cmd_hostfile() {
    local n="${1:-}" f
    f="$STATE/hostfile-$n"
    cmd_place "$n" | awk '{print $2}' | uniq -c | awk '{print $2, "slots=" $1}' >"$f"
    echo "$f"
}

cmd_mpirun() {
    local n="" prev="" a mpirun first f version
    # The first -np: a later "-n 10" may be the program's own flag.
    for a in "$@"; do
        case "$prev" in -np | -n | --np) n="$a"; break ;; esac
        prev="$a"
    done
    [ -n "$n" ] || die "mpirun: give -np N"
    f="$(cmd_hostfile "$n")"
    mpirun="${KVC_MPIRUN:-$(command -v mpirun || true)}"
    [ -n "$mpirun" ] || die "mpirun: no mpirun on PATH (set KVC_MPIRUN)"
    first="$(hosts | head -1 | cut -d' ' -f1)"
    # Its own folder first on PATH: the daemons it starts on the hosts (orted, prted) are there.
    export PATH="$(dirname "$mpirun"):$PATH"
    version="$("$mpirun" --version 2>/dev/null | head -1 | grep -o '[0-9][0-9.]*' | head -1 || true)"
    local cidr="$SUBNET.0.0/24" args
    # --map-by slot: rank r on the host the hostfile's slots give it (Open MPI 5's default,
    # with --oversubscribe, put every rank on the first host).
    # --bind-to none: the hosts share this machine's cores, and each host's daemon binds its
    # ranks from core 0 up, so binding put the first rank of every host on the same core (two
    # ranks of 2 x 1 on core 0 of 2, the other idle: every step ran at half speed).
    if [ "${version%%.*}" -ge 5 ] 2>/dev/null; then
        # Open MPI 5: PRRTE launches (its ssh launcher's agent), the shared-memory BTL is "sm".
        args=(--hostfile "$f" --prtemca plm_ssh_agent "$STATE/agent" --prtemca plm_ssh_no_tree_spawn 1
            --prtemca oob_tcp_if_include "$cidr" --mca btl tcp,sm,self --mca btl_tcp_if_include "$cidr" --map-by slot --bind-to none)
    else
        args=(--hostfile "$f" --mca plm_rsh_agent "$STATE/agent" --mca plm_rsh_no_tree_spawn 1
            --mca oob_tcp_if_include "$cidr" --mca btl tcp,vader,self --mca btl_tcp_if_include "$cidr" --map-by slot --bind-to none)
    fi
    cmd_exec "$first" "$mpirun" "${args[@]}" "$@"
}

cmd_measure() {
    local secs="${1:-2}" n i from to port=5201
    [[ "$secs" =~ ^[0-9]+$ ]] || die "usage: measure [SECONDS]"
    rm -f "$STATE/measured.new"
    mapfile -t all < <(hosts)
    n=${#all[@]}
    [ "$n" -ge 2 ] || die "measure needs 2 hosts or more"
    for ((i = 0; i < n; i++)); do
        from="${all[$i]%% *}"
        to="${all[$(((i + 1) % n))]}"
        local toh="${to%% *}" toa="${to##* }"
        # The receiver counts bytes until the sender closes; the sender streams for SECS.
        timeout $((secs + 20)) ip netns exec "$toh" /usr/bin/python3 -c '
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(15)
c, _ = s.accept(); c.settimeout(15); total = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.monotonic()
    total += len(b)
dt = time.monotonic() - t0
print(f"{total / dt / 1e6:.1f}")
' "$toa" "$port" >"$STATE/measure.out" &
        local rx=$!
        sleep 0.5
        timeout $((secs + 20)) ip netns exec "$from" /usr/bin/python3 -c '
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=15)
buf = b"\xa5" * (1 << 20); end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end: c.sendall(buf)
c.close()
' "$toa" "$port" "$secs"
        wait "$rx"
        echo "$from $(cat "$STATE/measure.out")" >>"$STATE/measured.new"
        echo "$from $(cat "$STATE/measure.out") MB/s (to $toh, link rate $(cat "$STATE/rate"))"
    done
    mv "$STATE/measured.new" "$STATE/measured"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    hosts) hosts ;;
    addr) host_index "${1:-}" >/dev/null; hosts | awk -v h="$1" '$1 == h {print $2}' ;;
    exec) cmd_exec "$@" ;;
    cut) cmd_link "${1:?usage: cut HOST}" down ;;
    restore) cmd_link "${1:?usage: restore HOST}" up ;;
    measure) cmd_measure "$@" ;;
    place) cmd_place "$@" ;;
    hostfile) cmd_hostfile "$@" ;;
    agent) hosts >/dev/null; echo "$STATE/agent" ;;
    mpirun) cmd_mpirun "$@" ;;
    log) hosts >/dev/null; echo "$STATE/exec.log" ;;
    measured) [ -f "$STATE/measured" ] || die "no measure has run on cluster '$PREFIX'"; cat "$STATE/measured" ;;
    ifname) echo "$IFNAME" ;;
    cidr) echo "$SUBNET.0.0/24" ;;
    *) die "usage: $0 [--prefix P] [--subnet A.B] up H [RATE] | down | hosts | addr HOST | exec HOST CMD... | cut HOST | restore HOST | measure [S] | measured | place N | hostfile N | agent | log | mpirun ARGS... | ifname | cidr" ;;
esac
