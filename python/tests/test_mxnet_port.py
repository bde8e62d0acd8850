"""MXNet's tests/python/unittest/test_kvstore.py and test_kvstore_custom.py, ported to this API.

Dense storage only (kvstore has no row_sparse), on NumPy arrays and, where torch is installed,
torch tensors. Four `mx.cpu(i)` devices become four separate host arrays.
"""

import numpy as np
import pytest

import kvstore as kv

SHAPE = (4, 4)
KEYS = [5, 7, 11]
STR_KEYS = ["b", "c", "d"]
DEVS = 4


def init_kv(xp):
    """MXNet's init_kv: key 3 and KEYS, all zeros."""
    store = kv.create("local")
    store.init(3, xp.zeros(SHAPE))
    store.init(KEYS, [xp.zeros(SHAPE)] * len(KEYS))
    return store


def init_kv_with_str(xp):
    """MXNet's init_kv_with_str: key 'a' and STR_KEYS, all zeros."""
    store = kv.create("local")
    store.init("a", xp.zeros(SHAPE))
    store.init(STR_KEYS, [xp.zeros(SHAPE)] * len(STR_KEYS))
    return store


def check(xp, a, value):
    np.testing.assert_array_equal(xp.numpy(a), np.full(SHAPE, value, dtype=np.float32))


@pytest.mark.parametrize("str_key", [False, True])
def test_single_kv_pair(xp, str_key):
    store = init_kv_with_str(xp) if str_key else init_kv(xp)
    key = "a" if str_key else 3
    store.push(key, xp.ones(SHAPE))
    val = xp.zeros(SHAPE)
    store.pull(key, out=val)
    check(xp, val, 1)


@pytest.mark.parametrize("key", [3, "a"])
def test_init(xp, key):
    store = kv.create("local")
    store.init(key, xp.ones(SHAPE) * 4)
    a = xp.zeros(SHAPE)
    store.pull(key, out=a)
    check(xp, a, 4)


@pytest.mark.parametrize("kind", ["device", "local"])
def test_pull(xp, kind):
    store = kv.create(kind)
    a = xp.ones(SHAPE)
    store.init("1", xp.zeros(SHAPE))
    store.push("1", [a, a, a, a])
    val = xp.zeros(SHAPE)
    store.pull("1", out=val)
    check(xp, val, 4)
    store.init("2", xp.zeros(SHAPE))
    val = xp.ones(SHAPE)
    store.pull("2", out=val)
    check(xp, val, 0)


@pytest.mark.parametrize("str_key", [False, True])
def test_list_kv_pair(xp, str_key):
    store = init_kv_with_str(xp) if str_key else init_kv(xp)
    keys = STR_KEYS if str_key else KEYS
    store.push(keys, [xp.ones(SHAPE) * 4] * len(keys))
    val = [xp.zeros(SHAPE)] * len(keys)  # one array three times, as in MXNet
    store.pull(keys, out=val)
    for v in val:
        check(xp, v, 4)


@pytest.mark.parametrize("str_key", [False, True])
def test_aggregator(xp, str_key):
    store = init_kv_with_str(xp) if str_key else init_kv(xp)
    key = "a" if str_key else 3
    keys = STR_KEYS if str_key else KEYS
    vals = [xp.ones(SHAPE) for _ in range(DEVS)]
    store.push(key, vals)
    store.pull(key, out=vals)
    for v in vals:
        check(xp, v, DEVS)
    vals = [[xp.ones(SHAPE) * 2.0 for _ in range(DEVS)]] * len(keys)
    store.push(keys, vals)
    outs = [[xp.zeros(SHAPE) for _ in range(DEVS)] for _ in keys]
    store.pull(keys, out=outs)
    for per_key in outs:
        for v in per_key:
            check(xp, v, 2.0 * DEVS)


@pytest.mark.parametrize("str_key", [False, True])
def test_updater(xp, str_key):
    store = init_kv_with_str(xp) if str_key else init_kv(xp)
    key = "a" if str_key else 3
    keys = STR_KEYS if str_key else KEYS

    def updater(k, recv, local):
        local += recv

    store._set_updater(updater)
    outs = [xp.zeros(SHAPE) for _ in range(DEVS)]
    store.push(key, [xp.ones(SHAPE) for _ in range(DEVS)])
    store.pull(key, out=outs)
    for v in outs:
        check(xp, v, DEVS)
    num_push = 4
    for _ in range(num_push):
        store.push(keys, [[xp.ones(SHAPE) for _ in range(DEVS)]] * len(keys))
    outs = [[xp.zeros(SHAPE) for _ in range(DEVS)] for _ in keys]
    store.pull(keys, out=outs)
    for per_key in outs:
        for v in per_key:
            check(xp, v, num_push * DEVS)


