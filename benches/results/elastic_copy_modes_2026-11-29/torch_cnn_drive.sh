#!/bin/bash
# The torch CNN at 4 ranks under mpirun --with-ft ulfm, one job per round holding three stores
# per kvstore mode: KVSTORE_REPLICAS=0, =1 with the sums replayed, =1 with the parts sent
# (torch_overlap.py --replicas-ab). The store order alternates between jobs.
# Usage: V=<venv> benches/results/elastic_copy_modes_2026-11-29/torch_cnn_drive.sh JOBS OUTDIR
set -u
V=${V:?a venv with torch, kvstore and kvstore_mpi}; JOBS=$1; OUT=$2
for i in $(seq 0 $((JOBS - 1))); do
    order=$([ $((i % 2)) -eq 0 ] && echo 01s || echo s10)
    { echo "job $i order $order load $(cut -d' ' -f1 /proc/loadavg)"
      OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 \
      KVSTORE_TIMEOUT=120 KVSTORE_BENCH_PORT=$((29800 + i)) timeout -k 5 600 \
      $V/bin/mpirun --with-ft ulfm --oversubscribe -np 4 $V/bin/python benches/torch_overlap.py \
          --model cnn --rounds 6 --steps 5 --modes kvstore_blocking,kvstore_overlap \
          --replicas-ab --ab-order $order --json $OUT/job$i.json; echo "rc $?"; } > $OUT/job$i.txt 2>&1
    tail -1 $OUT/job$i.txt
done
