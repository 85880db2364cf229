"""Helpers shared by the container tests (formats x makers x dtypes x backends)."""
import numpy as np

import twellpy as tw
from twellpy._array import bfloat16

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


def cast(x64, dtype):
    """float64 numpy array -> dtype (numpy)."""
    return x64.astype(dtype)


def to_xp(xp, a):
    return xp.asarray(a)


def bits_equal(a, b):
    """Bit-exact equality of two value arrays (numpy/cupy), NaN and -0 aware."""
    a, b = host(a), host(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return np.array_equal(a.view(u), b.view(u))


def dense_ref(x):
    """float64 numpy reference of a (possibly 16-bit, possibly cupy) dense array."""
    return host(x).astype(np.float64)


__all__ = ["FORMATS", "host", "cast", "to_xp", "bits_equal", "dense_ref", "bfloat16"]
