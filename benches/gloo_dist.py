"""PyTorch's gloo backend on CPU tensors: reduce and broadcast, the peer of a dist_sync push and
pull of one key, and allreduce (DDP's collective), the peer of the two together (examples/bench_dist_store.rs measures kvstore and raw MPI the same way).

    python -m torch.distributed.run --nproc-per-node 4 benches/gloo_dist.py [MiB ...]

For each size (4 KiB, then 1, 16 and 64 MiB of float32 unless sizes in MiB are given), a
barrier before each timed call, and each sample is the slowest rank's time. Rank 0 prints one
line per op and size: `gloo <op> <bytes> <median seconds> <GB/s>`, GB/s being bytes / median.
Interleave runs of this script with runs of bench_dist_store and compare medians.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

SAMPLES = int(os.environ.get("SAMPLES", "15"))
WARMUP = 2


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def slowest(local):
    t = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed(call):
    dist.barrier()
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mib = [float(a) for a in sys.argv[1:]]
    sizes = [4 << 10] + ([int(m * (1 << 20)) for m in mib] if mib else [1 << 20, 16 << 20, 64 << 20])
    torch.manual_seed(rank)
    for nbytes in sizes:
        n = nbytes // 4
        grad = torch.rand(n, dtype=torch.float32) - 0.5
        value = torch.rand(n, dtype=torch.float32)
        ops = {
            # A push of one key homed on rank 0: every rank's sum arrives there.
            "reduce": lambda: dist.reduce(grad, dst=0),
            # A pull of it: rank 0's value to every rank.
            "broadcast": lambda: dist.broadcast(value, src=0),
            # DDP's collective: the sum on every rank, the peer of a push then a pull.
            "allreduce": lambda: dist.all_reduce(grad),
        }
        times = {op: [] for op in ops}
        for i in range(WARMUP + SAMPLES):
            for op, call in ops.items():  # interleaved, sample by sample
                t = timed(call)
                if i >= WARMUP:
                    times[op].append(t)
        for op in ops:
            med = median(slowest(times[op]))
            if rank == 0:
                print(f"gloo {op} {nbytes} {med:.6e} {nbytes / med / 1e9:.3f}", flush=True)
    if rank == 0:
        print(f"# {size} ranks, torch {torch.__version__}, {SAMPLES} samples, medians", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
