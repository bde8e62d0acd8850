"""dist_device_sync from Python, on one GPU rank launched as torchrun launches it, on the
stand-in driver (tools/stand-in-driver, a libcuda + libnccl that runs the GPU code on an
interpreter). THIS IS NOT A GPU RUN: it checks the path from Python through the NCCL link.

Runs where the stand-in is on the library path (python/ci.sh sets KVSTORE_STANDIN_LIB to its
folder); skipped, saying so, elsewhere. On a real GPU machine the same script runs under
`torchrun --nproc-per-node 1` (scripts/gpu-check.sh stages it).
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
import sys
import numpy as np
import kvstore

seed = int(sys.argv[1])
rng = np.random.default_rng(seed)
kv = kvstore.create("dist_device_sync")
assert (kv.type, kv.rank, kv.num_workers, kv.local_rank) == ("dist_device_sync", 0, 1, 0)
shapes = {3: (2, 3), 7: (300,)}
init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
kv.init(list(shapes), [init[k] for k in shapes])
grads = {k: [rng.standard_normal(s).astype(np.float32) for _ in range(2)] for k, s in shapes.items()}
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
kv.push(list(shapes), [grads[k] for k in shapes])
for k, s in shapes.items():
    out = np.zeros(s, np.float32)
    kv.pull(k, out=out)
    want = init[k] - 0.1 * (grads[k][0].astype(np.float64) + grads[k][1])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
kv.barrier()
print("ok dist_device_sync", flush=True)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_gpu_rank_launched_as_torchrun_does():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    env = dict(os.environ)
    env.update(
        LD_LIBRARY_PATH=LIB + os.pathsep + env.get("LD_LIBRARY_PATH", ""),
        KVSTORE_STANDIN="1",
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        KVSTORE_TIMEOUT="120",
    )
    # Not an MPI launch: no variable of mpirun's may leak in from the test's own environment.
    for v in list(env):
        if v.startswith(("OMPI_", "PMI_", "PMIX_")):
            del env[v]
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(seed)], env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ok dist_device_sync" in p.stdout, p.stdout + p.stderr
