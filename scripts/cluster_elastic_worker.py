"""One worker of scripts/cluster-elastic.sh (issue 39 on the simulated cluster), started by
``mpirun --with-ft ulfm`` on every rank:

    python cluster_elastic_worker.py SEED LOGDIR HOLD_RANKS HOLD_SECS PACE

Data-parallel training of three keys (one of them sliced over the ranks) with SGD and momentum
in the store. Every step has one global batch of ROWS gradient rows per key, fresh for each
(SEED, step, key, row); rank r of n pushes the sum of its n-th share of the rows. So the sum the
store applies does not depend on the world size, and one NumPy process replaying the same rows
(float64) is the reference at any world size, before and after a rank is lost.

- A checkpoint is saved before step CKPT.
- At step HOLD every rank writes "AT HOLD"; the ranks in HOLD_RANKS (comma-separated, original
  numbers) then sleep HOLD_SECS before their push of that step, so the other ranks wait inside
  that push. The script kills the holding ranks (SIGKILL) or cuts their host's link then.
- A survivor that gets WorldChangedError checks its attributes, and that every key equals the
  NumPy replay of the steps the store kept: 0 to CKPT-1 where it reloaded the checkpoint
  (``restored``; KVSTORE_REPLICAS=0, or a build without copies), else every step that took
  effect before the loss (the lost ranks' parts rebuilt from their copies). It then trains on
  from there to step STEPS-1 as a rank of the new world (its rows re-sharded for the new size), sleeping PACE seconds
  after each (so that the survivors still run when mpirun learns that a cut host is gone), checks the final values
  against the NumPy replay of every step, saves, and writes "DONE".
- A side without a majority gets DistFailedError "no majority": it writes "STOPPED", checks
  that the next call fails the same way, and exits 3. It never computes on.

Every line goes to LOGDIR/rank-R.log (R the original rank), with the wall time: a cut host's
stdout never reaches mpirun, but the hosts share the file system. Any other outcome raises, so
the worker exits non-zero.
"""

import os
import sys
import time

import numpy as np

import kvstore

SEED = int(sys.argv[1])
LOGDIR = sys.argv[2]
HOLD_RANKS = {int(r) for r in sys.argv[3].split(",") if r}
HOLD_SECS = float(sys.argv[4])
PACE = float(sys.argv[5])  # seconds each step after the world changed sleeps first

SHAPES = {0: (64,), 1: (3000,), 2: (5, 7)}  # key 1 is sliced (KVSTORE_BIGARRAY_BOUND=1000)
ROWS = 12  # rows of the global batch per step and key: an even share at 1, 2, 3, 4 and 6 ranks
CKPT, HOLD, STEPS = 3, 5, 9
LR, MOMENTUM = 0.1, 0.5
RANK0 = int(os.environ["OMPI_COMM_WORLD_RANK"])
LOG = open(os.path.join(LOGDIR, f"rank-{RANK0}.log"), "a", buffering=1)


def say(msg):
    line = f"rank {RANK0} host {os.uname().nodename} t={time.time():.3f}: {msg}\n"
    LOG.write(line)
    sys.stdout.write(line)
    sys.stdout.flush()


def row(step, key, i):
    return np.random.default_rng([SEED, step, key, i]).standard_normal(SHAPES[key])


def my_grads(step, rank, n):
    """The sum of rank `rank`'s share of step `step`'s rows, per key (float32, as pushed)."""
    share = ROWS // n
    return [sum(row(step, k, i) for i in range(rank * share, (rank + 1) * share)).astype(np.float32)
            for k in SHAPES]


def replay(steps):
    """NumPy, in float64: SGD with momentum (MXNet's rule) over the whole batch of each step."""
    rng = np.random.default_rng([SEED, 7])
    weights = [rng.standard_normal(s).astype(np.float32).astype(np.float64) for s in SHAPES.values()]
    moms = [np.zeros_like(w) for w in weights]
    for t in range(steps):
        for k in SHAPES:
            g = sum(row(t, k, i) for i in range(ROWS))
            moms[k] = MOMENTUM * moms[k] - LR * g
            weights[k] = weights[k] + moms[k]
    return weights


