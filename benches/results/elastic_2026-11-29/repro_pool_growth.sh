#!/bin/bash
# Under mpirun --with-ft ulfm the dist store's buffer pool is not reused: every push takes fresh
# buffers, so a rank's RSS grows by about one push's worth per step until the pool's cap
# (KVSTORE_DIST_POOL_BYTES, 1 GiB by default). Plain mpirun, or the pool off, stays flat.
# 4 ranks, a 32 MiB store (benches/elastic_recovery.py's "32mb"), SGD with momentum, no kill.
# Run from the repository root; V: a venv with kvstore and kvstore_mpi (Open MPI 5 wheel).
V=${V:-/work/venv-cluster/venv}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
rss() {  # launch flags..., then: env for the ranks
  timeout -k 5 300 $V/bin/mpirun "$@" --oversubscribe -np 4 $V/bin/python \
    benches/elastic_recovery.py worker --model 32mb --victim -1 --steps $STEPS \
    | grep -o '"rss_mb": [0-9.]*' | head -1
}
for STEPS in 6 30 90; do
  echo "steps $STEPS: plain $(KVSTORE_REPLICAS=0 rss) | ulfm $(KVSTORE_REPLICAS=0 rss --with-ft ulfm)" \
       "| ulfm, KVSTORE_DIST_POOL_BYTES=0: $(KVSTORE_DIST_POOL_BYTES=0 KVSTORE_REPLICAS=0 rss --with-ft ulfm)"
done
