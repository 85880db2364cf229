"""Bitwise determinism: the same inputs give the same bits, every run.

Construction (padding included), conversions, inference and the training
step are each run several times on fresh copies of the same inputs and the
outputs compared bit for bit (NaN- and -0-aware). On the CPU the runs also
vary the Numba thread count (1 thread vs all), because the ``prange`` loops
must not make results depend on the schedule. The CUDA variants carry the
``gpu`` marker and run the same bodies on cupy inputs.
"""
import os

import numba
import numpy as np
import pytest
import scipy.sparse as sp

import twellpy as tw
from _reliability_util import bits_equal
from _train_ref import to_gpu
from makers import SMALL_MAKERS, wide
from twellpy._array import bfloat16


def rmatmul(w, A):
    """``w @ A``; cupy operands call ``A.__rmatmul__`` directly, because whether
    ``cupy.ndarray.__matmul__`` defers to a foreign ``__rmatmul__`` depends on the
    CuPy version (the operator form on cupy is tested once, in test_gpu_reliability)."""
    return w @ A if isinstance(w, np.ndarray) else A.__rmatmul__(w)


FORMATS = {
    "twell": (tw.TwELL, {}),
    "twell_t64_s4": (tw.TwELL, {"tile": 64, "slots": 4}),
    "twell_t1_s1": (tw.TwELL, {"tile": 1, "slots": 1}),
    "ell": (tw.ELL, {}),
    "hybrid_auto": (tw.Hybrid, {}),
    "hybrid_w2": (tw.Hybrid, {"width": 2}),
}
#: compute-sanitizer runs (TWELLPY_SANITIZE, set by benchmarks/device_suite.sh) are much slower:
#: fewer repeats and no 70000-column case there
SANITIZE = bool(os.environ.get("TWELLPY_SANITIZE"))
MAKERS = dict(SMALL_MAKERS) if SANITIZE else dict(SMALL_MAKERS, wide=wide)
N_RUNS = 1 if SANITIZE else 3


def _dev(a, backend):
    return to_gpu(a) if backend == "cuda" else a.copy()


