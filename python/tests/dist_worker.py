"""One worker of a distributed test, started N times by ``mpirun`` (see test_dist.py).

    mpirun -np N python dist_worker.py CASE SEED [ARGS...]

Each case checks its own results against a NumPy (or single-process torch) reference that it
computes independently, from data that every worker regenerates from SEED, and prints one line
``rank R: ok CASE ...`` on success or ``rank R: EXPECTED <ExceptionClass>: message`` for the
errors a case provokes on purpose. Any other outcome raises, so the worker exits non-zero.
"""

import os
import sys
import time

import numpy as np

import kvstore

CASE = sys.argv[1]
SEED = int(sys.argv[2])
ARGS = sys.argv[3:]


def say(msg):
    # One write of the whole line: the workers share mpirun's stdout, and print() writes the
    # text and its newline apart, so another worker's line could land between them.
    sys.stdout.write(f"rank {os.environ.get('OMPI_COMM_WORLD_RANK', '?')}: {msg}\n")
    sys.stdout.flush()


def expect(exc_class, f):
    """Runs ``f``, which must raise ``exc_class``; prints it."""
    try:
        f()
    except exc_class as e:
        say(f"EXPECTED {type(e).__name__}: {e}")
        return e
    raise AssertionError(f"expected {exc_class.__name__}, got no error")


def values(rank, key, shape, n=2):
    """The ``n`` values rank ``rank`` pushes to ``key``: fresh for every (SEED, rank, key)."""
    rng = np.random.default_rng([SEED, rank, key])
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def basic():
    kv = kvstore.create("dist_sync")
    n, r = kv.num_workers, kv.rank
    assert n == int(os.environ["OMPI_COMM_WORLD_SIZE"]), (n, os.environ["OMPI_COMM_WORLD_SIZE"])
    assert r == int(os.environ["OMPI_COMM_WORLD_RANK"])
    assert kv.local_rank == int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    assert kv.type == "dist_sync"
    shapes = {3: (2, 3), 7: (1000,), 11: (4, 5, 6)}
    init_rng = np.random.default_rng([SEED, 99])
    init = {k: init_rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    # Every rank passes its own init value; rank 0's is the one the store keeps (MXNet's rule).
    mine = {k: v + r for k, v in init.items()}
    kv.init(list(shapes), [mine[k] for k in shapes])
    for k, s in shapes.items():
        out = np.zeros(s, np.float32)
        kv.pull(k, out=out)
        np.testing.assert_array_equal(out, init[k] + 0)
    # Assign: the sum over every rank's values.
    kv.push(list(shapes), [values(r, k, s) for k, s in shapes.items()])
    for k, s in shapes.items():
        want = sum(sum(values(q, k, s)) for q in range(n))
        out = np.zeros(s, np.float32)
        kv.pull(k, out=out)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    # SGD in the store: w -= lr * (rescale * sum + wd * w).
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, wd=0.01, rescale_grad=1.0 / n))
    before = {}
    for k, s in shapes.items():
        before[k] = np.zeros(s, np.float32)
        kv.pull(k, out=before[k])
    kv.push(list(shapes), [values(r + 10, k, s, n=1) for k, s in shapes.items()])
    for k, s in shapes.items():
        g = sum(values(q + 10, k, s, n=1)[0] for q in range(n)).astype(np.float64) / n
        want = before[k] - 0.1 * (g + 0.01 * before[k])
        out = np.zeros(s, np.float32)
        kv.pull(k, out=out)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    kv.barrier()
    # pushpull in place, as DistributedOptimizer sums gradients.
    kv2 = kvstore.create("dist_sync")
    grad = values(r + 20, 5, (3, 3), n=1)[0]
    kv2.init(5, np.zeros((3, 3), np.float32))
    kv2.pushpull(5, grad)
    np.testing.assert_allclose(grad, sum(values(q + 20, 5, (3, 3), n=1)[0] for q in range(n)), rtol=1e-5, atol=1e-5)
    say(f"ok basic ({n} workers)")


def reject():
    kv = kvstore.create("dist_sync")
    r = kv.rank
    kv.init(3, np.ones((2, 3), np.float32))
    if r == 1:
        expect(kvstore.ShapeMismatchError, lambda: kv.push(3, np.ones((3, 2), np.float32)))
    else:
        expect(kvstore.RankRejectedError, lambda: kv.push(3, np.ones((2, 3), np.float32)))
    # Nothing changed on any rank, and the store goes on.
    out = np.zeros((2, 3), np.float32)
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, np.ones((2, 3)))
    kv.push(3, np.full((2, 3), r + 1, np.float32))
    kv.pull(3, out=out)
    n = kv.num_workers
    np.testing.assert_array_equal(out, np.full((2, 3), n * (n + 1) / 2))
    say("ok reject")


def desync():
    kv = kvstore.create("dist_sync")
    r = kv.rank
    kv.init([3, 5], [np.ones(4, np.float32), np.ones(4, np.float32)])
    key = 5 if r == 1 else 3
    expect(kvstore.DesyncError, lambda: kv.push(key, np.ones(4, np.float32)))
    expect(kvstore.DistFailedError, lambda: kv.pull(3, out=np.zeros(4, np.float32)))
    # Bad input after the failure is the failure too, wherever it is found.
    expect(kvstore.DistFailedError, lambda: kv.push(3, "not an array"))
    expect(kvstore.DistFailedError, lambda: kv.push(3.5, np.ones(4, np.float32)))
    say("ok desync")


def desync_optimizer():
    # Ranks that disagree on a hyperparameter must fail, never compute.
    kv = kvstore.create("dist_sync")
    r = kv.rank
    kv.init(3, np.ones(4, np.float32))
    lr = 0.1 if r == 0 else 0.2
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=lr))
    expect(kvstore.DesyncError, lambda: kv.push(3, np.ones(4, np.float32)))
    say("ok desync_optimizer")


# A global that one of the updaters below reads (desync_updater "global").
SCALE = 2.0


def desync_updater():
    """Ranks whose Python updaters differ fail the push: another function (ARGS[0] "function"),
    one closure that captured another value ("closure"), or one function reading a global that
    differs ("global"). Each computes what the others do on rank 0, so only the identity the
    store compares can tell."""
    global SCALE
    kv = kvstore.create("dist_sync")
    r = kv.rank
    kv.init(3, np.ones(4, np.float32))

    def double(key, inp, stored):
        stored += inp * 2

    def twice(key, inp, stored):
        stored += inp + inp

    def scaled(scale):
        def update(key, inp, stored):
            stored += inp * scale

        return update

    def by_global(key, inp, stored):
        stored += inp * SCALE

    class Double:
        factor = 2.0

    class Triple:
        factor = 3.0

    def by_class(rule):
        def update(key, inp, stored):
            stored += inp * rule.factor

        return update

    how = ARGS[0]
    if how == "function":
        kv.set_updater(double if r == 0 else twice)
    elif how == "closure":
        kv.set_updater(scaled(2.0 if r == 0 else 3.0))
    elif how == "class":
        kv.set_updater(by_class(Double if r == 0 else Triple))
    else:
        SCALE = 2.0 if r == 0 else 3.0
        kv.set_updater(by_global)
    expect(kvstore.DesyncError, lambda: kv.push(3, np.ones(4, np.float32)))
    say(f"ok desync_updater {how}")


def same_updater():
    """The same Python updater on every rank (a closure over a value every rank computes
    alike) passes the check and computes: stored + 3 * sum over the ranks."""
    kv = kvstore.create("dist_sync")
    r, n = kv.rank, kv.num_workers
    init = values(99, 3, (4,), n=1)[0]
    kv.init(3, init)
    scale = float(n + 1)
    # What a closure often reaches: a module imported in the function (whose namespace holds
    # hash-ordered sets, and each worker has its own hash seed), a set, a class.
    import numpy as np_local

    skip = {"a", "b", "c"}

    class Rule:
        factor = scale

    def update(key, inp, stored):
        if key in skip:
            return
        stored += np_local.asarray(inp) * Rule.factor

    kv.set_updater(update)
    kv.push(3, values(r, 3, (4,), n=1))
    out = np.zeros(4, np.float32)
    kv.pull(3, out=out)
    want = init + scale * sum(values(q, 3, (4,), n=1)[0] for q in range(n))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    say("ok same_updater")


