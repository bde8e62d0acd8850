"""kvstore.torch.DistributedOptimizer against plain single-process torch training.

Skipped (and reported as such) where torch is not installed.
"""

import copy
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch not installed")

import kvstore  # noqa: E402
from kvstore.torch import DistributedOptimizer  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def make_problem(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 5, generator=g)
    y = torch.randn(64, 2, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return x, y, model


def train(model, opt, x, y, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fresh_seed():
    return int.from_bytes(os.urandom(4), "little")


@pytest.mark.parametrize(
    "make_opt,update_on_kvstore,rtol",
    [
        # The store sums the gradients, torch steps: bit for bit the same.
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3), False, 0),
        (lambda ps: torch.optim.RMSprop(ps, lr=0.01), False, 0),
        # The store runs the optimizer: the same math, rounded in another order. Over 30 steps
        # that leaves up to 1.2e-6 (SGD) and 3.9e-6 (Adam) absolute between the two, the worst
        # of 150 fresh seeds each (measured 2026-11-26); an element near zero then has a large
        # relative difference, so the absolute bound is 2e-5, five times that worst case and
        # still far below a wrong step (lr 0.01 moves an element by up to 0.3 here).
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3), True, 1e-4),
        (lambda ps: torch.optim.SGD(ps, lr=0.05), True, 1e-4),
        # epsilon after the bias correction, as torch has it: the same math.
        (lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=1e-3), True, 1e-4),
    ],
    ids=["sgd-local", "rmsprop-local", "sgd-momentum-store", "sgd-store", "adam-store"],
)
def test_wrapper_equals_plain_torch(make_opt, update_on_kvstore, rtol):
    seed = fresh_seed()
    print(f"seed {seed}")
    x, y, plain = make_problem(seed)
    wrapped = copy.deepcopy(plain)
    plain_losses = train(plain, make_opt(plain.parameters()), x, y, 30)
    opt = DistributedOptimizer(
        make_opt(wrapped.parameters()), kvstore.create("local"), update_on_kvstore=update_on_kvstore
    )
    wrapped_losses = train(wrapped, opt, x, y, 30)
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(q, p, rtol=rtol, atol=rtol * 0.2)
    torch.testing.assert_close(
        torch.tensor(wrapped_losses), torch.tensor(plain_losses), rtol=rtol, atol=rtol * 0.2
    )
    assert plain_losses[-1] < plain_losses[0]


def test_scheduler_learning_rate_reaches_the_store():
    x, y, plain = make_problem(fresh_seed())
    wrapped = copy.deepcopy(plain)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=5, gamma=0.5)
    opt = DistributedOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=5, gamma=0.5)
    for _ in range(15):
        train(plain, ref, x, y, 1)
        ref_sched.step()
        train(wrapped, opt, x, y, 1)
        sched.step()
    # The store took the rate of each step: the last of the 15 ran at 0.1 * 0.5**2.
    assert opt.store.learning_rate == pytest.approx(0.1 * 0.5**2)
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


def test_named_parameters_are_the_keys():
    _, _, model = make_problem(1)
    store = kvstore.create("local")
    DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), store, named_parameters=model.named_parameters()
    )
    assert store.keys() == [n for n, _ in model.named_parameters()]


def test_untranslatable_optimizer_says_what_to_do():
    _, _, model = make_problem(2)
    with pytest.raises(ValueError, match="update_on_kvstore=False"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
            update_on_kvstore=True,
        )


