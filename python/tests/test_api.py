"""The binding's own behaviour: data paths, dtypes, layouts, errors, updaters, threads.

Every numeric check compares with NumPy arithmetic on fresh random data.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvstore as kv


def test_sum_of_random_pushes_matches_numpy(xp, rng):
    store = kv.create("local")
    shape = (3, 5, 7)
    store.init("w", xp.zeros(shape))
    vals = [xp.random(shape, rng) for _ in range(5)]
    store.push("w", vals)
    out = xp.zeros(shape)
    store.pull("w", out=out)
    expected = sum(xp.numpy(v).astype(np.float32) for v in vals)
    np.testing.assert_allclose(xp.numpy(out), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_dtypes_round_trip(xp, rng, dtype):
    store = kv.create("local")
    v = xp.random((4, 6), rng, dtype)
    store.init(0, v)
    out = xp.zeros((4, 6), dtype)
    store.pull(0, out=out)
    np.testing.assert_array_equal(xp.numpy(out), xp.numpy(v))


def test_bfloat16_with_torch(rng):
    torch = pytest.importorskip("torch", reason="torch not installed")
    store = kv.create("local")
    v = torch.from_numpy(rng.standard_normal((8,)).astype("float32")).to(torch.bfloat16)
    store.init(0, v)
    store.push(0, [v, v])
    out = torch.zeros(8, dtype=torch.bfloat16)
    store.pull(0, out=out)
    np.testing.assert_allclose(
        out.float().numpy(), (v.float() * 2).to(torch.bfloat16).float().numpy(), rtol=1e-2
    )


def test_pull_converts_to_the_outs_dtype(rng):
    store = kv.create("local")
    v = rng.standard_normal((5,)).astype(np.float32)
    store.init(1, v)
    out64 = np.zeros(5, np.float64)
    out16 = np.zeros(5, np.float16)
    store.pull(1, out=[out64, out16])
    np.testing.assert_array_equal(out64, v.astype(np.float64))
    np.testing.assert_array_equal(out16, v.astype(np.float16))


def test_strided_values_and_outs(rng):
    store = kv.create("local")
    big = rng.standard_normal((6, 8)).astype(np.float32)
    value = big[::2, 1::3]  # a non-contiguous view
    assert not value.flags.c_contiguous
    store.init("s", value)
    store.push("s", [value, np.ascontiguousarray(value)])  # strided + contiguous
    holder = np.full((6, 8), -1.0, np.float32)
    out = holder[1::2, ::3]
    store.pull("s", out=out)
    np.testing.assert_allclose(out, 2 * value, rtol=1e-6)
    # Only the viewed elements were written.
    mask = np.ones_like(holder, bool)
    mask[1::2, ::3] = False
    assert (holder[mask] == -1).all()
    # A Fortran-ordered out, and a negative-stride value.
    f_out = np.asfortranarray(np.zeros(value.shape, np.float32))
    store.pull("s", out=f_out)
    np.testing.assert_allclose(f_out, 2 * value, rtol=1e-6)
    store.push("s", value[::-1, ::-1])
    store.pull("s", out=f_out)
    np.testing.assert_array_equal(f_out, value[::-1, ::-1])


def test_scalar_and_empty_arrays():
    store = kv.create("local")
    store.init(0, np.array(2.5, np.float32))
    out = np.zeros((), np.float32)
    store.push(0, [np.array(1.0, np.float32)] * 3)
    store.pull(0, out=out)
    assert out == 3.0
    store.init(1, np.zeros((0, 4), np.float32))
    store.pull(1, out=np.zeros((0, 4), np.float32))


def test_push_copies_the_callers_array(rng):
    """MXNet aliased a single pushed array; here a later write to it changes nothing."""
    store = kv.create("local")
    g = rng.standard_normal(4).astype(np.float32)
    store.init(0, np.zeros(4, np.float32))
    store.push(0, g)
    expected = g.copy()
    g += 100
    out = np.zeros(4, np.float32)
    store.pull(0, out=out)
    np.testing.assert_array_equal(out, expected)


# Errors: clear Python types, the Rust message, and the store unchanged.


def stored(store, key, shape=(2, 3), dtype=np.float32):
    out = np.zeros(shape, dtype)
    store.pull(key, out=out)
    return out


def test_unknown_key_is_a_key_error():
    store = kv.create("local")
    with pytest.raises(KeyError) as e:
        store.pull(9, out=np.zeros(3, np.float32))
    assert isinstance(e.value, kv.UnknownKeyError) and isinstance(e.value, kv.Error)
    assert str(e.value) == "pull: key 9 has not been initialized: call init(9, value) first"
    with pytest.raises(kv.UnknownKeyError):
        store.push(9, np.ones(3, np.float32))
    store.init(9, np.ones(3, np.float32))  # not poisoned, unlike MXNet


def test_shape_mismatch_is_a_value_error_and_changes_nothing(rng):
    store = kv.create("local")
    v = rng.standard_normal((2, 3)).astype(np.float32)
    store.init(3, v)
    with pytest.raises(ValueError, match=r"shape mismatch for key 3.*\(2, 3\).*\(4, 4\)"):
        store.push(3, np.ones((4, 4), np.float32))
    with pytest.raises(kv.ShapeMismatchError):
        store.pull(3, out=np.zeros((4, 4), np.float32))
    np.testing.assert_array_equal(stored(store, 3), v)


def test_list_push_is_all_or_nothing(rng):
    store = kv.create("local")
    a = rng.standard_normal(4).astype(np.float32)
    store.init([1, 2], [a, a])
    with pytest.raises(kv.ShapeMismatchError):
        store.push([1, 2], [np.ones(4, np.float32), np.ones(5, np.float32)])
    np.testing.assert_array_equal(stored(store, 1, (4,)), a)


def test_dtype_mismatch_is_a_type_error():
    store = kv.create("local")
    store.init(3, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="dtype mismatch") as e:
        store.push(3, np.ones(3, np.float64))
    assert isinstance(e.value, kv.DTypeMismatchError)


def test_other_errors():
    store = kv.create("local")
    store.init(3, np.ones(3, np.float32))
    with pytest.raises(kv.DuplicateInitError, match="duplicate init of key 3"):
        store.init(3, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.push([3, 4], [np.ones(3, np.float32)])
    with pytest.raises(ValueError, match="no values given for key 3"):
        store.push(3, [])
    with pytest.raises(TypeError, match="int and string keys cannot be mixed"):
        store.init(["x"], [np.ones(3, np.float32)])
    with pytest.raises(OverflowError, match="2147483648"):
        store.push(2**31, np.ones(3, np.float32))
    with pytest.raises(OverflowError, match=str(2**70)):
        store.push(2**70, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="bool"):
        store.push(True, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="float"):
        store.push(3.0, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="unsupported array dtype"):
        store.push(3, np.ones(3, np.int64))
    with pytest.raises(TypeError, match="__dlpack__"):
        store.push(3, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="out="):
        store.pull(3)
    ro = np.zeros(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match="writable"):
        store.pull(3, out=ro)
    store.push(3, ro)  # reading a read-only array is fine
    with pytest.raises(kv.UnknownKindError, match="local, "):
        kv.create("dist_synk")
    try:  # a one-worker world with the MPI link (kvstore-mpi); its install command without
        assert kv.create("dist_sync").num_workers == 1
    except kv.UnknownKindError as e:
        assert "pip install 'kvstore[mpi]'" in str(e), str(e)
    with pytest.raises(kv.UnknownKindError, match="use 'dist_sync'"):
        kv.create("dist_async")
    with pytest.raises(ValueError):
        store.set_optimizer(kv.optimizer.SGD(learning_rate=-1.0))
    np.testing.assert_array_equal(stored(store, 3, (3,)), 0)


def test_numpy_integer_keys():
    store = kv.create("local")
    store.init(np.int64(5), np.ones(2, np.float32))
    store.pull([np.int32(5)], out=[np.zeros(2, np.float32)])
    assert store.keys() == [5]


# Updaters.


def test_python_updater_mutates_in_place_and_sees_keys(rng):
    store = kv.create("local")
    seen = []
    v = rng.standard_normal((2, 3)).astype(np.float32)
    g = rng.standard_normal((2, 3)).astype(np.float32)
    store.init([7, 5], [v, v])

    def update(key, inp, st):
        seen.append(key)
        assert isinstance(inp, np.ndarray) and inp.shape == (2, 3)
        st += inp * 2

    store.set_updater(update)
    store.push([7, 5, 7], [g, g, g])
    assert seen == [5, 7]  # once per key, ascending
    np.testing.assert_allclose(stored(store, 7), v + 2 * (2 * g), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stored(store, 5), v + 2 * g, rtol=1e-5, atol=1e-6)
    store.set_updater(None)  # back to assign
    store.push(5, g)
    np.testing.assert_array_equal(stored(store, 5), g)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_python_updater_dtypes(dtype):
    store = kv.create("local")
    store.init("k", np.ones(4, dtype))
    store.set_updater(lambda key, inp, st: st.__imul__(inp))
    store.push("k", np.full(4, 3, dtype))
    out = np.zeros(4, dtype)
    store.pull("k", out=out)
    np.testing.assert_array_equal(out, 3)


def test_failing_updater_raises_with_cause_and_changes_nothing(rng):
    store = kv.create("local")
    v = rng.standard_normal((2, 3)).astype(np.float32)
    store.init([1, 2], [v, v])

    def update(key, inp, st):
        st += 1  # a partial change must not be kept
        if key == 2:
            raise ZeroDivisionError("boom")

    store.set_updater(update)
    with pytest.raises(kv.UpdaterError, match="updater failed on key 2") as e:
        store.push([1, 2], [v, v])
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    np.testing.assert_array_equal(stored(store, 1), v)
    np.testing.assert_array_equal(stored(store, 2), v)


def numpy_sgd(w, grads, lr, momentum, wd):
    mom = np.zeros_like(w)
    for g in grads:
        mom = momentum * mom - lr * (g + wd * w)
        w = w + mom
    return w


def test_set_optimizer_sgd_matches_numpy(rng):
    store = kv.create("local")
    w = rng.standard_normal(10)
    store.init("w", w)
    store.set_optimizer(kv.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3))
    grads = [rng.standard_normal(10) for _ in range(5)]
    for g in grads:
        store.push("w", g)
    out = np.zeros(10)
    store.pull("w", out=out)
    np.testing.assert_allclose(out, numpy_sgd(w, grads, 0.1, 0.9, 1e-3), rtol=1e-12)
    assert store.learning_rate == 0.1
    store.set_learning_rate(0.05)
    assert store.learning_rate == 0.05


def test_set_optimizer_adam_matches_numpy(rng):
    store = kv.create("local")
    w = rng.standard_normal(10)
    store.init(0, w)
    store.set_optimizer("adam")
    lr, b1, b2, eps = 0.001, 0.9, 0.999, 1e-8
    m = np.zeros(10)
    v = np.zeros(10)
    ref = w.copy()
    for t in range(1, 6):
        g = rng.standard_normal(10)
        store.push(0, g)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        ref = ref - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
    out = np.zeros(10)
    store.pull(0, out=out)
    np.testing.assert_allclose(out, ref, rtol=1e-10)


def test_save_and_load(tmp_path, rng):
    store = kv.create("local")
    v = rng.standard_normal(6).astype(np.float32)
    store.init("p", v)
    store.save(tmp_path / "ckpt.safetensors")
    other = kv.create("local")
    other.load(tmp_path / "ckpt.safetensors")
    out = np.zeros(6, np.float32)
    other.pull("p", out=out)
    np.testing.assert_array_equal(out, v)
    with pytest.raises(kv.CheckpointError):
        other.load(tmp_path / "missing.safetensors")


def test_a_crafted_70_byte_index_is_an_error_not_an_abort(tmp_path):
    # An index that names 10^13 shards: it once made the process abort (exit 134) trying to
    # allocate for them. In a child, so an abort fails this test instead of the run.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    index = b"kvstore-checkpoint-index/1\ngeneration 1844674407\nworld 10000000000000\n"
    assert len(index) == 70
    (ckpt / "index").write_bytes(index)
    code = textwrap.dedent(
        f"""
        import kvstore as kv
        store = kv.create('local')
        try:
            store.load({str(ckpt)!r})
        except kv.CheckpointError as e:
            print('CheckpointError', e)
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "CheckpointError" in p.stdout, (p.returncode, p.stdout, p.stderr)
    assert "10000000000000 shards" in p.stdout, p.stdout