def updater_changed():
    """A value a Python updater reads changes after set_updater (the global SCALE here), on
    every rank alike: the next push computes with the new value."""
    global SCALE
    kv = kvstore.create("dist_sync")
    r, n = kv.rank, kv.num_workers
    init = values(99, 3, (4,), n=1)[0]
    kv.init(3, init)
    SCALE = 2.0

    def by_global(key, inp, stored):
        stored += inp * SCALE

    kv.set_updater(by_global)
    kv.push(3, values(r, 3, (4,), n=1))
    total = sum(values(q, 3, (4,), n=1)[0].astype(np.float64) for q in range(n))
    SCALE = 3.0
    kv.push(3, values(r, 3, (4,), n=1))
    out = np.zeros(4, np.float32)
    kv.pull(3, out=out)
    np.testing.assert_allclose(out, init + 5.0 * total, rtol=1e-5, atol=1e-5)
    say("ok updater_changed")


def stateful_updater():
    """A Python updater with state of its own (a momentum per key, as MXNet's Updater keeps
    ``states``): the rank that holds each key changes that key's state, so the state differs
    across ranks, by design. Several pushes of several keys compute SGD with momentum against
    a reference written here."""
    kv = kvstore.create("dist_sync")
    r, n = kv.rank, kv.num_workers
    keys = [3, 5, 8, 11]
    init = {k: values(99, k, (6,), n=1)[0] for k in keys}
    kv.init(keys, [init[k] for k in keys])
    momentum = {}

    def sgd_momentum(key, grad, weight):
        m = momentum.setdefault(key, np.zeros_like(weight))
        m *= 0.9
        m += grad
        weight -= 0.1 * m

    kv.set_updater(sgd_momentum)
    want = {k: init[k].astype(np.float64) for k in keys}
    mom = {k: np.zeros(6) for k in keys}
    for step in range(4):
        kv.push(keys, [values(r + 10 * step, k, (6,), n=1)[0] for k in keys])
        for k in keys:
            g = sum(values(q + 10 * step, k, (6,), n=1)[0].astype(np.float64) for q in range(n))
            mom[k] = 0.9 * mom[k] + g
            want[k] = want[k] - 0.1 * mom[k]
    for k in keys:
        out = np.zeros(6, np.float32)
        kv.pull(k, out=out)
        np.testing.assert_allclose(out, want[k], rtol=1e-4, atol=1e-4)
    say("ok stateful_updater")


def reject_python():
    """An error the Python layer raises on one rank before the store sees the call (ARGS[0]:
    "value", a non-array value, found in Python; "key", a float key, found by the native
    binding) reaches the other ranks as RankRejectedError. Every rank then retries, and the
    retries pair up: the sum is of the retried values, not of a stale call."""
    kv = kvstore.create("dist_sync")
    r, n = kv.rank, kv.num_workers
    kv.init(3, np.zeros(4, np.float32))
    mine = values(r, 3, (4,), n=1)[0]
    if r == 1:
        bad = {
            "value": (TypeError, lambda: kv.push(3, "not an array")),
            "key": (TypeError, lambda: kv.push(3.5, mine)),
            "priority": (OverflowError, lambda: kv.push(3, mine, priority=2**31)),
        }[ARGS[0]]
        expect(*bad)
    else:
        expect(kvstore.RankRejectedError, lambda: kv.push(3, mine))
    out = np.zeros(4, np.float32)
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, np.zeros(4, np.float32))
    kv.push(3, mine)
    kv.pull(3, out=out)
    np.testing.assert_allclose(out, sum(values(q, 3, (4,), n=1)[0] for q in range(n)), rtol=1e-5)
    say(f"ok reject_python {ARGS[0]}")


def load_order():
    """Rank 1 loads a checkpoint before setting the optimizer, the others after: the load
    would restore the momentum on some ranks only. It fails on every rank instead."""
    path = ARGS[0]
    kv = kvstore.create("dist_sync")
    r = kv.rank
    sgd = kvstore.optimizer.SGD(learning_rate=0.05, momentum=0.9)
    kv.set_optimizer(sgd)
    kv.init([0, 1], [np.ones(4, np.float32), np.ones(4, np.float32)])
    kv.push([0, 1], [values(r, 0, (4,), n=1), values(r, 1, (4,), n=1)])
    kv.save(path)
    fresh = kvstore.create("dist_sync")
    if r != 1:
        fresh.set_optimizer(sgd)
    expect(kvstore.DesyncError, lambda: fresh.load(path))
    say("ok load_order")


def desync_torch():
    """DistributedOptimizer(update_on_kvstore=False): torch steps on every rank, so ranks whose
    torch hyperparameters differ must fail. ARGS[0] "lr": rank 1 made its optimizer with
    another learning rate; "schedule": rank 1 alone steps a scheduler after the first step."""
    import torch
    from kvstore.torch import DistributedOptimizer

    torch.set_num_threads(1)
    kv = kvstore.create("dist_sync")
    r = kv.rank
    model = torch.nn.Linear(3, 2)
    lr = 0.1 if (ARGS[0] != "lr" or r != 1) else 0.2
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), kv, update_on_kvstore=False)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    x, y = torch.ones(4, 3), torch.zeros(4, 2)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    if ARGS[0] == "schedule":
        step()
        if r == 1:
            sched.step()
    expect(kvstore.DesyncError, step)
    say(f"ok desync_torch {ARGS[0]}")


def torch_state():
    """DistributedOptimizer(update_on_kvstore=False) with Adam: after two steps every rank
    saves its state; then ARGS[0] "all": every rank loads the same state back (through the
    wrapper) and steps on, its parameters equal on every rank; "one": rank 1 alone loads a state
    whose first moments it changed ("inner": through the torch optimizer itself, not the
    wrapper), and the next step fails with a DesyncError on every rank."""
    import torch
    from kvstore.torch import DistributedOptimizer

    torch.set_num_threads(1)
    kv = kvstore.create("dist_sync")
    r = kv.rank
    torch.manual_seed(SEED)
    model = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), kv, update_on_kvstore=False)
    g = torch.Generator().manual_seed(SEED + r)
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()
    step()
    saved = opt.state_dict()
    how = ARGS[0]
    if how == "all":
        opt.load_state_dict(saved)
        step()
        # Rank 0's parameters, summed with zeros from the others, equal every rank's own.
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        kv.init(1000, np.zeros(mine.size, np.float32))
        kv.push(1000, mine * (1 if r == 0 else 0))
        out = np.zeros(mine.size, np.float32)
        kv.pull(1000, out=out)
        assert np.array_equal(out, mine), (out, mine)
    else:
        if r == 1:
            for st in saved["state"].values():
                st["exp_avg"] = st["exp_avg"] * 0.5
            target = opt.optimizer if how == "inner" else opt
            target.load_state_dict(saved)
        expect(kvstore.DesyncError, step)
    say(f"ok torch_state {how}")


def torch_refuse():
    """DistributedOptimizer refuses a step on rank 1 alone (its momentum changed after the
    wrapper was made): the others get RankRejectedError for that step, and when every rank
    steps again the steps pair up: the parameters are equal on every rank."""
    import torch
    from kvstore.torch import DistributedOptimizer

    torch.set_num_threads(1)
    kv = kvstore.create("dist_sync")
    r = kv.rank
    torch.manual_seed(SEED)
    model = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), kv)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(SEED + r))
    y = torch.zeros(4, 2)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()
    if r == 1:
        opt.param_groups[0]["momentum"] = 0.5
        expect(ValueError, step)
        opt.param_groups[0]["momentum"] = 0.9
    else:
        expect(kvstore.RankRejectedError, step)
    step()
    kv.agree(" ".join(p.detach().numpy().tobytes().hex() for p in model.parameters()))
    say("ok torch_refuse")


def timeout():
    kv = kvstore.create("dist_sync")
    r = kv.rank
    kv.init(3, np.ones(4, np.float32))
    if r == 1:
        # Rank 0 times out meanwhile, and its exit ends the job (test_dist.py checks that this
        # rank is ended before the sleep is over); were it not, the push must fail, not hang.
        time.sleep(float(ARGS[0]))
        expect(kvstore.DistError, lambda: kv.push(3, np.ones(4, np.float32)))
    else:
        t0 = time.monotonic()
        expect(kvstore.TimeoutError, lambda: kv.push(3, np.ones(4, np.float32)))
        say(f"timed out after {time.monotonic() - t0:.1f} s")
    say("ok timeout")


