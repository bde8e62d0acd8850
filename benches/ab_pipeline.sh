#!/usr/bin/env bash
# Interleaved A/B of two builds of the benchmarks (BENCHMARKS.md, "One pipeline: before / after"):
# the dist store (examples/bench_dist_store, mpirun -np 2 and 4) and the local store
# (examples/bench_kv, 4 devices), the order of the builds flipped every pair. Prints json lines
# tagged with the build, the pair and the load.
#
# usage: benches/ab_pipeline.sh DIR_A DIR_B [PAIRS (4)] [DIR_C] > ab.jsonl
# (DIST_REPS=N: the dist store's repetitions per cell, in place of its default 200)
# (with DIR_C, a third build joins every round; the order rotates every round)
# DIR_*: a release target dir holding examples/bench_dist_store and examples/bench_kv, built with
#   cargo build --release --features mpi --example bench_dist_store --example bench_kv
set -euo pipefail
a=$1 b=$2 pairs=${3:-4} c=${4:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
load() { cut -d' ' -f1 /proc/loadavg; }
tag() { sed -n -e 's/^json {/{/' -e '/^{/p' | sed "s/^{/{\"build\":\"$1\",\"pair\":$2,\"load\":$(load),/"; }
run() {
    local dir=$1 name=$2 pair=$3
    for np in 2 4; do
        mpirun --oversubscribe -np "$np" "$dir/examples/bench_dist_store" --sizes 4K,64K,1M,16M \
            ${DIST_REPS:+--reps "$DIST_REPS"} 2>/dev/null | tag "$name" "$pair"
    done
    for cmd in "push 4K 4" "pull 4K 4" "push 1M 4" "pull 1M 4" "push 64M 4" "pull 64M 4" \
        "push_list 1K 4" "pull_list 1K 4"; do
        # shellcheck disable=SC2086
        "$dir/examples/bench_kv" $cmd 2>/dev/null | sed "s/^{/{\"cmd\":\"$cmd\",/" | tag "$name" "$pair"
    done
}
for pair in $(seq "$pairs"); do
    if [ -z "$c" ]; then
        if ((pair % 2)); then
            run "$a" A "$pair"; run "$b" B "$pair"
        else
            run "$b" B "$pair"; run "$a" A "$pair"
        fi
        continue
    fi
    case $((pair % 3)) in
        1) run "$a" A "$pair"; run "$b" B "$pair"; run "$c" C "$pair" ;;
        2) run "$b" B "$pair"; run "$c" C "$pair"; run "$a" A "$pair" ;;
        0) run "$c" C "$pair"; run "$a" A "$pair"; run "$b" B "$pair" ;;
    esac
done
