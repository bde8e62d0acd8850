#!/usr/bin/env bash
# Multi-host (simulated), the peers (BENCHMARKS.md): per layout and round, across the hosts of
# scripts/cluster.sh, in turn (the order rotated each round):
#  - kvstore's push and pull of one key, and raw MPI, by examples/bench_dist_store (mpirun);
#  - PyTorch gloo's reduce, broadcast and allreduce (benches/gloo_dist.py; ranks started in
#    their hosts as torchrun would, `cluster.sh place`);
#  - MXNet 1.9.1's dist_sync (benches/mxnet_dist.py: ps-lite, its scheduler on the first host,
#    one server beside each worker, as benches/mxnet_dist.sh does in one box).
#
# usage: TORCHPY=<python with torch> MXPY=<python with mxnet 1.9.1> \
#            benches/cluster_peers.sh BIN [ROUNDS (5)] > lines.txt
#   BIN: a release build of examples/bench_dist_store (--features mpi, the mpirun on PATH's MPI)
#   RATE (default 1gbit), LAYOUTS (default "2x1 2x2"), MPIRUN_ARGS (default
#   "--mca btl_tcp_links 4")
# Prints one line per figure: `<peer> <layout> <round> <op> <bytes> <slowest median s>`, plus
# the link's measured MB/s; benches/cluster_peers_summary.py prints the table. Needs root;
# brings its own cluster up (prefix kp) and down. Every process is bounded by `timeout`.
set -euo pipefail
bin=$1 rounds=${2:-5}
here="$(cd "$(dirname "$0")/.." && pwd)"
cluster="$here/scripts/cluster.sh"
torchpy=${TORCHPY:?a python with torch} mxpy=${MXPY:?a python with mxnet 1.9.1}
export KVC_PREFIX=kp KVC_SUBNET=10.81
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
read -r -a extra <<<"${MPIRUN_ARGS:---mca btl_tcp_links 4}"
sizes_b="4096 1048576 16777216 67108864"
trap '"$cluster" down >/dev/null 2>&1' EXIT

kvstore() {  # layout np round
    KVC_LAYOUTS="$2:$1" timeout 600 "$cluster" mpirun -np "$2" \
        -x OMPI_MCA_mpi_yield_when_idle=1 "${extra[@]}" \
        "$bin" --sizes 4K,1M,16M,64M --no-small --reps 4 2>/dev/null |
        sed -n 's/^json {/{/p' | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l)
    print("kvstore-json", sys.argv[1], sys.argv[2], json.dumps(d))' "$1" "$3"
}

gloo() {  # layout np round
    local port=$((29400 + $3)) addr0 pids=() out
    addr0=$("$cluster" addr "${KVC_PREFIX}0")
    out=$(mktemp)
    while read -r rank host _addr lrank lsize; do
        "$cluster" exec "$host" env RANK="$rank" WORLD_SIZE="$2" LOCAL_RANK="$lrank" \
            LOCAL_WORLD_SIZE="$lsize" MASTER_ADDR="$addr0" MASTER_PORT="$port" \
            GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 timeout 600 "$torchpy" \
            "$here/benches/gloo_dist.py" >>"$out" 2>/dev/null &
        pids+=($!)
    done < <(KVC_LAYOUTS="$2:$1" "$cluster" place "$2")
    for p in "${pids[@]}"; do wait "$p" || true; done
    awk -v l="$1" -v r="$3" '$1 == "gloo" { print "gloo", l, r, $2, $3, $4 }' "$out"
    rm -f "$out"
}

mxnet() {  # layout np round
    local port=$((9400 + $3)) addr0 pids=() workers=() out
    addr0=$("$cluster" addr "${KVC_PREFIX}0")
    out=$(mktemp)
    local common=(DMLC_PS_ROOT_URI="$addr0" DMLC_PS_ROOT_PORT="$port" DMLC_NUM_SERVER="$2"
        DMLC_NUM_WORKER="$2" DMLC_INTERFACE=eth0 OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1)
    "$cluster" exec "${KVC_PREFIX}0" env "${common[@]}" DMLC_ROLE=scheduler \
        timeout 600 "$mxpy" -c "import mxnet" >/dev/null 2>&1 &
    pids+=($!)
    while read -r _rank host _rest; do
        "$cluster" exec "$host" env "${common[@]}" DMLC_ROLE=server \
            timeout 600 "$mxpy" -c "import mxnet" >/dev/null 2>&1 &
        pids+=($!)
        "$cluster" exec "$host" env "${common[@]}" DMLC_ROLE=worker \
            timeout 600 "$mxpy" "$here/benches/mxnet_dist.py" $sizes_b >>"$out" 2>/dev/null &
        workers+=($!)
    done < <(KVC_LAYOUTS="$2:$1" "$cluster" place "$2")
    for w in "${workers[@]}"; do wait "$w" || true; done
    for p in "${pids[@]}"; do wait "$p" || true; done
    awk -v l="$1" -v r="$3" '$1 == "mxnet" { k = $2 " " $3; if (!(k in m) || $4 > m[k]) m[k] = $4 }
        END { for (k in m) print "mxnet", l, r, k, m[k] }' "$out" | sort -k4,4 -k5,5n
    rm -f "$out"
}

for layout in ${LAYOUTS:-2x1 2x2}; do
    hosts=${layout%x*} per=${layout#*x}
    np=$((hosts * per))
    "$cluster" up "$hosts" "${RATE:-1gbit}" >/dev/null
    echo "link $layout $("$cluster" measure 2 | awk '{print $2}' | sort -n | head -1)"
    peers=(kvstore gloo mxnet)
    for round in $(seq "$rounds"); do
        for i in 0 1 2; do
            "${peers[$(((i + round) % 3))]}" "$layout" "$np" "$round"
        done
    done
    "$cluster" down >/dev/null
done
