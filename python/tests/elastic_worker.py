"""A worker of tests/test_elastic.py under ``mpirun --with-ft ulfm``: trains a small model with
BatchNorm through ``DistributedOptimizer`` in one mode (``local``: torch steps;
``overlap``; ``prefetch``), with buffers, while the worker that started as rank VICTIM
SIGKILLs itself at the start of step KILL. Each survivor prints its world changes and a
digest of its parameters and buffers at the end: the survivors must agree.

    python elastic_worker.py MODE SEED VICTIM KILL
"""

import hashlib
import os
import signal
import sys

import torch

import kvstore
from kvstore.torch import DistributedOptimizer

STEPS = 12


def main():
    mode, seed, victim, kill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    kv = kvstore.create("dist_sync")
    first_rank = kv.rank
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )
    kinds = {
        "local": dict(update_on_kvstore=False),
        "overlap": dict(overlap=True),
        "prefetch": dict(prefetch=model),
    }
    seen = []
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        kv,
        named_parameters=model.named_parameters(),
        buffers=model.named_buffers(),
        on_world_change=seen.append,
        **kinds[mode],
    )
    step = 0
    while step < STEPS:
        if first_rank == victim and step == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(seed * 1000 + step * 10 + kv.rank)
        x = torch.randn(8, 4, generator=g)
        try:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        except kvstore.WorldChangedError as e:
            assert seen and seen[-1] is e, (seen, e)
            print(f"rank {kv.rank}: world changed: lost {e.lost}, now {e.world}; "
                  f"committed {e.committed}", flush=True)
            if e.committed:
                step += 1
            continue  # without a checkpoint the store kept its keys (buddy copies) or the
            # wrapper put them back from the new rank 0's parameters
        step += 1
    opt.synchronize()
    h = hashlib.sha256()
    for t in list(model.parameters()) + list(model.buffers()):
        h.update(t.detach().contiguous().numpy().tobytes())
    print(f"rank {kv.rank}: done {mode}, {len(seen)} change(s), digest {h.hexdigest()}",
          flush=True)


if __name__ == "__main__":
    main()
