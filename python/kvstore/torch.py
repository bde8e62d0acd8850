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
"""

import hashlib
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

    def __init__(self, optimizer, store=None, *, named_parameters=None, update_on_kvstore=None):
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

    def step(self, closure=None):
        """Pushes the gradients and pulls the parameters (update_on_kvstore), or sums the
        gradients through the store and steps the wrapped optimizer. Parameters without a
        gradient are left out, as torch optimizers do."""
        loss = None
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
                if self.store.num_workers > 1:
                    # Torch steps on every worker: they must step alike. Compared when changed
                    # (a worker that changes alone calls agree where the others pushpull, and
                    # that fails too).
                    settings = _settings(self.optimizer)
                    if settings != self._agreed:
                        self.store.agree(settings)
                        self._agreed = settings
                    # Its state too, at the first step and after a load_state_dict (which
                    # replaces the state dict): momentum loaded on some workers only would
                    # step them apart.
                    if self._state_due or id(self.optimizer.state) != self._state_id:
                        # A failure here (the host copy) is told to the other workers,
                        # which are in the agree below.
                        with _told(self.store._kv, "agree"):
                            digest = _state_digest(self.optimizer)
                        self.store.agree(f"torch optimizer state sha256 {digest}")
                        self._state_due = False
                        self._state_id = id(self.optimizer.state)
                self.store.pushpull(keys, grads)
                workers = self.store.num_workers
                if workers > 1:
                    for g in grads:
                        g.div_(workers)
                self.optimizer.step()
        return loss