def slow_create():
    """Rank 1 creates its store only after ARGS[0] seconds: rank 0 waits inside MPI's setup,
    which MPI cannot cancel, so after KVSTORE_TIMEOUT it must end its process (and with it the
    job), not wait on."""
    if int(os.environ["OMPI_COMM_WORLD_RANK"]) == 1:
        time.sleep(float(ARGS[0]))
    say("creating")
    kvstore.create("dist_sync")
    say("ok slow_create (created: the bound did not end this process)")


def distenv():
    # Set by the test for every worker: a WORLD_SIZE that disagrees with mpirun's.
    e = expect(kvstore.DistEnvError, lambda: kvstore.create("dist_sync"))
    assert "WORLD_SIZE" in str(e), str(e)
    say("ok distenv")


def exits():
    kv = kvstore.create("dist_sync")
    r = kv.rank
    kv.init(3, np.ones(4, np.float32))
    if r == 1:
        say("exiting with code 3")
        sys.exit(3)
    expect(kvstore.RankExitedError, lambda: kv.push(3, np.ones(4, np.float32)))
    say("ok exits")


SHAPES = {k: (k + 1, 3) for k in range(6)}


def step_grads(rank):
    """The gradients rank ``rank`` of the saving job pushes after the checkpoint."""
    return [values(rank + 1000, k, s, n=1)[0] for k, s in SHAPES.items()]


def save():
    """Trains a little with SGD momentum, saves a sharded checkpoint into ARGS[0], then makes
    one more step. Rank 0 saves the values it pulled at the checkpoint and after that step, for
    the load side to compare."""
    path = ARGS[0]
    kv = kvstore.create("dist_sync")
    r, n = kv.rank, kv.num_workers
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.05, momentum=0.9))
    keys = list(SHAPES)
    kv.init(keys, [np.full(s, k, np.float32) for k, s in SHAPES.items()])
    for step in range(3):
        kv.push(keys, [values(r + 100 * step, k, s, n=1) for k, s in SHAPES.items()])
    kv.save(path)
    outs = [np.zeros(s, np.float32) for s in SHAPES.values()]
    kv.pull(keys, out=outs)
    at_save = np.concatenate([o.ravel() for o in outs])
    kv.push(keys, step_grads(r))
    kv.pull(keys, out=outs)
    after = np.concatenate([o.ravel() for o in outs])
    if r == 0:
        np.save(path + ".at-save.npy", at_save)
        np.save(path + ".after.npy", after)
    say(f"ok save ({n} workers)")


def load():
    """Loads ARGS[0] (saved by ARGS[1] workers) at this number of workers, and into a
    single-process store: both hold the values of the checkpoint, and one more step with the
    same summed gradient gives the saving job's next values, which needs the momentum that the
    checkpoint carries."""
    path, saved_by = ARGS[0], int(ARGS[1])
    at_save = np.load(path + ".at-save.npy")
    after = np.load(path + ".after.npy")
    keys = list(SHAPES)
    total = [sum(step_grads(q)[i] for q in range(saved_by)) for i in range(len(keys))]
    for kind in ("dist_sync", "local"):
        kv = kvstore.create(kind)
        r, n = kv.rank, kv.num_workers
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.05, momentum=0.9))
        kv.load(path)
        outs = [np.zeros(s, np.float32) for s in SHAPES.values()]
        kv.pull(keys, out=outs)
        np.testing.assert_array_equal(np.concatenate([o.ravel() for o in outs]), at_save)
        # This job's workers push shares that sum to the saving job's gradient.
        mine = [t if r == 0 else t * 0 for t in total]
        kv.push(keys, mine)
        kv.pull(keys, out=outs)
        got = np.concatenate([o.ravel() for o in outs])
        np.testing.assert_allclose(got, after, rtol=1e-5, atol=1e-6)
        # Without the checkpoint's momentum the step would differ by far more than that.
        assert np.abs(after - at_save).max() > 1e-2
    say("ok load")


def optimizer():
    """kvstore.torch.DistributedOptimizer on N workers, each with its part of the batch,
    against one process on the whole batch and against DistributedDataParallel (gloo)."""
    import copy

    import torch
    import torch.distributed as dist
    from kvstore.torch import DistributedOptimizer

    torch.set_num_threads(1)
    kind, update_on_kvstore = ARGS[0], ARGS[1] == "1"
    # "1": the gradients go out from backward's hooks (overlap=True), in buckets of bucket_mb.
    overlap = len(ARGS) > 2 and ARGS[2] == "1"
    # "1": the pulls are waited for at each layer's next forward (prefetch=model).
    prefetch = len(ARGS) > 3 and ARGS[3] == "1"
    r = int(os.environ["OMPI_COMM_WORLD_RANK"])
    n = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    g = torch.Generator().manual_seed(SEED)
    per = 8
    x = torch.randn(n * per, 6, generator=g)
    y = torch.randn(n * per, 3, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def make(ps):
        if kind == "sgd":
            return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3)
        return torch.optim.Adam(ps, lr=0.01, weight_decay=1e-3)

    def train(m, opt, xs, ys, steps=20):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(xs), ys).backward()
            opt.step()

    whole = copy.deepcopy(model)
    train(whole, make(whole.parameters()), x, y)

    mine = slice(r * per, (r + 1) * per)
    ours = copy.deepcopy(model)
    kv = kvstore.create("dist_sync")
    opt = DistributedOptimizer(
        make(ours.parameters()), kv, named_parameters=ours.named_parameters(),
        update_on_kvstore=update_on_kvstore, overlap=overlap, bucket_mb=1e-4,
        prefetch=ours if prefetch else None,
    )
    train(ours, opt, x[mine], y[mine])
    if prefetch:
        # The last step's pulls are still queued; the model's state_dict waits for them.
        assert opt._pending, "prefetch: the last step's pulls were waited for in step()"
        ours_state = {k: v.clone() for k, v in ours.state_dict().items()}
        assert not opt._pending
    if overlap or prefetch:
        # The blocking wrapper on a store of its own: the very same parameters, bit for bit. A
        # bucket and the blocking call's one list are messages of other sizes, and the store
        # sums every key's ranks in rank order whatever its message holds (MPI's own reduce
        # picks its order of additions by message size: 20 steps of momentum once carried that
        # to 1.3e-7 at 3 ranks).
        blocking = copy.deepcopy(model)
        b_opt = DistributedOptimizer(
            make(blocking.parameters()), kvstore.create("dist_sync"),
            named_parameters=blocking.named_parameters(), update_on_kvstore=update_on_kvstore,
        )
        train(blocking, b_opt, x[mine], y[mine])
        for (name, p), q in zip(ours.named_parameters(), blocking.parameters()):
            assert torch.equal(p, q), (name, (p - q).abs().max().item())
            if prefetch:
                assert torch.equal(ours_state[name], q), name

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['KVSTORE_TEST_PORT']}", rank=r,
        world_size=n,
    )
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    train(ddp, make(ddp.parameters()), x[mine], y[mine])
    dist.destroy_process_group()

    worst = 0.0
    for (name, p), q, d in zip(ours.named_parameters(), whole.parameters(), ddp.module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} vs whole batch: {m}")
        torch.testing.assert_close(p, d, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} vs DDP: {m}")
        worst = max(worst, (p - q).abs().max().item())
    # The training moved the parameters well beyond the tolerance, so equality means something.
    moved = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), model.parameters()))
    assert moved > 1e-2, moved
    say(
        f"ok optimizer {kind} update_on_kvstore={update_on_kvstore} overlap={overlap} "
        f"prefetch={prefetch} (max diff {worst:.2e}, moved {moved:.2e})"
    )


