"""One worker of MXNet 1.9.1's own dist_sync (ps-lite), timing a push and a pull of one key per
size: the peer of `bench_dist_store`'s store push and pull. Started by benches/mxnet_dist.sh,
which also starts ps-lite's scheduler and servers (as many servers as workers, MXNet's usual
layout, so big keys are sliced over the servers as ours are over the ranks).

A push is `kv.push(key, grad)` followed by `mx.nd.waitall()` (MXNet's calls return at once); a
pull is `kv.pull(key, out=o)` and `o.wait_to_read()`. Every sample starts after a barrier
(`kv._barrier()`). Each worker prints one line per op and size:
`mxnet <op> <bytes> <median seconds> rank <r>`; the launcher keeps the slowest worker's median.
No updater is set, so the servers assign the sum, as a kvstore store with no updater does.
"""

import sys
import time

import mxnet as mx
import numpy as np

SAMPLES = 20
WARMUP = 3


def main():
    sizes = [int(s) for s in sys.argv[1:]] or [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    kv = mx.kv.create("dist_sync")
    rank = kv.rank
    rng = np.random.default_rng(rank)
    for i, nbytes in enumerate(sizes):
        n = nbytes // 4
        key = 100 + i
        kv.init(key, mx.nd.zeros((n,)))
        grad = mx.nd.array(rng.random(n, dtype=np.float32) - 0.5)
        out = mx.nd.zeros((n,))
        mx.nd.waitall()
        times = {"push": [], "pull": []}
        for s in range(WARMUP + SAMPLES):
            kv._barrier()
            t = time.perf_counter()
            kv.push(key, grad)
            mx.nd.waitall()
            push = time.perf_counter() - t
            kv._barrier()
            t = time.perf_counter()
            kv.pull(key, out=out)
            out.wait_to_read()
            pull = time.perf_counter() - t
            if s >= WARMUP:
                times["push"].append(push)
                times["pull"].append(pull)
        for op, ts in times.items():
            print(f"mxnet {op} {nbytes} {float(np.median(ts)):.9f} rank {rank}", flush=True)


if __name__ == "__main__":
    main()
