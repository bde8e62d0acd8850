#!/usr/bin/env bash
# dist_sync on CPU ranks (BENCHMARKS.md, "dist_sync on CPU ranks (MPI)"):
#  - the store's push and pull of one key next to raw MPI on buffers of the same size, in the
#    same run, interleaved (examples/bench_dist_store.rs), at 2 and 4 ranks;
#  - PyTorch gloo's reduce and broadcast (benches/gloo_dist.py), a run of its own right after
#    each store run of the same rank count (skipped, and said so, when torch does not import);
#  - 1000 keys x 1 KiB in one push_list / pull_list at 4 ranks;
#  - the fingerprint check's cost: the same small calls in runs with KVSTORE_DIST_CHECK=1 and
#    =0, alternating.
# Every run's lines go to OUT/runs.jsonl (with the round and the load average); the tables are
# printed by benches/dist_summary.py.
#
# usage: benches/dist_bench.sh [ROUNDS (2)] [OUT (target/dist_bench)]
# PYTHON names the python that has torch (default python3).
set -euo pipefail
rounds=${1:-2}
out=${2:-target/dist_bench}
py=${PYTHON:-python3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
cd "$(dirname "$0")/.."
cargo build --release --features mpi --example bench_dist_store
bin=target/release/examples/bench_dist_store
mkdir -p "$out"
: >"$out/runs.jsonl"
: >"$out/log.txt"

gloo=1
if ! "$py" -c "import torch, torch.distributed" 2>/dev/null; then
    echo "SKIPPED: gloo (torch does not import in $py; set PYTHON)" | tee -a "$out/log.txt"
    gloo=0
fi

load() { cut -d' ' -f1 /proc/loadavg; }

# Runs "$@" and appends its json lines, tagged, to runs.jsonl; the rest goes to the log.
record() {
    local tag=$1 round=$2
    shift 2
    local l0
    l0=$(load)
    echo "## round $round, $tag, load $l0: $*" >>"$out/log.txt"
    "$@" 2>&1 | tee -a "$out/log.txt" | sed -n 's/^json {/{/p' |
        sed "s/^{/{\"round\":$round,\"tag\":\"$tag\",\"load\":$l0,/" >>"$out/runs.jsonl"
}

# gloo prints `gloo <op> <bytes> <seconds> <GB/s>`: turned into json lines here.
gloo_run() {
    local np=$1 round=$2 l0
    l0=$(load)
    echo "## round $round, gloo, load $l0: $np ranks" >>"$out/log.txt"
    "$py" -m torch.distributed.run --nproc-per-node "$np" benches/gloo_dist.py 0.0625 1 16 64 256 \
        2>&1 | tee -a "$out/log.txt" |
        awk -v np="$np" -v r="$round" -v l="$l0" '$1 == "gloo" && ($2 == "reduce" || $2 == "broadcast") {
            op = ($2 == "reduce") ? "push" : "pull";
            printf "{\"round\":%s,\"tag\":\"gloo\",\"load\":%s,\"ranks\":%s,\"bytes\":%s,\"op\":\"%s\",\"gloo_s\":%s}\n", r, l, np, $3, op, $4
        }' >>"$out/runs.jsonl"
}

for round in $(seq "$rounds"); do
    for np in 2 4; do
        record store "$round" mpirun --oversubscribe -np "$np" "$bin" --no-small
        if [ "$gloo" = 1 ]; then gloo_run "$np" "$round"; fi
    done
    # The fingerprint check on and off, alternating (its order flips every round).
    if [ $((round % 2)) = 1 ]; then checks="1 0"; else checks="0 1"; fi
    for c in $checks; do
        record "check$c" "$round" env KVSTORE_DIST_CHECK="$c" \
            mpirun --oversubscribe -np 4 "$bin" --sizes 4K --reps 500
    done
done
python3 benches/dist_summary.py "$out/runs.jsonl" | tee "$out/tables.md"