def nightly():
    """MXNet's nightly dist_sync_kvstore.py (default_cpu and init), on this API: MXNet's `test`
    optimizer (stored += rescale_grad * sum, rescale_grad 2) as a Python updater; str keys of
    (2, 3) and a big (1200, 1200) key, which is sliced over the workers (over 1e6 elements), in
    float32 and float16; each worker pushes ones * (rank + 1), and after round i a pull is
    1 + 2 * n(n+1)/2 * (i+1). Then int keys, each initialized from rank 0 only."""
    kv = kvstore.create("dist_sync")
    r, n = kv.rank, kv.num_workers
    rate = 2.0

    def test_optimizer(key, input, stored):
        stored += rate * input

    kv.set_updater(test_optimizer)
    shapes = {"3": (2, 3), "5": (2, 3), "7": (2, 3), "99": (1200, 1200)}
    half = {"4": (2, 3), "6": (2, 3), "8": (2, 3), "100": (1200, 1200)}
    keys = list(shapes) + list(half)
    dtypes = [np.float32] * len(shapes) + [np.float16] * len(half)
    all_shapes = list(shapes.values()) + list(half.values())
    kv.init(keys, [np.ones(s, d) for s, d in zip(all_shapes, dtypes)])
    for i in range(3):
        kv.push(keys, [np.ones(s, d) * (r + 1) for s, d in zip(all_shapes, dtypes)])
        want = 1 + rate * n * (n + 1) / 2 * (i + 1)
        outs = [np.zeros(s, d) for s, d in zip(all_shapes, dtypes)]
        kv.pull(keys, out=outs)
        for k, o in zip(keys, outs):
            assert (o == want).all(), (k, i, want, o.ravel()[:4])
    # init from rank 0: every worker passes its own value, rank 0's is kept.
    kv2 = kvstore.create("dist_sync")
    ints = list(range(200, 210))
    kv2.init(ints, [np.ones((2, 3), np.float32) * (i + 1000 * r) for i in ints])
    outs = [np.zeros((2, 3), np.float32) for _ in ints]
    kv2.pull(ints, out=outs)
    for i, o in zip(ints, outs):
        assert (o == i).all(), (i, o)
    big = np.random.default_rng([SEED, 7]).standard_normal((1100, 1000)).astype(np.float32)
    kv2.init(300, big + r)
    out = np.zeros_like(big)
    kv2.pull(300, out=out)
    np.testing.assert_array_equal(out, big)
    say(f"ok nightly ({n} workers)")


def unused():
    """A parameter without a gradient on one worker (unused in its part of the batch) must not
    put the workers out of step: each step's weights are the same on every worker, and equal a
    reference that sums the gradients each worker had (zeros for none). At step 2 worker 1's
    loss is zero, and v has a gradient on no worker (so it stays as it was). With overlap=True
    and update_on_kvstore=True, v used on some workers only is refused (DesyncError on every
    worker, naming the options)."""
    import torch
    from kvstore.torch import DistributedOptimizer

    r = int(os.environ["OMPI_COMM_WORLD_RANK"])
    n = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    on_store = ARGS[0] == "1"
    overlap = len(ARGS) > 1 and ARGS[1] == "1"
    w = torch.nn.Parameter(torch.zeros(3))
    v = torch.nn.Parameter(torch.zeros(2))
    opt = DistributedOptimizer(
        torch.optim.SGD([w, v], lr=0.1), kvstore.create("dist_sync"),
        named_parameters=[("w", w), ("v", v)], update_on_kvstore=on_store, overlap=overlap,
        **_views(on_store, 1e-6),
    )
    want_w, want_v = torch.zeros(3), torch.zeros(2)
    for step in range(4):
        opt.zero_grad()
        # Worker `step % n` skips v, and at step 2 worker 1 has a zero loss (no v either).
        idle = step == 2 and r == 1 % n
        uses_v = step % n != r and not idle
        loss = (w * (0 if idle else r + 1 + step)).sum()
        if uses_v:
            loss = loss + (v * (r + 2)).sum()
        if on_store and overlap and step == 0 and n > 1:
            # v used on some workers only, and its bucket queued from backward on those.
            def refused():
                loss.backward()
                opt.step()
            e = expect(kvstore.DesyncError, refused)
            assert "update_on_kvstore=False" in str(e) and "overlap=False" in str(e), e
            say("ok unused (refused: a parameter used on some workers only)")
            return
        loss.backward()
        opt.step()
        gw = sum(0 if (step == 2 and q == 1 % n) else (q + 1 + step) for q in range(n))
        gv = sum(0 if (step == 2 and q == 1 % n) or step % n == q else (q + 2) for q in range(n))
        want_w -= 0.1 * gw / n
        want_v -= 0.1 * gv / n
        torch.testing.assert_close(w.detach(), want_w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v.detach(), want_v, rtol=1e-6, atol=1e-6)
    say(f"ok unused on_store={on_store} overlap={overlap} views={opt._grads is not None}")


def _views(on_store, bucket_mb):
    """The wrapper's bucket options: with KVSTORE_TEST_GRAD_VIEWS=1 and torch stepping,
    gradients as views into flat buckets (``bucket_mb=3e-4``: the contract's model then has two
    buckets, one mixing trained, unused and sometimes-used parameters)."""
    if os.environ.get("KVSTORE_TEST_GRAD_VIEWS") == "1" and not on_store:
        return {"gradient_as_bucket_view": True, "bucket_mb": 3e-4}
    return {"bucket_mb": bucket_mb}


class _Net:
    """A model for the DDP contract: two trained layers, a frozen one, one that no worker
    uses, and one used on some workers at some steps."""

    @staticmethod
    def make(torch, g):
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(6, 16)
                self.b = torch.nn.Linear(16, 3)
                self.frozen = torch.nn.Linear(3, 3)
                self.never = torch.nn.Linear(3, 3)
                self.some = torch.nn.Linear(3, 3)

            def forward(self, x, use_some):
                h = self.frozen(self.b(torch.tanh(self.a(x))))
                return h + self.some(h) if use_some else h

        net = Net()
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        net.frozen.requires_grad_(False)
        return net


def contract():
    """kvstore.torch.DistributedOptimizer against DistributedDataParallel (gloo,
    find_unused_parameters=True) with the same scaler, clipping and accumulation, 20 steps:
    equal within 1e-5. ARGS: update_on_kvstore, overlap, feature ("plain", "scaler", "clip",
    "nosync"). With update_on_kvstore=True a scaler and clipping are refused on every worker,
    naming update_on_kvstore=False. Frozen and unused parameters never move."""
    import copy

    import torch
    import torch.distributed as dist
    from kvstore.torch import DistributedOptimizer

    torch.set_num_threads(1)
    on_store, overlap, feature = ARGS[0] == "1", ARGS[1] == "1", ARGS[2]
    r = int(os.environ["OMPI_COMM_WORLD_RANK"])
    n = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    g = torch.Generator().manual_seed(SEED)
    per, steps = 8, 20
    x = torch.randn(steps, n * per, 6, generator=g)
    y = torch.randn(steps, n * per, 3, generator=g)
    model = _Net.make(torch, g)
    mine = slice(r * per, (r + 1) * per)

    def use_some(step, rank):
        # Used on some workers only, but on every worker or none with overlap and the store
        # stepping (which refuses the first: see unused()).
        return step % 3 != 0 if (on_store and overlap) else (step + rank) % 3 != 0

    def run(m, opt, scaler, no_sync):
        for step in range(steps):
            xs = x[step, mine].clone()
            if feature == "scaler" and step == 2 and r == n - 1:
                xs[0, 0] = float("inf")  # an overflow on one worker only
            opt.zero_grad()
            halves = (xs[: per // 2], xs[per // 2:]), (y[step, mine][: per // 2], y[step, mine][per // 2:])
            parts = list(zip(*halves)) if feature == "nosync" else [(xs, y[step, mine])]
            for k, (xp, yp) in enumerate(parts):
                ctx = no_sync() if k < len(parts) - 1 else _nullcontext()
                with ctx:
                    # Accumulated halves each count half, as one batch would: summed whole, the
                    # gradient doubled and, with momentum 0.9, some seeds' runs diverged to NaN
                    # (DDP's as well as the store's: seed 960595394, the test could not compare).
                    loss = torch.nn.functional.mse_loss(m(xp, use_some(step, r)), yp) / len(parts)
                    (scaler.scale(loss) if scaler else loss).backward()
            if feature == "clip":
                if scaler:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], 0.05)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        return scaler.get_scale() if scaler else None

    def make_scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**8) if feature == "scaler" else None

    ours = copy.deepcopy(model)
    opt = DistributedOptimizer(
        torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2),
        kvstore.create("dist_sync"), named_parameters=ours.named_parameters(),
        update_on_kvstore=on_store, overlap=overlap, **_views(on_store, 1e-4),
    )
    if on_store and feature in ("scaler", "clip"):
        e = expect(ValueError, lambda: run(ours, opt, make_scaler(), opt.no_sync))
        assert "update_on_kvstore=False" in str(e), e
        say(f"ok contract {feature} refused (update_on_kvstore=True overlap={overlap})")
        return
    our_scale = run(ours, opt, make_scaler(), opt.no_sync)
    views = opt._grads is not None
    if views:
        # Each bucket one key (the frozen layer's, outside every bucket, its own); the
        # gradients left by the last step are views into the buckets' buffers.
        keys = opt.store.keys()
        buckets = [k for k in keys if k.startswith("kvstore.torch/gradient bucket")]
        assert len(buckets) == 2 and len(keys) == 4, keys
        flat = opt._grads.flats[0].untyped_storage().data_ptr()
        for q in (ours.some.weight, ours.b.weight, ours.a.bias):
            assert q.grad.untyped_storage().data_ptr() == flat, "a gradient outside its bucket"
        assert ours.never.weight.grad is None and ours.frozen.weight.grad is None

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['KVSTORE_TEST_PORT']}", rank=r,
        world_size=n,
    )
    ddp = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), find_unused_parameters=True
    )
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    ddp_scale = run(ddp, ddp_opt, make_scaler(), ddp.no_sync)
    dist.destroy_process_group()

    assert our_scale == ddp_scale, (our_scale, ddp_scale)
    if feature == "scaler":
        # The overflow on one worker made every worker skip step 2 and halve its scale.
        assert our_scale < 2.0**8, our_scale
    for (name, p), d, p0 in zip(
        ours.named_parameters(), ddp.module.parameters(), model.parameters()
    ):
        torch.testing.assert_close(p, d, rtol=0, atol=1e-5, msg=lambda m: f"{name} vs DDP: {m}")
        if name.startswith(("frozen.", "never.")):
            assert torch.equal(p, p0), f"{name} moved"
        else:
            assert (p - p0).abs().max().item() > 1e-3, f"{name} did not move"
    say(f"ok contract {feature} update_on_kvstore={on_store} overlap={overlap} views={views}")


