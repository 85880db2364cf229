"""CPU tests of twellpy.ops (spmm, spmm_t, sddmm, transpose, multiply) on every format."""
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

import twellpy as tw
from twellpy import ops
from twellpy._array import bfloat16

TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 5e-3,
       bfloat16: 2e-2}
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), bfloat16]


def rel(got, ref):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / den) if den else float(np.linalg.norm(got))


def make_dense(M, N, density, seed, hot_row=None, empty_rows=()):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, N)) * (rng.random((M, N)) < density)
    if hot_row is not None:
        a[hot_row] = rng.standard_normal(N)
    for r in empty_rows:
        a[r] = 0.0
    return a


MAKERS = {
    "random": lambda: make_dense(40, 300, 0.05, 0),
    "hot_row": lambda: make_dense(33, 300, 0.03, 1, hot_row=4),
    "empty": lambda: np.zeros((12, 70)),
    "empty_rows": lambda: make_dense(20, 130, 0.1, 2, empty_rows=(0, 5, 19)),
    "M1": lambda: make_dense(1, 257, 0.2, 3),
    "full_rows": lambda: make_dense(6, 65, 1.0, 4),
}


def containers(a, dtype):
    ah = a.astype(dtype)
    return [tw.ELL.from_dense(ah), tw.TwELL.from_dense(ah, tile=64, slots=4),
            tw.TwELL.from_dense(ah, tile=256, slots=32), tw.Hybrid.from_dense(ah, width="auto"),
            tw.Hybrid.from_dense(ah, width=2)]


def exact(A):
    return np.asarray(A.toarray(), dtype=np.float64)


@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_spmm_spmm_t_sddmm(maker, dtype):
    a = MAKERS[maker]()
    M, N = a.shape
    rng = np.random.default_rng(5)
    B = rng.standard_normal((N, 9)).astype(dtype)
    C = rng.standard_normal((M, 9)).astype(dtype)
    X = rng.standard_normal((M, 13)).astype(dtype)
    Y = rng.standard_normal((N, 13)).astype(dtype)
    for A in containers(a, dtype):
        ad = exact(A)
        out = ops.spmm(A, B)
        assert out.dtype == dtype and out.shape == (M, 9)
        assert rel(out, ad @ B.astype(np.float64)) <= TOL[dtype], A
        out = ops.spmm_t(A, C)
        assert out.dtype == dtype and out.shape == (N, 9)
        assert rel(out, ad.T @ C.astype(np.float64)) <= TOL[dtype], A
        S = ops.sddmm(X, Y, A)
        assert S.format == A.format and S.shape == A.shape and S.dtype == dtype
        np.testing.assert_array_equal(S.indices, A.indices)
        ref = (X.astype(np.float64) @ Y.astype(np.float64).T) * (ad != 0)
        assert rel(exact(S), ref) <= TOL[dtype], A
        assert S.n_backup == A.n_backup


@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose_is_exact_and_deterministic(maker, dtype):
    a = MAKERS[maker]()
    for A in containers(a, dtype):
        T1 = ops.transpose(A)
        T2 = ops.transpose(A)
        assert T1.format == "hybrid" and T1.shape == A.shape[::-1]
        assert T1.indices.dtype == np.int32 and T1.row_nnz.dtype == np.int32
        np.testing.assert_array_equal(exact(T1), exact(A).T)
        for k in ("values", "indices", "row_nnz", "backup", "backup_rows"):
            assert getattr(T1, k).tobytes() == getattr(T2, k).tobytes(), k
        T1.check_format(full_check=True)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)])
def test_transpose_csr(dtype):
    a = make_dense(50, 200, 0.05, 6, hot_row=3)
    for A in containers(a, dtype):
        Tc = ops.transpose(A, format="csr")
        assert sp.issparse(Tc) and Tc.shape == (200, 50)
        assert Tc.indices.dtype == np.int32 and Tc.indptr.dtype == np.int32
        np.testing.assert_array_equal(Tc.toarray(), exact(A).T)
        for r in range(Tc.shape[0]):  # row ids ascending inside each row of A.T
            seg = Tc.indices[Tc.indptr[r]:Tc.indptr[r + 1]]
            assert (np.diff(seg) > 0).all()