def test_torch_example_loss_falls():
    for args in ([], ["--optimizer", "adam"], ["--local-step"]):
        r = subprocess.run(
            [sys.executable, os.path.join(EXAMPLES, "train_torch.py"), "--steps", "100", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        losses = [float(line.split()[-1]) for line in r.stdout.splitlines() if "loss" in line]
        assert len(losses) == 6, r.stdout
        assert losses[-1] < 0.5 * losses[0], r.stdout


def test_hyperparameters_the_store_cannot_follow_are_refused():
    # The store follows a changed learning rate; any other change would be silently ignored.
    x, y, model = make_problem(fresh_seed())
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), kvstore.create("local")
    )
    train(model, opt, x, y, 1)
    opt.param_groups[0]["momentum"] = 0.0
    with pytest.raises(ValueError, match="hyperparameters changed"):
        train(model, opt, x, y, 1)
    opt.param_groups[0]["momentum"] = 0.9
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.optimizer.add_param_group({"params": [extra]})
    with pytest.raises(ValueError, match="parameters changed"):
        train(model, opt, x, y, 1)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    ],
    ids=["sgd", "rmsprop"],
)
def test_gradient_buckets_equal_plain_torch_and_stay_views(make_opt, overlap):
    """gradient_as_bucket_view=True: bit for bit plain torch. After backward the gradients
    are views into the buckets' buffers, the same from one step to the next, whether the
    wrapper's zero_grad or model.zero_grad() set them to None."""
    seed = fresh_seed()
    print(f"seed {seed}")
    x, y, plain = make_problem(seed)
    wrapped = copy.deepcopy(plain)
    popt = make_opt(plain.parameters())
    # 1.9e-4 MiB (199 bytes): the last layer and the first bias (200 bytes) close a bucket,
    # and the first weight (320 bytes) is one of its own.
    opt = DistributedOptimizer(
        make_opt(wrapped.parameters()), kvstore.create("local"), update_on_kvstore=False,
        overlap=overlap, gradient_as_bucket_view=True, bucket_mb=1.9e-4,
    )
    assert [len(m) for m in opt._grads.members] == [3, 1], opt._grads.members
    assert len(opt.store.keys()) == 2, opt.store.keys()
    storages = None
    for step in range(12):
        for m, o in ((plain, popt), (wrapped, opt)):
            if m is wrapped and step % 4 == 3:
                m.zero_grad()  # every .grad None: copied back into the views by backward
            else:
                o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            if m is wrapped:
                now = [p.grad.untyped_storage().data_ptr() for p in m.parameters()]
                flats = [f.untyped_storage().data_ptr() for f in opt._grads.flats]
                assert now == [flats[1], flats[0], flats[0], flats[0]], (now, flats)
                assert storages in (None, now)
                storages = now
            o.step()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p, q), (p - q).abs().max()


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_a_nan_gradient_is_stepped_on_not_taken_for_a_change(overlap):
    """A model that diverged: the store steps on the NaN sum as torch would (NaN parameters),
    where the check of gradients changed before step() once saw NaN != NaN and raised."""
    x, y, model = make_problem(fresh_seed())
    plain = copy.deepcopy(model)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), kvstore.create("local"), overlap=overlap
    )
    popt = torch.optim.SGD(plain.parameters(), lr=0.1)
    x[3, 1] = float("nan")
    for m, o in ((model, opt), (plain, popt)):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.isnan(q).any() and torch.equal(p.isnan(), q.isnan())


def test_gradient_buckets_leave_none_where_torch_does_and_keep_each_layout():
    """A gradient backward did not reach is None, after zero_grad and after backward; a
    zero_grad between backward and step moves nothing; a channels_last conv's gradient has the
    conv's strides, so a fused optimizer pairs each element with its own."""
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    head = torch.nn.Linear(4, 2)
    skipped = torch.nn.Linear(2, 2)
    params = list(conv.parameters()) + list(head.parameters()) + list(skipped.parameters())
    plain = [p.detach().clone().requires_grad_() for p in params]
    popt = torch.optim.Adam(plain, lr=0.01, fused=True)
    opt = DistributedOptimizer(
        torch.optim.Adam(params, lr=0.01, fused=True), kvstore.create("local"),
        update_on_kvstore=False, gradient_as_bucket_view=True,
    )
    x = torch.randn(5, 3, 6, 6).to(memory_format=torch.channels_last)

    def loss(ps):
        h = torch.nn.functional.conv2d(x, ps[0], ps[1]).mean((2, 3))
        return torch.nn.functional.linear(h, ps[2], ps[3]).square().sum()

    for step in range(4):
        opt.zero_grad()
        popt.zero_grad()
        assert all(p.grad is None for p in params)
        loss(params).backward()
        loss(plain).backward()
        assert params[0].grad.stride() == params[0].stride()
        assert skipped.weight.grad is None and skipped.bias.grad is None
        if step == 2:
            before = [p.detach().clone() for p in params]
            opt.zero_grad()
            opt.step()
            assert all(torch.equal(p, b) for p, b in zip(params, before))
            continue
        opt.step()
        popt.step()
    for p, q in zip(params, plain):
        assert torch.equal(p, q), (p - q).abs().max()


