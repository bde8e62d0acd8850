"""Where a data-parallel torch step's time goes, per mode: forward, backward and step() timed
apart on every rank, for DDP (gloo), the kvstore wrapper blocking, with overlap=True, with
overlap and prefetch=model, and plain torch with no communication (the compute alone).

    scripts/cluster.sh mpirun -np 2 -x MASTER_ADDR=... python benches/torch_phases.py --model cnn

Prints one line per rank and mode: the medians of forward, backward, step() and the whole step,
and for the blocking wrapper the medians of the store calls step() makes (any_of, push, pull).
The models are benches/torch_overlap.py's. A barrier (gloo) precedes every step.
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import kvstore
from kvstore.torch import DistributedOptimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_overlap import sgd, start  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank")
    ap.add_argument("--rounds", type=int, default=8, help="the first is a warm-up")
    ap.add_argument("--steps", type=int, default=5, help="steps per mode per round")
    a = ap.parse_args()

    r, _, base, x, y = start(a.model, a.batch, "29534")

    def wrapper(m, **kw):
        return m, DistributedOptimizer(sgd(m), kvstore.create("dist_sync"), **kw)

    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    plain = copy.deepcopy(base)
    prefetched = copy.deepcopy(base)
    modes = {
        "ddp": (ddp, sgd(ddp)),
        "blocking": wrapper(copy.deepcopy(base)),
        "overlap": wrapper(copy.deepcopy(base), overlap=True),
        "prefetch": wrapper(prefetched, overlap=True, prefetch=prefetched),
        "compute only": (plain, sgd(plain)),
    }
    calls = {}
    store = modes["blocking"][1].store
    for name in ["any_of", "push", "pull"]:
        call = getattr(store, name)

        def timed(*args, _call=call, _name=name, **kw):
            t = time.perf_counter()
            out = _call(*args, **kw)
            calls.setdefault(_name, []).append(time.perf_counter() - t)
            return out

        setattr(store, name, timed)

    times = {k: {"forward": [], "backward": [], "step": [], "whole": []} for k in modes}
    for rnd in range(a.rounds):
        for k, (m, opt) in modes.items():
            for _ in range(a.steps):
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(x), y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                t3 = time.perf_counter()
                if rnd:
                    for part, v in zip(times[k], (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                        times[k][part].append(v)
            if hasattr(opt, "synchronize"):
                opt.synchronize()  # before another store is called
    for k in modes:
        parts = "  ".join(f"{p} {1e3 * statistics.median(v):6.2f}" for p, v in times[k].items())
        print(f"rank {r} {k:13s} {parts} ms", flush=True)
    parts = "  ".join(f"{c} {1e3 * statistics.median(v):6.2f}" for c, v in calls.items())
    print(f"rank {r} blocking's store calls: {parts} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
