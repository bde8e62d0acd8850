#!/bin/bash
# usage: run.sh ROUNDS NPS SIZES [extra]
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
rounds=$1; nps=$2; sizes=$3; shift 3
for r in $(seq $rounds); do
  if ((r % 2)); then order="A B"; else order="B A"; fi
  for b in $order; do
    for np in $nps; do
      timeout 600 mpirun --oversubscribe -np $np /tmp/ab/$b --sizes $sizes "$@" 2>/dev/null | sed -n 's/^json {/{"build":"'$b'","round":'$r',/p'
    done
  done
done
