"""Array backends for the tests: every test that takes `xp` runs on NumPy, and on torch where
torch is installed (otherwise the torch run is skipped, and says so)."""

import numpy as np
import pytest

try:
    import torch
except ImportError:  # torch is optional: only its tests need it
    torch = None


class NumpyBackend:
    name = "numpy"

    def ones(self, shape, dtype="float32"):
        return np.ones(shape, dtype=dtype)

    def zeros(self, shape, dtype="float32"):
        return np.zeros(shape, dtype=dtype)

    def full(self, shape, value, dtype="float32"):
        return np.full(shape, value, dtype=dtype)

    def random(self, shape, rng, dtype="float32"):
        return rng.standard_normal(shape).astype(dtype)

    def numpy(self, a):
        return np.asarray(a)


class TorchBackend:
    name = "torch"

    def _dt(self, dtype):
        return getattr(torch, dtype)

    def ones(self, shape, dtype="float32"):
        return torch.ones(shape, dtype=self._dt(dtype))

    def zeros(self, shape, dtype="float32"):
        return torch.zeros(shape, dtype=self._dt(dtype))

    def full(self, shape, value, dtype="float32"):
        return torch.full(shape, value, dtype=self._dt(dtype))

    def random(self, shape, rng, dtype="float32"):
        return torch.from_numpy(rng.standard_normal(shape).astype(dtype))

    def numpy(self, a):
        return a.detach().cpu().numpy()


@pytest.fixture(params=["numpy", "torch"])
def xp(request):
    if request.param == "numpy":
        return NumpyBackend()
    if torch is None:
        pytest.skip("torch not installed")
    return TorchBackend()


@pytest.fixture
def rng():
    # Fresh random data on every run; the seed is printed, so pytest shows it with a failure.
    seed = np.random.SeedSequence().entropy % (2**32)
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)
