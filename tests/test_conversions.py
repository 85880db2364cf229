"""Format x format round trips, scipy/cupyx conversions, transpose and value maps."""
import numpy as np
import pytest
import scipy.sparse as sp

import twellpy as tw
from _containers import FORMATS, bits_equal, host
from conftest import DTYPES
from makers import MAKERS, SMALL_MAKERS


@pytest.mark.parametrize("dst", FORMATS)
@pytest.mark.parametrize("src", FORMATS)
@pytest.mark.parametrize("maker", SMALL_MAKERS)
def test_format_to_format(backend, xp, maker, src, dst):
    x = xp.asarray(SMALL_MAKERS[maker](np.random.default_rng(11)).astype(np.float32))
    scls, sparams = FORMATS[src]
    dcls, dparams = FORMATS[dst]
    A = scls.from_dense(x, **sparams)
    B = A.asformat(dcls.format, **dparams)
    B.check_format(full_check=True)
    assert type(B) is dcls and B.device == A.device
    assert bits_equal(B.toarray(), x)
    assert B.nnz == A.nnz
    if B is A:  # same format, no parameters: asformat returns self
        assert scls is dcls and not dparams
        return
    # direct construction and conversion agree bit for bit
    D = dcls.from_dense(x, **dparams)
    for k in D._array_names:
        assert bits_equal(getattr(B, k), getattr(D, k)), k


def test_asformat_same_and_unknown():
    A = tw.TwELL.from_dense(np.eye(4))
    assert A.asformat("twell") is A
    assert A.asformat("twell", slots=2).slots == 2
    with pytest.raises(ValueError, match="unknown format 'csr'"):
        A.asformat("csr")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", MAKERS)
def test_scipy_roundtrip(maker, fmt, dtype):
    x64 = MAKERS[maker](np.random.default_rng(5))
    xd = x64.astype(dtype)
    cls, params = FORMATS[fmt]
    A = cls.from_scipy(sp.csr_array(x64), dtype=dtype, **params)
    A.check_format(full_check=True)
    assert A.dtype == dtype and bits_equal(A.toarray(), xd)
    for f in ("csr", "csc", "coo"):
        s = A.to_scipy(f)
        assert s.format == f
        # 16-bit values come back as float32 (scipy has no 16-bit types), losslessly.
        assert s.dtype == (np.float32 if np.dtype(dtype).itemsize == 2 else dtype)
        assert np.array_equal(s.toarray(), xd.astype(s.dtype))
    csr = A.to_scipy()
    assert csr.has_sorted_indices and csr.nnz == np.count_nonzero(x64)
    B = cls.from_scipy(csr, dtype=dtype, **params)
    for k in A._array_names:
        assert bits_equal(getattr(A, k), getattr(B, k)), k


@pytest.mark.parametrize("fmt", FORMATS)
def test_from_scipy_duplicates_zeros_unsorted_and_all_kinds(fmt):
    cls, params = FORMATS[fmt]
    rows = np.array([0, 0, 0, 2, 2, 1, 3, 3])
    cols = np.array([5, 1, 5, 7, 7, 2, 0, 4])
    vals = np.array([1.0, 2.0, 3.0, 4.0, -4.0, 0.0, 6.0, 7.0])  # (0,5) summed; (2,7) cancels; (1,2) explicit 0
    coo = sp.coo_array((vals, (rows, cols)), shape=(4, 300))
    want = coo.toarray()
    for m in (coo, coo.tocsr(), coo.tocsc(), sp.coo_matrix(coo), sp.csr_matrix(coo), sp.lil_array(want),
              sp.dok_array(want), sp.bsr_array(want)):
        A = cls.from_scipy(m, **params)
        A.check_format(full_check=True)
        assert np.array_equal(host(A.toarray()), want)
        assert A.nnz == 4  # (0,1), (0,5)=4, (3,0), (3,4)
    # unsorted column indices in a CSR
    m = sp.csr_array((np.array([1.0, 2.0, 3.0]), np.array([9, 2, 5]), np.array([0, 3])), shape=(1, 10))
    assert not m.has_sorted_indices
    A = cls.from_scipy(m, **params)
    A.check_format(full_check=True)
    assert np.array_equal(host(A.toarray()), m.toarray())


def test_from_scipy_cast_drops_underflow():
    m = sp.csr_array(np.array([[1e-30, 1.0, 0.0], [0.0, 1e-30, 0.0], [2.0, 0.0, 3.0]]))
    for cls, params in FORMATS.values():
        A = cls.from_scipy(m, dtype=np.float16, **params)
        A.check_format(full_check=True)
        assert A.nnz == 3
        assert host(A.toarray()).tolist() == [[0, 1, 0], [0, 0, 0], [2, 0, 3]]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", MAKERS)