def buffers():
    """BatchNorm's running statistics kept as DDP's broadcast_buffers keeps them: every worker
    starts each step from worker 0's. Parameters equal DDP's within 1e-5 after 20 steps, and
    the buffers are worker 0's on every worker (on worker 0, DDP's own). ARGS: update_on_kvstore,
    and "1" for prefetch=model (the buffers' broadcast, on a second store, goes before the
    prefetched pulls are queued)."""
    import copy

    import torch
    import torch.distributed as dist
    from kvstore.torch import DistributedOptimizer

    torch.set_num_threads(1)
    on_store = ARGS[0] == "1"
    r = int(os.environ["OMPI_COMM_WORLD_RANK"])
    n = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    g = torch.Generator().manual_seed(SEED)
    per, steps = 8, 20
    x = torch.randn(steps, n * per, 6, generator=g) * 2 + 1
    y = torch.randn(steps, n * per, 3, generator=g)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )
    mine = slice(r * per, (r + 1) * per)
    # Each worker's own statistics at the start, as if each had warmed up on its own data.
    with torch.no_grad():
        model[1].running_mean.copy_(torch.randn(16, generator=torch.Generator().manual_seed(r)))

    def run(m, opt):
        for step in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x[step, mine]), y[step, mine]).backward()
            opt.step()

    ours = copy.deepcopy(model)
    opt = DistributedOptimizer(
        torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9), kvstore.create("dist_sync"),
        named_parameters=ours.named_parameters(), update_on_kvstore=on_store,
        buffers=ours.named_buffers(), prefetch=ours if len(ARGS) > 1 and ARGS[1] == "1" else None,
    )
    run(ours, opt)
    opt.synchronize()
    kv = kvstore.create("dist_sync")
    kv.agree(" ".join(b.numpy().tobytes().hex() for b in ours.buffers()))

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['KVSTORE_TEST_PORT']}", rank=r,
        world_size=n,
    )
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    run(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
    dist.destroy_process_group()
    for (name, p), d in zip(ours.named_parameters(), ddp.module.parameters()):
        torch.testing.assert_close(p, d, rtol=0, atol=1e-5, msg=lambda m: f"{name} vs DDP: {m}")
    if r == 0:
        for (name, b), d in zip(ours.named_buffers(), ddp.module.buffers()):
            torch.testing.assert_close(b, d, rtol=0, atol=1e-5, msg=lambda m: f"{name} vs DDP: {m}")
    say(f"ok buffers update_on_kvstore={on_store} prefetch={ARGS[1:] == ['1']}")


def uneven():
    """Uneven inputs: the last worker runs out of batches a step early and exits. The others'
    next call fails with RankExitedError naming what to do (kvstore.torch has no join()).
    ARGS: update_on_kvstore."""
    import torch
    from kvstore.torch import DistributedOptimizer

    torch.set_num_threads(1)
    kv = kvstore.create("dist_sync")
    r, n = kv.rank, kv.num_workers
    model = torch.nn.Linear(4, 2)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), kv, update_on_kvstore=ARGS[0] == "1"
    )
    x = torch.randn(4, 5, 4, generator=torch.Generator().manual_seed(SEED + r))
    batches = 2 if r == n - 1 else 3

    def train():
        for step in range(batches):
            opt.zero_grad()
            model(x[step]).pow(2).mean().backward()
            opt.step()

    if r == n - 1:
        train()
        say("ok uneven (ran out of batches)")
        return
    e = expect(kvstore.RankExitedError, train)
    assert "join()" in str(e) and "drop_last" in str(e), e
    say("ok uneven")


def recover():
    """A backward that raises on every worker at step 1 (caught: the batch skipped, as an
    OOM guard does) and a layer unfrozen at step 3 (fine-tuning): the workers stay equal to
    one process on the whole batch. ARGS: update_on_kvstore, overlap. With both on, the failed
    backward had pushed buckets: a RuntimeError on every worker instead."""
    import copy

    import torch
    from kvstore.torch import DistributedOptimizer

    torch.set_num_threads(1)
    on_store, overlap = ARGS[0] == "1", ARGS[1] == "1"
    r = int(os.environ["OMPI_COMM_WORLD_RANK"])
    n = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    g = torch.Generator().manual_seed(SEED)
    per, steps = 8, 8
    x = torch.randn(steps, n * per, 4, generator=g)
    y = torch.randn(steps, n * per, 2, generator=g)
    torch.manual_seed(SEED)  # the same model on every worker, for the reference
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("boom")

    def train(m, opt, rows):
        for step in range(steps):
            opt.zero_grad()
            if step == 3:
                m[0].requires_grad_(True)
            if step == 1:
                try:
                    # (x requires grad, so Boom is in the graph under the frozen layer; the
                    # last layer's gradients are made, and with overlap pushed, before it.)
                    xs = x[step, rows].clone().requires_grad_()
                    out = m[2](Boom.apply(m[1](m[0](xs))))
                    torch.nn.functional.mse_loss(out, y[step, rows]).backward()
                except RuntimeError as e:
                    assert "boom" in str(e), e
                    continue
            torch.nn.functional.mse_loss(m(x[step, rows]), y[step, rows]).backward()
            opt.step()

    ours = copy.deepcopy(model)
    opt = DistributedOptimizer(
        torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), kvstore.create("dist_sync"),
        update_on_kvstore=on_store, overlap=overlap, **_views(on_store, 1e-5),
    )
    if on_store and overlap:
        e = expect(RuntimeError, lambda: train(ours, opt, slice(r * per, (r + 1) * per)))
        assert "load the last checkpoint" in str(e), e
        say("ok recover (refused: a failed backward had pushed)")
        return
    train(ours, opt, slice(r * per, (r + 1) * per))
    whole = copy.deepcopy(model)
    train(whole, torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9), slice(0, n * per))
    for p, q, p0 in zip(ours.parameters(), whole.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
        assert (p - p0).abs().max().item() > 1e-3
    say(f"ok recover update_on_kvstore={on_store} overlap={overlap} views={opt._grads is not None}")


def views_edges():
    """gradient_as_bucket_view=True where torch's own rules are easy to break: zero_grad with
    and without set_to_none, a layer frozen mid-run (its zeroed gradient still stepped, as
    torch steps it), a zero_grad between backward and step (nothing moves), a parameter listed
    twice in param_groups (torch warns and steps it twice: its gradient averaged once), and a
    channels_last conv stepped by a fused optimizer (its gradient laid out as the parameter).
    Bit for bit the wrapper without views, and plain torch on the whole batch within 1e-5."""
    import copy
    import warnings

    import torch
    from kvstore.torch import DistributedOptimizer

    warnings.simplefilter("ignore")  # the duplicate parameter
    torch.set_num_threads(1)
    r = int(os.environ["OMPI_COMM_WORLD_RANK"])
    n = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    g = torch.Generator().manual_seed(SEED)
    per, steps = 4, 8
    x = torch.randn(steps, n * per, 3, 6, 6, generator=g)
    y = torch.randn(steps, n * per, 2, generator=g)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.a = torch.nn.Linear(64, 8)
            self.b = torch.nn.Linear(8, 2)

        def forward(self, xs):
            return self.b(torch.tanh(self.a(torch.tanh(self.conv(xs)).flatten(1))))

    torch.manual_seed(SEED)
    model = Net().to(memory_format=torch.channels_last)

    def make_opt(m):
        ps = list(m.parameters())
        return torch.optim.Adam(ps + [m.b.bias], lr=0.01, weight_decay=1e-2, fused=True)

    def train(m, opt, rows):
        for step in range(steps):
            opt.zero_grad(set_to_none=step % 2 == 0)
            if step == 3:
                m.a.requires_grad_(False)
            torch.nn.functional.mse_loss(m(x[step, rows]), y[step, rows]).backward()
            if step == 5:
                before = [p.detach().clone() for p in m.parameters()]
                opt.zero_grad()
                opt.step()
                assert all(p.grad is None for p in m.parameters()), "a gradient left"
                for p, q in zip(m.parameters(), before):
                    assert torch.equal(p, q), "a step after zero_grad moved a parameter"
                continue
            if step == 1 and hasattr(opt, "_grads") and opt._grads is not None:
                w = m.conv.weight
                assert w.grad.stride() == w.stride(), (w.grad.stride(), w.stride())
            opt.step()

    mine = slice(r * per, (r + 1) * per)
    runs = {}
    for views in (False, True):
        m = copy.deepcopy(model)
        opt = DistributedOptimizer(
            make_opt(m), kvstore.create("dist_sync"), update_on_kvstore=False,
            gradient_as_bucket_view=views, bucket_mb=1e-3,
        )
        train(m, opt, mine)
        runs[views] = m
    whole = copy.deepcopy(model)
    train(whole, make_opt(whole), slice(0, n * per))
    for (name, p), q, w in zip(
        runs[True].named_parameters(), runs[False].parameters(), whole.parameters()
    ):
        assert torch.equal(p, q), f"{name}: views differ from no views"
        torch.testing.assert_close(p, w, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    say("ok views_edges")


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def skip_step():
    """A worker that skips step() by its own if (at step 2, the last worker) fails the next
    call of every worker with DesyncError, never summing gradients of different steps."""
    import torch
    from kvstore.torch import DistributedOptimizer

    torch.set_num_threads(1)
    on_store, overlap = ARGS[0] == "1", ARGS[1] == "1"
    kv = kvstore.create("dist_sync")
    r, n = kv.rank, kv.num_workers
    g = torch.Generator().manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), kv,
        update_on_kvstore=on_store, overlap=overlap, **_views(on_store, 1e-4),
    )
    x = torch.randn(6, 5, 4, generator=g)
    failed_at = None
    for step in range(6):
        try:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[step] * (r + 1)), torch.zeros(5, 2)).backward()
            if step == 2 and r == n - 1:
                continue  # the user's own if
            opt.step()
        except kvstore.DesyncError as e:
            say(f"EXPECTED DesyncError at step {step}: {e}")
            assert "backward" in str(e) and "step" in str(e), e
            failed_at = step
            break
    assert failed_at in (2, 3), failed_at
    say(f"ok skip_step update_on_kvstore={on_store} overlap={overlap}")


