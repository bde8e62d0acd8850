#!/usr/bin/env bash
# A: 8771f29 (before the rank-order reduce), B: 34daaed (after), C: B with blocking_wins also true for
# broadcasts (dropped); each built with `cargo build --release --features mpi --example bench_dist_store`
# in its own worktree and target dir. usage: ./ab_three_builds.sh ROUNDS > ab_three_builds.jsonl
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
A=/work/ab-old-target/release/examples/bench_dist_store
B=/work/main/target/release/examples/bench_dist_store
C=/work/ab-bcast-target/release/examples/bench_dist_store
load() { cut -d' ' -f1 /proc/loadavg; }
one() { mpirun --oversubscribe -np $2 $1 --sizes 4K,64K,256K,1M,16M 2>/dev/null | sed -n 's/^json {/{/p' | sed "s/^{/{\"build\":\"$3\",\"pair\":$4,\"load\":$(load),/"; }
for pair in $(seq $1); do
  for np in 2 3 4; do
    case $((pair % 3)) in
      1) one $A $np A $pair; one $B $np B $pair; one $C $np C $pair ;;
      2) one $B $np B $pair; one $C $np C $pair; one $A $np A $pair ;;
      0) one $C $np C $pair; one $A $np A $pair; one $B $np B $pair ;;
    esac
  done
done