def test_the_gil_is_released_during_store_calls():
    """Thread A's push holds key 3's lock inside a Python updater that waits for an event.
    The main thread then pulls key 3 and blocks on that lock. Thread B sets the event. If the
    pull kept the GIL while blocked, neither B nor A's updater could run again: a deadlock,
    caught here by the subprocess's timeout (a hang guard, not a timing assert)."""
    code = textwrap.dedent(
        """
        import threading, time
        import numpy as np
        import kvstore as kv
        store = kv.create('local')
        store.init(3, np.zeros(4, np.float32))
        started, proceed = threading.Event(), threading.Event()
        def update(key, inp, st):
            started.set()
            proceed.wait()
            st += inp
        store.set_updater(update)
        a = threading.Thread(target=store.push, args=(3, np.ones(4, np.float32)))
        a.start()
        started.wait()
        def release():
            time.sleep(0.2)  # let the main thread enter the pull first (not needed to pass)
            proceed.set()
        threading.Thread(target=release).start()
        out = np.zeros(4, np.float32)
        store.pull(3, out=out)  # waits for A's push to finish
        a.join()
        print(out.tolist())
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[1.0, 1.0, 1.0, 1.0]"


class LegacyProducer:
    """A producer from before DLPack 1.0 (as NumPy < 2.1 and older torch are): `__dlpack__`
    takes no max_version and returns a legacy capsule."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_legacy_dlpack_producers(rng):
    store = kv.create("local")
    v = rng.standard_normal((3, 4)).astype(np.float32)
    store.init("L", LegacyProducer(v))
    store.push("L", [LegacyProducer(v), LegacyProducer(v[:, ::2].repeat(2, axis=1))])
    out = np.zeros((3, 4), np.float32)
    store.pull("L", out=LegacyProducer(out))
    np.testing.assert_allclose(out, v + v[:, ::2].repeat(2, axis=1), rtol=1e-6)
