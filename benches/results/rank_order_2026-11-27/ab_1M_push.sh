#!/usr/bin/env bash
# A: 8771f29 (before the rank-order reduce), B: 34daaed (after), built as in ab_three_builds.sh.
# usage: ./ab_1M_push.sh ROUNDS > ab_1M_push.jsonl
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
A=/work/ab-old-target/release/examples/bench_dist_store
B=/work/main/target/release/examples/bench_dist_store
load() { cut -d' ' -f1 /proc/loadavg; }
one() { mpirun --oversubscribe -np $2 $1 --sizes 1M --no-small 2>/dev/null | sed -n 's/^json {/{/p' | sed "s/^{/{\"build\":\"$3\",\"pair\":$4,\"load\":$(load),/"; }
for pair in $(seq $1); do
  for np in 3 4; do
    if ((pair % 2)); then one $A $np A $pair; one $B $np B $pair; else one $B $np B $pair; one $A $np A $pair; fi
  done
done
