"""Step time of data-parallel torch training on CPU ranks: DistributedDataParallel (gloo)
against kvstore.torch.DistributedOptimizer, blocking and with overlap=True (issue 18).

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 \\
      mpirun --oversubscribe -np 2 python benches/torch_overlap.py --model mlp --json out.json

Each rank trains three copies of one model on its own batch: DDP (gloo allreduce, its own
bucketing and overlap), the kvstore wrapper stepping blocking (push everything, pull
everything, in step()) and the wrapper with overlap (buckets pushed from backward's hooks). The
modes take turns, a few steps each, for --rounds rounds, so that the machine's noise falls on
all of them alike. A step is zero_grad + forward + backward + step, timed on every rank; the
figure per step is the slowest rank's, and the table gives each mode's median and its ratio to
DDP's. All three use SGD with momentum, so they train the same model the same way.

Elastic runs (issue 39): under ``mpirun --with-ft ulfm`` the store commits each push at a
fault-tolerant agreement and, with ``KVSTORE_REPLICAS=1``, keeps a copy of every rank's parts on
a buddy rank. ``--replicas-ab`` makes every kvstore mode twice in the same job, one store
created with ``KVSTORE_REPLICAS=0`` (suffix ``_r0``) and one with ``1`` (``_r1``), so the copies'
cost is timed interleaved with the same launch; ``--modes`` keeps only the named modes (DDP is
always kept: the ratios are to it). Benches/results/elastic_2026-11-29 has the commands.

It then records one overlapped step's timeline on rank 0: when backward started and ended, and
when each bucket's push was queued, started and finished on the store's worker. A push that
starts before backward ends is communication overlapping compute.
"""

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import kvstore
from kvstore.torch import DistributedOptimizer


def model_of(name):
    if name == "mlp":
        return torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(784, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        ), (1, 28, 28)
    if name == "cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(64 * 8 * 8, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 10),
        ), (3, 32, 32)
    if name == "many":
        return Many(1000, 256), (256,)
    raise SystemExit(f"unknown model {name}: mlp, cnn or many")


class Many(torch.nn.Module):
    """Many small parameters (``count`` vectors of ``width`` float32, 1 KiB each at 256): the
    store's "lists" case as a torch model. Each layer scales its input elementwise, then
    ``tanh`` (a product of 1000 scales alone diverges within 10 steps)."""

    def __init__(self, count, width):
        super().__init__()
        self.scales = torch.nn.ParameterList(
            torch.nn.Parameter(1 + 0.01 * torch.randn(width)) for _ in range(count)
        )
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x):
        for s in self.scales:
            x = torch.tanh(x * s)
        return self.head(x)


def start(model, batch, port):
    """One thread, gloo's group (across hosts it meets at MASTER_ADDR, the first host), the
    model and this rank's batch: (rank, size, model, inputs, labels)."""
    torch.set_num_threads(1)
    r = int(os.environ["OMPI_COMM_WORLD_RANK"])
    n = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:"
        f"{os.environ.get('KVSTORE_BENCH_PORT', port)}",
        rank=r,
        world_size=n,
    )
    torch.manual_seed(0)
    base, shape = model_of(model)
    g = torch.Generator().manual_seed(1 + r)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return r, n, base, x, y


class RawAllreduce:
    """A torch optimizer's step after one gloo allreduce of a flat buffer as big as all the
    gradients (not the gradients themselves: the collective alone, with no packing)."""

    def __init__(self, opt):
        self.opt = opt
        n = sum(p.numel() for g in opt.param_groups for p in g["params"])
        self.flat = torch.zeros(n)

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self):
        dist.all_reduce(self.flat)
        self.opt.step()


