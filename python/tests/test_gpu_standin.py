"""dist_device_sync from Python, on GPU ranks launched as torchrun launches them, on the
stand-in driver (tools/stand-in-driver, a libcuda + libnccl that runs the GPU code on an
interpreter). THIS IS NOT A GPU RUN: it checks the path from Python through the NCCL link.

Runs where the stand-in is on the library path (python/ci.sh sets KVSTORE_STANDIN_LIB to its
folder); skipped, saying so, elsewhere. Two workers are two processes whose NCCL
communicator the stand-in joins across processes. On a real GPU, `python/examples/train_torch.py`
under `torchrun` runs the same path (benches/results/history/gpu.md, "Run 4": one worker on an
H200).
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

LIB = os.environ.get("KVSTORE_STANDIN_LIB")

pytestmark = pytest.mark.skipif(
    not LIB, reason="SKIPPED: KVSTORE_STANDIN_LIB is not set (the stand-in driver's folder)"
)

SCRIPT = r"""
import os
import sys
import numpy as np
import kvstore

seed, n = int(sys.argv[1]), int(sys.argv[2])
r = int(os.environ["RANK"])
kv = kvstore.create("dist_device_sync")
assert (kv.type, kv.rank, kv.num_workers, kv.local_rank) == ("dist_device_sync", r, n, r)
shapes = {3: (2, 3), 7: (300,)}
rng0 = np.random.default_rng([seed, 99])
init = {k: rng0.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
# Every worker passes its own init value; rank 0's is kept.
kv.init(list(shapes), [init[k] + r for k in shapes])

def grads(q):
    rng = np.random.default_rng([seed, q])
    return {k: [rng.standard_normal(s).astype(np.float32) for _ in range(2)] for k, s in shapes.items()}

kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
mine = grads(r)
kv.push(list(shapes), [mine[k] for k in shapes])
for k, s in shapes.items():
    total = sum(g.astype(np.float64) for q in range(n) for g in grads(q)[k])
    out = np.zeros(s, np.float32)
    kv.pull(k, out=out)
    np.testing.assert_allclose(out, init[k] - 0.1 * total, rtol=1e-5, atol=1e-5)
kv.barrier()
print(f"ok dist_device_sync rank {r} of {n}", flush=True)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("n", [1, 2])
def test_gpu_ranks_launched_as_torchrun_does(n):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    port = free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ)
        env.update(
            LD_LIBRARY_PATH=LIB + os.pathsep + env.get("LD_LIBRARY_PATH", ""),
            KVSTORE_STANDIN="1",
            KVSTORE_STANDIN_GPUS=str(n),
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            KVSTORE_TIMEOUT="120",
        )
        # Not an MPI launch: no variable of mpirun's may leak in from the test's environment.
        for v in list(env):
            if v.startswith(("OMPI_", "PMI_", "PMIX_")):
                del env[v]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", SCRIPT, str(seed), str(n)], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a GPU worker hung past 300 s")
        outs.append((p.returncode, out))
    for r, (rc, out) in enumerate(outs):
        assert rc == 0, out
        assert f"ok dist_device_sync rank {r} of {n}" in out, out