def test_gradient_buckets_are_refused_where_the_store_steps_or_a_name_is_taken():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="update_on_kvstore=False"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), kvstore.create("local"),
            gradient_as_bucket_view=True,
        )
    w = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="rename it"):
        DistributedOptimizer(
            torch.optim.SGD([w], lr=0.1), kvstore.create("local"), update_on_kvstore=False,
            named_parameters=[("kvstore.torch/gradient bucket 0", w)], gradient_as_bucket_view=True,
        )


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
@pytest.mark.parametrize(
    "update_on_kvstore,views", [(False, False), (True, False), (False, True)],
    ids=["local-step", "on-store", "local-step-views"],
)
def test_frozen_and_unused_parameters_never_move(update_on_kvstore, views, overlap):
    # Weight decay and momentum would move a parameter pushed with a zero gradient.
    seed = fresh_seed()
    print(f"seed {seed}")
    x, y, model = make_problem(seed)
    frozen = torch.nn.Linear(2, 2)
    unused = torch.nn.Linear(2, 2)
    frozen.requires_grad_(False)
    params = list(model.parameters()) + list(frozen.parameters()) + list(unused.parameters())
    before = [p.detach().clone() for p in params]
    opt = DistributedOptimizer(
        torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2), kvstore.create("local"),
        update_on_kvstore=update_on_kvstore, overlap=overlap, bucket_mb=1e-3 if views else 1e-4,
        gradient_as_bucket_view=views,
    )
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(frozen(model(x)), y).backward()
        opt.step()
    for p, b in zip(params[-4:], before[-4:]):
        assert torch.equal(p.detach(), b)
    assert all(p.grad is None for p in params[-4:])
    assert not torch.equal(params[0].detach(), before[0])


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
@pytest.mark.parametrize("update_on_kvstore", [False, True], ids=["local-step", "on-store"])
def test_no_sync_accumulates_as_one_backward(update_on_kvstore, overlap):
    seed = fresh_seed()
    x, y, plain = make_problem(seed)
    wrapped = copy.deepcopy(plain)
    popt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    wopt = DistributedOptimizer(
        torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9), kvstore.create("local"),
        update_on_kvstore=update_on_kvstore, overlap=overlap, bucket_mb=1e-4,
    )
    for _ in range(4):
        for m, opt, sync in ((plain, popt, None), (wrapped, wopt, wopt.no_sync)):
            opt.zero_grad()
            for k, half in enumerate((slice(0, 32), slice(32, 64))):
                loss = torch.nn.functional.mse_loss(m(x[half]), y[half])
                if sync is not None and k == 0:
                    with sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_broadcast_buffers_is_refused_naming_the_option():
    _, _, model = make_problem(1)
    with pytest.raises(ValueError, match="broadcast_buffers"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), kvstore.create("local"),
            broadcast_buffers=True,
        )


def test_a_grad_scaler_and_clipping_are_refused_when_the_store_steps():
    x, y, model = make_problem(fresh_seed())
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), kvstore.create("local"),
        update_on_kvstore=True,
    )
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    with pytest.raises(ValueError, match="update_on_kvstore=False"):
        scaler.step(opt)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), kvstore.create("local"),
        update_on_kvstore=True,
    )
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(ValueError, match="update_on_kvstore=False"):
        opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_adamw_is_stepped_by_torch_not_translated_to_the_stores_l2_adam():
    x, y, plain = make_problem(fresh_seed())
    wrapped = copy.deepcopy(plain)
    make = lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)  # noqa: E731
    opt = DistributedOptimizer(make(wrapped.parameters()), kvstore.create("local"))
    assert not opt.update_on_kvstore
    train(plain, make(plain.parameters()), x, y, 5)
    train(wrapped, opt, x, y, 5)
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="AdamW"):
        DistributedOptimizer(make(wrapped.parameters()), kvstore.create("local"), update_on_kvstore=True)


