"""Trains a small MLP with torch, synchronized through a kvstore by DistributedOptimizer.

    python examples/train_torch.py [--optimizer sgd|adam] [--local-step] [--steps N]
    mpirun -np 4 python examples/train_torch.py            # 4 CPU workers: dist_sync
    torchrun --nproc-per-node 2 examples/train_torch.py    # 2 GPU workers: dist_device_sync

The data are a fixed random regression task. Each worker trains on its share of the batch; the
store sums the workers' gradients, so every worker steps as one process would on the whole
batch. Rank 0 prints the loss on the whole batch every 20 steps, and it falls. With
--local-step the store only sums the gradients and torch's optimizer steps
(update_on_kvstore False); by default the store runs the optimizer.

The store kind follows the launch: `dist_sync` under mpirun (CPU tensors), `dist_device_sync`
under torchrun (each worker's tensors on its GPU, cuda:LOCAL_RANK; on CPU tensors where the
machine has no GPU), `local` when started alone. --kind overrides it.

Elastic training (--elastic), with workers that may be lost:

    mpirun --with-ft ulfm -np 4 python examples/train_torch.py --elastic \
        --checkpoint-dir /shared/ckpt [--kill-rank 2 --kill-step 37]

Under Open MPI 5's fault tolerance a lost worker does not end the job: the survivors go on with
fewer workers, and the call in flight raises kvstore.WorldChangedError. The loop here shows what
stays the user's:

- Data: at step t every worker draws the same random sample of the data set (seeded by t), and
  worker r of n trains on its r-th slice of B samples (--batch): re-sharded by kv.rank and
  kv.num_workers at every step, so the survivors take over the lost worker's share of the data.
- Learning rate: the global batch is n * B, so it shrinks with n, and this example follows the
  linear scaling rule: lr = --lr * n / (the number of workers at the start), set in
  DistributedOptimizer's on_world_change callback. (Keep the global batch instead, with a larger
  B per survivor, and the rate can stay.) The wrapper itself sets the store's gradient average,
  rescale_grad = 1 / n, keeping the optimizer's state.
- Checkpoints: every K steps (--checkpoint-every) every worker saves the store into
  DIR/step-<t> (a directory every worker can reach); the step counter is the name, so it
  survives with the checkpoint. Rank 0 keeps the last two.
- Which step comes next, after a WorldChangedError e: if e.restored, the store went back to
  that checkpoint (KVSTORE_REPLICAS=0, or two losses at once), so training resumes at its step;
  else the store lost nothing, and if e.committed the step in flight took effect (go on to the
  next), else it is redone.

--kill-rank R --kill-step S makes the worker that started as rank R SIGKILL itself at the start
of step S, to try it (tests/test_elastic.py does, at a random step). At the end, rank 0 prints
the committed steps and writes --out (the parameters, and each committed step's world size).
"""

import argparse
import os
import re
import shutil
import signal
import sys

try:
    import torch
except ImportError:
    print("SKIPPED: torch not installed")
    sys.exit(0)

import kvstore
from kvstore.torch import DistributedOptimizer

# The elastic data set, its model and its optimizer; tests/test_elastic.py replays them.
ELASTIC_SAMPLES = 512
ELASTIC_MOMENTUM = 0.9
ELASTIC_WD = 1e-4

MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def launched_kind():
    if any(v in os.environ for v in MPI_VARS):
        return "dist_sync"
    if "WORLD_SIZE" in os.environ:
        return "dist_device_sync"
    return "local"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    ap.add_argument("--local-step", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kind", default=None, help="store kind (default: from the launcher)")
    ap.add_argument("--elastic", action="store_true", help="go on when workers are lost")
    ap.add_argument("--checkpoint-dir", default="train_torch_ckpt",
                    help="(--elastic) where to checkpoint: a directory every worker reaches")
    ap.add_argument("--checkpoint-every", type=int, default=10, metavar="K")
    ap.add_argument("--batch", type=int, default=16, help="(--elastic) samples per worker")
    ap.add_argument("--lr", type=float, default=0.05, help="(--elastic) at the start's size")
    ap.add_argument("--seed", type=int, default=0, help="(--elastic) data and initial model")
    ap.add_argument("--kill-rank", type=int, default=None, metavar="R")
    ap.add_argument("--kill-step", type=int, default=None, metavar="S")
    ap.add_argument("--out", default=None, help="(--elastic) rank 0 writes the result here")
    args = ap.parse_args()
    if args.elastic:
        if args.local_step or args.optimizer != "sgd":
            ap.error("--elastic runs SGD in the store (no --local-step, no --optimizer adam): "
                     "its checkpoint is the store's")
        if args.checkpoint_every < 1:
            ap.error("--checkpoint-every must be at least 1")
        if (args.kill_rank is None) != (args.kill_step is None):
            ap.error("--kill-rank and --kill-step go together")
        torch.set_num_threads(1)
        train_elastic(args, kvstore.create(args.kind or launched_kind()))
        return

    torch.set_num_threads(1)
    store = kvstore.create(args.kind or launched_kind())
    rank, workers = store.rank, store.num_workers
    device = torch.device("cpu")
    if store.type == "dist_device_sync" and torch.cuda.is_available():
        device = torch.device("cuda", store.local_rank % torch.cuda.device_count())

    torch.manual_seed(0)  # the same data and initial model on every worker
    x = torch.randn(256, 8)
    true_w = torch.randn(8, 1)
    y = torch.tanh(x @ true_w) + 0.05 * torch.randn(256, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model.to(device)
    x, y = x.to(device), y.to(device)
    share = slice(rank * len(x) // workers, (rank + 1) * len(x) // workers)

    if args.optimizer == "sgd":
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    else:
        base = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = DistributedOptimizer(
        base,
        store,
        named_parameters=model.named_parameters(),
        update_on_kvstore=not args.local_step,
    )
    if rank == 0:
        print(f"store {store.type}: {workers} worker(s), keys {store.keys()}, on {device}")
    for step in range(args.steps + 1):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[share]), y[share]).backward()
        opt.step()
        if step % 20 == 0 and rank == 0:
            with torch.no_grad():
                loss = torch.nn.functional.mse_loss(model(x), y)
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)



