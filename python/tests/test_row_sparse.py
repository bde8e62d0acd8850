"""Row-sparse keys from Python: MXNet 1.9.1's own results (the fixture
`tests/fixtures/mxnet_row_sparse.json` of the Rust crate, written by `make_mxnet_row_sparse.py`
with MXNet run on this machine), MXNet's unit tests of row_sparse (ported), SciPy CSR and
(ids, rows) values, torch tensors, and the errors (each leaves the store as it was)."""

import json
import pathlib

import numpy as np
import pytest

import kvstore

FIXTURE = (
    pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "mxnet_row_sparse.json"
)


def floats(bits, shape=None):
    a = np.array(bits, dtype=np.uint32).view(np.float32)
    return a if shape is None else a.reshape(shape)


def cases():
    return json.loads(FIXTURE.read_text())["cases"]


def optimizer_of(o):
    if o is None:
        return None
    args = {k: v for k, v in o.items() if k != "name"}
    cls = {"sgd": kvstore.optimizer.SGD, "adam": kvstore.optimizer.Adam}[o["name"]]
    return cls(lazy_update=True, **args)


@pytest.mark.parametrize("case", range(len(cases())))
def test_row_sparse_pushes_match_mxnet(case):
    c = cases()[case]
    shape = tuple(c["shape"])
    kv = kvstore.create(c["kind"])
    kv.init("e", kvstore.RowSparse(np.arange(shape[0]), floats(c["init"], shape), shape))
    opt = optimizer_of(c["optimizer"])
    if opt is not None:
        kv.set_optimizer(opt)
    for s, values in enumerate(c["steps"]):
        pushed = [
            kvstore.RowSparse(
                v["ids"], floats(v["rows"], (len(v["ids"]),) + shape[1:]), shape
            )
            for v in values
        ]
        kv.push("e", pushed)
        whole = np.zeros(shape, dtype=np.float32)
        kv.pull("e", out=whole)
        np.testing.assert_allclose(whole, floats(c["dense"][s], shape), rtol=1e-6, atol=1e-6)
        # MXNet's row-sparse out: the rows asked for, zeros elsewhere.
        out = np.full(shape, 7.0, dtype=np.float32)
        kv.row_sparse_pull("e", out=out, row_ids=np.array(c["pull_ids"][s]))
        np.testing.assert_allclose(out, floats(c["pulled"][s], shape), rtol=1e-6, atol=1e-6)


def rsp(ids, rows, shape):
    return kvstore.RowSparse(np.array(ids), np.asarray(rows, dtype=np.float32), shape)


def test_mxnet_row_sparse_pull_one_and_four_outs():
    # test_kvstore.py's test_row_sparse_pull: init ones as rsp; random row ids of shape (2, 2)
    # per out; each out has 1 in its rows and 0 elsewhere.
    rng = np.random.default_rng()
    shape = (4, 4)
    kv = kvstore.create("local")
    kv.init("e", rsp(np.arange(4), np.ones(shape), shape))
    for count in (1, 4):
        outs = [np.full(shape, 5.0, dtype=np.float32) for _ in range(count)]
        ids = [rng.integers(0, 4, size=4).reshape(2, 2) for _ in range(count)]
        if count == 1:
            kv.row_sparse_pull("e", out=outs[0], row_ids=ids[0])
        else:
            kv.row_sparse_pull("e", out=outs, row_ids=ids)
        for o, i in zip(outs, ids):
            want = np.zeros(shape, dtype=np.float32)
            want[np.unique(i)] = 1
            np.testing.assert_array_equal(o, want)


def test_mxnet_sparse_aggregator_and_single_pair():
    # test_single_kv_pair (rsp): a push of ones as rsp, a dense pull: 1. test_sparse_aggregator:
    # random rsp values from 4 devices; each out equals their sum.
    rng = np.random.default_rng()
    shape = (4, 4)
    kv = kvstore.create("local")
    kv.init(3, rsp([], np.zeros((0, 4)), shape))
    kv.push(3, rsp(np.arange(4), np.ones(shape), shape))
    out = np.zeros(shape, dtype=np.float32)
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, np.ones(shape))
    vals = []
    for _ in range(4):
        ids = np.sort(rng.choice(4, size=int(rng.integers(1, 5)), replace=False))
        vals.append(rsp(ids, rng.standard_normal((len(ids), 4)), shape))
    kv.push(3, vals)
    got = kv.row_sparse_pull(3, row_ids=np.arange(4))
    np.testing.assert_allclose(got.to_dense(), sum(v.to_dense() for v in vals), rtol=1e-6)


