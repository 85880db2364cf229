"""Helpers shared by the container tests (formats x makers x dtypes x backends)."""
import numpy as np

import twellpy as tw

#: name -> (class, from_dense/from_scipy parameters)
FORMATS = {
    "twell": (tw.TwELL, {}),
    "twell_t64_s4": (tw.TwELL, {"tile": 64, "slots": 4}),
    "ell": (tw.ELL, {}),
    "hybrid": (tw.Hybrid, {}),
    "hybrid_w2": (tw.Hybrid, {"width": 2}),
}


def host(a):
    """numpy copy of a numpy/cupy array."""
    return np.asarray(a.get() if hasattr(a, "get") else a)


def bits_equal(a, b):
    """Bit-exact equality of two value arrays (numpy/cupy), NaN and -0 aware."""
    a, b = host(a), host(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    u = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return np.array_equal(a.view(u), b.view(u))