def test_transpose_many_rows_int32():
    """M beyond 131072 rows transposes with int32 indices."""
    M, N = 140000, 40
    rng = np.random.default_rng(7)
    rows = rng.integers(0, M, 30000)
    cols = rng.integers(0, N, 30000)
    m = sp.csr_array((rng.standard_normal(30000), (rows, cols)), shape=(M, N))
    A = tw.ELL.from_scipy(m)
    T = ops.transpose(A, width="fixed:4")
    assert T.shape == (N, M) and T.indices.dtype == np.int32
    np.testing.assert_allclose(T.to_scipy().toarray(), m.toarray().T)
    assert T.n_backup > 0  # 40 rows of ~750 entries each do not fit in width 4


def test_multiply_and_with_values():
    a = make_dense(30, 120, 0.1, 8, hot_row=2)
    for A in containers(a, np.float32):
        P = ops.multiply(A, A)
        np.testing.assert_allclose(exact(P), exact(A) ** 2, rtol=1e-6)
        V = A.with_values(A.values * 2, backup=None if A.backup is None else A.backup * 2)
        np.testing.assert_allclose(exact(ops.multiply(A, V)), 2 * exact(A) ** 2, rtol=1e-6)


def test_mixed_dtypes_promote():
    a = make_dense(20, 64, 0.2, 9)
    A = tw.Hybrid.from_dense(a.astype(bfloat16))
    B = np.random.default_rng(9).standard_normal((64, 5))
    out = ops.spmm(A, B)
    assert out.dtype == np.float64
    assert rel(out, exact(A) @ B) < 1e-12


def test_vector_operands():
    a = make_dense(25, 90, 0.1, 10, hot_row=0)
    A = tw.TwELL.from_dense(a, tile=32, slots=2)
    v = np.arange(90.0)
    w = np.arange(25.0)
    np.testing.assert_allclose(ops.spmm(A, v), a @ v, rtol=1e-12)
    np.testing.assert_allclose(ops.spmm_t(A, w), a.T @ w, rtol=1e-12)


def test_bad_inputs():
    a = make_dense(10, 20, 0.3, 11)
    A = tw.ELL.from_dense(a)
    with pytest.raises(TypeError, match="A must be a twellpy"):
        ops.spmm(a, a.T)
    with pytest.raises(ValueError, match=r"B has shape \(19, 3\), expected \(20, K\)"):
        ops.spmm(A, np.ones((19, 3)))
    with pytest.raises(ValueError, match=r"expected \(10, K\)"):
        ops.spmm_t(A, np.ones((11, 3)))
    with pytest.raises(TypeError, match="B has dtype int64"):
        ops.spmm(A, np.ones((20, 3), dtype=np.int64))
    with pytest.raises(ValueError, match=r"Y has shape \(19, 4\), expected \(20, 4\)"):
        ops.sddmm(np.ones((10, 4)), np.ones((19, 4)), A)
    with pytest.raises(ValueError, match=r"X has shape \(9, 4\)"):
        ops.sddmm(np.ones((9, 4)), np.ones((20, 4)), A)
    with pytest.raises(ValueError, match="unknown format 'coo'"):
        ops.transpose(A, format="coo")
    with pytest.raises(TypeError, match="format='csr' needs float32 or float64"):
        ops.transpose(tw.ELL.from_dense(a.astype(np.float16)), format="csr")
    B = tw.ELL.from_dense(a * (np.arange(20) % 2))
    with pytest.raises(ValueError, match="different sparsity pattern"):
        ops.multiply(A, B)
    with pytest.raises(ValueError, match="same format|A's format"):
        ops.multiply(A, tw.Hybrid.from_dense(a))
    with pytest.raises(TypeError, match="B must be a dense array"):
        ops.spmm(A, A)


@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 30), N=st.integers(1, 80), density=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**16), fmt=st.sampled_from(["ell", "twell", "hybrid"]))
def test_random_shapes(M, N, density, seed, fmt):
    a = make_dense(M, N, density, seed)
    A = {"ell": lambda: tw.ELL.from_dense(a),
         "twell": lambda: tw.TwELL.from_dense(a, tile=16, slots=3),
         "hybrid": lambda: tw.Hybrid.from_dense(a, width="quantile:0.5")}[fmt]()
    rng = np.random.default_rng(seed)
    B = rng.standard_normal((N, 3))
    C = rng.standard_normal((M, 3))
    np.testing.assert_allclose(ops.spmm(A, B), a @ B, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ops.spmm_t(A, C), a.T @ C, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(exact(ops.transpose(A)), a.T)
    X = rng.standard_normal((M, 4))
    Y = rng.standard_normal((N, 4))
    np.testing.assert_allclose(exact(ops.sddmm(X, Y, A)), (X @ Y.T) * (a != 0), rtol=1e-10, atol=1e-12)
