"""Trains a small MLP with torch, synchronized through a kvstore by DistributedOptimizer.

    python examples/train_torch.py [--optimizer sgd|adam] [--local-step] [--steps N]

The data are a fixed random regression task; the loss printed every 20 steps falls. With
--local-step the store only sums the gradients and torch's optimizer steps (update_on_kvstore
False); by default the store runs the optimizer.
"""

import argparse
import sys

try:
    import torch
except ImportError:
    print("SKIPPED: torch not installed")
    sys.exit(0)

import kvstore
from kvstore.torch import DistributedOptimizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    ap.add_argument("--local-step", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    true_w = torch.randn(8, 1)
    y = torch.tanh(x @ true_w) + 0.05 * torch.randn(256, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    if args.optimizer == "sgd":
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    else:
        base = torch.optim.Adam(model.parameters(), lr=0.01)
    store = kvstore.create("local")
    opt = DistributedOptimizer(
        base,
        store,
        named_parameters=model.named_parameters(),
        update_on_kvstore=not args.local_step,
    )
    print(f"store keys: {store.keys()}")
    for step in range(args.steps + 1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step % 20 == 0:
            print(f"step {step:4d}  loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
