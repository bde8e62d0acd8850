"""Asynchronous calls (push_async, pull_async, pushpull_async, wait, wait_all) and
DistributedOptimizer(overlap=True), in one process. Their dist runs are in test_dist.py.

The torch tests are skipped (and reported as such) where torch is not installed.
"""

import copy
import os

import numpy as np
import pytest

import kvstore

SIZES = [3, 1, 17, 5]


def fresh_seed():
    return int.from_bytes(os.urandom(4), "little")


def quarters(rng, n):
    # Multiples of 1/4 in [-8, 8]: float32 sums of them are exact in any order.
    return (rng.integers(-32, 33, n) / 4).astype(np.float32)


def store(seed):
    rng = np.random.default_rng(seed)
    kv = kvstore.create("local")
    kv.init(list(range(len(SIZES))), [quarters(rng, n) for n in SIZES])
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.25, momentum=0.5, wd=0.125))
    return kv


def program(rng, n):
    calls = []
    for _ in range(n):
        op = ["push", "pull", "pushpull"][rng.integers(3)]
        keys = [int(k) for k in rng.integers(0, len(SIZES), rng.integers(1, 4))]
        values = [[quarters(rng, SIZES[k]) for _ in range(rng.integers(1, 3))] for k in keys]
        calls.append((op, keys, values, int(rng.integers(-2, 3))))
    return calls


def finals(kv):
    outs = [np.zeros(n, np.float32) for n in SIZES]
    kv.pull(list(range(len(SIZES))), out=outs)
    return outs


def test_queued_calls_equal_the_same_calls_made_blocking():
    seed = fresh_seed()
    print(f"seed {seed}")
    calls = program(np.random.default_rng(seed), 40)
    sync, queued = store(seed), store(seed)
    want, got = [], []
    for op, keys, values, priority in calls:
        outs = [np.zeros(SIZES[k], np.float32) for k in keys]
        pulled = [np.zeros(SIZES[k], np.float32) for k in keys]
        if op == "push":
            sync.push(keys, values)
            queued.push_async(keys, values, priority=priority)
        elif op == "pull":
            sync.pull(keys, out=outs)
            queued.pull_async(keys, out=pulled, priority=priority)
        else:
            sync.pushpull(keys, values, out=outs)
            queued.pushpull_async(keys, values, out=pulled, priority=priority)
        want.append(outs)
        got.append(pulled)
        # The values were copied: changing them now changes nothing queued.
        for vs in values:
            for v in vs:
                v[...] = 1e6
    queued.wait_all()
    for w, g in zip(want + [finals(sync)], got + [finals(queued)]):
        for a, b in zip(w, g):
            np.testing.assert_array_equal(b, a)


def test_a_failed_call_raises_at_the_wait_as_its_own_error_and_stops_the_later_calls():
    kv = store(fresh_seed())
    before = finals(kv)
    kv.pull_async(9, out=np.zeros(2, np.float32))
    kv.push_async(0, np.ones(3, np.float32))  # not run
    kv.wait(2)  # no call on key 2
    with pytest.raises(kvstore.UnknownKeyError, match=r"asynchronous call #1 pull \[9\]"):
        kv.wait(0)
    with pytest.raises(kvstore.UnknownKeyError, match="1 later call"):
        kv.wait_all()
    for a, b in zip(finals(kv), before):
        np.testing.assert_array_equal(a, b)
    kv.push_async(0, np.ones(3, np.float32))
    kv.wait_all()
    assert not np.array_equal(finals(kv)[0], before[0])


def test_a_blocking_call_after_a_failed_queued_call_raises_its_error():
    kv = store(fresh_seed())
    kv.push_async(0, np.ones(4, np.float32))  # the wrong shape
    with pytest.raises(kvstore.ShapeMismatchError, match="asynchronous call"):
        kv.pull(1, out=np.zeros(1, np.float32))
    kv.pull(1, out=np.zeros(1, np.float32))


def test_bad_arguments_raise_at_once_and_fail_the_queue_in_their_place():
    kv = store(fresh_seed())
    with pytest.raises(TypeError):
        kv.push_async(0, "not an array")
    with pytest.raises(kvstore.InvalidArgumentError, match="refused"):
        kv.wait_all()
    kv.wait_all()