def test_transpose(backend, xp, maker, fmt):
    x64 = MAKERS[maker](np.random.default_rng(9))
    x = xp.asarray(x64.astype(np.float32))
    cls, params = FORMATS[fmt]
    A = cls.from_dense(x, **params)
    T = A.T
    assert type(T) is cls and T.shape == A.shape[::-1]
    T.check_format(full_check=True)
    assert bits_equal(T.toarray(), xp.ascontiguousarray(x.T))
    assert bits_equal(T.T.toarray(), x)
    T2 = A.transpose()
    for k in T._array_names:
        assert bits_equal(getattr(T, k), getattr(T2, k))  # deterministic
    if cls is tw.TwELL:
        assert (T.tile, T.slots) == (A.tile, A.slots)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_value_maps(backend, xp, fmt, dtype):
    x64 = MAKERS["over_capacity"](np.random.default_rng(4))
    xd = x64.astype(dtype)
    cls, params = FORMATS[fmt]
    A = cls.from_dense(xp.asarray(xd), **params)
    for B, want in ((-A, -xd), (A.abs(), np.abs(xd)), (abs(A), np.abs(xd)),
                    (A * 2, (x64 * 2).astype(dtype)), (0.5 * A, (x64 * 0.5).astype(dtype)),
                    (A / 4, (x64 / 4).astype(dtype)), (A * A, (xd.astype(np.float64) ** 2).astype(dtype))):
        B.check_format(full_check=True)
        assert B.dtype == dtype and type(B) is cls
        assert bits_equal(B.toarray(), xp.asarray(want + np.zeros((), dtype)))
    for dt in DTYPES:
        C = A.astype(dt)
        C.check_format(full_check=True)
        assert C.dtype == dt and bits_equal(C.toarray(), xp.asarray(xd.astype(dt)))
    with pytest.raises(ValueError, match="scalar factor must be finite"):
        A * float("inf")
    with pytest.raises(TypeError, match="dtype int32 is not supported"):
        A.astype(np.int32)


def test_mul_requires_same_pattern():
    A = tw.TwELL.from_dense(np.eye(3))
    B = tw.TwELL.from_dense(np.eye(3)[::-1].copy())
    with pytest.raises(ValueError, match="different sparsity pattern"):
        A * B
    with pytest.raises(ValueError, match="same format and shape"):
        A * tw.ELL.from_dense(np.eye(3))


@pytest.mark.parametrize("fmt", FORMATS)
def test_with_values_and_copy(backend, xp, fmt):
    x64 = MAKERS["over_capacity"](np.random.default_rng(6))
    cls, params = FORMATS[fmt]
    A = cls.from_dense(xp.asarray(x64), **params)
    new_vals = xp.full(A.values.shape, 3.0, np.float32)  # padding slots get ignored
    backup = None if A.backup is None else xp.full(A.backup.shape, 5.0, np.float32)
    if A.n_backup:
        with pytest.raises(ValueError, match="backup is required"):
            A.with_values(new_vals)
    B = A.with_values(new_vals, backup)
    B.check_format(full_check=True)
    want = np.where(x64 != 0, 3.0, 0.0)
    if A.n_backup:
        want[host(A.backup_rows)] = 5.0
    assert B.dtype == np.float32 and np.array_equal(host(B.toarray()), want)
    with pytest.raises(ValueError, match=r"values has shape \(1, 1\), expected"):
        A.with_values(xp.zeros((1, 1), np.float32), backup)
    C = A.copy()
    for k in A._array_names:
        assert bits_equal(getattr(A, k), getattr(C, k))
        assert getattr(A, k) is not getattr(C, k)
    C.values[...] = 0
    assert bits_equal(A.toarray(), xp.asarray(x64))


def test_to_device_cpu_returns_self():
    A = tw.Hybrid.from_dense(np.eye(5))
    assert A.to_device("cpu") is A
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        A.to_device("tpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_to_device_roundtrip_gpu(fmt, dtype):
    import cupy

    x = MAKERS["over_capacity"](np.random.default_rng(8)).astype(dtype)
    cls, params = FORMATS[fmt]
    A = cls.from_dense(x, **params)
    G = A.to_device("cuda")
    assert G.device == "cuda:0" and isinstance(G.values, cupy.ndarray)
    G.check_format(full_check=True)
    assert bits_equal(G.toarray(), x)
    H = G.to_device("cpu")
    for k in A._array_names:
        assert bits_equal(getattr(A, k), getattr(H, k))
    # GPU construction gives the same bits as CPU construction
    D = cls.from_dense(cupy.asarray(x), **params)
    for k in A._array_names:
        assert bits_equal(getattr(A, k), getattr(D, k)), k


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cupyx_roundtrip_gpu(fmt):
    import cupyx.scipy.sparse as csp

    x = MAKERS["over_capacity"](np.random.default_rng(10)).astype(np.float32)
    cls, params = FORMATS[fmt]
    m = csp.csr_matrix(sp.csr_matrix(x))
    A = cls.from_cupyx(m, **params)
    assert A.device == "cuda:0" and bits_equal(A.toarray(), x)
    back = A.to_cupyx("csr")
    assert np.array_equal(back.toarray().get(), x)
