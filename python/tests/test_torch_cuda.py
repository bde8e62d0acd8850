"""PyTorch CUDA tensors lent to the store in place (no copy), with DLPack's stream handshake.

Needs a GPU that torch can use; skipped, saying so, elsewhere (CI has none: the Rust side of
the lend, `tests/lent_gpu.rs`, runs there on the stand-in driver). `scripts/gpu-check.sh`
stages this file for the GPU run.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvstore  # noqa: E402
from kvstore import _arrays  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="SKIPPED: torch sees no CUDA device"
)


@pytest.fixture
def no_staging(monkeypatch):
    """Fails any copy of a CUDA tensor through host memory: the calls must lend in place."""

    def refuse(arr):
        raise AssertionError(f"a {type(arr).__name__} was staged through host memory")

    monkeypatch.setattr(_arrays, "_to_host", refuse)
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: refuse(self))


def rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def test_push_and_pull_lend_cuda_tensors_in_place(no_staging):
    seed = int.from_bytes(np.random.bytes(4), "little")
    n = 1 << 20
    w0, g0, g1 = rand(n, seed), rand(n, seed + 1), rand(n, seed + 2)
    kv = kvstore.create("device")
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.5))
    kv.init(3, w0.float().cuda())
    grads = [g0.float().cuda(), g1.float().cuda()]
    kept = [g.clone() for g in grads]
    out = torch.full((n,), float("nan"), device="cuda")
    ptr = out.data_ptr()
    kv.push(3, grads)
    kv.pull(3, out=out)
    want = w0 - 0.5 * (g0.float().double() + g1.float().double())
    # Read on torch's stream straight after the call: the handshake orders it after the store.
    got = out.double()
    assert out.data_ptr() == ptr
    assert torch.allclose(got, want.cuda(), atol=1e-6)
    for g, k in zip(grads, kept):
        assert torch.equal(g, k), "a pushed tensor changed"


def test_torch_work_before_the_call_is_waited_for():
    """The gradient is written by a long kernel on torch's current stream (a side stream) just
    before the push, and the out is read on it just after the pull, with no synchronize: the
    stream handshake alone orders them."""
    seed = int.from_bytes(np.random.bytes(4), "little")
    n = 4096
    kv = kvstore.create("device")
    kv.init(5, torch.zeros(n * n // 64, device="cuda"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a = rand((n, n), seed).float().cuda()
        for _ in range(3):  # milliseconds of work queued before the push
            a = (a @ a).clamp_(-1, 1)
        grad = a.flatten()[: n * n // 64].contiguous()
        kv.push(5, grad)
        out = torch.empty_like(grad)
        kv.pull(5, out=out)
        got = out.clone()
    side.synchronize()
    assert torch.equal(got, grad), "the store read the gradient before torch wrote it"


def test_non_contiguous_tensors_go_through_a_contiguous_copy():
    seed = int.from_bytes(np.random.bytes(4), "little")
    v = rand((300, 4), seed).float().cuda()
    kv = kvstore.create("device")
    kv.init(9, torch.zeros(300, device="cuda"))
    kv.push(9, v[:, 1])  # a strided view
    base = torch.full((300, 4), -7.0, device="cuda")
    kv.pull(9, out=base[:, 2])
    torch.cuda.synchronize()
    assert torch.equal(base[:, 2], v[:, 1])
    assert torch.all(base[:, [0, 1, 3]] == -7.0), "the pull wrote outside its view"


def test_a_cpu_store_takes_cuda_tensors_too():
    seed = int.from_bytes(np.random.bytes(4), "little")
    v = rand(1000, seed).float()
    kv = kvstore.create("local")
    kv.init("w", torch.zeros(1000))
    kv.push("w", [v.cuda(), v.cuda()])
    out = torch.zeros(1000, device="cuda")
    kv.pull("w", out=out)
    assert torch.equal(out.cpu(), 2 * v)


def test_tensors_with_size_one_dimensions_are_lent(no_staging):
    """torch calls a (1, 4) view of a transposed (4, 1) tensor contiguous, and its DLPack
    export gives both dimensions stride 1: the lend accepts it (a size-1 dimension's stride
    does not matter)."""
    seed = int.from_bytes(np.random.bytes(4), "little")
    v = rand((4, 1), seed).float().cuda().t()
    assert v.is_contiguous() and v.shape == (1, 4)
    kv = kvstore.create("device")
    kv.init(2, torch.zeros(1, 4, device="cuda"))
    kv.push(2, v)
    out = torch.empty(4, 1, device="cuda").t()
    kv.pull(2, out=out)
    assert torch.equal(out, v)


def test_a_pull_into_a_weight_used_by_autograd_is_seen_by_backward():
    """A pull writes the out in place, as copy_ would: a backward through a value the pull
    replaced fails, as torch makes it fail for any in-place write, instead of silently using
    the new values."""
    kv = kvstore.create("device")
    w = torch.ones(8, device="cuda", requires_grad=True)
    kv.init(6, torch.full((8,), 2.0, device="cuda"))
    y = (w * w).sum()
    kv.pull(6, out=w)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_a_tensor_over_several_allocator_chunks_is_lent(no_staging):
    """96 MiB: with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the GPU run runs this
    file with it too) torch maps it over several physical chunks, which the driver reports
    as separate allocations; the lend checks the first and the last byte, not one range."""
    seed = int.from_bytes(np.random.bytes(4), "little")
    n = 24 << 20
    g = torch.Generator(device="cuda").manual_seed(seed)
    v = torch.randn(n, device="cuda", generator=g)
    kv = kvstore.create("device")
    kv.init(1, torch.zeros(n, device="cuda"))
    kv.push(1, v)
    out = torch.empty(n, device="cuda")
    kv.pull(1, out=out)
    assert torch.equal(out, v)
