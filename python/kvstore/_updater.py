"""Calls a Python updater with NumPy arrays it may change in place."""

import numpy as np


def call(fn, key, input_bytes, stored_bytes, shape, dtype):
    """Views the two buffers the store hands over as NumPy arrays and calls
    ``fn(key, input, stored)``. Whatever ``fn`` leaves in ``stored`` becomes the key's value."""
    inp = np.frombuffer(input_bytes, dtype=dtype).reshape(shape)
    stored = np.frombuffer(stored_bytes, dtype=dtype).reshape(shape)
    fn(key, inp, stored)
