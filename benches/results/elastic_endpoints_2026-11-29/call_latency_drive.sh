#!/bin/bash
# Per-call latency of small calls at 4 ranks: plain mpirun against mpirun --with-ft ulfm
# (KVSTORE_REPLICAS=0), jobs interleaved round by round; rank 0's RESULT line per job.
# Usage (repo root): V=/work/venv-cluster/venv benches/results/elastic_endpoints_2026-11-29/call_latency_drive.sh ROUNDS > OUT.jsonl
R=$(dirname "$0"); V=${V:-/work/venv-cluster/venv}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export KVSTORE_TIMEOUT=120 BLOCKS=${BLOCKS:-10} CALLS=${CALLS:-200}
for r in $(seq 0 $(( ${1:-8} - 1 ))); do
  for launch in plain ulfm; do
    ft=(); [ $launch = ulfm ] && ft=(--with-ft ulfm)
    line=$(KVSTORE_REPLICAS=0 timeout -k 5 120 "$V/bin/mpirun" "${ft[@]}" --oversubscribe -np 4 \
        -x KVSTORE_REPLICAS "$V/bin/python" "$R/call_latency.py" 2>&1 | grep '^RESULT {"rank": 0' | sed 's/^RESULT //')
    rc=${PIPESTATUS[0]}
    echo "{\"round\": $r, \"launch\": \"$launch\", \"load1\": $(cut -d' ' -f1 /proc/loadavg), \"result\": ${line:-null}}"
  done
done