def two_bit_reference(contributions, threshold, residuals):
    """What a compressed push stores: each worker's contribution added to its residual, +t,
    -t or 0 sent per element (the rest kept), the sent values summed in worker order, all in
    float32. ``residuals`` (one per worker) is updated."""
    t = np.float32(threshold)
    total = None
    for c, r in zip(contributions, residuals):
        r += c
        sent = np.where(r >= t, t, np.where(r <= -t, -t, np.float32(0))).astype(np.float32)
        r -= sent
        total = sent if total is None else (total + sent).astype(np.float32)
    return total


def compressed():
    """2-bit compression across workers: MXNet's nightly sequence (residuals that reach the
    threshold exactly) and random values, against the reference above."""
    kv = kvstore.create("dist_sync")
    n, r = kv.num_workers, kv.rank
    t = 0.5
    kv.set_gradient_compression({"type": "2bit", "threshold": t})
    shape = (5, 7)
    kv.init(9, np.zeros(shape, np.float32))
    residuals = [np.zeros(shape, np.float32) for _ in range(n)]
    rng = np.random.default_rng([SEED, 5])
    steps = [np.full((n,) + shape, g, np.float32) for g in (0.4, 0.1, 0.2, 0.3, 0.5, -0.5)]
    steps += [rng.uniform(-1, 1, (n,) + shape).astype(np.float32) for _ in range(3)]
    for step, per_worker in enumerate(steps):
        kv.push(9, per_worker[r].copy())
        want = two_bit_reference(per_worker, t, residuals)
        out = np.zeros(shape, np.float32)
        kv.pull(9, out=out)
        assert np.array_equal(out, want), (step, out, want)
    # A key of 8.4 MB (sliced): a push of more than 8 MiB travels in waves, the encode of one
    # overlapping the send of the one before, with the sums of one wave.
    big = (2_100_007,)
    kv.init(10, np.zeros(big, np.float32))
    residuals = [np.zeros(big, np.float32) for _ in range(n)]
    for step in range(3):
        per_worker = rng.uniform(-1, 1, (n,) + big).astype(np.float32)
        kv.push(10, per_worker[r].copy())
        want = two_bit_reference(per_worker, t, residuals)
        out = np.zeros(big, np.float32)
        kv.pull(10, out=out)
        assert np.array_equal(out, want), (step, np.flatnonzero(out != want)[:5])
    say(f"ok compressed threshold={t}")


def row_sparse():
    """MXNet's nightly dist_sync_kvstore.py row-sparse checks on this API: with MXNet's `test`
    optimizer (stored += 2 * sum) as a Python updater, each worker sets row rank % 2 of an rsp
    key (float32 and float16) to rank + 1; after round i, row x is
    1 + 2 * (i + 1) * sum(rank + 1 for ranks with rank % 2 == x), checked by row_sparse_pull of
    random ids (rows not asked for are 0 in the out). A big (1200, 1200) key, sliced over the
    workers, where worker r pushes every 2(r+1)-th row of a 30 % selection. An empty push
    leaves the value alone; a pull of no rows gives zeros."""
    kv = kvstore.create("dist_sync")
    r, n = kv.rank, kv.num_workers
    rate = 2.0

    def test_optimizer(key, input, stored):
        stored += rate * input

    kv.set_updater(test_optimizer)
    small = (4, 3)
    kv.init(["9", "10"], [kvstore.RowSparse(np.arange(4), np.ones(small, d), small)
                          for d in (np.float32, np.float16)])
    big = (1200, 1200)
    kv.init_row_sparse("big", np.ones(big, np.float32))
    sel = np.sort(np.random.default_rng([SEED, 9]).choice(big[0], 360, replace=False))
    rng = np.random.default_rng([SEED, 10, r])
    for i in range(3):
        for key, d in (("9", np.float32), ("10", np.float16)):
            row = np.full((1, 3), r + 1, d)
            kv.push(key, kvstore.RowSparse([r % 2], row, small))
        mine = sel[:: 2 * (r + 1)]
        kv.push("big", kvstore.RowSparse(mine, np.full((len(mine), big[1]), r + 1, np.float32), big))
        for key, d in (("9", np.float32), ("10", np.float16)):
            ids = rng.integers(0, 4, size=3)
            out = np.full(small, 9, d)
            kv.row_sparse_pull(key, out=out, row_ids=ids)
            want = np.zeros(small, d)
            for x in np.unique(ids):
                want[x] = 1 + rate * (i + 1) * sum(q + 1 for q in range(n) if q % 2 == x)
            assert np.array_equal(out, want), (key, i, out, want)
        ids = np.unique(np.concatenate([rng.choice(sel, 20), rng.integers(0, big[0], 5)]))
        got = kv.row_sparse_pull("big", row_ids=ids)
        for x, row in zip(got.ids, got.rows):
            w = 1 + rate * (i + 1) * sum(q + 1 for q in range(n) if x in sel[:: 2 * (q + 1)])
            assert (row == w).all(), ("big", i, x, row[:3], w)
    before = np.zeros(small, np.float32)
    kv.pull("9", out=before)
    kv.push("9", kvstore.RowSparse(np.array([], np.int64), np.zeros((0, 3), np.float32), small))
    after = np.zeros(small, np.float32)
    kv.pull("9", out=after)
    assert np.array_equal(before, after), (before, after)
    out = np.full(small, 3, np.float32)
    kv.row_sparse_pull("9", out=out, row_ids=np.array([], np.int64))
    assert (out == 0).all(), out
    say(f"ok row_sparse ({n} workers)")