def sgd(m):
    """The optimizer every mode trains with."""
    return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5, help="steps per mode per round")
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--modes", default="kvstore_blocking,kvstore_overlap,kvstore_prefetch",
                    help="the kvstore modes to run, comma-separated (DDP always runs)")
    ap.add_argument("--replicas-ab", action="store_true",
                    help="each kvstore mode once per store of --ab-order (under ULFM)")
    ap.add_argument("--ab-order", default="01",
                    help="with --replicas-ab: the stores of each mode, in the order they run "
                         "in a round: 0 (KVSTORE_REPLICAS=0), 1 (=1, the sums replayed), "
                         "s (=1, KVSTORE_REPLICA_UPDATE=send)")
    a = ap.parse_args()
    wanted = a.modes.split(",")

    r, n, base, x, y = start(a.model, a.batch, "29533")
    params = sum(p.numel() for p in base.parameters())

    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    modes = {"ddp_gloo": (ddp, sgd(ddp))}

    def store(replicas):
        if replicas is None:
            return kvstore.create("dist_sync")
        wanted = {"0": {"KVSTORE_REPLICAS": "0"},
                  "1": {"KVSTORE_REPLICAS": "1", "KVSTORE_REPLICA_UPDATE": "replay"},
                  "s": {"KVSTORE_REPLICAS": "1", "KVSTORE_REPLICA_UPDATE": "send"}}[replicas]
        before = {k: os.environ.get(k) for k in wanted}
        os.environ.update(wanted)
        try:
            return kvstore.create("dist_sync")
        finally:
            for k, v in before.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v

    def kv_mode(name, replicas):
        m = copy.deepcopy(base)
        if name == "kvstore_blocking":
            return m, DistributedOptimizer(sgd(m), store(replicas))
        if name == "kvstore_overlap":
            return m, DistributedOptimizer(sgd(m), store(replicas), overlap=True,
                                           bucket_mb=a.bucket_mb)
        if name == "kvstore_local":  # torch steps: the gradients averaged, one key each
            return m, DistributedOptimizer(sgd(m), store(replicas), update_on_kvstore=False)
        if name == "kvstore_local_views":  # and each bucket one key, its gradients views
            return m, DistributedOptimizer(sgd(m), store(replicas), update_on_kvstore=False,
                                           gradient_as_bucket_view=True, bucket_mb=a.bucket_mb)
        if name == "kvstore_local_overlap":
            return m, DistributedOptimizer(sgd(m), store(replicas), update_on_kvstore=False,
                                           overlap=True, bucket_mb=a.bucket_mb)
        if name == "kvstore_local_overlap_views":
            return m, DistributedOptimizer(sgd(m), store(replicas), update_on_kvstore=False,
                                           overlap=True, gradient_as_bucket_view=True,
                                           bucket_mb=a.bucket_mb)
        if name == "compute":  # no communication: the step's compute alone, for reference
            return m, sgd(m)
        if name == "raw_allreduce":  # the compute and one gloo allreduce of the gradients'
            return m, RawAllreduce(sgd(m))  # bytes, packed already: the floor of a packed sum
        if name == "kvstore_prefetch":
            return m, DistributedOptimizer(sgd(m), store(replicas), overlap=True,
                                           bucket_mb=a.bucket_mb, prefetch=m)
        raise SystemExit(f"unknown mode {name}")

    for name in wanted:
        if a.replicas_ab:
            for rep in a.ab_order:
                modes[f"{name}_r{rep}"] = kv_mode(name, rep)
        else:
            modes[name] = kv_mode(name, None)

    def step(m, opt):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()

    for m, opt in modes.values():  # warm-up
        for _ in range(2):
            step(m, opt)
        if hasattr(opt, "synchronize"):
            opt.synchronize()
    times = {k: [] for k in modes}
    for _ in range(a.rounds):
        for name, (m, opt) in modes.items():
            for _ in range(a.steps):
                dist.barrier()
                t = time.perf_counter()
                step(m, opt)
                times[name].append(time.perf_counter() - t)
            # The prefetched pulls of this mode's last step, before another store is called.
            if hasattr(opt, "synchronize"):
                opt.synchronize()
    # The slowest rank's time of each step.
    mine = torch.tensor([times[k] for k in modes], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    slowest = {k: mine[i].tolist() for i, k in enumerate(modes)}

    # One overlapped step's timeline, on every rank (rank 0's is printed).
    overlapped = [k for k in modes if k.startswith("kvstore_overlap")]
    if not overlapped:
        dist.destroy_process_group()
        if r == 0:
            report(a, params, n, slowest, None, None)
        return
    m, opt = modes[overlapped[0]]
    opt.store.set_timeline(True)
    opt.store.take_timeline()
    marks = {}
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(m(x), y)
    marks["backward_start"] = opt.store.clock()
    loss.backward()
    marks["backward_end"] = opt.store.clock()
    opt.step()
    marks["step_end"] = opt.store.clock()
    calls = opt.store.take_timeline()
    opt.store.set_timeline(False)
    dist.destroy_process_group()

    if r != 0:
        return
    report(a, params, n, slowest, marks, calls)


def report(a, params, n, slowest, marks, calls):
    """Rank 0's table (and the timeline, where one was recorded)."""
    ddp_median = statistics.median(slowest["ddp_gloo"])
    result = {
        "model": a.model,
        "params": params,
        "ranks": n,
        "batch_per_rank": a.batch,
        "bucket_mb": a.bucket_mb,
        "steps_per_mode": len(slowest["ddp_gloo"]),
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in slowest.items()},
        "timeline": {"marks": marks, "calls": calls},
        "steps_ms": {k: [1e3 * t for t in v] for k, v in slowest.items()},
        "launch": "ulfm" if os.environ.get("OMPI_MCA_mpi_ft_enable") else "plain",
    }
    print(f"{a.model}: {params} parameters, {n} ranks, batch {a.batch} per rank, "
          f"{result['steps_per_mode']} steps per mode (slowest rank per step)")
    for k, v in slowest.items():
        med = statistics.median(v)
        print(f"  {k:18s} median {1e3 * med:8.3f} ms   DDP / this = {ddp_median / med:5.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if marks is None:
        return
    t0 = marks["backward_start"]
    print(f"  timeline of one overlapped step on rank 0 (ms from backward's start): backward "
          f"ends at {1e3 * (marks['backward_end'] - t0):.3f}, step ends at "
          f"{1e3 * (marks['step_end'] - t0):.3f}")
    overlapping = 0
    for call, queued, started, finished, ok in calls:
        during = started < marks["backward_end"]
        overlapping += during and " push " in call
        print(f"    {call:34s} queued {1e3 * (queued - t0):8.3f}  ran {1e3 * (started - t0):8.3f} "
              f"-> {1e3 * (finished - t0):8.3f}{'  (during backward)' if during else ''}")
    print(f"  pushes that started while backward ran: {overlapping}")


if __name__ == "__main__":
    main()