def test_the_timeline_names_each_call_on_the_clock():
    kv = store(fresh_seed())
    kv.set_timeline(True)
    t0 = kv.clock()
    kv.push_async([0, 1], [np.ones(3, np.float32), np.ones(1, np.float32)])
    kv.wait_all()
    t1 = kv.clock()
    [(call, queued, started, finished, ok)] = kv.take_timeline()
    assert call == "#1 push [0, 1]" and ok
    assert t0 <= queued <= started <= finished <= t1


# ------------------------------------------------------------------------------------------
# DistributedOptimizer(overlap=True)


def torch_problem(seed):
    torch = pytest.importorskip("torch", reason="torch not installed")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 5, generator=g)
    y = torch.randn(64, 2, generator=g)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 2),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return torch, x, y, model


def train(torch, model, opt, x, y, steps, sched=None):
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("update_on_kvstore", [True, False], ids=["store-steps", "torch-steps"])
@pytest.mark.parametrize("bucket_mb", [1e-6, 1e-3, 1.0], ids=["bucket-per-param", "some-buckets", "one-bucket"])
@pytest.mark.parametrize("schedule", [False, True], ids=["constant-lr", "step-lr"])
def test_overlap_gives_the_parameters_of_the_blocking_step(update_on_kvstore, bucket_mb, schedule):
    from kvstore.torch import DistributedOptimizer

    seed = fresh_seed()
    print(f"seed {seed}")
    torch, x, y, plain = torch_problem(seed)
    blocking, overlapped = copy.deepcopy(plain), copy.deepcopy(plain)

    def sgd(m):
        # MXNet's momentum (which the store runs) keeps lr inside its buffer, torch's outside:
        # the two agree only while lr is constant, so the schedule runs without momentum.
        momentum = 0.0 if schedule else 0.9
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=momentum, weight_decay=1e-3)

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5) if schedule else None

    ref = sgd(plain)
    a = DistributedOptimizer(sgd(blocking), update_on_kvstore=update_on_kvstore)
    b = DistributedOptimizer(
        sgd(overlapped), update_on_kvstore=update_on_kvstore, overlap=True, bucket_mb=bucket_mb
    )
    train(torch, plain, ref, x, y, 12, sched(ref))
    train(torch, blocking, a, x, y, 12, sched(a.optimizer))
    train(torch, overlapped, b, x, y, 12, sched(b.optimizer))
    for p, q, r in zip(plain.parameters(), blocking.parameters(), overlapped.parameters()):
        # The same sums and the same updates, key by key: bit for bit the blocking step.
        torch.testing.assert_close(r, q, rtol=0, atol=0)
        # Against torch itself: within 1e-5.
        torch.testing.assert_close(r, p, rtol=1e-5, atol=1e-5)


def test_overlap_queues_buckets_while_backward_runs():
    from kvstore.torch import DistributedOptimizer

    torch, x, y, model = torch_problem(fresh_seed())
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), overlap=True, bucket_mb=1e-6
    )
    opt.store.set_timeline(True)
    first = next(model.parameters())  # the first layer's weight: backward reaches it last
    last_grad = []
    first.register_post_accumulate_grad_hook(lambda p: last_grad.append(opt.store.clock()))
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    calls = opt.store.take_timeline()
    pushes = [c for c in calls if " push " in c[0]]
    # One push per parameter, the last layer's first, and those of every layer but the first
    # (keys 2 to 5) queued before backward reached the first layer (whose weight and bias
    # torch may accumulate in either order).
    assert len(pushes) == len(list(model.parameters())), calls
    # (The timeline is in the order the calls ran: a local store may run waiting calls of
    # higher priority, the first layers', first.)
    assert "#1 push [5]" in [c[0] for c in pushes], calls
    later = [c for c in pushes if c[0].endswith(("push [2]", "push [3]", "push [4]", "push [5]"))]
    assert len(later) == 4 and all(c[1] < last_grad[0] for c in later), (calls, last_grad)


def test_a_second_backward_before_step_is_refused_with_overlap():
    from kvstore.torch import DistributedOptimizer

    torch, x, y, model = torch_problem(fresh_seed())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), overlap=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="before step"):
        torch.nn.functional.mse_loss(model(x), y).backward()


