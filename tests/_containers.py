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


def bits_equal(a, b, any_nan=False):
    """Bit-exact equality of two value arrays (numpy/cupy), NaN and -0 aware.

    ``any_nan``: NaN must meet NaN, but its payload and sign may differ. A NaN that
    arithmetic makes (x * NaN) is the GPU's canonical NaN there and the operand's
    NaN on x86, so only copies, not products, keep a payload."""
    a, b = host(a), host(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    u = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    if any_nan:
        nan_a, nan_b = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
        if not np.array_equal(nan_a, nan_b):
            return False
        a, b = np.where(nan_a, np.zeros_like(a), a), np.where(nan_b, np.zeros_like(b), b)
    return np.array_equal(a.view(u), b.view(u))
