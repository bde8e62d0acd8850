"""PyTorch integration: an optimizer wrapper that synchronizes through a kvstore.

    import torch, kvstore
    from kvstore.torch import DistributedOptimizer

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               kvstore.create('local'))
    loss.backward()
    opt.step()        # push the gradients, then pull the parameters
    opt.zero_grad()

Two modes, as MXNet's Trainer has them:

- ``update_on_kvstore=True``: the store runs the optimizer. ``step()`` pushes every gradient
  and pulls every parameter back. The torch optimizer's hyperparameters are translated to the
  store's SGD or Adam (``torch.optim.SGD`` with momentum and weight decay, ``torch.optim.Adam``);
  a learning rate changed in ``param_groups`` (by a scheduler) is passed on at the next step.
- ``update_on_kvstore=False``: the store sums the gradients (``pushpull`` in place, averaged
  over the workers), and the wrapped torch optimizer steps locally. Any torch optimizer works.
  Its type and hyperparameters are compared across the workers (``KVStore.agree``) at the
  first step and whenever they change, and so is its state (a SHA-256 of every state tensor's
  bytes) at the first step and after every ``load_state_dict``, through the wrapper or on the
  torch optimizer itself: workers that would step differently fail with a ``DesyncError``
  instead of training apart. (A state changed in place, as ``opt.state[p]['exp_avg'].zero_()``
  on some workers, is not seen.)

The default is True for SGD and Adam and False otherwise. No torch is needed to build or import
``kvstore``; this module imports torch when it is used.

``overlap=True`` moves the communication into the backward pass. A hook on each parameter
(``register_post_accumulate_grad_hook``) marks its gradient ready. Parameters are put in buckets
of about ``bucket_mb`` MiB, in reverse order, as backward reaches them. Each bucket is queued on
the store (``push_async``, or ``pushpull_async`` with ``update_on_kvstore=False``) once its
gradients are ready and the buckets before it are queued. So every worker queues the same calls
in the same order, and the store sums each bucket (and with ``update_on_kvstore=True`` runs the
optimizer on it, on each key's home: ZeRO-1 with the optimizer in the store) while backward
computes the layers below. ``step()`` queues what is left, pulls the parameters, and waits. The
results are those of ``overlap=False``. Call ``step()`` after each ``backward()``: a gradient
accumulated again after its bucket was queued raises. When torch steps
(``update_on_kvstore=False``), backward's end waits for the sums and averages them, as DDP's
does, so code between ``backward()`` and ``step()`` (clipping, a GradScaler) sees the averaged
gradients. When the store steps, it has used each gradient as backward made it: a gradient or
learning rate changed after backward makes ``step()`` raise a ValueError.
"""

import hashlib
import threading
from dataclasses import replace

import torch

from . import KVStore, _told, create
from . import optimizer as _kvopt


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


