"""Optimizers that run inside the store, as ``kv.set_optimizer(...)`` takes them.

Their parameters have MXNet's names and defaults (``mx.optimizer.SGD`` and ``mx.optimizer.Adam``),
and the store computes exactly what MXNet's ``sgd_update``, ``sgd_mom_update`` and
``adam_update`` do.
"""

from dataclasses import dataclass
from typing import Optional


def _check_lazy(optimizer):
    """Row-sparse pushes update the rows present only (MXNet's ``lazy_update=True``, its
    default); ``lazy_update`` changes nothing for dense keys."""
    if not optimizer.lazy_update:
        from ._errors import InvalidArgumentError

        raise InvalidArgumentError(
            "lazy_update=False (updating every row on a row-sparse push) is not supported: "
            "row-sparse pushes update the rows present only; push dense gradients to a dense "
            "key to update every row"
        )


@dataclass
class SGD:
    """Stochastic gradient descent, with optional momentum:
    ``mom = momentum * mom - lr * (rescale_grad * grad + wd * weight); weight += mom``."""

    learning_rate: float = 0.01
    momentum: float = 0.0
    wd: float = 0.0
    rescale_grad: float = 1.0
    clip_gradient: Optional[float] = None
    lazy_update: bool = True

    def _apply(self, native, keep_state=False):
        _check_lazy(self)
        native.set_sgd(
            float(self.learning_rate),
            float(self.momentum),
            float(self.wd),
            float(self.rescale_grad),
            None if self.clip_gradient is None else float(self.clip_gradient),
            keep_state,
        )


@dataclass
class Adam:
    """Adam with bias correction in the step size, as MXNet's ``adam_update``. With
    ``epsilon_after_correction=True``, epsilon is added to the bias-corrected root, as
    ``torch.optim.Adam`` does."""

    learning_rate: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    wd: float = 0.0
    rescale_grad: float = 1.0
    clip_gradient: Optional[float] = None
    epsilon_after_correction: bool = False
    lazy_update: bool = True

    def _apply(self, native, keep_state=False):
        _check_lazy(self)
        native.set_adam(
            float(self.learning_rate),
            float(self.beta1),
            float(self.beta2),
            float(self.epsilon),
            float(self.wd),
            float(self.rescale_grad),
            None if self.clip_gradient is None else float(self.clip_gradient),
            bool(self.epsilon_after_correction),
            keep_state,
        )


def create(name, **kwargs):
    """An optimizer by name, as ``mx.optimizer.create``: ``create('sgd', learning_rate=0.1)``."""
    kinds = {"sgd": SGD, "adam": Adam}
    try:
        kind = kinds[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown optimizer '{name}': use one of {', '.join(kinds)}"
        ) from None
    return kind(**kwargs)
