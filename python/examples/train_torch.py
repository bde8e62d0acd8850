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
"""

import argparse
import os
import sys

try:
    import torch
except ImportError:
    print("SKIPPED: torch not installed")
    sys.exit(0)

import kvstore
from kvstore.torch import DistributedOptimizer

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
    args = ap.parse_args()

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


if __name__ == "__main__":
    main()