class DistributedOptimizer:
    """Wraps a torch optimizer so that ``step()`` goes through a kvstore.

    Parameters are the store's keys: their names when ``named_parameters`` is given (as
    ``model.named_parameters()``), else their positions in ``param_groups`` (0, 1, ...). The
    constructor initializes the store with the current parameters. Everything else (``zero_grad``,
    ``param_groups``, ``state_dict``) is the wrapped optimizer's.
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
    ):
        if store is None:
            store = create("local")
        if not isinstance(store, KVStore):
            raise TypeError(f"store must be a kvstore.KVStore, got {type(store).__name__}")
        self.optimizer = optimizer
        self.store = store
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
            update_on_kvstore = type(optimizer) in (torch.optim.SGD, torch.optim.Adam)
        self.update_on_kvstore = bool(update_on_kvstore)
        # The torch settings the workers last agreed on (update_on_kvstore=False), and whether
        # the optimizer's state is to be compared at the next step: at the first, and after a
        # load_state_dict (seen by torch's post-hook, and, where torch has none, by the state
        # dict's id, since torch's load replaces the dict; no reference is kept to the old one).
        self._agreed = None
        self._state_due = True
        self._state_id = id(optimizer.state)
        if hasattr(optimizer, "register_load_state_dict_post_hook"):
            optimizer.register_load_state_dict_post_hook(self._state_loaded)
        if self.update_on_kvstore:
            self._translated = _translate(optimizer, self.store.num_workers)
            self.store.set_optimizer(self._translated)
            self._lr = float(optimizer.param_groups[0]["lr"])
        with torch.no_grad():
            params = [p.detach() for p in self._params]
            self.store.init(self._keys, params)
            # Every worker starts from the store's parameters (a no-op in one process).
            self.store.pull(self._keys, out=params)
        self.overlap = bool(overlap)
        if self.overlap:
            self._start_overlap(float(bucket_mb))

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    @property
    def param_groups(self):
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    def load_state_dict(self, state_dict):
        """The wrapped optimizer's ``load_state_dict``. With ``update_on_kvstore=False`` on
        several workers, the loaded state is compared across them at the next step."""
        self.optimizer.load_state_dict(state_dict)
        self._state_due = True

    def _state_loaded(self, _optimizer):
        self._state_due = True

    def zero_grad(self, set_to_none=True):
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

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
            now = _translate(self.optimizer, self.store.num_workers)
            if replace(now, learning_rate=self._translated.learning_rate) != self._translated:
                raise ValueError(
                    f"the optimizer's hyperparameters changed after DistributedOptimizer was "
                    f"made ({self._translated} -> {now}); the store follows a changed "
                    f"learning rate only: pass update_on_kvstore=False to step with torch"
                )

    def _agree_torch_step(self):
        """With update_on_kvstore=False on several workers: torch steps on every worker, so
        they must step alike. Its settings are compared when changed (a worker that changes
        alone calls agree where the others call the store, and that fails too); its state at
        the first step and after a load_state_dict (which replaces the state dict), since
        momentum loaded on some workers only would step them apart."""
        if self.store.num_workers == 1:
            return
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

    # Overlap: buckets queued from gradient hooks while backward runs.

    def _start_overlap(self, bucket_mb):
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise RuntimeError("overlap=True needs torch >= 2.1 (register_post_accumulate_grad_hook)")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        cap = bucket_mb * 2**20
        # Buckets of parameter indices, in reverse order (backward reaches the last layers
        # first), closed once they hold cap bytes. The same on every worker: the model is.
        self._buckets, bucket, size = [], [], 0
        for i in reversed(range(len(self._params))):
            p = self._params[i]
            bucket.append(i)
            size += p.numel() * p.element_size()
            if size >= cap:
                self._buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self._buckets.append(bucket)
        self._ready = [False] * len(self._params)
        self._queued_keys = []  # indices of the parameters queued this step
        # (the store steps) A copy of each gradient as it was queued, to see a change made
        # after (clipping, a GradScaler's unscale, which leaves the version counter alone).
        self._pushed = {}
        self._reduced = False  # (torch steps) backward's end waited for the sums
        self._waiting = False  # (torch steps) backward's end is to wait for them
        self._next = 0  # the first bucket not queued yet
        self._begun = False  # whether this step's first bucket was queued
        self._hook_lock = threading.Lock()
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
            for i, p in enumerate(self._params)
        ]

    def _grad_ready(self, i):
        """Parameter ``i``'s gradient is accumulated: queue every bucket now complete. Under a
        lock: autograd may run hooks on one thread per device, and a bucket must be queued
        once."""
        with self._hook_lock:
            self._grad_ready_locked(i)

    def _grad_ready_locked(self, i):
        if self._ready[i]:
            raise RuntimeError(
                f"the gradient of parameter {self._keys[i]!r} was accumulated again after it "
                f"was queued (several backward passes before step(), or a step() that was "
                f"skipped, as a GradScaler skips it on inf or NaN gradients, which the store "
                f"had then already applied): with overlap=True call step() after each "
                f"backward, or pass overlap=False"
            )
        self._ready[i] = True
        if not self.update_on_kvstore and not self._waiting:
            # Torch steps: backward's end waits for the sums, as DDP's does.
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self._waiting = True
        while self._next < len(self._buckets) and all(
            self._ready[j] for j in self._buckets[self._next]
        ):
            self._queue_bucket(self._buckets[self._next])
            self._next += 1

    def _begin(self):
        """Before this step's first bucket is queued: the checks and the learning rate that
        ``step()`` applies before pushing (a scheduler's change since the last step). When torch
        steps, backward's end waits for the sums (see ``_grad_ready``)."""
        if self._begun:
            return
        self._begun = True
        with _told(self.store._kv, "push" if self.update_on_kvstore else "pushpull"):
            self._check_unchanged()
            if self.update_on_kvstore:
                lr = float(self.optimizer.param_groups[0]["lr"])
                if lr != self._lr:
                    self.store.set_learning_rate(lr)
                    self._lr = lr

    def _queue_bucket(self, bucket):
        self._begin()
        multi = self.store.num_workers > 1
        if multi:
            # As in step(): every worker makes the same call; a missing gradient is zeros.
            for j in bucket:
                if self._params[j].grad is None:
                    self._params[j].grad = torch.zeros_like(self._params[j])
        live = [j for j in bucket if self._params[j].grad is not None]
        if not live:
            return
        keys = [self._keys[j] for j in live]
        grads = [self._params[j].grad for j in live]
        # MXNet's priority: the first layers, needed first by the next forward, highest.
        priority = -min(live)
        with torch.no_grad():
            if self.update_on_kvstore:
                self.store.push_async(keys, grads, priority=priority)
            else:
                self.store.pushpull_async(keys, grads, priority=priority)
        self._queued_keys.extend(live)
        if self.update_on_kvstore:
            for j in live:
                self._pushed[j] = self._params[j].grad.detach().clone()

    def _queue_rest(self):
        """Queues the buckets backward did not: a parameter it never reached goes as zeros on
        several workers (every worker makes the same calls), and is left out in one process."""
        for i in range(len(self._params)):
            self._ready[i] = True
        while self._next < len(self._buckets):
            self._queue_bucket(self._buckets[self._next])
            self._next += 1

    def _backward_done(self):
        """(torch steps) The end of backward: every bucket queued, the sums in, averaged over
        the workers. Code between ``backward()`` and ``step()`` (gradient clipping, a
        GradScaler's unscale) then sees the averaged gradients, as with DDP."""
        self._queue_rest()
        # (agree is a blocking call: it waits for the queued pushpulls first.)
        self._agree_torch_step()
        self.store.wait_all()
        workers = self.store.num_workers
        if workers > 1:
            with torch.no_grad():
                for i in self._queued_keys:
                    self._params[i].grad.div_(workers)
        self._reduced = True

    def _check_untouched(self):
        """(the store steps) A ValueError when a gradient or the learning rate changed after
        backward queued it: the store already applied the gradients as backward made them."""
        changed = [
            self._keys[i]
            for i in self._queued_keys
            if self._params[i].grad is None or not torch.equal(self._params[i].grad, self._pushed[i])
        ]
        lr = float(self.optimizer.param_groups[0]["lr"])
        if changed or lr != self._lr:
            what = (
                f"the gradients of {changed[:5]} changed" if changed else
                f"the learning rate changed to {lr}"
            )
            raise ValueError(
                f"{what} after backward had pushed them (gradient clipping, a GradScaler's "
                f"unscale, a warmup setting lr before step()): with overlap=True and "
                f"update_on_kvstore=True the store runs the optimizer on each gradient as "
                f"backward makes it, so this step already used the unchanged values and the "
                f"model's parameters were not updated. Change the learning rate before "
                f"backward, or pass update_on_kvstore=False (torch steps on gradients averaged "
                f"at the end of backward, as with DDP)"
            )

    def _step_overlapped(self, loss):
        """``step()`` with overlap: queue what backward did not, then finish the step."""
        try:
            if not self.update_on_kvstore:
                if not self._reduced:  # no backward since the last step
                    self._backward_done()
                with torch.no_grad():
                    self.optimizer.step()
                return loss
            self._queue_rest()
            queued = sorted(self._queued_keys)
            if queued:
                self.store.wait_all()
                self._check_untouched()
                with torch.no_grad():
                    self.store.pull_async(
                        [self._keys[i] for i in queued],
                        out=[self._params[i].detach() for i in queued],
                    )
                    self.store.wait_all()
                self.optimizer._opt_called = True
            else:
                self.store.wait_all()
            return loss
        finally:
            self._queued_keys = []
            self._pushed = {}
            self._ready = [False] * len(self._params)
            self._next = 0
            self._begun = False
            self._reduced = False
            self._waiting = False

    def step(self, closure=None):
        """Pushes the gradients and pulls the parameters (update_on_kvstore), or sums the
        gradients through the store and steps the wrapped optimizer. Parameters without a
        gradient are left out, as torch optimizers do."""
        loss = None
        if self.overlap:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            return self._step_overlapped(loss)
        # An error here, before the store is called (in the closure, or a change this wrapper
        # refuses), is told to the other workers, which then fail this step too: were it not,
        # their step's call would pair with this worker's next one, summing gradients of
        # different steps.
        with _told(self.store._kv, "push" if self.update_on_kvstore else "pushpull"):
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._check_unchanged()
            if self.update_on_kvstore:
                lr = float(self.optimizer.param_groups[0]["lr"])
                if lr != self._lr:  # a scheduler changed it: keep the optimizer's state
                    self.store.set_learning_rate(lr)
                    self._lr = lr
        if self.store.num_workers > 1:
            # Every worker makes the same store call every step: a parameter without a gradient
            # on this worker (unused in its part of the batch) contributes zeros, as
            # DistributedDataParallel(find_unused_parameters=True) does.
            live = list(zip(self._keys, self._params))
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in self._params]
        else:
            live = [(k, p) for k, p in zip(self._keys, self._params) if p.grad is not None]
            grads = [p.grad for _, p in live]
        if not live:
            return loss
        keys = [k for k, _ in live]
        with torch.no_grad():
            if self.update_on_kvstore:
                self.store.push(keys, grads)
                self.store.pull(keys, out=[p.detach() for _, p in live])
                # The wrapped optimizer did not step, but it was stepped for: tell torch's LR
                # schedulers, which warn otherwise.
                self.optimizer._opt_called = True
            else:
                self._agree_torch_step()
                self.store.pushpull(keys, grads)
                workers = self.store.num_workers
                if workers > 1:
                    for g in grads:
                        g.div_(workers)
                self.optimizer.step()
        return loss