def _same(a, b):
    """Bitwise equality of results: arrays, containers, scipy matrices, tuples."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, tw.SparseArray):
        return (a.format == b.format and a._params() == b._params()
                and all(bits_equal(getattr(a, k), getattr(b, k)) for k in a._array_names))
    if sp.issparse(a):
        return (bits_equal(a.indptr, b.indptr) and bits_equal(a.indices, b.indices)
                and bits_equal(a.data, b.data))
    if hasattr(a, "indptr"):  # cupyx csr
        return _same(a.get(), b.get())
    return bits_equal(a, b)


def assert_deterministic(backend, fn):
    """fn() several times (CPU: with 1 and all Numba threads) -> identical bits."""
    first = fn()
    threads = [numba.config.NUMBA_NUM_THREADS, 1] if backend == "cpu" else [None]
    saved = numba.get_num_threads()
    try:
        for run in range(N_RUNS):
            n = threads[run % len(threads)]
            if n is not None:
                numba.set_num_threads(n)
            assert _same(fn(), first), f"run {run + 1} (numba threads {n}) differs from run 0"
    finally:
        numba.set_num_threads(saved)
    return first


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_construction_is_bitwise_deterministic(backend, fmt, maker, dtype):
    cls, params = FORMATS[fmt]
    x = MAKERS[maker](np.random.default_rng(7)).astype(dtype)
    A = assert_deterministic(backend, lambda: cls.from_dense(_dev(x, backend), **params))
    csr = sp.csr_array(x.astype(np.float64))

    def from_scipy():
        B = cls.from_scipy(csr, dtype=dtype, **params)
        return B.to_device("cuda") if backend == "cuda" else B

    B = assert_deterministic(backend, from_scipy)
    assert _same(A, B)  # the dense and the CSR construction paths agree bit for bit
    assert_deterministic(backend, lambda: A.T)
    for other, (cls2, params2) in FORMATS.items():
        if dtype == np.float32 and other != fmt:
            assert_deterministic(backend, lambda: A.asformat(cls2.format, **params2))
    assert_deterministic(backend, lambda: A.to_scipy("csr") if backend == "cpu" else A.to_cupyx("csr"))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("maker", [k for k in ("zero_rows", "full_rows", "one_hot_row", "over_capacity",
                                               "ragged_n", "wide") if k in MAKERS])
@pytest.mark.parametrize("fmt", ["twell", "twell_t64_s4", "ell", "hybrid_auto", "hybrid_w2"])
def test_inference_is_bitwise_deterministic(backend, fmt, maker, dtype):
    cls, params = FORMATS[fmt]
    rng = np.random.default_rng(8)
    x = MAKERS[maker](rng).astype(dtype)
    m, n = x.shape
    A = cls.from_dense(_dev(x, backend), **params)
    W = _dev(rng.standard_normal((n, 5)).astype(dtype), backend)
    V = _dev(rng.standard_normal((3, m)).astype(dtype), backend)
    G = _dev(rng.standard_normal((m, 5)).astype(dtype), backend)
    X = _dev(rng.standard_normal((m, 4)).astype(dtype), backend)
    Y = _dev(rng.standard_normal((n, 4)).astype(dtype), backend)
    assert_deterministic(backend, lambda: A @ W)
    assert_deterministic(backend, lambda: rmatmul(V, A))
    assert_deterministic(backend, lambda: tw.ops.spmm(A, W))
    assert_deterministic(backend, lambda: tw.ops.spmm_t(A, G))
    assert_deterministic(backend, lambda: tw.ops.sddmm(X, Y, A))
    assert_deterministic(backend, lambda: tw.ops.transpose(A))
    assert_deterministic(backend, lambda: tw.ops.multiply(A, A))
    assert_deterministic(backend, lambda: (A * 3.0, -A, abs(A), A.astype(np.float16)))


def _ffn_inputs(backend, dtype, m=300, d=48, h=320, seed=9):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d))
    x[:, 0] = 1.0
    x[::37, 0] = -6.0  # a few tokens fire most neurons (rows over capacity)
    wg = rng.standard_normal((h, d)) / np.sqrt(d)
    wg[:, 0] = -1.5
    wu = rng.standard_normal((h, d)) / np.sqrt(d)
    wd = rng.standard_normal((d, h)) / np.sqrt(h)
    dy = rng.standard_normal((m, d))
    return [_dev(a.astype(dtype), backend) for a in (x, wg, wu, wd, dy)]


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16, np.dtype(np.float16)], ids=str)
@pytest.mark.parametrize("mode", ["auto", "sparse", "dense"])
def test_ffn_inference_is_bitwise_deterministic(backend, mode, dtype):
    x, wg, wu, wd, _ = _ffn_inputs(backend, dtype)
    assert_deterministic(backend, lambda: tw.ffn.gated_forward(x, wg, wu, wd, mode=mode, slots=8, tile=64,
                                                                 return_activations=True))
    assert_deterministic(backend, lambda: tw.ffn.relu_forward(x, wu, wd, mode=mode, return_activations=True))
    ffn = tw.ffn.GatedFFN(wg, wu, wd, mode=mode)
    assert_deterministic(backend, lambda: ffn(x))  # a reused plan gives the same bits as a fresh one
    assert _same(ffn(x), tw.ffn.gated_forward(x, wg, wu, wd, mode=mode))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("width", ["auto", 4])
def test_training_is_bitwise_deterministic(backend, width, dtype):
    """Every training kernel is deterministic (no float atomics), with or without the flag."""
    x, wg, wu, wd, dy = _ffn_inputs(backend, dtype, m=257, h=200)

    def gated():
        y, ctx = tw.ffn.gated_forward_train(x, wg, wu, wd, l1=1e-3, width=width, deterministic=False)
        assert ctx.stats["deterministic"] is True
        return (y, ctx.g, ctx.u) + tuple(tw.ffn.gated_backward(ctx, dy))

    def relu():
        y, ctx = tw.ffn.relu_forward_train(x, wu, wd, l1=1e-3, width=width, deterministic=True)
        return (y, ctx.h) + tuple(tw.ffn.relu_backward(ctx, dy))

    assert_deterministic(backend, gated)
    assert_deterministic(backend, relu)


def test_save_load_is_byte_deterministic(tmp_path):
    """Two saves of the same container give the same file contents."""
    x = MAKERS["over_capacity"](np.random.default_rng(3)).astype(bfloat16)
    A = tw.TwELL.from_dense(x, slots=16)
    p1, p2 = tmp_path / "a.npz", tmp_path / "b.npz"
    tw.save(p1, A)
    tw.save(p2, tw.TwELL.from_dense(x, slots=16))
    with np.load(p1) as z1, np.load(p2) as z2:
        assert z1.files == z2.files
        for k in z1.files:
            assert z1[k].dtype == z2[k].dtype and z1[k].tobytes() == z2[k].tobytes(), k
    assert _same(tw.load(p1), A)
