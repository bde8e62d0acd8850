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