def test_two_wrappers_on_one_store_are_refused():
    _, _, a = make_problem(1)
    _, _, b = make_problem(2)
    kv = kvstore.create("local")
    DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), kv, named_parameters=[
        (f"a{i}", p) for i, p in enumerate(a.parameters())
    ])
    with pytest.raises(ValueError, match="store of its own"):
        DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), kv)


def test_a_closure_reaches_the_optimizer_that_calls_it_lbfgs():
    x, y, plain = make_problem(fresh_seed())
    wrapped = copy.deepcopy(plain)

    def closure_for(m, opt):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss
        return closure

    popt = torch.optim.LBFGS(plain.parameters(), lr=0.5, max_iter=4)
    wopt = DistributedOptimizer(torch.optim.LBFGS(wrapped.parameters(), lr=0.5, max_iter=4))
    for _ in range(3):
        popt.step(closure_for(plain, popt))
        wopt.step(closure_for(wrapped, wopt))
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p, q)


def test_sparse_gradients_are_refused_with_what_to_do():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), kvstore.create("local"),
                               update_on_kvstore=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse=False"):
        opt.step()


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking-push", "overlapped-push"])
def test_prefetch_waits_at_each_layers_forward_and_gives_the_blocking_parameters(overlap):
    x, y, model = make_problem(fresh_seed())
    blocking, ours = copy.deepcopy(model), copy.deepcopy(model)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    b_opt = DistributedOptimizer(sgd(blocking), kvstore.create("local"))
    opt = DistributedOptimizer(
        sgd(ours), kvstore.create("local"), overlap=overlap, bucket_mb=1e-4, prefetch=ours
    )
    # Which keys each wait was for, and which layer's forward it ran in.
    waits, layer = [], [None]
    real_wait = opt.store.wait
    opt.store.wait = lambda key: (waits.append((layer[0], key)), real_wait(key))[1]
    for i, m in enumerate(ours):
        m.register_forward_pre_hook(lambda _m, _a, i=i: layer.__setitem__(0, i), prepend=True)
    train(blocking, b_opt, x, y, 5)
    train(ours, opt, x, y, 5)
    # Layer 0 holds keys 0 and 1 (weight, bias), layer 2 keys 2 and 3: each waited for in its
    # own forward, at every step after the first (the first starts from the init's pull).
    assert sorted(set(waits)) == [(0, 0), (0, 1), (2, 2), (2, 3)], waits
    assert len(waits) == 4 * 4, waits
    # The last step's pulls are queued: the model's state_dict waits for them.
    state = ours.state_dict()
    assert [k for _, k in waits[16:]] == [0, 1, 2, 3], waits
    for (name, p), q in zip(ours.named_parameters(), blocking.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(state[name], q), name
    moved = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), model.parameters()))
    assert moved > 1e-2, moved


def test_prefetch_is_refused_where_it_cannot_apply_with_what_to_do():
    _, _, model = make_problem(fresh_seed())
    with pytest.raises(TypeError, match="torch.nn.Module"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), kvstore.create("local"),
            prefetch=model.parameters(),
        )
    with pytest.raises(ValueError, match="update_on_kvstore=True"):
        DistributedOptimizer(
            torch.optim.RMSprop(model.parameters(), lr=0.1), kvstore.create("local"),
            prefetch=model,
        )
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="no module of this model holds"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), kvstore.create("local"), prefetch=other
        )
    # Some of the optimizer's parameters outside the model: nothing would wait for them.
    scale = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"no module of this model holds \(\[4\]\)"):
        DistributedOptimizer(
            torch.optim.SGD([*model.parameters(), scale], lr=0.1), kvstore.create("local"),
            prefetch=model,
        )


