"""PyTorch integration: an optimizer wrapper that synchronizes through a kvstore, with the
contract of ``DistributedDataParallel``.

    import torch, kvstore
    from kvstore.torch import DistributedOptimizer

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               kvstore.create('dist_sync'),
                               named_parameters=model.named_parameters())
    loss.backward()   # the gradients are summed across the workers
    opt.step()        # the update
    opt.zero_grad()

Two modes, as MXNet's Trainer has them:

- ``update_on_kvstore=False``: torch steps. At the end of every ``backward()`` the gradients are
  averaged over the workers (``pushpull``), as DDP averages them, so everything between
  ``backward()`` and ``step()`` (a GradScaler's inf check and unscale, gradient clipping, a
  user's own code) sees the same averaged gradients on every worker, and every worker steps,
  or skips, alike. Any torch optimizer works; its type, hyperparameters and state are compared
  across the workers (``KVStore.agree``) when they change: at the first step, after a
  ``load_state_dict``, after a scheduler's change. (A state changed in place, as
  ``opt.state[p]['exp_avg'].zero_()`` on some workers, is not seen.)
- ``update_on_kvstore=True``: the store runs the optimizer (ZeRO-1: each key's state on its
  home). ``step()`` pushes the gradients and pulls the parameters. ``torch.optim.SGD`` (with
  momentum and weight decay) and ``torch.optim.Adam`` are translated to the store's; a learning
  rate changed in ``param_groups`` (by a scheduler) is passed on at the next step. The store
  sums the gradients as backward made them, so this mode refuses what must change them first:
  a GradScaler, and gradient clipping or any other change to the gradients between
  ``backward()`` and ``step()`` raise a ``ValueError`` naming ``update_on_kvstore=False``. The
  optimizer's state is in the store: checkpoint it with ``store.save``. With momentum, a
  changed learning rate applies to new gradients only (MXNet's rule; torch also rescales the
  momentum).

The default is True for SGD and Adam and False otherwise. No torch is needed to build or import
``kvstore``; this module imports torch when it is used.

Parameters that get no gradient are never moved, as with DDP and plain torch: a frozen
parameter (``requires_grad=False``) is never pushed, and a parameter that got no gradient on
any worker in a step keeps ``.grad`` as it was (``None``) and is not pushed; one that got a
gradient on some workers only is summed with zeros from the others
(``find_unused_parameters=True``). ``no_sync()`` accumulates gradients locally over several
backward passes, as DDP's does; the next backward outside it synchronizes.

``buffers=model.named_buffers()`` keeps the model's buffers (BatchNorm's running statistics)
equal to worker 0's, as DDP's ``broadcast_buffers=True`` does.

Every call the wrapper makes carries its count of backward passes and steps into the store's
check (``KVStore.set_tag``): a worker that skipped a ``step()`` or a backward, or ran out of
batches before the others (DDP's ``join`` has no equivalent here), fails the next call on every
worker with a ``DesyncError``, instead of summing gradients of different steps.

``overlap=True`` moves the communication into the backward pass. A hook on each parameter
(``register_post_accumulate_grad_hook``) marks its gradient ready. Parameters are put in buckets
of about ``bucket_mb`` MiB, in reverse order, as backward reaches them. Each bucket is queued on
the store (``pushpull_async``, or ``push_async`` with ``update_on_kvstore=True``) once its
gradients are ready and the buckets before it are queued, and the store sums it while backward
computes the layers below. The results are those of ``overlap=False``. With
``update_on_kvstore=True`` the store has then run the optimizer on each bucket during backward:
call ``step()`` after each backward (``no_sync()`` to accumulate), and use it only where every
parameter that gets a gradient on one worker gets one on every worker (a parameter used on some
workers only raises a ``DesyncError`` there; one used on none is fine).

``gradient_as_bucket_view=True`` (with ``update_on_kvstore=False``, as DDP's option of that name)
keeps the gradients as views into flat buffers, one per bucket of about ``bucket_mb`` MiB of the
parameters trainable when the wrapper is made. Each bucket is one store key, summed in place:
no gradient is copied into a packed buffer and out again, and a call carries one key per bucket
instead of one per parameter. A gradient set to ``None`` (by any ``zero_grad``) becomes its view
again, zeroed, when backward reaches it and before autograd adds to it: backward writes into the
bucket with no copy, and a parameter backward does not reach keeps ``None``, as in plain torch.
Each view has its parameter's strides (a channels_last conv's gradient is laid out as the conv,
as fused optimizers need). A parameter made trainable later travels as a key of its own. The store then
holds the buckets' sums: checkpoint the model and the optimizer with torch, whose state dicts
name the parameters, as in any ``update_on_kvstore=False`` run. With the store stepping it is
refused: there each parameter stays a key of its own, so that the store's checkpoints name
parameters and a parameter with no gradient is never stepped.

``prefetch=model`` (with ``update_on_kvstore=True``) moves the pull into the next forward:
``step()`` queues the pull of the new parameters and returns, and each module of ``model`` waits
for its own parameters' pull when its forward begins (its first forward pre-hook, ahead of a
``weight_norm``'s), so the first layers compute while the last ones still arrive (FSDP's
forward prefetch, for the parameters the store stepped). The parameters are those of
``prefetch=None``, bit for bit. A module whose forward reads a child's parameters without
calling it (``nn.MultiheadAttention``'s ``out_proj``) is seen doing so in the first forward and
waits for them from then on; a forward that first does so while their pull is queued fails
that ``step()`` on every worker. Until its module's next forward a parameter may still be
written by the store: ``state_dict()`` and ``load_state_dict()`` of any module of the model,
``step()`` and ``opt.synchronize()`` wait for every pull; call ``opt.synchronize()`` before
reading the parameters any other way (``p.data``, an EMA of the weights), and before a call on
another dist store (another wrapper's included), whose calls could otherwise reach the wire in
another order on another worker (a ``DesyncError``). See python/README.md for
``torch.compile``.
"""

import contextlib
import hashlib
import threading
import weakref
from dataclasses import replace

import torch

from . import DesyncError, DistError, KVStore, RankExitedError, WorldChangedError, _told, create
from . import optimizer as _kvopt
from ._grad_buckets import GradBuckets