def async_local_failure():
    """A queued push whose Python updater fails (on the key's home, which tells the others:
    every worker's queue holds the failure). Worker 0 takes its failure with wait_all; worker
    1 does not, so its next blocking call, a pull, raises the failure without making the
    pull. Worker 0's pull must then fail at once, naming it, not wait for worker 1 until
    KVSTORE_TIMEOUT. Then the workers are in step: the next pull brings the stored value,
    unchanged by the failed update."""
    kv = kvstore.create("dist_sync")
    r = kv.rank
    init = values(99, 3, (4,), n=1)[0]
    kv.init(3, init)

    def update(key, inp, stored):
        raise ValueError("this updater fails where it runs")

    kv.set_updater(update)
    kv.push_async(3, values(r, 3, (4,), n=1))
    out = np.zeros(4, np.float32)
    if r == 0:
        expect(kvstore.Error, kv.wait_all)
        e = expect(kvstore.RankRejectedError, lambda: kv.pull(3, out=out))
        assert "asynchronous call before it failed" in str(e), e
    else:
        expect(kvstore.Error, lambda: kv.pull(3, out=out))
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, init)
    say("ok async_local_failure")


def lose_rank():
    """Rank 2 kills itself (SIGKILL) at the start of step 5 of a push-and-pull loop; under
    `mpirun --with-ft ulfm` the survivors (2 of 3, a majority) go on without it: each gets
    WorldChangedError for its call in flight, and since the store never saved a checkpoint it
    holds no key now. Each prints the error and exits 3. Printing "ok" means a survivor
    finished the loop: a wrong outcome."""
    import signal

    kv = kvstore.create("dist_sync")
    kv.init(0, np.zeros(1 << 16, np.float32))
    out = np.zeros(1 << 16, np.float32)
    for step in range(20):
        if kv.rank == 2 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            kv.push(0, values(kv.rank, 0, 1 << 16, 1)[0])
            kv.pull(0, out=out)
        except kvstore.WorldChangedError as e:
            say(f"EXPECTED {type(e).__name__}: {e}")
            assert kv.num_workers == 2 and "holds no key" in str(e), (kv.num_workers, str(e))
            expect(kvstore.UnknownKeyError, lambda: kv.pull(0, out=out))
            sys.exit(3)
    say("ok lose_rank")


SURVIVE_SHAPES = {0: (64,), 1: (3000,), 2: (5, 7)}


def survive_grads(rank, step):
    """The gradients rank ``rank`` pushes at ``step``: fresh for every (SEED, rank, step)."""
    return [values(rank + 1000 * step, k, s, n=1)[0] for k, s in SURVIVE_SHAPES.items()]


def sgd_momentum_steps(weights, moms, grads_by_step, lr, momentum):
    """NumPy's SGD with momentum (MXNet's rule), one step per summed gradient, in float64."""
    for grads in grads_by_step:
        for k, g in enumerate(grads):
            moms[k] = momentum * moms[k] - lr * g
            weights[k] = weights[k] + moms[k]
    return weights, moms


def survive():
    """Elastic training under ``mpirun --with-ft ulfm``: 8 steps, a checkpoint after step 2,
    and rank ARGS[1] SIGKILLs itself at the start of step 5. Every survivor must get
    WorldChangedError for its call in flight, with the world one rank smaller. With buddy
    copies (``KVSTORE_REPLICAS=1``, the default) nothing is lost: the keys are as steps 0 to 4
    left them; with ``KVSTORE_REPLICAS=0`` they are back at the checkpoint (steps 0 to 2). Either
    is checked against a NumPy replay of those steps on every rank's gradients (key 1 is
    sliced, so its slices are cut again for the new size). The survivors then redo the steps
    from there to 7 as the new world's ranks, and the values must equal a NumPy replay of every
    committed step (momentum included).

    ARGS[2], where given, is the store's kind: with ``dist_device_sync`` (GPU ranks) the
    survivors also abort their NCCL communicator and join a new one among themselves."""
    import signal

    path, victim = ARGS[0], int(ARGS[1])
    kind = ARGS[2] if len(ARGS) > 2 else "dist_sync"
    replicas = os.environ.get("KVSTORE_REPLICAS", "1") != "0"
    kv = kvstore.create(kind)
    n0, r0 = kv.num_workers, kv.rank
    lr, momentum = 0.25, 0.5
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=lr, momentum=momentum))
    keys = list(SURVIVE_SHAPES)
    rng = np.random.default_rng([SEED, 7])
    init = [rng.standard_normal(s).astype(np.float32) for s in SURVIVE_SHAPES.values()]
    kv.init(keys, init)
    outs = [np.zeros(s, np.float32) for s in SURVIVE_SHAPES.values()]

    def summed(ranks, step):
        per_rank = [survive_grads(q, step) for q in ranks]
        return [sum(g[k].astype(np.float64) for g in per_rank) for k in range(len(keys))]

    # The world of each committed step, in order.
    worlds = []
    changed = None
    step = 0
    while step < 8:
        if step == 3 and changed is None:
            kv.save(path)
        if r0 == victim and step == 5 and changed is None:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            kv.push(keys, survive_grads(kv.rank, step))
            worlds.append(kv.num_workers)
            kv.pull(keys, out=outs)
        except kvstore.WorldChangedError as e:
            assert changed is None, f"a second WorldChangedError: {e}"
            changed = e
            say(f"EXPECTED {type(e).__name__}: {e}")
            assert kv.num_workers == n0 - 1, kv.num_workers
            want_rank = r0 - (1 if r0 > victim else 0)
            assert kv.rank == want_rank, (kv.rank, want_rank)
            assert (e.lost, e.world, e.rank) == ([victim], n0 - 1, want_rank), (
                e.lost, e.world, e.rank)
            if replicas:
                # The victim never pushed step 5, so that push took effect nowhere.
                assert e.healed and e.restored is None and not e.committed, str(e)
                worlds = worlds[:5]
            else:
                assert not e.healed and not e.committed, str(e)
                assert e.restored == os.path.realpath(path), (e.restored, path)
                worlds = worlds[:3]
            step = len(worlds)
            # Where the store is now: the committed steps, each of its own world.
            weights = [v.astype(np.float64) for v in init]
            moms = [np.zeros_like(w) for w in weights]
            grads = [summed(range(w), t) for t, w in enumerate(worlds)]
            weights, moms = sgd_momentum_steps(weights, moms, grads, lr, momentum)
            kv.pull(keys, out=outs)
            for k in keys:
                np.testing.assert_allclose(outs[k], weights[k], rtol=1e-5, atol=1e-6)
            continue
        step += 1
    assert changed is not None, "no rank was lost: the victim's kill did not happen"
    # Every step, as the store committed it.
    assert len(worlds) == 8, worlds
    weights = [v.astype(np.float64) for v in init]
    moms = [np.zeros_like(w) for w in weights]
    grads = [summed(range(w), t) for t, w in enumerate(worlds)]
    weights, moms = sgd_momentum_steps(weights, moms, grads, lr, momentum)
    for k in keys:
        np.testing.assert_allclose(outs[k], weights[k], rtol=1e-5, atol=1e-6)
    # The new world saves and agrees as any world does.
    kv.save(path)
    kv.barrier()
    say(f"ok survive {kind} (now rank {kv.rank} of {kv.num_workers}; worlds {worlds})")


DURING_SHAPES = {0: (64,), 1: (1000, 2000)}