def elastic_data(seed):
    """The elastic run's data set and initial model, the same on every worker."""
    torch.manual_seed(seed)
    x = torch.randn(ELASTIC_SAMPLES, 8)
    y = torch.tanh(x @ torch.randn(8, 1)) + 0.05 * torch.randn(ELASTIC_SAMPLES, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return x, y, model


def elastic_sample(seed, step, workers, batch):
    """The indices of step ``step``'s global batch, ``workers * batch`` samples: worker r's
    share is ``[r * batch, (r + 1) * batch)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randperm(ELASTIC_SAMPLES, generator=g)[: workers * batch]


def checkpoint_step(path):
    """The step a checkpoint directory ``.../step-<t>`` was saved at (before step t ran)."""
    m = re.search(r"step-(\d+)$", os.path.normpath(path))
    if m is None:
        raise ValueError(f"{path} is not a checkpoint of this example (.../step-<t>)")
    return int(m.group(1))


def train_elastic(args, store):
    """Trains on, as workers are lost: see the module's doc."""
    first_rank, first_workers = store.rank, store.num_workers
    x, y, model = elastic_data(args.seed)
    os.makedirs(args.checkpoint_dir, exist_ok=True)

    def scale_lr(e):
        # The user's choice: the linear scaling rule for a global batch of n * B.
        for group in opt.param_groups:
            group["lr"] = args.lr * e.world / first_workers
        print(f"rank {e.rank}: world changed: lost {e.lost}, now {e.world} workers; restored "
              f"{e.restored}, committed {e.committed}; lr {opt.param_groups[0]['lr']:.5f}",
              flush=True)

    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=ELASTIC_MOMENTUM,
                        weight_decay=ELASTIC_WD),
        store,
        named_parameters=model.named_parameters(),
        on_world_change=scale_lr,
    )
    if store.rank == 0:
        print(f"elastic: {store.num_workers} workers, checkpoints every {args.checkpoint_every} "
              f"steps in {args.checkpoint_dir}", flush=True)
    committed = []  # (step, workers) of each step in the parameters now
    saved = []
    step = 0
    while step < args.steps:
        if step % args.checkpoint_every == 0 and (not saved or saved[-1] != step):
            path = os.path.join(args.checkpoint_dir, f"step-{step:06d}")
            try:
                store.save(path)
            except kvstore.WorldChangedError as e:
                # Lost while saving: the store holds what it held before, or its last checkpoint.
                step = after_world_change(e, step, committed)
                continue
            saved.append(step)
            if store.rank == 0:
                for old in saved[:-2]:
                    old = os.path.join(args.checkpoint_dir, f"step-{old:06d}")
                    if os.path.isdir(old):
                        shutil.rmtree(old)
                    elif os.path.exists(old):
                        os.remove(old)  # a single-process store's checkpoint is one file
            del saved[:-2]
        if first_rank == args.kill_rank and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        rank, workers = store.rank, store.num_workers
        mine = elastic_sample(args.seed, step, workers, args.batch)[
            rank * args.batch:(rank + 1) * args.batch]
        try:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
        except kvstore.WorldChangedError as e:
            # DistributedOptimizer has set the store's rescale_grad for the new world and
            # pulled the parameters; the loop re-shards (above) and picks the step.
            step = after_world_change(e, step, committed)
            if store.rank == 0:
                print(f"step {step:4d}  loss {whole_loss(model, x, y):.5f} (after the change)",
                      flush=True)
            continue
        committed.append((step, workers))
        if store.rank == 0 and step % 20 == 0:
            print(f"step {step:4d}  loss {whole_loss(model, x, y):.5f}", flush=True)
        step += 1
    print(f"rank {store.rank}: done elastic, {len(committed)} committed steps, "
          f"{store.num_workers} workers (started as rank {first_rank} of {first_workers})",
          flush=True)
    if store.rank == 0:
        print(f"final loss {whole_loss(model, x, y):.5f}; committed steps by world size: "
              f"{summary(committed)}", flush=True)
        if args.out:
            torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                        "committed": committed, "workers": first_workers}, args.out)


def after_world_change(e, step, committed):
    """The step to run next after ``e``, a WorldChangedError met in step ``step``; drops from
    ``committed`` the steps the store lost."""
    if e.restored:
        nxt = checkpoint_step(e.restored)
    elif e.committed:
        # The step took effect on every survivor, with the old world's shard of the data.
        committed.append((step, store_workers_before(e)))
        nxt = step + 1
    else:
        nxt = step
    committed[:] = [(t, n) for t, n in committed if t < nxt]
    return nxt


def store_workers_before(e):
    """The number of workers before the change ``e`` reports."""
    return e.world + len(e.lost)


def whole_loss(model, x, y):
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def summary(committed):
    """``[(first step, last step, workers), ...]``: the committed steps, in runs of one world
    size."""
    runs = []
    for t, n in committed:
        if runs and runs[-1][2] == n and runs[-1][1] == t - 1:
            runs[-1][1] = t
        else:
            runs.append([t, t, n])
    return [tuple(r) for r in runs]


if __name__ == "__main__":
    main()