def check(outs, steps, what):
    want = replay(steps)
    for k in SHAPES:
        np.testing.assert_allclose(outs[k], want[k], rtol=1e-5, atol=1e-5,
                                   err_msg=f"key {k} {what}")
        assert np.abs(outs[k]).max() > 0.1, f"key {k} {what}: all (near) zero"
    say(f"VALUES OK {what} (max |w| {max(np.abs(o).max() for o in outs):.3f})")


def main():
    ckpt = os.path.join(LOGDIR, "ckpt")
    kv = kvstore.create("dist_sync")
    n0 = kv.num_workers
    assert ROWS % n0 == 0, f"{ROWS} rows do not share evenly over {n0} ranks"
    say(f"START seed {SEED}, rank {kv.rank} of {n0}")
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=LR, momentum=MOMENTUM))
    keys = list(SHAPES)
    rng = np.random.default_rng([SEED, 7])
    kv.init(keys, [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()])
    outs = [np.zeros(s, np.float32) for s in SHAPES.values()]
    changed = None
    step = 0
    while step < STEPS:
        if step == CKPT and changed is None:
            kv.save(ckpt)
            say(f"SAVED before step {CKPT}")
        if step == HOLD and changed is None:
            say("AT HOLD")
            if RANK0 in HOLD_RANKS:
                time.sleep(HOLD_SECS)
                say("HOLD OVER")
        pushed = False
        try:
            kv.push(keys, my_grads(step, kv.rank, kv.num_workers))
            pushed = True
            kv.pull(keys, out=outs)
        except kvstore.WorldChangedError as e:
            assert changed is None, f"a second WorldChangedError: {e}"
            changed = e
            say(f"WORLD CHANGED at step {step}: lost={e.lost} world={e.world} rank={e.rank} "
                f"committed={e.committed} restored={e.restored}: {e}")
            assert (kv.num_workers, kv.rank) == (e.world, e.rank), (kv.num_workers, kv.rank)
            assert 2 * e.world > n0 and e.world + len(e.lost) == n0, (e.world, e.lost, n0)
            assert ROWS % e.world == 0, f"{ROWS} rows do not share evenly over {e.world} ranks"
            if e.restored is not None:
                # Reloaded from the checkpoint (no copies of the lost ranks' parts).
                assert e.restored == os.path.realpath(ckpt) and not e.committed, (e.restored, e.committed)
                step, what = CKPT, "at the checkpoint"
            else:
                # Rebuilt from the survivors' parts and their copies of the lost ones: every
                # key as the last call that took effect left it (this push, if it committed).
                step = step + 1 if pushed or e.committed else step
                what = f"after the {step} committed steps"
            kv.pull(keys, out=outs)
            check(outs, step, what)
            say(f"GOING ON from step {step} ({what})")
            continue
        except kvstore.DistFailedError as e:
            say(f"STOPPED at step {step}: {e}")
            assert "no majority" in str(e), str(e)
            try:
                kv.pull(keys, out=outs)
            except kvstore.DistFailedError as again:
                assert "no majority" in str(again), str(again)
                say("STOPPED AGAIN (the next call fails too)")
                sys.exit(3)
            raise AssertionError("a call after 'no majority' succeeded")
        step += 1
        if changed is not None and PACE > 0:
            say(f"step {step - 1} of the new world done")
            time.sleep(PACE)
    check(outs, STEPS, f"after {STEPS} steps")
    kv.save(ckpt)
    kv.barrier()
    lost = changed.lost if changed else []
    say(f"DONE rank {kv.rank} of {kv.num_workers}, lost {lost}")


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:
        if not (isinstance(e, SystemExit) and e.code == 3):
            import traceback

            say("FAILED " + "".join(traceback.format_exception(e)).replace("\n", "\n    "))
        raise