def _translate(opt, workers):
    """The store optimizer equivalent to a torch SGD or Adam, or a ValueError saying why not.
    The store sums the gradients of ``workers`` workers, each the mean over its part of the
    batch: ``rescale_grad`` makes that the mean over the whole batch, as one process (and
    DistributedDataParallel) would step on."""
    groups = opt.param_groups
    keys = {
        torch.optim.SGD: ("lr", "momentum", "weight_decay", "dampening", "nesterov"),
        torch.optim.Adam: ("lr", "betas", "eps", "weight_decay", "amsgrad"),
    }
    kind = type(opt)
    if kind not in keys:
        raise ValueError(
            f"update_on_kvstore=True needs torch.optim.SGD or torch.optim.Adam, got "
            f"{kind.__name__}: pass update_on_kvstore=False to step it locally"
        )
    first = {k: groups[0].get(k) for k in keys[kind]}
    for g in groups[1:]:
        if any(g.get(k) != first[k] for k in keys[kind]):
            raise ValueError(
                "the store runs one optimizer for every parameter, but the param_groups have "
                "different hyperparameters: pass update_on_kvstore=False"
            )
    if groups[0].get("maximize", False):
        raise ValueError("maximize=True is not supported on the store: pass update_on_kvstore=False")
    if kind is torch.optim.SGD:
        if first["dampening"] or first["nesterov"]:
            raise ValueError(
                "the store's SGD has no dampening or Nesterov momentum: pass "
                "update_on_kvstore=False"
            )
        return _kvopt.SGD(
            learning_rate=float(first["lr"]),
            momentum=float(first["momentum"]),
            wd=float(first["weight_decay"]),
            rescale_grad=1.0 / workers,
        )
    if first["amsgrad"]:
        raise ValueError("the store's Adam has no AMSGrad: pass update_on_kvstore=False")
    if groups[0].get("decoupled_weight_decay", False):
        raise ValueError(
            "the store's Adam has L2 weight decay, not decoupled (AdamW): pass "
            "update_on_kvstore=False"
        )
    beta1, beta2 = first["betas"]
    return _kvopt.Adam(
        learning_rate=float(first["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        epsilon=float(first["eps"]),
        wd=float(first["weight_decay"]),
        rescale_grad=1.0 / workers,
        epsilon_after_correction=True,
    )


def _with_grad(closure):
    def run():
        with torch.enable_grad():
            return closure()

    return run


def _translatable(opt):
    """Whether the store can run ``opt`` (the default of ``update_on_kvstore``)."""
    try:
        _translate(opt, 1)
    except ValueError:
        return False
    return True


def _settings(opt):
    """The torch optimizer's type and every param group's hyperparameters, in words that every
    worker writes alike."""

    def plain(v):
        if isinstance(v, torch.Tensor):
            return v.tolist() if v.numel() <= 16 else f"tensor{tuple(v.shape)}"
        if isinstance(v, (list, tuple)):
            return type(v)(plain(x) for x in v)
        return v

    groups = [
        f"{len(g['params'])} params "
        + ", ".join(f"{k}={plain(g[k])!r}" for k in sorted(g) if k != "params")
        for g in opt.param_groups
    ]
    return f"torch {type(opt).__module__}.{type(opt).__qualname__} stepping locally: " + "; ".join(
        groups
    )


def _state_digest(opt):
    """A SHA-256 of the torch optimizer's state: for each parameter (in ``param_groups``
    order) its state entries by name, tensors by dtype, shape and bytes. Equal on workers that
    will step alike; one copy to the host of the state (about the model's size, or twice it)."""
    h = hashlib.sha256()

    def feed(v):
        # Tensors by their bytes (never their repr, which names the worker's own GPU), and
        # containers walked, as LBFGS and others keep lists of tensors.
        if isinstance(v, torch.Tensor):
            t = v.detach().reshape(-1).contiguous()
            h.update(f"tensor {v.dtype} {tuple(v.shape)};".encode())
            h.update(t.view(torch.uint8).cpu().numpy().tobytes())
        elif isinstance(v, (list, tuple)):
            h.update(f"{type(v).__name__} {len(v)};".encode())
            for x in v:
                feed(x)
        elif isinstance(v, dict):
            h.update(f"dict {len(v)};".encode())
            for k in sorted(v, key=repr):
                h.update(f"{k!r}:".encode())
                feed(v[k])
        else:
            h.update(f"{type(v).__name__} {v!r};".encode())

    order = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    entries = sorted(opt.state.items(), key=lambda kv: order.get(id(kv[0]), -1))
    for p, state in entries:
        h.update(f"param {order.get(id(p), -1)};".encode())
        feed(dict(state))
    return h.hexdigest()


def _once(tensors):
    """``tensors`` with each one once: a parameter listed twice in ``param_groups`` (torch
    warns, and steps it twice) carries one gradient, averaged once."""
    return list({id(t): t for t in tensors}.values())


def _same(a, b):
    """Whether two norms are the same: equal, or both NaN (a NaN gradient left as backward made
    it is no change, though NaN equals nothing)."""
    return torch.equal(a, b) or bool(torch.isnan(a).all() and torch.isnan(b).all())


class _Prefetch:
    """(prefetch) The model's modules, by id: each parameter's module (``owner``), each
    module's parent, what each module's forward waits for (``waits``: its own parameters,
    and those its forward was seen to read for a child that did not run), and since the last
    step the modules whose forward ran and the parameters that got a gradient."""

    def __init__(self, root):
        self.root = root
        self.owner, self.parent, self.waits = {}, {}, {}
        self.fired, self.used = set(), set()


class _NoHook:
    """What a prefetch hook becomes in a copy of its module (``copy.deepcopy``, pickling with
    ``torch.save``): a copy is not the wrapper's model, so it waits for nothing."""

    def __call__(self, *_args, **_kwargs):
        return None


class _WaitHook:
    """A module's forward pre-hook: waits for the pulls of what the module reads."""

    def __init__(self, wrapper, mid):
        self._wrapper = weakref.ref(wrapper)
        self._mid = mid

    def __call__(self, _module, _args):
        wrapper = self._wrapper()
        if wrapper is not None:
            wrapper._module_forward(self._mid)

    def __reduce__(self):
        return (_NoHook, ())


class _SyncHook:
    """A ``state_dict`` or ``load_state_dict`` pre-hook: waits for every pull (a load after
    ``step()`` would be overwritten by the queued pull otherwise)."""

    def __init__(self, wrapper):
        self._wrapper = weakref.ref(wrapper)

    def __call__(self, *_args, **_kwargs):
        wrapper = self._wrapper()
        if wrapper is not None:
            wrapper.synchronize()

    def __reduce__(self):
        return (_NoHook, ())


class DistributedOptimizer:
    """Wraps a torch optimizer so that its gradients are summed through a kvstore, as
    ``DistributedDataParallel`` sums them (see the module's doc for the contract).

    Parameters are the store's keys: their names when ``named_parameters`` is given (as
    ``model.named_parameters()``), else their positions in ``param_groups`` (0, 1, ...). The
    constructor initializes the store with the current parameters, frozen ones included (a
    checkpoint names them all), and every worker starts from the store's. Everything else
    (``zero_grad``, ``param_groups``, ``state_dict``) is the wrapped optimizer's.

    ``buffers`` (``model.named_buffers()``, or a list of tensors) are kept equal across the
    workers as DDP's ``broadcast_buffers=True`` keeps them: worker 0's values are copied to
    every worker at the start and after every ``step()`` (BatchNorm's running statistics), so
    each forward starts from worker 0's, as with DDP. They go through a second store of the same
    kind (integer buffers as float64, exact up to 2**53). ``broadcast_buffers=True`` without
    ``buffers`` raises a ValueError, since the wrapper sees the optimizer's parameters, not the
    model's buffers.

    ``gradient_as_bucket_view=True`` (``update_on_kvstore=False`` only, else a ``ValueError``)
    keeps the gradients as views into one flat buffer per bucket, each bucket a store key (see
    the module's doc).

    ``prefetch=model`` waits for each parameter's pull at its module's next forward instead of
    in ``step()`` (see the module's doc): a ``TypeError`` for anything but a ``torch.nn.Module``,
    a ``ValueError`` with ``update_on_kvstore=False`` or a model that does not hold every one
    of the optimizer's parameters.

    **A lost worker** (``mpirun --with-ft ulfm``, a ``dist_sync`` store): the survivors go on
    with fewer workers, and the call in flight raises ``kvstore.WorldChangedError`` out of
    ``step()``, ``backward()`` or a forward (prefetch). Before it reaches the loop, the wrapper
    follows the new world:

    - the store's ``rescale_grad`` becomes 1 / the new ``store.num_workers`` (with
      ``update_on_kvstore=False`` the average already divides by it at every backward), and
      the optimizer's state is kept: reloaded from ``e.restored`` when the store went back to
      its checkpoint; kept in the store when it lost nothing (``set_optimizer(...,
      keep_state=True)``);
    - with ``update_on_kvstore=True`` every worker's parameters are pulled from the store, so
      they are the checkpoint's (``e.restored``), or those of the last call that committed; a
      store with no checkpoint, which forgot every key, is initialized again from the new rank
      0's parameters, with the optimizer's state afresh;
    - with ``update_on_kvstore=False`` the parameters and the torch optimizer's state are the
      loop's: reload them from your own checkpoint when ``e.restored`` is set;
    - the calls in flight are dropped, the counts in every call's check start again at 0 on
      every survivor, and the buffers go back to the new rank 0's;
    - then ``on_world_change(e)`` is called, if given (the place for a learning-rate rule, a
      log line), and the error is raised on.

    The loop then re-shards its data by ``store.rank`` and ``store.num_workers``, and goes on:
    from the checkpoint's step if ``e.restored``; from the next step if ``e.committed`` (the
    step took effect on every survivor); else it redoes the step. ``examples/train_torch.py
    --elastic`` shows the loop.
    """

    def __init__(
        self,
        optimizer,
        store=None,
        *,
        named_parameters=None,
        update_on_kvstore=None,
        overlap=False,
        bucket_mb=1.0,
        buffers=None,
        broadcast_buffers=None,
        prefetch=None,
        on_world_change=None,
        gradient_as_bucket_view=False,
    ):
        if store is None:
            store = create("local")
        if not isinstance(store, KVStore):
            raise TypeError(f"store must be a kvstore.KVStore, got {type(store).__name__}")
        if getattr(store, "_torch_wrapper", False):
            raise ValueError(
                "this store already synchronizes another DistributedOptimizer: the store holds "
                "one optimizer and one step count, so give each DistributedOptimizer a store of "
                "its own (kvstore.create(...) again)"
            )
        if on_world_change is not None and not callable(on_world_change):
            raise TypeError(
                f"on_world_change takes a function of the WorldChangedError, got "
                f"{type(on_world_change).__name__}"
            )
        if broadcast_buffers and buffers is None:
            raise ValueError(
                "broadcast_buffers=True needs the model's buffers (the wrapper sees the "
                "optimizer's parameters only): pass buffers=model.named_buffers()"
            )
        self.optimizer = optimizer
        self.store = store
        store._torch_wrapper = True
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is not None:
            names = {id(p): n for n, p in named_parameters}
            missing = [i for i, p in enumerate(self._params) if id(p) not in names]
            if missing:
                raise ValueError(
                    f"named_parameters has no name for {len(missing)} of the optimizer's "
                    f"parameters: pass model.named_parameters() of the model being optimized"
                )
            self._keys = [names[id(p)] for p in self._params]
        else:
            self._keys = list(range(len(self._params)))
        if update_on_kvstore is None:
            update_on_kvstore = _translatable(optimizer)
        self.update_on_kvstore = bool(update_on_kvstore)
        self.overlap = bool(overlap)
        if self.overlap and not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise RuntimeError("overlap=True needs torch >= 2.1 (register_post_accumulate_grad_hook)")
        if (self.overlap or gradient_as_bucket_view) and not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if gradient_as_bucket_view:
            if self.update_on_kvstore:
                raise ValueError(
                    "gradient_as_bucket_view=True needs update_on_kvstore=False (torch steps): "
                    "when the store steps, each parameter is a key of its own, so that a "
                    "checkpoint names parameters and a parameter with no gradient is never "
                    "stepped; pass update_on_kvstore=False, or leave gradient_as_bucket_view off"
                )
            if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
                raise RuntimeError(
                    "gradient_as_bucket_view=True needs torch >= 2.1 "
                    "(register_post_accumulate_grad_hook)"
                )
        if prefetch is not None:
            if not isinstance(prefetch, torch.nn.Module):
                raise TypeError(
                    f"prefetch takes the model (a torch.nn.Module), got {type(prefetch).__name__}"
                )
            if not self.update_on_kvstore:
                raise ValueError(
                    "prefetch needs update_on_kvstore=True: with torch stepping, step() needs "
                    "the averaged gradients, so there is no pull left to move into the next "
                    "forward"
                )
        # The torch settings the workers last agreed on (update_on_kvstore=False), and whether
        # the optimizer's state is to be compared at the next step: at the first, and after a
        # load_state_dict (seen by torch's post-hook, and, where torch has none, by the state
        # dict's id, since torch's load replaces the dict; no reference is kept to the old one).
        self._agreed = None
        self._state_due = True
        self._state_id = id(optimizer.state)
        if hasattr(optimizer, "register_load_state_dict_post_hook"):
            optimizer.register_load_state_dict_post_hook(self._state_loaded)
        # Under mpirun --with-ft ulfm a lost rank changes the world: what to call then, how
        # many world changes were seen, and the world size the store's rescale_grad was set for.
        self._on_world_change = on_world_change
        self._world_changes = 0
        self._rescaled_for = self.store.num_workers
        if self.update_on_kvstore:
            self._translated = _translate(optimizer, self.store.num_workers)
            self.store.set_optimizer(self._translated)
            self._lr = float(optimizer.param_groups[0]["lr"])
        # (gradient_as_bucket_view) The gradients' flat buffers, each bucket a key of its own.
        self._grads = None
        if gradient_as_bucket_view:
            self._grads = self._make_grad_buckets(float(bucket_mb))
        with torch.no_grad():
            keys, values = self._held_keys()
            if self._grads is not None:
                # The parameters travel in their buckets' buffers, once, before any gradient.
                for i, view in self._grads.views.items():
                    view.copy_(self._params[i].detach())
            self.store.init(keys, values)
            # Every worker starts from the store's parameters (a no-op in one process).
            self.store.pull(keys, out=values)
            if self._grads is not None:
                for i, view in self._grads.views.items():
                    self._params[i].detach().copy_(view)
                for flat in self._grads.flats:
                    flat.zero_()
        # Counts that go into every call's check (set_tag): backward passes begun, steps made.
        self._backwards = 0
        self._steps = 0
        self._tag = None
        self._lock = threading.Lock()  # autograd may run hooks on one thread per device
        self._in_backward = False
        self._no_sync = False
        self._synced = False  # (torch steps) the gradients were averaged since the last step
        self._norms = {}  # (store steps) each gradient's norm when backward left it
        self._hooked = [False] * len(self._params)
        self._hooks = []
        if self._grads is not None:
            for i in self._grads.views:
                self._hooks.append(
                    self._params[i].register_hook(lambda g, i=i: self._grad_arriving(i, g))
                )
        self._bucket_mb = float(bucket_mb)
        self._buckets = []
        self._bucket_of = {}  # (overlap) parameter index -> its bucket
        self._reset_overlap()
        self._hook_new_parameters()
        self._buffer_store = None  # (several workers, with buffers) the buffers' own store
        if buffers is not None and broadcast_buffers is not False:
            self._start_buffers(buffers)
        # (prefetch) The parameters whose pull is still queued: index -> key.
        self._pending = {}
        self._pull_later = []  # (prefetch) what step() queues once the buffers are broadcast
        self._prefetch = None  # (prefetch) the model's module tree: see _hook_prefetch
        if prefetch is not None:
            self._hook_prefetch(prefetch)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def _make_grad_buckets(self, bucket_mb):
        """The flat gradient buffers of the parameters trainable now; a parameter made
        trainable later travels as a key of its own."""
        n = len(self._params)
        if all(isinstance(k, str) for k in self._keys):
            taken = set(self._keys)

            def key(b):
                name = f"kvstore.torch/gradient bucket {b}"
                if name in taken:
                    raise ValueError(
                        f"a parameter is named {name!r}, the name of a gradient bucket's key: "
                        f"rename it, or leave gradient_as_bucket_view off"
                    )
                return name
        else:

            def key(b):
                return n + b

        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        return GradBuckets(self._params, trainable, bucket_mb * 2**20, key)

    def _held_keys(self):
        """The keys the store holds and a tensor for each: every parameter's, or with
        gradient buckets, each bucket's (its flat buffer) and the parameters outside them."""
        params = [p.detach() for p in self._params]
        if self._grads is None:
            return list(self._keys), params
        alone = [i for i in range(len(self._params)) if i not in self._grads.bucket]
        return (
            self._grads.keys + [self._keys[i] for i in alone],
            self._grads.flats + [params[i] for i in alone],
        )

    @property
    def param_groups(self):
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def _step_supports_amp_scaling(self):
        # A GradScaler then hands itself to step() instead of skipping it on one worker: with
        # the store stepping, step() refuses it on every worker (see _refuse_changes).
        return self.update_on_kvstore

    def load_state_dict(self, state_dict):
        """The wrapped optimizer's ``load_state_dict``. With ``update_on_kvstore=False`` on
        several workers, the loaded state is compared across them at the next step."""
        self.optimizer.load_state_dict(state_dict)
        self._state_due = True

    def _state_loaded(self, _optimizer):
        self._state_due = True

    def zero_grad(self, set_to_none=True):
        """The wrapped optimizer's ``zero_grad``. After a backward that raised (and was
        caught, to skip the batch), it also drops what that backward left."""
        with self._watch():
            self._abandon_backward()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._grads is not None:
            self._grads.cleared(self._params)

    def _abandon_backward(self):
        """A backward that began and never ended (an exception inside it, caught): its end
        callback never runs, so its state is dropped here, its queued calls waited for."""
        if not self._in_backward:
            return
        self._in_backward = False
        pushed = self.overlap and self.update_on_kvstore and bool(self._queued)
        try:
            if self._queued:
                with self._explained():
                    self.store.wait_all()
        finally:
            self._reset_overlap()
            self._norms = {}
        if pushed:
            with _told(self.store._kv, "push"):
                raise RuntimeError(
                    "a backward pass raised after it had pushed some gradients: with "
                    "overlap=True and update_on_kvstore=True the store already stepped on "
                    "them, so the model and the store differ now; load the last checkpoint. "
                    "Pass overlap=False to skip failed batches"
                )

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate their gradients locally, with no communication,
        as DDP's ``no_sync``: the first backward after it synchronizes the sum."""
        old = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = old

    # Buffers: worker 0's, on every worker.

    def _start_buffers(self, buffers):
        pairs = [x if isinstance(x, tuple) else (i, x) for i, x in enumerate(buffers)]
        if any(not isinstance(b, torch.Tensor) for _, b in pairs):
            raise TypeError("buffers takes model.named_buffers() or a list of tensors")
        self._buffers = [b for _, b in pairs]
        if self.store.num_workers == 1 or not pairs:
            return
        # A store of its own: it only assigns (the parameters' store may run an optimizer).
        self._buffer_store = create(self.store.type)
        self._buffer_keys = [n for n, _ in pairs]
        self._buffer_store.set_tag("kvstore.torch buffers at the start")
        with torch.no_grad():
            self._buffer_store.init(self._buffer_keys, self._buffer_values())
        self._pull_buffers()

    def _buffer_values(self):
        """The buffers as the store carries them: floats as they are, others as float64."""
        return [b.detach() if b.is_floating_point() else b.detach().double() for b in self._buffers]

    def _pull_buffers(self):
        """Pulls into the float buffers in place, and the others through a float64 copy."""
        with torch.no_grad():
            outs = [
                b if b.is_floating_point() else torch.empty_like(b, dtype=torch.float64)
                for b in self._buffers
            ]
            self._buffer_store.pull(self._buffer_keys, out=outs)
            for b, o in zip(self._buffers, outs):
                if o is not b:
                    b.copy_(o)

    def _broadcast_buffers(self):
        """Worker 0's buffers on every worker: the others push zeros, and the sum is kept."""
        if self._buffer_store is None:
            return
        self._buffer_store.set_tag(f"kvstore.torch buffers after step {self._steps}")
        with torch.no_grad():
            values = self._buffer_values()
            if self.store.rank != 0:
                values = [torch.zeros_like(v) for v in values]
            self._buffer_store.push(self._buffer_keys, values)
        self._pull_buffers()

    # The check's tag, and the errors that name what a mismatch means.

    def _set_tag(self):
        tag = f"kvstore.torch backward {self._backwards} step {self._steps}"
        if tag != self._tag:
            self.store.set_tag(tag)
            self._tag = tag

    @contextlib.contextmanager
    def _explained(self):
        """Re-raises a DesyncError or RankExitedError of the wrapper's calls with what it
        means for the loop."""
        try:
            yield
        except RankExitedError as e:
            if "kvstore.torch" in str(e):
                raise
            raise RankExitedError(
                f"{e}. kvstore.torch: if that worker ran out of batches before this one, give "
                f"every worker as many batches (DistributedSampler(drop_last=True)): there is "
                f"no join() for uneven inputs"
            ) from e
        except DesyncError as e:
            if "kvstore.torch" not in str(e) or "what differs" in str(e):
                raise
            raise DesyncError(
                f"{e}. What differs: the workers reached this call after different numbers of "
                f"backward passes or steps: a worker skipped step() (its own if), ran a "
                f"backward the others did not, or ran out of batches first (kvstore.torch has "
                f"no join() for uneven inputs: give every worker as many batches, as "
                f"DistributedSampler(drop_last=True) does). With overlap=True and "
                f"update_on_kvstore=True it also means a parameter got a gradient on some "
                f"workers only: pass overlap=False or update_on_kvstore=False. If the workers "
                f"show the same counts, calls of two stores crossed: with prefetch, call "
                f"opt.synchronize() before calling another dist store"
            ) from e

    # A world change: ranks lost under mpirun --with-ft ulfm, the survivors going on.

    @contextlib.contextmanager
    def _watch(self):
        """Around each entry point (``step``, ``zero_grad``, ``synchronize``, the hooks): a
        ``WorldChangedError`` of a store call is followed (``_world_changed``) once, by the
        innermost, and raised on: the loop re-shards its data and decides what to redo."""
        try:
            yield
        except WorldChangedError as e:
            latest = self._world_changed(e)
            if latest is e:
                raise
            raise latest from e

    def _world_changed(self, e):
        """Follows the world change that ``e`` reports, then calls ``on_world_change``; returns
        the error to raise: ``e``, or the last of the losses seen while following it."""
        if getattr(e, "_kvstore_torch_followed", False):
            return e
        for _ in range(8):  # each round is one more lost rank: the store's quorum ends it
            e._kvstore_torch_followed = True
            try:
                self._follow_world(e)
                break
            except WorldChangedError as again:
                if not again.restored and not e.restored:
                    # A second loss while following the first: the call in flight when it
                    # struck is the wrapper's own, so the user's step stands as ``e`` said.
                    again.committed = e.committed
                e = again
        else:
            raise e
        if self._on_world_change is not None:
            self._on_world_change(e)
        return e

    def _follow_world(self, e):
        """What the wrapper holds that depends on the world: the calls in flight (dropped),
        the counts in every call's check (0 on every survivor), the store's ``rescale_grad``
        (1 / the new number of workers), the store's keys (put back where it lost them) and the
        parameters (pulled from the store, when it steps), and the buffers' store."""
        # Every call in flight failed: queued ones were skipped, and their errors go.
        self._in_backward = False
        self._synced = False
        self._pending = {}
        self._pull_later = []
        self._norms = {}
        self._reset_overlap()
        try:
            self.store.wait_all()
        except DistError:
            pass  # the calls of the old world, queued behind the one that failed
        # The survivors met the loss in different calls (a backward's, a step's): from here on
        # they count alike, and the calls below carry a tag of their own.
        self._world_changes += 1
        self._backwards = 0
        self._steps = 0
        self._tag = None
        self.store.set_tag(f"kvstore.torch: after world change {self._world_changes}")
        self._agreed = None
        self._state_due = True
        workers = self.store.num_workers
        held = set(self.store.keys())
        params = [p.detach() for p in self._params]
        with torch.no_grad():
            if self.update_on_kvstore:
                translated = replace(
                    self._translated, learning_rate=self._lr, rescale_grad=1.0 / workers
                )
                if not held:
                    # No checkpoint: the store forgot every key, and the optimizer's state with
                    # it. It starts again from the new rank 0's parameters.
                    self.store.set_optimizer(translated)
                    self.store.init(self._keys, params)
                    self._rescaled_for = workers
                elif e.restored:
                    # Reloaded from the checkpoint: set the new rescale_grad, then load the
                    # state again (set_optimizer starts it afresh; load keeps the one in force).
                    self.store.set_optimizer(translated)
                    self.store.load(e.restored)
                    self._rescaled_for = workers
                else:
                    # The store kept every key and its state (buddy copies): the new
                    # rescale_grad, keeping that state.
                    self.store.set_optimizer(translated, keep_state=True)
                    self._rescaled_for = workers
                self._translated = replace(
                    self._translated, rescale_grad=1.0 / self._rescaled_for
                )
                # Every worker's parameters become the store's: the checkpoint's, or those of
                # the last call that committed.
                self.store.pull(self._keys, out=params)
            elif not held:
                # The store only sums (torch steps): its keys need only exist again.
                self.store.init(*self._held_keys())
        if self._buffer_store is not None:
            self._follow_buffers()

    def _follow_buffers(self):
        """The buffers' store after a world change: it learns of it at its next call (a
        barrier here), then holds worker 0's buffers again."""
        try:
            self._buffer_store.barrier()
        except WorldChangedError:
            pass  # it went through the change too
        if not set(self._buffer_store.keys()):
            with torch.no_grad():
                self._buffer_store.init(self._buffer_keys, self._buffer_values())
        self._pull_buffers()

    # Hooks: every backward pass is counted, and what it reached recorded.

    def _hook_new_parameters(self):
        """Hooks every trainable parameter not hooked yet (at the start, and parameters made
        trainable later), and puts it in a bucket."""
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            return  # torch < 2.1: backward is not seen; step() synchronizes
        new = False
        for i, p in enumerate(self._params):
            if not self._hooked[i] and p.requires_grad:
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
                )
                self._hooked[i] = True
                new = True
        if new and self.overlap:
            self._make_buckets(self._bucket_mb)

    def _grad_arriving(self, i, g):
        """(gradient buckets) Before autograd accumulates ``g``: a ``None`` gradient becomes
        the parameter's view, so that backward writes into the bucket."""
        with self._lock:
            self._grads.arriving(i, self._params[i], g)

    def _grad_ready(self, i):
        if self._prefetch is not None:
            self._prefetch.used.add(i)
        if self._grads is not None and i in self._grads.bucket:
            with self._lock:
                self._grads.adopt(i, self._params[i])
        if self._in_backward and not self.overlap:
            # No store call to make (the common hook when torch steps): no world change to
            # follow, so not the cost of _watch at each of a thousand parameters.
            return
        with self._watch(), self._lock:
            if not self._in_backward:
                self._backward_begins()
            if self.overlap and not self._no_sync and self._pushes():
                if not self._ready[i]:
                    self._ready[i] = True
                    self._missing[self._bucket_of[i]] -= 1
                self._queue_ready_buckets()

    def _backward_begins(self):
        if self.overlap and self.update_on_kvstore and self._next > 0 and not self._no_sync:
            # The store already ran the optimizer on the last backward's buckets: a second
            # backward would push its sum again. Every worker is told (a worker that skipped
            # step() meets the others' step here: DesyncError on each).
            self.store.agree("kvstore.torch: a backward pass before step(), after the last "
                             "backward's gradients were pushed")
            raise RuntimeError(
                "a backward pass began after the last one's gradients were pushed and before "
                "step(): with overlap=True and update_on_kvstore=True the store runs the "
                "optimizer on each backward's gradients, so call step() after each backward, "
                "accumulate under opt.no_sync(), or pass overlap=False"
            )
        self._in_backward = True
        self._backwards += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self):
        """The end of a backward pass. Torch steps: the gradients are averaged now (unless in
        no_sync), so what runs before step() sees them as DDP's users do. The store steps: each
        gradient's norm is kept, to see a change made before step() (with overlap, after
        backward pushed some of them)."""
        self._in_backward = False
        if self.update_on_kvstore:
            self._norms = self._grad_norms(
                [i for i, p in enumerate(self._params) if p.grad is not None]
            )
            return
        if not self._no_sync:
            with self._watch(), self._explained():
                self._sync_grads()

    # One worker's use of the parameters, and the workers' together.

    def _pushes(self):
        """Whether gradients go through the store: with several workers, or the store
        stepping."""
        return self.update_on_kvstore or self.store.num_workers > 1

    def _local_use(self):
        """Which parameters have a gradient on this worker: trainable, with a ``.grad`` (as a
        torch optimizer sees it: a frozen parameter, or one backward did not reach since
        ``zero_grad()``, has none). A sparse gradient is refused, on every worker."""
        use = [p.requires_grad and self._has_grad(i, p) for i, p in enumerate(self._params)]
        self._refuse_sparse([i for i, u in enumerate(use) if u], "agree")
        return use

    def _refuse_sparse(self, indices, op):
        """A TypeError, told to the other workers at their next ``op``, if any of ``indices``
        has a sparse gradient."""
        sparse = [
            self._keys[i] for i in indices
            if self._params[i].grad is not None and self._params[i].grad.layout != torch.strided
        ]
        if sparse:
            with _told(self.store._kv, op):
                raise TypeError(
                    f"the gradients of {sparse[:5]} are sparse (nn.Embedding(sparse=True)): "
                    f"kvstore.torch sums dense gradients; make the layer dense (sparse=False)"
                )

    def _has_grad(self, i, p):
        """Whether parameter ``i`` (``p``) has a gradient, as torch sees one (a gradient
        bucket's view holds none until backward adds to it)."""
        if self._grads is not None and i in self._grads.bucket:
            return self._grads.holds(i, p)
        return p.grad is not None

    def _used_anywhere(self, mine):
        """For each parameter, whether it has a gradient on any worker (``mine``: on this one).
        One small call, whose check carries the counts."""
        if self.store.num_workers == 1:
            return mine
        self._set_tag()
        return self.store.any_of("kvstore.torch: parameters with a gradient", mine)

    def _fill(self, indices):
        """A zero gradient for each of ``indices`` that has none (used on another worker);
        the indices filled."""
        filled = [i for i in indices if not self._has_grad(i, self._params[i])]
        for i in filled:
            if self._grads is not None and i in self._grads.bucket:
                self._grads.fill(i, self._params[i])
            else:
                self._params[i].grad = torch.zeros_like(self._params[i])
        return filled

    def _summed(self, indices):
        """The store keys and the tensors that carry the gradients of ``indices`` (each with
        a gradient here, or filled): each gradient bucket that holds any of them, whole, and
        the gradients of the others."""
        if self._grads is None:
            return [self._keys[i] for i in indices], [self._params[i].grad for i in indices]
        buckets, alone = self._grads.carriers(self._params, indices)
        return (
            [self._grads.keys[b] for b in buckets] + [self._keys[i] for i in alone],
            [self._grads.flats[b] for b in buckets] + [self._params[i].grad for i in alone],
        )

    # Torch steps: the gradients averaged at the end of backward.

    def _sync_grads(self):
        """Averages the gradients of every parameter used on any worker, in place."""
        try:
            used = None
            if self.overlap:
                used = self._finish_overlapped_sync()
            elif self.store.num_workers > 1:
                self._agree_torch_step()
                used = self._used_anywhere(self._local_use())
                indices = [i for i, u in enumerate(used) if u]
                self._fill(indices)
                if indices:
                    keys, sums = self._summed(indices)
                    with torch.no_grad():
                        self.store.pushpull(keys, sums)
                        for t in _once(sums):
                            t.div_(self.store.num_workers)
            if self._grads is not None:
                if used is None:  # one worker
                    used = [self._has_grad(i, p) for i, p in enumerate(self._params)]
                self._grads.settle(self._params, used)
        finally:
            self._reset_overlap()
        self._synced = True

    def _agree_torch_step(self):
        """With update_on_kvstore=False on several workers: torch steps on every worker, so
        they must step alike. Its settings are compared when changed (a worker that changes
        alone calls agree where the others call the store, and that fails too); its state at
        the first step and after a load_state_dict (which replaces the state dict), since
        momentum loaded on some workers only would step them apart."""
        if self.store.num_workers == 1:
            return
        self._set_tag()
        with _told(self.store._kv, "agree"):
            self._check_unchanged()
        settings = _settings(self.optimizer)
        if settings != self._agreed:
            self.store.agree(settings)
            self._agreed = settings
        if self._state_due or id(self.optimizer.state) != self._state_id:
            # A failure here (the host copy) is told to the other workers, which are in the
            # agree below.
            with _told(self.store._kv, "agree"):
                digest = _state_digest(self.optimizer)
            self.store.agree(f"torch optimizer state sha256 {digest}")
            self._state_due = False
            self._state_id = id(self.optimizer.state)

    def _check_unchanged(self):
        """A ValueError when the optimizer's parameters, or (update_on_kvstore) any of its
        hyperparameters but the learning rate, changed since this wrapper was made."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(params) != len(self._params) or any(p is not q for p, q in zip(params, self._params)):
            raise ValueError(
                "the optimizer's parameters changed after DistributedOptimizer was made (a "
                "param group added or removed): the store holds only the first ones, so the "
                "others would never be synchronized; make a new DistributedOptimizer"
            )
        if self.update_on_kvstore:
            now = _translate(self.optimizer, self._rescaled_for)
            if replace(now, learning_rate=self._translated.learning_rate) != self._translated:
                raise ValueError(
                    f"the optimizer's hyperparameters changed after DistributedOptimizer was "
                    f"made ({self._translated} -> {now}); the store follows a changed "
                    f"learning rate only: pass update_on_kvstore=False to step with torch"
                )

    # The store steps: what must not have happened between backward and step().

    def _grad_norms(self, indices):
        """Each gradient's norm, by parameter index, in one pass over them: a change of scale
        (clipping, unscaling) changes it."""
        grads = [self._params[i].grad.detach() for i in indices]
        if not grads:
            return {}
        with torch.no_grad():
            return dict(zip(indices, torch._foreach_norm(grads)))

    def _refuse_changes(self, scaler):
        """(the store steps) A ValueError for a GradScaler, and for a gradient changed since
        backward made it (clipping, a GradScaler's unscale_, a user's own change)."""
        if scaler:
            raise ValueError(
                "update_on_kvstore=True cannot take a GradScaler: the store runs the optimizer "
                "on the sum of the gradients as backward made them, so it can neither unscale "
                "them nor skip a step whose averaged gradient is not finite on every worker. "
                "Pass update_on_kvstore=False (torch steps on the averaged gradients, as with "
                "DDP)"
            )
        now = self._grad_norms([i for i in self._norms if self._params[i].grad is not None])
        changed = [
            self._keys[i] for i, n in self._norms.items() if i not in now or not _same(now[i], n)
        ]
        if changed:
            raise ValueError(
                f"the gradients of {changed[:5]} changed between backward() and step() "
                f"(gradient clipping, a GradScaler's unscale_, a change of your own): with "
                f"update_on_kvstore=True the store sums the gradients as backward made them "
                f"and steps on the sum, so it cannot clip by the global norm or skip a step. "
                f"Pass update_on_kvstore=False (torch steps on the gradients averaged at the "
                f"end of backward, as with DDP)"
            )

    # Overlap: buckets queued from the hooks while backward runs.

    def _make_buckets(self, bucket_mb):
        """Buckets of the hooked parameters' indices, in reverse order (backward reaches the last
        layers first), closed once they hold ``bucket_mb`` MiB. The same on every worker: the
        model is."""
        cap = bucket_mb * 2**20
        self._buckets, bucket, size = [], [], 0
        # Gradient buckets first, as they are (they hold the parameters trainable at the start).
        views = {} if self._grads is None else self._grads.bucket
        if self._grads is not None:
            self._buckets = [list(m) for m in self._grads.members]
        for i in reversed(range(len(self._params))):
            p = self._params[i]
            if not self._hooked[i] or i in views:
                continue
            bucket.append(i)
            size += p.numel() * p.element_size()
            if size >= cap:
                self._buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self._buckets.append(bucket)
        self._bucket_of = {i: b for b, members in enumerate(self._buckets) for i in members}
        self._missing = [len(b) for b in self._buckets]

    def _reset_overlap(self):
        self._ready = [False] * len(self._params)
        self._missing = [len(b) for b in self._buckets]  # per bucket: gradients not ready yet
        self._queued = []  # indices of the parameters queued since the last synchronization
        self._queued_sums = []  # (torch steps) the tensors queued, averaged once summed
        self._next = 0  # the first bucket not queued yet

    def _queue_ready_buckets(self):
        # A count per bucket, not a scan of it at each hook: a model of 1000 parameters in one
        # bucket made a million checks per backward.
        while self._next < len(self._buckets) and self._missing[self._next] == 0:
            self._queue_bucket(self._buckets[self._next])
            self._next += 1

    def _queue_bucket(self, bucket, used=None):
        """Queues a bucket's gradients: all of them when queued from backward's hooks (each is
        ready), else those in ``used``, with zeros for the ones this worker has none of."""
        live = bucket if used is None else [j for j in bucket if used[j]]
        if not live:
            return []
        self._refuse_sparse(live, "push")
        if not self._queued:
            self._begin_overlapped()
        filled = self._fill(live)
        keys, sums = self._summed(live)
        # MXNet's priority: the first layers, needed first by the next forward, highest.
        priority = -min(live)
        with torch.no_grad():
            if self.update_on_kvstore:
                self.store.push_async(keys, sums, priority=priority)
            else:
                self.store.pushpull_async(keys, sums, priority=priority)
        self._queued.extend(live)
        self._queued_sums.extend(sums)
        return filled

    def _begin_overlapped(self):
        """Before the first bucket of a backward: the tag, and the checks and the learning
        rate that ``step()`` applies before pushing."""
        self._set_tag()
        if self.update_on_kvstore:
            with _told(self.store._kv, "push"):
                self._check_unchanged()
            lr = float(self.optimizer.param_groups[0]["lr"])
            if lr != self._lr:
                self.store.set_learning_rate(lr)
                self._lr = lr
        else:
            self._agree_torch_step()

    def _queue_rest(self, used):
        """Queues the buckets backward did not complete: the parameters in ``used`` (None:
        all), with zeros for those without a gradient here; the parameters given zeros."""
        filled = []
        while self._next < len(self._buckets):
            filled += self._queue_bucket(self._buckets[self._next], used)
            self._next += 1
        # Parameters made trainable since the last step have no hook yet (they get one at
        # step()): one bucket of their own, last.
        unhooked = [
            i for i, p in enumerate(self._params) if p.requires_grad and not self._hooked[i]
        ]
        if unhooked:
            filled += self._queue_bucket(unhooked, used)
        return filled

    def _finish_overlapped_sync(self):
        """(torch steps) The end of backward: the rest queued, every bucket's parameters in it
        (so every worker queues the same calls, whatever it used), the sums in, averaged. Then
        a parameter used on no worker gets back the ``None`` gradient it had. Returns, per
        parameter, whether any worker used it (None with one worker)."""
        if self.store.num_workers == 1:
            return None
        mine = self._local_use()
        filled = self._queue_rest(None)
        self.store.wait_all()
        used = self._used_anywhere(mine)
        with torch.no_grad():
            for t in _once(self._queued_sums):
                t.div_(self.store.num_workers)
        for i in filled:
            if not used[i]:
                self._params[i].grad = None
        return used

    # Prefetch: the pull of the parameters waited for at their module's next forward.

    def _hook_prefetch(self, model):
        """A forward pre-hook on every module of ``model``, run before the module's own ones
        (a ``weight_norm`` computes its weight in one), that waits for the queued pulls of the
        parameters the module holds; and ``state_dict`` and ``load_state_dict`` pre-hooks that
        wait for every pull."""
        index = {id(p): i for i, p in enumerate(self._params)}
        tree = _Prefetch(id(model))
        for module in model.modules():
            mid = id(module)
            for child in module.children():
                tree.parent.setdefault(id(child), mid)
            for p in module.parameters(recurse=False):
                i = index.get(id(p))
                if i is not None and i not in tree.owner:
                    tree.owner[i] = mid
                    tree.waits.setdefault(mid, []).append(i)
            module.register_forward_pre_hook(_WaitHook(self, mid), prepend=True)
            if hasattr(module, "register_state_dict_pre_hook"):
                module.register_state_dict_pre_hook(_SyncHook(self))
            if hasattr(module, "register_load_state_dict_pre_hook"):
                module.register_load_state_dict_pre_hook(_SyncHook(self))
        outside = [self._keys[i] for i in range(len(self._params)) if i not in tree.owner]
        if outside:
            raise ValueError(
                f"prefetch: the optimizer steps parameters that no module of this model holds "
                f"({outside[:5]}): nothing would wait for their pull; pass the model that "
                f"holds every parameter the optimizer steps, or prefetch=None"
            )
        self._prefetch = tree

    def _module_forward(self, mid):
        """A module's forward begins: waits for the pulls of what it reads."""
        self._prefetch.fired.add(mid)
        with self._watch():
            self._await(self._prefetch.waits.get(mid, ()))

    def _check_prefetched_reads(self):
        """At step(): a parameter that got a gradient while its pull was still queued was read
        by a forward that did not run its module (``nn.MultiheadAttention`` reads its
        ``out_proj``'s weight itself). From now on the nearest module whose forward ran waits
        for it; this step, computed from a parameter the store may have been writing, fails on
        every worker."""
        tree = self._prefetch
        used, fired = tree.used, tree.fired
        tree.used, tree.fired = set(), set()
        for i in used:
            mid = tree.owner[i]
            if mid in fired:
                continue
            while mid in tree.parent and mid not in fired:
                mid = tree.parent[mid]
            if i not in tree.waits.setdefault(mid, []):
                tree.waits[mid].append(i)
        stale = sorted(i for i in used if i in self._pending)
        if stale:
            with _told(self.store._kv, "push"):
                raise RuntimeError(
                    f"prefetch: {[self._keys[i] for i in stale][:5]} were read by a forward "
                    f"before their pull arrived: their module's own forward did not run (its "
                    f"parent read them), and this forward was the first to do so. Their "
                    f"parent module now waits for them, but this step's gradients came from "
                    f"parameters the store was still writing: restart from the last checkpoint, "
                    f"or pass prefetch=None"
                )

    def _queue_pulls(self, pushed):
        """Queues the pull of ``pushed``, in buckets in forward order (the first layers, needed
        first, with the highest priority), and returns without waiting."""
        cap, bucket, size = self._bucket_mb * 2**20, [], 0
        for n, i in enumerate(pushed):
            p = self._params[i]
            bucket.append(i)
            size += p.numel() * p.element_size()
            if size >= cap or n == len(pushed) - 1:
                self.store.pull_async(
                    [self._keys[j] for j in bucket],
                    out=[self._params[j].detach() for j in bucket],
                    priority=-bucket[0],
                )
                self._pending.update((j, self._keys[j]) for j in bucket)
                bucket, size = [], 0

    def _await(self, indices):
        """Waits for the queued pulls of the parameters in ``indices``."""
        for i in indices:
            key = self._pending.pop(i, None)
            if key is not None:
                with self._explained():
                    self.store.wait(key)

    def synchronize(self):
        """Waits for every parameter's queued pull (``prefetch``): after it the parameters are
        the store's, as after a ``step()`` without prefetch. ``step()``, a module's forward and
        ``state_dict()`` and ``load_state_dict()`` of the model's modules wait for what they
        read; call it before reading the parameters any other way (``p.data``, ``p.clone()``,
        an EMA of the weights) and before a call on another dist store."""
        if self._pending:
            with self._watch():
                self._await(list(self._pending))

    # step()

    def step(self, closure=None):
        """Steps the wrapped optimizer on the gradients averaged at the end of backward
        (update_on_kvstore=False), or pushes the gradients and pulls the parameters. Parameters
        that got no gradient on any worker are left as they are. A ``WorldChangedError`` is
        raised after the wrapper has followed the new world (see the class's doc)."""
        with self._watch():
            return self._step(closure)

    def _step(self, closure):
        scaler = "grad_scale" in vars(self) or "found_inf" in vars(self)
        self._abandon_backward()
        if self._prefetch is not None:
            self._check_prefetched_reads()
        self.synchronize()
        loss = None
        if closure is not None and self.update_on_kvstore:
            with torch.enable_grad():
                loss = closure()
        try:
            with self._explained():
                if self.update_on_kvstore:
                    self._step_on_store(scaler)
                elif closure is not None:
                    # The optimizer calls it (LBFGS, more than once): each backward in it is
                    # averaged at its end.
                    loss = self.optimizer.step(_with_grad(closure))
                else:
                    if not self._synced:
                        # No backward synchronized since the last step (none ran here, or
                        # all ran in no_sync): the other workers make this call too.
                        self._sync_grads()
                    with torch.no_grad():
                        self.optimizer.step()
        finally:
            self._steps += 1
            self._synced = False
            self._hook_new_parameters()
        try:
            self._broadcast_buffers()
        finally:
            if self._pull_later:
                pushed, self._pull_later = self._pull_later, []
                with torch.no_grad():
                    self._queue_pulls(pushed)
        return loss

    def _step_on_store(self, scaler):
        # An error before the store is called (a change this wrapper refuses) is told to the
        # other workers, which then fail this step too: were it not, their step's call would
        # pair with this worker's next one, summing gradients of different steps.
        try:
            with _told(self.store._kv, "push"):
                self._refuse_changes(scaler)
                if not self.overlap:
                    self._check_unchanged()
                    lr = float(self.optimizer.param_groups[0]["lr"])
                    if lr != self._lr:  # a scheduler changed it: keep the optimizer's state
                        self.store.set_learning_rate(lr)
                        self._lr = lr
            mine = self._local_use()
            if self.overlap:
                # The parameters used on any worker (after this worker's queued buckets, which
                # every worker queued alike where each used the same parameters).
                self._queue_rest(self._used_anywhere(mine))
                pushed = sorted(self._queued)
            else:
                pushed = [i for i, u in enumerate(self._used_anywhere(mine)) if u]
                self._fill(pushed)
                if pushed:
                    with torch.no_grad():
                        self.store.push(
                            [self._keys[i] for i in pushed],
                            [self._params[i].grad for i in pushed],
                        )
            if pushed:
                with torch.no_grad():
                    if self._prefetch is not None:
                        # Queued by step() after the buffers' broadcast: a call of another
                        # store while these run would reach the wire in another order on
                        # another worker.
                        self._pull_later = pushed
                    else:
                        outs = [self._params[i].detach() for i in pushed]
                        if self.overlap:
                            self.store.pull_async([self._keys[i] for i in pushed], out=outs)
                            self.store.wait_all()
                        else:
                            self.store.pull([self._keys[i] for i in pushed], out=outs)
                # The wrapped optimizer did not step, but it was stepped for: tell torch's LR
                # schedulers, which warn otherwise.
                self.optimizer._opt_called = True
            elif self.overlap:
                self.store.wait_all()
        finally:
            self._norms = {}
            self._reset_overlap()
