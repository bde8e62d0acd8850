"""The MXNet KVStore tutorial (seed 001) and the d2l 'KV Store' notebook (seed 003), line by
line, with `import kvstore as kv` in place of `mx.kv` and NumPy arrays (or torch tensors, with
--torch) in place of `mx.nd`. It prints the tutorial's numbers:
2, 8, 4, 4, 6, 6, 3, 11 for seed 001, then -2, -7, 3, -3, -0.3, 3, 3.05 for seed 003.

    python examples/tutorial.py            # NumPy
    python examples/tutorial.py --torch    # torch tensors (prints SKIPPED without torch)
    mpirun -np 2 python examples/tutorial.py --dist   # on a dist_sync store, 2 or 4 workers
    python examples/tutorial.py --flat     # each array on one line, as --dist prints them

With --dist, every worker makes the tutorial's calls on one `dist_sync` store and pushes a share
of each push: the per-device values of a push are dealt out over the workers, and a single value
is divided among them. The sums, so every number printed, are the tutorial's, on every worker
(each line is prefixed with the worker's rank). The updater runs once per push, on the worker
that holds the key, so only that worker prints "update on key".
"""

import sys

import numpy as np

import kvstore

if "--torch" in sys.argv:
    try:
        import torch
    except ImportError:
        print("SKIPPED: torch not installed")
        sys.exit(0)

    class nd:  # mx.nd's constructors, on torch tensors
        @staticmethod
        def ones(shape, ctx=None):
            return torch.ones(shape)

        @staticmethod
        def zeros(shape, ctx=None):
            return torch.zeros(shape)

    def show(a):
        print(a.numpy())

else:

    class nd:  # mx.nd's constructors, on NumPy arrays
        @staticmethod
        def ones(shape, ctx=None):
            return np.ones(shape)

        @staticmethod
        def zeros(shape, ctx=None):
            return np.zeros(shape)

    def show(a):
        print(a)


DIST = "--dist" in sys.argv


class Shared:
    """A dist_sync store to which each worker pushes its share of every push."""

    def __init__(self):
        self.kv = kvstore.create("dist_sync")

    def __getattr__(self, name):
        return getattr(self.kv, name)

    def _share(self, value):
        if isinstance(value, (list, tuple)):  # one value per device: deal them out
            mine = list(value)[self.kv.rank :: self.kv.num_workers]
            # More workers than devices: a worker with none adds zeros, which change no sum.
            return mine or [value[0] * 0]
        return value / self.kv.num_workers

    def push(self, key, value):
        if isinstance(key, (list, tuple)):
            self.kv.push(key, [self._share(v) for v in value])
        else:
            self.kv.push(key, self._share(value))


def create(kind):
    return Shared() if DIST else kvstore.create(kind)


if DIST or "--flat" in sys.argv:
    # One line per array, its elements flattened, prefixed with the worker's rank under --dist:
    # the workers' lines interleave, and each must say whose it is.

    def show(a):
        flat = np.asarray(a.numpy() if hasattr(a, "numpy") else a, dtype=np.float64).ravel()
        who = f"rank {kv.rank} " if DIST else ""
        # One write per line: the workers share mpirun's stdout.
        sys.stdout.write(f"{who}= " + " ".join(f"{x:g}" for x in flat) + "\n")
        sys.stdout.flush()


print("## seed 001: the MXNet KVStore tutorial")

# Initialization
kv = create("local")  # create a local kv store.
shape = (2, 3)
kv.init(3, nd.ones(shape) * 2)
a = nd.zeros(shape)
kv.pull(3, out=a)
show(a)  # 2

# Push, Aggregate, and Update
kv.push(3, nd.ones(shape) * 8)
kv.pull(3, out=a)  # pull out the value
show(a)  # 8

contexts = [kvstore.cpu(i) for i in range(4)]
b = [nd.ones(shape, ctx) for ctx in contexts]
kv.push(3, b)
kv.pull(3, out=a)
show(a)  # 4


def update(key, input, stored):
    print("update on key: %d" % key)
    stored += input * 2


kv._set_updater(update)
kv.pull(3, out=a)
show(a)  # 4

kv.push(3, nd.ones(shape))
kv.pull(3, out=a)
show(a)  # 6

# Pull
b = [nd.ones(shape, ctx) for ctx in contexts]
kv.pull(3, out=b)
show(b[1])  # 6

# Handle a list of key-value pairs: a single device
keys = [5, 7, 9]
kv.init(keys, [nd.ones(shape)] * len(keys))
kv.push(keys, [nd.ones(shape)] * len(keys))
b = [nd.zeros(shape)] * len(keys)
kv.pull(keys, out=b)
show(b[1])  # 3

# Multiple devices
b = [[nd.ones(shape, ctx) for ctx in contexts]] * len(keys)
kv.push(keys, b)
kv.pull(keys, out=b)
show(b[1][1])  # 11

print("## seed 003: the d2l 'KV Store' notebook")
kv = create("device")
cpu = kvstore.cpu

shape = (2, 3)
kv.init(3, nd.ones(shape) * (-2))
A = nd.zeros(shape)
kv.pull(3, out=A)
show(A)  # -2

kv.push(3, nd.ones(shape) * (-7))
kv.pull(3, out=A)
show(A)  # -7

contexts = [cpu(i) for i in range(3)]
B = [nd.ones(shape, ctx=ctx) for ctx in contexts]
kv.push(3, B)
kv.pull(3, out=A)
show(A)  # 3

keys = [7, 11, 13, 17]
values = [nd.ones(shape) * (-3)] * len(keys)
kv.init(keys, values)
C = [nd.zeros(shape)] * len(keys)
kv.pull(keys, out=C)
show(C[0])  # -3

D = [[nd.ones(shape, ctx=ctx) * (-0.1) for ctx in contexts]] * len(keys)
print("D[0] : ", D[0])
kv.push(keys, D)
kv.pull(keys, out=C)
show(C[0])  # -0.3


def update(key, input, stored):  # noqa: F811 (the notebook redefines it)
    print("update on key: %d" % key)
    stored += input * 0.01


kv._set_updater(update)
kv.pull(3, out=A)
show(A)  # 3: no push yet

kv.push(3, nd.ones(shape) * 5)
kv.pull(3, out=A)
show(A)  # 3.05
