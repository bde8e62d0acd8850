#!/usr/bin/env bash
# Multi-host (simulated), BENCHMARKS.md: bench_dist_store across the hosts of scripts/cluster.sh,
# two builds interleaved, every layout and link rate asked for, ROUNDS rounds (the order of the
# builds flipped every round). Each json line is tagged with the build, the layout, the rate,
# the round and the measured link MB/s; benches/cluster_summary.py prints the tables.
#
# usage: benches/cluster_bench.sh DIR_A DIR_B [ROUNDS (5)] > runs.jsonl
#   DIR_*: a release target dir holding examples/bench_dist_store
#   RATES="1gbit 10gbit" (default "1gbit"), LAYOUTS="2x2 2x1 4x1" (default), SIZES (default
#   "4K,1M,16M,64M"), MPIRUN_ARGS (default "--mca btl_tcp_links 4": Open MPI's TCP links per
#   pair of ranks; one TCP stream reached 60% of a shaped 1 Gbit/s link here)
# Needs root (network namespaces, tc); brings its own cluster up (prefix kz) and down.
set -euo pipefail
a=$1 b=$2 rounds=${3:-5}
here="$(cd "$(dirname "$0")/.." && pwd)"
cluster="$here/scripts/cluster.sh"
export KVC_PREFIX=kz KVC_SUBNET=10.79
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
read -r -a extra <<<"${MPIRUN_ARGS:---mca btl_tcp_links 4}"
trap '"$cluster" down >/dev/null 2>&1' EXIT
for rate in ${RATES:-1gbit}; do
    for layout in ${LAYOUTS:-2x2 2x1 4x1}; do
        hosts=${layout%x*} per=${layout#*x}
        np=$((hosts * per))
        "$cluster" up "$hosts" "$rate" >/dev/null
        mbs=$("$cluster" measure 2 | awk '{print $2}' | sort -n | head -1)
        for round in $(seq "$rounds"); do
            if ((round % 2)); then order="A B"; else order="B A"; fi
            for build in $order; do
                dir=$a
                [ "$build" = B ] && dir=$b
                KVC_LAYOUTS="$np:$layout" timeout 600 "$cluster" mpirun -np "$np" \
                    -x OMPI_MCA_mpi_yield_when_idle=1 "${extra[@]}" \
                    "$dir/examples/bench_dist_store" --sizes "${SIZES:-4K,1M,16M,64M}" \
                    --no-small --reps 4 2>/dev/null |
                    sed -n 's/^json {/{/p' |
                    sed "s/^{/{\"build\":\"$build\",\"layout\":\"$layout\",\"rate\":\"$rate\",\"round\":$round,\"link_mbs\":$mbs,/"
            done
        done
    done
done