def prefetch_pair(make_model, seed):
    """The same model twice, one with prefetch=model and one without, each with its own store."""
    torch.manual_seed(seed)
    plain = make_model()
    torch.manual_seed(seed)
    ours = make_model()  # not a deepcopy: a weight_norm layer cannot be copied
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)  # noqa: E731
    return (
        (plain, DistributedOptimizer(adam(plain), kvstore.create("local"))),
        (ours, DistributedOptimizer(adam(ours), kvstore.create("local"), prefetch=ours)),
    )


def losses_of(model, opt, xs):
    out = []
    for x in xs:
        opt.zero_grad()
        loss = model(x).square().mean()
        # Every parameter of these models is used: with prefetch, the forward waited for all.
        assert not getattr(opt, "_pending", None), opt._pending
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("layer", ["weight_norm", "attention"])
def test_prefetch_equals_no_prefetch_where_a_module_computes_or_reads_for_another(layer):
    # weight_norm computes the weight in a forward pre-hook of its own, registered before the
    # wrapper's; nn.MultiheadAttention reads out_proj's weight without calling out_proj. Both
    # must see the store's parameters: every step's loss and the end bit for bit.
    def make():
        if layer == "weight_norm":
            return torch.nn.Sequential(
                torch.nn.utils.weight_norm(torch.nn.Linear(8, 16)), torch.nn.Tanh(),
                torch.nn.utils.weight_norm(torch.nn.Linear(16, 4)),
            )
        return torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                                batch_first=True)

    seed = fresh_seed()
    (plain, p_opt), (ours, opt) = prefetch_pair(make, seed)
    g = torch.Generator().manual_seed(seed)
    shape = (16, 8) if layer == "weight_norm" else (4, 5, 8)
    xs = [torch.randn(*shape, generator=g) for _ in range(6)]
    # A hook that ran before the wait would read parameters whose pull is still queued: the
    # wait is every module's first hook, ahead of those it had before the wrapper
    # (weight_norm's), which the pulls may finish before on this fast local store.
    for m in ours.modules():
        first = next(iter(m._forward_pre_hooks.values()), None)
        assert type(first).__name__ == "_WaitHook", (m, first)
    assert losses_of(ours, opt, xs) == losses_of(plain, p_opt, xs)
    opt.synchronize()
    for (name, p), q in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


def test_prefetch_state_dicts_loads_and_copies_see_the_stores_parameters():
    seed = fresh_seed()
    (plain, p_opt), (ours, opt) = prefetch_pair(lambda: make_problem(seed)[2], seed)
    x, _, _ = make_problem(seed)
    losses_of(plain, p_opt, [x, x])
    losses_of(ours, opt, [x, x])
    # A submodule's state_dict waits for the queued pulls too.
    assert opt._pending
    first = ours[0].state_dict()
    assert torch.equal(first["weight"], plain[0].weight)
    # A copy (an EMA model, torch.save) carries no wait of the wrapper's, and pickles.
    losses_of(ours, opt, [x])
    losses_of(plain, p_opt, [x])
    twin = copy.deepcopy(ours)
    buf = __import__("io").BytesIO()
    torch.save(ours, buf)
    assert opt._pending  # neither the copy nor the save waited, nor needed to
    # A load right after step() is not overwritten by the queued pulls.
    wanted = {k: torch.randn_like(v) for k, v in ours.state_dict().items()}
    ours.load_state_dict(wanted)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, wanted[k]), k
    assert twin is not ours


def test_prefetch_fails_a_step_whose_forward_read_a_parameter_before_its_pull():
    # A forward that reads a child's weight directly, the first time after a step: the pull
    # was still queued, so the step fails (on every worker) instead of pushing gradients of
    # a parameter the store was writing; the parent waits for it from then on.
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
            self.direct = False

        def forward(self, x):
            x = self.a(x)
            return x @ self.b.weight.T if self.direct else self.b(x)

    seed = fresh_seed()
    torch.manual_seed(seed)
    net = Net()
    opt = DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), kvstore.create("local"), prefetch=net,
        named_parameters=net.named_parameters(),
    )
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    losses_of(net, opt, [x])
    net.direct = True
    opt.zero_grad()
    net(x).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"\['b.weight'\] were read by a forward before"):
        opt.step()