def test_scipy_csr_and_pairs_push_rows():
    sp = pytest.importorskip("scipy.sparse")
    rng = np.random.default_rng()
    shape = (6, 3)
    w0 = rng.standard_normal(shape).astype(np.float32)
    kv = kvstore.create("device")
    kv.init_row_sparse("emb", w0)
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.5))
    dense = np.zeros(shape, dtype=np.float32)
    dense[[1, 4]] = rng.standard_normal((2, 3))
    pair_rows = rng.standard_normal((2, 3)).astype(np.float32)
    kv.push_row_sparse("emb", [sp.csr_matrix(dense), (np.array([4, 4]), pair_rows)])
    want = w0.copy()
    want[1] -= 0.5 * dense[1]
    want[4] -= 0.5 * (dense[4] + pair_rows[0] + pair_rows[1])
    got = np.zeros(shape, dtype=np.float32)
    kv.pull("emb", out=got)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert kv.row_sparse_pull("emb", row_ids=[4, 1]).ids.tolist() == [1, 4]


def test_torch_rows_and_outs():
    torch = pytest.importorskip("torch")
    shape = (5, 2)
    kv = kvstore.create("local")
    kv.init("e", kvstore.RowSparse(torch.arange(5), torch.ones(shape), shape))
    kv.push("e", kvstore.RowSparse(torch.tensor([2]), torch.full((1, 2), 3.0), shape))
    out = torch.full(shape, 9.0)
    kv.row_sparse_pull("e", out=out, row_ids=torch.tensor([2, 0]))
    want = torch.zeros(shape)
    want[2] = 3.0  # assign: the value is the pushed sum, zeros elsewhere (as MXNet)
    assert torch.equal(out, want)


def snapshot(kv, keys, shape):
    outs = []
    for k in keys:
        o = np.zeros(shape, dtype=np.float32)
        kv.pull(k, out=o)
        outs.append(o)
    return outs


def test_bad_row_sparse_input_is_a_typed_error_and_changes_nothing():
    rng = np.random.default_rng()
    shape = (6, 4)
    kv = kvstore.create("local")
    kv.init_row_sparse(0, rng.standard_normal(shape).astype(np.float32))
    kv.init(1, rng.standard_normal(shape).astype(np.float32))
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    good = rsp([1, 2], rng.standard_normal((2, 4)), shape)
    kv.push(0, good)
    before = snapshot(kv, [0, 1], shape)
    pushed = good.rows.copy()
    bad = [
        lambda: kv.push(0, rsp([6], np.ones((1, 4)), shape)),  # out of range
        lambda: kv.push_row_sparse(0, (np.array([0]), np.ones((1, 5), np.float32))),  # width
        lambda: kv.push(1, good),  # row-sparse to a dense key
        lambda: kv.push(0, np.ones(shape, dtype=np.float32)),  # dense to a row-sparse key
        lambda: kv.push(0, [good, np.ones(shape, dtype=np.float32)]),  # mixed
        lambda: kv.row_sparse_pull(1, row_ids=[0]),  # dense key
        lambda: kv.row_sparse_pull(0, row_ids=[0, 6]),  # out of range
        lambda: kv.push_row_sparse(0, (np.array([-1]), np.ones((1, 4), dtype=np.float32))),
        lambda: kv.init_row_sparse(2, np.zeros(6, dtype=np.float32)),  # one dimension
    ]
    for i, call in enumerate(bad):
        with pytest.raises(kvstore.RowSparseError):
            call()
    # Values that stand for an array of another shape than the key's, and outs of another
    # shape: nothing is written, not even to the outs before the bad one.
    sp = pytest.importorskip("scipy.sparse")
    with pytest.raises(kvstore.ShapeMismatchError):
        kv.push(0, rsp([0], np.ones((1, 5)), (6, 5)))
    with pytest.raises(kvstore.ShapeMismatchError):
        kv.push(0, sp.csr_matrix(np.ones((3, 4), np.float32)))
    first = np.full(shape, 7.0, np.float32)
    with pytest.raises(kvstore.ShapeMismatchError):
        kv.row_sparse_pull(0, out=[first, np.zeros((6, 5), np.float32)], row_ids=[0])
    assert (first == 7.0).all(), "an out was written before the bad one was found"
    with pytest.raises((TypeError, ValueError)):
        kv.push(0, good, priority="x")
    with pytest.raises(kvstore.RowSparseError):
        kvstore.RowSparse([5], np.ones((1, 4)), (3, 4))  # id past the declared shape
    for a, b in zip(snapshot(kv, [0, 1], shape), before):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(good.rows, pushed)
    assert kv.keys() == [0, 1]
    with pytest.raises(kvstore.InvalidArgumentError):
        kv.set_optimizer(kvstore.optimizer.SGD(lazy_update=False))