def test_get_type():
    assert kv.create("local_allreduce_cpu").type == "local_allreduce_cpu"
    assert kv.create("device").type == "device"


@pytest.mark.parametrize("str_store", [False, True])
def test_invalid_pull(xp, str_store):
    """MXNet: using the other key type in init, push or pull is an error. Here it is a
    KeyTypeError (a TypeError), and the store is unchanged."""
    store = init_kv_with_str(xp) if str_store else init_kv(xp)
    other, other_list = (3, KEYS) if str_store else ("a", STR_KEYS)
    with pytest.raises(kv.KeyTypeError):
        store.init(other, xp.ones(SHAPE))
    with pytest.raises(TypeError):
        store.push(other, xp.ones(SHAPE))
    with pytest.raises(TypeError):
        store.pull(other, out=xp.ones(SHAPE))
    with pytest.raises(TypeError):
        store.push(other_list, [xp.ones(SHAPE)] * 3)
    assert store.keys() == (STR_KEYS_SORTED(str_store))


def STR_KEYS_SORTED(str_store):
    return ["a"] + STR_KEYS if str_store else [3] + KEYS


# test_kvstore_custom.py: broadcast and pushpull.


@pytest.mark.parametrize("key", [3, "a"])
def test_broadcast_single_kv_pair(xp, key):
    store = kv.create("device")
    out = xp.zeros(SHAPE)
    store.broadcast(key, xp.ones(SHAPE), out)
    check(xp, out, 1)
    outs = [xp.zeros(SHAPE)] * 3
    store.broadcast(key + key, xp.ones(SHAPE), out=outs)
    for o in outs:
        check(xp, o, 1)


@pytest.mark.parametrize("str_key", [False, True])
def test_broadcast_list_kv_pair(xp, str_key):
    store = kv.create("device")
    keys = STR_KEYS if str_key else KEYS
    outs = [xp.zeros(SHAPE)] * len(keys)
    store.broadcast(keys, [xp.ones(SHAPE)] * len(keys), out=outs)
    for o in outs:
        check(xp, o, 1)
    keys2 = [k + k for k in keys]
    outs = [[xp.zeros(SHAPE)] * 2] * len(keys)
    store.broadcast(keys2, [xp.ones(SHAPE)] * len(keys), out=outs)
    for per_key in outs:
        for o in per_key:
            check(xp, o, 1)


@pytest.mark.parametrize("key,key_list", [(3, KEYS), ("a", STR_KEYS)])
def test_pushpull_single_kv_pair(xp, key, key_list):
    store = kv.create("device")
    store.broadcast(key, xp.zeros(SHAPE), out=xp.zeros(SHAPE))
    vals = [xp.ones(SHAPE) for _ in range(DEVS)]
    outs = [xp.zeros(SHAPE) for _ in range(DEVS)]
    store.pushpull(key, vals, out=outs)
    for o in outs:
        check(xp, o, DEVS)
    store.pushpull(key, vals)  # in place
    for v in vals:
        check(xp, v, DEVS)
    store.broadcast(key_list, [xp.zeros(SHAPE)] * len(key_list), out=[xp.zeros(SHAPE)] * 3)
    # The inner list is shared by the three keys: every push reads 2s before any pull writes.
    vals = [[xp.ones(SHAPE) * 2 for _ in range(DEVS)]] * len(key_list)
    outs = [[xp.zeros(SHAPE) for _ in range(DEVS)] for _ in key_list]
    store.pushpull(key_list, vals, out=outs)
    for per_key in outs:
        for o in per_key:
            check(xp, o, 2 * DEVS)
    store.pushpull(key_list, vals)
    for per_key in vals:
        for v in per_key:
            check(xp, v, 2 * DEVS)


def test_custom_store_pushpull(xp):
    """test_custom_store: pushpull(1, [ones]*2, out=[e]*2) gives 2, then in place 2+2 = 4."""
    store = kv.create("local")
    out = xp.zeros((1,))
    store.broadcast(1, xp.ones((1,)), out=out)
    np.testing.assert_array_equal(xp.numpy(out), [1])
    arr_list = [xp.ones((1,)) for _ in range(2)]
    outs = [xp.zeros((1,)) for _ in range(2)]
    store.pushpull(1, arr_list, out=outs)
    for o in outs:
        np.testing.assert_array_equal(xp.numpy(o), [2])
    store.pushpull(1, outs)
    for o in outs:
        np.testing.assert_array_equal(xp.numpy(o), [4])
    assert store.is_capable("optimizer")
    with pytest.raises(ValueError, match="Unknown capability"):
        store.is_capable("foo")
