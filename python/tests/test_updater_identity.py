"""What the workers of a dist store compare of a Python updater (kvstore._updater.identity):
equal in every process of one program, different where the updater would compute differently."""

import os
import subprocess
import sys

import numpy as np
import pytest

import kvstore
from kvstore._updater import identity

PROGRAM = r"""
import numpy as np
from kvstore._updater import identity

def make(scale):
    import numpy as np_local
    names = {"a", "b", "c"}
    loop = [1]
    loop.append(loop)

    class Rule:
        factor = scale

    def update(key, inp, stored):
        if key in names or loop:
            stored += np_local.asarray(inp) * Rule.factor
    return update

print(identity(make(2.0)))
"""


def identity_in_a_process(seed):
    env = dict(os.environ, PYTHONHASHSEED=str(seed))
    p = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_one_program_gives_one_identity_whatever_the_hash_seed():
    # A captured module, a set and a self-referencing list: each worker has its own hash seed.
    assert identity_in_a_process(1) == identity_in_a_process(2) == identity_in_a_process(3)


def scaled_by_class(rule):
    def update(key, inp, stored):
        stored += inp * rule.factor

    return update


class Double:
    factor = 2.0


class Triple:
    factor = 3.0


class Scale:
    __slots__ = ("s",)

    def __init__(self, s):
        self.s = s

    def __call__(self, key, inp, stored):
        stored += inp * self.s


def test_updaters_that_compute_differently_have_different_identities():
    torch = pytest.importorskip("torch", reason="SKIPPED: torch not installed")

    def by_tensor(t):
        return lambda key, inp, stored: stored.__iadd__(inp * float(t))

    pairs = [
        (scaled_by_class(Double), scaled_by_class(Triple)),
        (Scale(2.0), Scale(3.0)),
        (by_tensor(torch.tensor(2.0)), by_tensor(torch.tensor(3.0))),
        ({1, 2}.__contains__, {1, 3}.__contains__),
        (lambda k, i, s: s.__iadd__(i * np.float32(2)), lambda k, i, s: s.__iadd__(i * np.float32(3))),
    ]
    for a, b in pairs:
        assert identity(a) != identity(b), (a, b)
    # The same updater, made twice: the same identity.
    assert identity(scaled_by_class(Double)) == identity(scaled_by_class(Double))


def test_key_and_value_lists_of_different_lengths_are_an_error_in_every_op():
    kv = kvstore.create("local")
    a, b = np.ones(2, np.float32), np.ones(2, np.float32)
    with pytest.raises(kvstore.InvalidArgumentError, match="1 keys but 2 values"):
        kv.init([3], [a, b])
    assert kv.keys() == []
    kv.init([3], [a])
    with pytest.raises(kvstore.InvalidArgumentError, match="1 keys but 2"):
        kv.broadcast([4], [a, b], out=[a])
    with pytest.raises(kvstore.InvalidArgumentError, match="1 keys but 2"):
        kv.push([3], [a, b])


class Base:
    X = 2.0


class Child(Base):
    def update(self, key, inp, stored):
        stored += inp * self.X


class Tripled(Base):
    X = 3.0


class ChildOfTripled(Tripled):
    def update(self, key, inp, stored):
        stored += inp * self.X


def make_call_class(scale):
    class Rule:
        def __call__(self, key, inp, stored):
            stored += inp * scale

    return Rule()


def make_static(scale):
    class R:
        @staticmethod
        def f(x):
            return scale * x

    return lambda key, inp, stored: stored.__iadd__(R.f(inp))


def make_bound(scale):
    # Classes made in a function: their attribute dicts are temporaries of the walk, freed
    # and their ids reused while it goes on (which once made a base's setting read as seen).
    class Base:
        M = scale

    class Opt(Base):
        def upd(self, key, inp, stored):
            stored += self.M * inp

    return Opt().upd


def test_methods_inherited_settings_and_call_bodies_are_read():
    assert identity(make_bound(2.0)) != identity(make_bound(3.0))
    assert identity(make_bound(2.0)) == identity(make_bound(2.0))
    assert identity(make_call_class(2.0)) != identity(make_call_class(3.0))
    assert identity(make_static(2.0)) != identity(make_static(3.0))
    # The same method name on classes whose bases set another X.
    assert identity(Child().update) != identity(ChildOfTripled().update)


SET_PROGRAM = r"""
from kvstore._updater import identity

class Layer:
    def __init__(self, lr):
        self.lr = lr

def make():
    lrs = {Layer(0.1): 1.0, Layer(0.2): 2.0}
    groups = {frozenset({"a", "b"}), frozenset({"c"})}
    def update(key, inp, stored):
        stored += inp * len(lrs) * len(groups)
    return update

print(identity(make()))
"""


def test_dicts_keyed_by_objects_and_sets_of_sets_are_one_identity_in_every_process():
    def run(seed):
        env = dict(os.environ, PYTHONHASHSEED=str(seed))
        p = subprocess.run([sys.executable, "-c", SET_PROGRAM], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    assert len({run(seed) for seed in range(6)}) == 1


def test_a_bfloat16_tensor_is_read():
    torch = pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    assert identity(lambda k, i, s: a) != identity(lambda k, i, s: b)