def test_dropping_a_store_with_queued_python_updates_does_not_hang():
    # The queued pushes run a Python updater, which needs the GIL; dropping the store with
    # them queued must run them without holding it. In a child, so a hang fails this test
    # instead of the run.
    import subprocess
    import sys

    code = """
import numpy as np, kvstore
seen = []
def add(key, value, stored):
    seen.append(key)
    stored += value
kv = kvstore.create('local')
kv.init(0, np.zeros(1000, np.float32))
kv.set_updater(add)
for _ in range(20):
    kv.push_async(0, np.ones(1000, np.float32))
del kv
assert len(seen) == 20, seen
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_a_failed_queued_call_is_reported_when_the_store_is_dropped_unwaited():
    import subprocess
    import sys

    code = """
import numpy as np, kvstore
kv = kvstore.create('local')
kv.init(0, np.zeros(4, np.float32))
kv.push_async(0, np.ones(5, np.float32))   # the wrong shape: fails on the worker
del kv
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "no wait returned it" in r.stderr and "push [0]" in r.stderr, r.stderr


def clip(torch, model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)


@pytest.mark.parametrize("update_on_kvstore", [True, False], ids=["store-steps", "torch-steps"])
def test_gradient_clipping_between_backward_and_step_with_overlap(update_on_kvstore):
    # Torch steps: backward's end waits for the (averaged) sums, so clipping after it applies,
    # as in the blocking wrapper. The store steps: it runs the optimizer on the gradients as
    # backward made them, so a change after backward raises, blocking or overlapped.
    from kvstore.torch import DistributedOptimizer

    torch, x, y, plain = torch_problem(fresh_seed())
    blocking, overlapped = copy.deepcopy(plain), copy.deepcopy(plain)

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    a = DistributedOptimizer(sgd(blocking), update_on_kvstore=update_on_kvstore)
    b = DistributedOptimizer(
        sgd(overlapped), update_on_kvstore=update_on_kvstore, overlap=True, bucket_mb=1e-6
    )
    for model, opt in ((blocking, a), (overlapped, b)):
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            clip(torch, model)
            if update_on_kvstore:
                with pytest.raises(ValueError, match="update_on_kvstore=False"):
                    opt.step()
                break
            opt.step()
    for q, r in zip(blocking.parameters(), overlapped.parameters()):
        torch.testing.assert_close(r, q, rtol=0, atol=0)


class DeviceArray:
    """An array on a device the store cannot write in place (as a CuPy or non-CUDA torch
    array): the Python half pulls into a host copy and copies it back after the call. Records
    every copy back."""

    def __init__(self, values):
        self.values = np.array(values)
        self.copied = 0

    def __dlpack__(self, **kw):
        raise AssertionError("a device array is never exported in place")

    def __dlpack_device__(self):
        return (13, 0)  # kDLExtDev: neither host memory nor CUDA

    def get(self):
        return self.values.copy()

    def set(self, host):
        self.values[...] = host
        self.copied += 1


def test_a_failed_queued_pull_never_copies_back_into_the_callers_array():
    rng = np.random.default_rng(fresh_seed())
    kv = kvstore.create("local")
    init = quarters(rng, 6)
    kv.init(1, init)
    before = quarters(rng, 6)
    # A pull of an unknown key fails when it runs: the out keeps its values, and nothing is
    # copied into it, by wait_all nor by wait.
    for by_key in (False, True):
        out = DeviceArray(before)
        kv.pull_async(2, out=out)
        if by_key:
            with pytest.raises(kvstore.UnknownKeyError):
                kv.wait(2)
            assert out.copied == 0
        # (wait raises a failed call's error until wait_all has raised it.)
        with pytest.raises(kvstore.UnknownKeyError):
            kv.wait_all()
        assert out.copied == 0
        np.testing.assert_array_equal(out.values, before)
    # A call not run because an earlier one failed: no copy either.
    out = DeviceArray(before)
    kv.pull_async(2, out=DeviceArray(before))
    kv.pull_async(1, out=out)
    with pytest.raises(kvstore.UnknownKeyError):
        kv.wait_all()
    assert out.copied == 0
    np.testing.assert_array_equal(out.values, before)
    # And a pull that succeeds is copied back.
    kv.pull_async(1, out=out)
    kv.wait_all()
    assert out.copied == 1
    np.testing.assert_array_equal(out.values, init)
