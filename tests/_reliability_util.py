"""Host copies and bit comparisons that never rely on CuPy's bfloat16 support.

Used by the reliability tests (fuzz, bad input, determinism, concurrency,
GPU reliability): cupy arrays travel to the host as raw unsigned bytes, the
way ``tests/test_gpu_containers.py`` moves them.
"""
import numpy as np

from twellpy._array import bfloat16

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def host(a):
    """numpy copy (or view) of a numpy/cupy array; float/bfloat16 bytes moved raw."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "get"):
        if a.dtype.kind == "f" or a.dtype == bfloat16:
            import cupy

            return cupy.asnumpy(cupy.ascontiguousarray(a).view(_UINT[a.dtype.itemsize])).view(a.dtype)
        return a.get()
    return np.asarray(a)


def bits_equal(a, b):
    """Bit-exact equality of two arrays (numpy/cupy): dtype, shape and bytes; NaN and -0 aware."""
    a, b = host(a), host(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    u = _UINT[a.dtype.itemsize]
    return np.array_equal(np.ascontiguousarray(a).view(u), np.ascontiguousarray(b).view(u))


def poison_cuda_allocations(monkeypatch):
    """Make every output the CUDA container backend allocates start as garbage.

    Float outputs are filled with 0xFF bytes (NaN in every float dtype), index
    outputs with 0x7B bytes, so an element a kernel forgets to write shows up.
    """
    from twellpy.backends import cuda

    real = cuda._alloc

    def poisoned(shape, dtype):
        a = real(shape, dtype)
        if a.nbytes:
            dt = np.dtype(dtype)
            a.data.memset_async(0xFF if dt.kind == "f" or dt == bfloat16 else 0x7B, a.nbytes)
        return a

    monkeypatch.setattr(cuda, "_alloc", poisoned)