def during():
    """Elastic training under ``mpirun --with-ft ulfm``, a rank lost DURING a call of each kind
    (ARGS: checkpoint path, victim, what, delay in seconds). The program: push, push, save,
    then the call under test (``save``, ``load`` of that checkpoint, ``init`` of a new key, a
    push of a ``sliced`` key, or a 2-bit ``compressed`` push), push, pull. Just before the call
    under test the victim starts a timer that SIGKILLs it after the delay, so it dies inside
    that call (the others already in it) or, where the call ends first, in a later one.

    Every survivor must fail the same call with WorldChangedError, carry on from what that
    error says (the next call where it committed, else the same one again; back to the
    checkpoint where it was restored), and end with every key equal to a NumPy replay of the
    calls that took effect (SGD with momentum; for 2-bit, every rank's residuals, which each
    survivor keeps where the store healed, and which start again at zero where it went back to
    a checkpoint saved by another world size). It prints its events and a digest of its values,
    which the test compares across survivors. ARGS[4], where given, is the store's kind
    (``dist_device_sync``: GPU ranks, whose NCCL collective the victim dies in)."""
    import hashlib
    import signal
    import threading

    path, victim, what, delay = ARGS[0], int(ARGS[1]), ARGS[2], float(ARGS[3])
    kind = ARGS[4] if len(ARGS) > 4 else "dist_sync"
    kv = kvstore.create(kind)
    n0, r0 = kv.num_workers, kv.rank
    lr, momentum, t = 0.25, 0.5, np.float32(0.5)
    if what == "compressed":
        kv.set_gradient_compression({"type": "2bit", "threshold": float(t)})
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=lr, momentum=momentum))
    keys = list(DURING_SHAPES)
    rng = np.random.default_rng([SEED, 11])
    init = [rng.standard_normal(s).astype(np.float32) for s in DURING_SHAPES.values()]
    new_key, new_value = 5, rng.standard_normal((1000, 1000)).astype(np.float32)
    kv.init(keys, init)
    middle = {"save": "save", "load": "load", "init": "init"}.get(what, "push")
    program = ["push", "push", "save", middle, "push", "pull"]
    armed_at = 3

    def grads(rank, step):
        g = np.random.default_rng([SEED, rank, step])
        return [g.standard_normal(s).astype(np.float32) for s in DURING_SHAPES.values()]

    # The replay: the committed calls, each with the ranks (as first numbered) alive then.
    log = []
    alive = list(range(n0))
    events = []
    step = 0
    outs = [np.zeros(s, np.float32) for s in DURING_SHAPES.values()]
    while step < len(program):
        call = program[step]
        if step == armed_at and r0 == victim:
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        try:
            if call == "push":
                kv.push(keys, grads(r0, step))
            elif call == "save":
                kv.save(path)
            elif call == "load":
                kv.load(path)
            elif call == "init":
                kv.init(new_key, new_value)
            else:
                kv.pull(keys, out=outs)
            events.append(f"{step} {call}: ok")
            log.append((step, tuple(alive)))
            step += 1
        except kvstore.WorldChangedError as e:
            events.append(f"{step} {call}: lost {e.lost} committed {e.committed} "
                          f"healed {e.healed} restored {e.restored is not None}")
            say(f"EXPECTED {type(e).__name__} in {call}: {e}")
            if e.committed:
                log.append((step, tuple(alive)))
                step += 1
            if e.restored is not None:
                saved = max(i for i, (s_, _) in enumerate(log) if program[s_] == "save")
                step = log[saved][0] + 1
                del log[saved + 1:]
            log.append(("change", e.restored is not None))
            alive = [a for i, a in enumerate(alive) if i not in e.lost]
            assert kv.num_workers == len(alive), (kv.num_workers, alive)

    if r0 == victim:
        time.sleep(60)  # The timer fires meanwhile, and the survivors' next call finds it.
    while True:
        try:
            kv.pull(keys, out=outs)
            break
        except kvstore.WorldChangedError as e:
            # The pull took effect nowhere, and changed nothing: again.
            events.append(f"the last pull: lost {e.lost} healed {e.healed} "
                          f"restored {e.restored is not None}")
            say(f"EXPECTED {type(e).__name__} in the last pull: {e}")
            assert e.healed or e.restored is not None, str(e)
            if e.restored is not None:
                saved = max(i for i, (s_, _) in enumerate(log) if program[s_] == "save")
                del log[saved + 1:]
            log.append(("change", e.restored is not None))
            alive = [a for i, a in enumerate(alive) if i not in e.lost]
    # NumPy's replay of the log.
    weights = [v.astype(np.float64) for v in init]
    moms = [np.zeros_like(w) for w in weights]
    residuals = {}
    saved = None
    has_new = False
    for s_, ranks in log:
        if s_ == "change":
            if ranks:  # restored: the checkpoint's world differs, so residuals restart
                residuals = {}
            continue
        call = program[s_]
        if call == "push":
            per_rank = [grads(q, s_) for q in ranks]
            if what == "compressed":
                summed = []
                for k, shape in enumerate(DURING_SHAPES.values()):
                    res = [residuals.setdefault((q, k), np.zeros(shape, np.float32))
                           for q in ranks]
                    summed.append(two_bit_reference([g[k] for g in per_rank], t, res)
                                  .astype(np.float64))
            else:
                summed = [sum(g[k].astype(np.float64) for g in per_rank)
                          for k in range(len(keys))]
            weights, moms = sgd_momentum_steps(weights, moms, [summed], lr, momentum)
        elif call == "save":
            saved = ([w.copy() for w in weights], [m.copy() for m in moms])
        elif call == "load":
            weights, moms = [w.copy() for w in saved[0]], [m.copy() for m in saved[1]]
        elif call == "init":
            has_new = True
    for k in keys:
        np.testing.assert_allclose(outs[k], weights[k], rtol=1e-4, atol=1e-5)
    digest = hashlib.sha256(b"".join(o.tobytes() for o in outs))
    if has_new:
        got = np.zeros(new_value.shape, np.float32)
        kv.pull(new_key, out=got)
        assert np.array_equal(got, new_value), "the new key's value"
        digest.update(got.tobytes())
    assert len(alive) == n0 - 1, f"no rank was lost: {events}"
    say(f"ok during {what} {kind}: events {events} digest {digest.hexdigest()[:16]}")


def no_majority():
    """Under ``mpirun --with-ft ulfm`` with 2 ranks, rank 1 SIGKILLs itself: the survivor holds
    1 of 2 ranks, not a strict majority, so it must stop with DistFailedError (it could be one
    half of a cut link) and never compute on."""
    import signal

    kv = kvstore.create("dist_sync")
    kv.init(0, np.zeros(16, np.float32))
    out = np.zeros(16, np.float32)
    for step in range(10):
        if kv.rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            kv.push(0, values(kv.rank, 0, 16, 1)[0])
            kv.pull(0, out=out)
        except kvstore.DistFailedError as e:
            assert "majority" in str(e), str(e)
            say(f"EXPECTED {type(e).__name__}: {e}")
            expect(kvstore.DistFailedError, lambda: kv.pull(0, out=out))
            sys.exit(3)
    say("ok no_majority")


KEPT = []


def exit_queued():
    """Ends the program with calls still queued: pulls into tensors only the store holds, and
    pushes through a Python updater. kvstore's drain at exit runs them first; without it the
    store's worker thread released those tensors, or called the updater, while Python
    finalized, and the process aborted (SIGABRT, "terminate called without an active
    exception")."""
    import torch

    kv = kvstore.create("dist_sync")
    # Kept until the interpreter shuts down, as a store held in a reference cycle is (the torch
    # wrapper's hooks make one): a store freed before that drains its queue as it is dropped.
    KEPT.append(kv)
    kv.init([0, 1], [torch.zeros(1 << 20), np.zeros(1 << 16, np.float32)])

    def add(key, inp, stored):
        stored += inp

    kv.set_updater(add)
    o = torch.empty(1 << 20)
    for _ in range(100):
        kv.pull_async(0, out=o.detach())
    for _ in range(20):
        kv.push_async(1, np.ones(1 << 16, np.float32))
    say("ok exit_queued")


CASES = {
    "row_sparse": row_sparse,
    "compressed": compressed,
    "unused": unused,
    "contract": contract,
    "recover": recover,
    "uneven": uneven,
    "buffers": buffers,
    "skip_step": skip_step,
    "views_edges": views_edges,
    "nightly": nightly,
    "basic": basic,
    "reject": reject,
    "desync": desync,
    "desync_optimizer": desync_optimizer,
    "desync_updater": desync_updater,
    "same_updater": same_updater,
    "updater_changed": updater_changed,
    "stateful_updater": stateful_updater,
    "reject_python": reject_python,
    "load_order": load_order,
    "desync_torch": desync_torch,
    "torch_refuse": torch_refuse,
    "torch_state": torch_state,
    "timeout": timeout,
    "distenv": distenv,
    "slow_create": slow_create,
    "exits": exits,
    "save": save,
    "load": load,
    "optimizer": optimizer,
    "async_local_failure": async_local_failure,
    "exit_queued": exit_queued,
    "lose_rank": lose_rank,
    "survive": survive,
    "during": during,
    "no_majority": no_majority,
}

if __name__ == "__main__":
    CASES[CASE]()
