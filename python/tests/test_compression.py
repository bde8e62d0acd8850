"""2-bit gradient compression from Python, against MXNet 1.9.1's own results (the fixture
`tests/fixtures/mxnet_2bit.json` of the Rust crate, written by `make_mxnet_2bit.py` with MXNet
run on this machine): a push of a list of values compresses each with its own residual, as
MXNet's `device` store does for each device."""

import json
import pathlib

import numpy as np
import pytest

import kvstore

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "mxnet_2bit.json"


def floats(bits, shape=None):
    a = np.array(bits, dtype=np.uint32).view(np.float32)
    return a if shape is None else a.reshape(shape)


def cases():
    return json.loads(FIXTURE.read_text())["cases"]


@pytest.mark.parametrize("case", range(len(cases())))
def test_two_bit_pushes_match_mxnet(case):
    c = cases()[case]
    shape = tuple(c["shape"])
    t = float(floats([c["threshold_bits"]])[0])
    kv = kvstore.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": t})
    exact = c["optimizer"] is None
    if not exact:
        o = c["optimizer"]
        kv.set_optimizer(
            kvstore.optimizer.SGD(
                learning_rate=o["learning_rate"],
                momentum=o["momentum"],
                wd=o["wd"],
                rescale_grad=o["rescale_grad"],
            )
        )
    kv.init(0, floats(c["init"], shape).copy())
    for s, (values, want) in enumerate(zip(c["steps"], c["pulled"])):
        kv.push(0, [floats(v, shape).copy() for v in values])
        out = np.zeros(shape, dtype=np.float32)
        kv.pull(0, out=out)
        want = floats(want, shape)
        if exact:
            assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), (s, out, want)
        else:
            np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6, err_msg=f"step {s}")


def test_bad_settings_are_refused():
    kv = kvstore.create("device")
    for bad in [{}, {"type": "1bit"}, {"type": "2bit", "treshold": 0.5}, {"type": "2bit", "threshold": 0}]:
        with pytest.raises(kvstore.InvalidArgumentError):
            kv.set_gradient_compression(bad)
    with pytest.raises(TypeError):
        kv.set_gradient_compression("2bit")
    with pytest.raises(kvstore.InvalidArgumentError, match="'device'"):
        kvstore.create("local").set_gradient_compression({"type": "2bit"})
    kv.init(3, np.zeros(4, dtype=np.float32))
    with pytest.raises(kvstore.InvalidArgumentError, match="before the first init"):
        kv.set_gradient_compression({"type": "2bit"})
    kv = kvstore.create("device")
    kv.set_gradient_compression({"type": "2bit"})
    with pytest.raises(kvstore.InvalidArgumentError, match="float32"):
        kv.init(4, np.zeros(4, dtype=np.float16))
    assert kv.keys() == []


def _round_half(x, kind):
    """``x`` (float32) rounded to the nearest bfloat16 or float16, ties to even, as float32."""
    if kind == "fp16":
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_a_16_bit_wire_keeps_the_rounding_error_for_the_next_push(kind):
    """Each value plus its residual is rounded to 16 bits; the error stays for the same key's
    next push from the same position; the rounded values are summed in list order. Against a
    NumPy reference, bit for bit, over several pushes of fresh random values."""
    rng = np.random.default_rng()
    kv = kvstore.create("device")
    kv.set_gradient_compression({"type": kind})
    shape, devices = (7, 9), 3
    kv.init(4, np.zeros(shape, np.float32))
    residual = [np.zeros(shape, np.float32) for _ in range(devices)]
    for _ in range(4):
        values = [rng.standard_normal(shape).astype(np.float32) for _ in range(devices)]
        kv.push(4, values)
        total = None
        for d, v in enumerate(values):
            acc = residual[d] + v
            sent = _round_half(acc, kind)
            residual[d] = acc - sent
            total = sent if total is None else total + sent
        out = np.full(shape, np.nan, np.float32)
        kv.pull(4, out=out)
        assert np.array_equal(out, total)
        assert not np.array_equal(out, sum(values)), "nothing was rounded"


def test_a_16_bit_wire_takes_no_threshold():
    kv = kvstore.create("device")
    with pytest.raises(kvstore.InvalidArgumentError, match="'type' alone"):
        kv.set_gradient_compression({"type": "bf16", "threshold": 0.5})
