"""A @ W and W @ A against a float64 reference; backend kernels with poisoned outputs."""
import numpy as np
import pytest

import twellpy as tw
from _containers import FORMATS, host
from conftest import DTYPES, RTOL, rel_err
from makers import MAKERS
from twellpy._array import bfloat16
from twellpy.backends import cpu


def _ref_tol(dtype, w_dtype=None):
    # Inputs are rounded to the storage dtype before the float64 reference is
    # computed, so the remaining error is the accumulation and output rounding.
    res = tw._base.result_dtype(dtype, w_dtype or dtype)
    return RTOL[np.dtype(res)] * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", MAKERS)
def test_matmul(backend, xp, maker, fmt, dtype):
    rng = np.random.default_rng(21)
    x = MAKERS[maker](rng).astype(dtype)
    m, n = x.shape
    w = rng.standard_normal((n, 7)).astype(dtype)
    cls, params = FORMATS[fmt]
    A = cls.from_dense(xp.asarray(x), **params)
    got = A @ xp.asarray(w)
    assert type(got) is type(xp.asarray(w)) and got.shape == (m, 7) and got.dtype == dtype
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert rel_err(got, ref) <= _ref_tol(dtype)
    v = w[:, 0].copy()
    gv = A @ xp.asarray(v)
    assert gv.shape == (m,) and rel_err(gv, ref[:, 0]) <= _ref_tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", MAKERS)
def test_rmatmul(backend, xp, maker, fmt, dtype):
    rng = np.random.default_rng(22)
    x = MAKERS[maker](rng).astype(dtype)
    m, n = x.shape
    w = rng.standard_normal((5, m)).astype(dtype)
    cls, params = FORMATS[fmt]
    A = cls.from_dense(xp.asarray(x), **params)
    got = xp.asarray(w) @ A
    assert got.shape == (5, n) and got.dtype == dtype
    ref = w.astype(np.float64) @ x.astype(np.float64)
    assert rel_err(got, ref) <= _ref_tol(dtype)
    gv = xp.asarray(w[0].copy()) @ A
    assert gv.shape == (n,) and rel_err(gv, ref[0]) <= _ref_tol(dtype)
    # matches the transpose route
    assert rel_err(A.T @ xp.asarray(w.T.copy()), ref.T) <= _ref_tol(dtype)


@pytest.mark.parametrize("a_dtype,w_dtype,res", [
    (np.float32, np.float64, np.float64), (bfloat16, np.float32, np.float32),
    (np.float16, bfloat16, np.float32), (np.float64, np.float16, np.float64)])
def test_matmul_mixed_dtypes(backend, xp, a_dtype, w_dtype, res):
    rng = np.random.default_rng(3)
    x = MAKERS["one_hot_row"](rng).astype(a_dtype)
    w = rng.standard_normal((x.shape[1], 4)).astype(w_dtype)
    A = tw.TwELL.from_dense(xp.asarray(x))
    got = A @ xp.asarray(w)
    assert got.dtype == res
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert rel_err(got, ref) <= _ref_tol(a_dtype, w_dtype)


def test_matmul_non_contiguous_w(backend, xp):
    rng = np.random.default_rng(1)
    x = MAKERS["ragged_n"](rng).astype(np.float32)
    wbig = rng.standard_normal((x.shape[1] * 2, 9)).astype(np.float32)
    w = xp.asarray(wbig)[::2, ::3]  # strided view
    A = tw.Hybrid.from_dense(xp.asarray(x), width=3)
    assert rel_err(A @ w, x.astype(np.float64) @ wbig[::2, ::3]) <= 4 * RTOL[np.dtype(np.float32)]
    wl = xp.asarray(rng.standard_normal((x.shape[0], 6)).astype(np.float32)).T  # (6, M) F-order
    assert rel_err(wl @ A, host(wl).astype(np.float64) @ x) <= 4 * RTOL[np.dtype(np.float32)]


def test_matmul_shape_errors():
    A = tw.TwELL.from_dense(np.eye(4, 6))
    with pytest.raises(ValueError, match=r"W has shape \(5, 2\), expected \(6, K\)"):
        A @ np.zeros((5, 2))
    with pytest.raises(ValueError, match=r"W has shape \(2, 5\), expected \(P, 4\)"):
        np.zeros((2, 5)) @ A
    with pytest.raises(ValueError, match="W must be 1-D or 2-D, got 3-D"):
        A @ np.zeros((6, 2, 2))
    with pytest.raises(TypeError, match="W has dtype int64"):
        A @ np.zeros((6, 2), np.int64)
    with pytest.raises(TypeError, match="sparse @ sparse is not supported"):
        A @ A.T


# --- backend kernels directly, outputs poisoned -----------------------------
def _poisoned_empty(monkeypatch):
    """Make the cpu backend allocate its outputs filled with NaN/garbage."""
    real_empty = np.empty

    def poisoned(shape, dtype=float, *a, **k):
        out = real_empty(shape, dtype, *a, **k)
        dt = np.dtype(dtype)
        if dt.kind == "f" or dt == bfloat16:
            out.view(np.uint8)[...] = 0xFF  # NaN in every float format
        else:
            out[...] = np.iinfo(dt).max if dt.kind in "iu" else 0
        return out

    monkeypatch.setattr(cpu, "_empty", poisoned)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_kernels_with_poisoned_outputs(monkeypatch, dtype):
    rng = np.random.default_rng(5)
    x = MAKERS["over_capacity"](rng).astype(dtype)
    _poisoned_empty(monkeypatch)
    vals, idx, counts, row_max = cpu.dense_to_twell(x, 64, 4)
    m, n = x.shape
    assert row_max.tolist() == [max(np.count_nonzero(r[t:t + 64]) for t in range(0, n, 64)) for r in x]
    assert (counts <= 4).all() and (counts >= 0).all()
    pad = np.arange(4) >= counts[..., None]
    assert (idx[pad] == -1).all() and not vals[pad].astype(np.float32).any()
    ok = row_max <= 4
    flat_v, flat_i = vals.reshape(m, -1), idx.reshape(m, -1)
    d = cpu.slots_to_dense(flat_v, flat_i, n)
    assert np.array_equal(d[ok].view(np.uint8), x[ok].view(np.uint8))
    row_nnz = cpu.dense_row_nnz(x)
    assert row_nnz.tolist() == np.count_nonzero(x.astype(np.float64), axis=1).tolist()
    w = int(row_nnz.max())
    ev, ei = cpu.dense_to_ell(x, w, row_nnz)
    ip, col, data = cpu.slots_to_csr(ev, ei, row_nnz)
    import scipy.sparse as sp

    ref = sp.csr_array(x.astype(np.float64))
    assert np.array_equal(ip, ref.indptr) and np.array_equal(col, ref.indices)
    assert np.array_equal(data.astype(np.float64), ref.data)
    tv, ti, tc, tmax = cpu.csr_to_twell(ip, col, data, n, 64, 4)
    assert np.array_equal(tv.view(np.uint8), vals.view(np.uint8)) and np.array_equal(ti, idx)
    assert np.array_equal(tc, counts) and np.array_equal(tmax, row_max)
    lv, li, lnnz = cpu.csr_to_ell(ip, col, data, w)
    assert np.array_equal(lv.view(np.uint8), ev.view(np.uint8)) and np.array_equal(li, ei)
    b = rng.standard_normal((n, 3)).astype(dtype)
    out = cpu.slots_spmm(ev, ei, b)
    assert rel_err(out, x.astype(np.float64) @ b.astype(np.float64)) <= _ref_tol(dtype)
    bt = rng.standard_normal((m, 3)).astype(dtype)
    out_t = cpu.slots_spmm_t(ev, ei, bt, n)
    assert rel_err(out_t, x.astype(np.float64).T @ bt.astype(np.float64)) <= _ref_tol(dtype)
    tip, tcol, tdata = cpu.transpose_slots(ev, ei, n)
    reft = sp.csr_array(x.astype(np.float64).T)
    assert np.array_equal(tip, reft.indptr) and np.array_equal(tcol, reft.indices)
    assert np.array_equal(tdata.astype(np.float64), reft.data)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_fast_paths_with_poisoned_outputs(monkeypatch, dtype):
    rng = np.random.default_rng(6)
    x = MAKERS["over_capacity"](rng).astype(dtype)
    m, n = x.shape
    vals, idx, counts, row_max = cpu.dense_to_twell(x, 64, 8)
    ok = row_max <= 8
    counts[~ok], idx[~ok], vals[~ok] = 0, -1, 0  # as the container does before moving rows to backup
    xs = np.where(ok[:, None], x.astype(np.float64), 0.0)  # what the slots hold
    b = rng.standard_normal((n, 5)).astype(dtype)
    bt = rng.standard_normal((m, 5)).astype(dtype)
    _poisoned_empty(monkeypatch)
    assert rel_err(cpu.twell_spmm(vals, idx, counts, b), xs @ b.astype(np.float64)) <= _ref_tol(dtype)
    assert rel_err(cpu.twell_spmm_t(vals, idx, counts, bt, n), xs.T @ bt.astype(np.float64)) <= _ref_tol(dtype)
    ip, col, data = cpu.twell_transpose(vals, idx, counts, n)
    generic = cpu.transpose_slots(vals.reshape(m, -1), idx.reshape(m, -1), n)
    for a, g in zip((ip, col, data), generic):
        assert np.array_equal(a.view(np.uint8), g.view(np.uint8))
    rows = x[~ok]
    assert rel_err(cpu.dense_rows_spmm(rows, b), rows.astype(np.float64) @ b.astype(np.float64)) <= _ref_tol(dtype)
    bsel = bt[~ok]
    assert rel_err(cpu.dense_rows_spmm_t(rows, bsel), rows.astype(np.float64).T @ bsel.astype(np.float64)) \
        <= _ref_tol(dtype)
    assert cpu.all_finite(x)
    assert cpu.dense_to_twell_finite(x, 64, 8)[4] and cpu.dense_row_nnz_finite(x)[1]
    fused = cpu.dense_to_twell_finite(x, 64, 8)
    for a, g in zip(fused[:4], cpu.dense_to_twell(x, 64, 8)):
        assert np.array_equal(a.view(np.uint8), g.view(np.uint8))
    for bad in (np.nan, np.inf, -np.inf):
        for col in (3, 37, n - 1):  # inside a 16-column chunk and in a tile's tail
            y = x.copy()
            y[1, col] = bad
            assert not cpu.all_finite(y)
            assert not cpu.dense_to_twell_finite(y, 64, 8)[4]
            assert not cpu.dense_row_nnz_finite(y)[1]


def test_cpu_dense_to_ell_leaves_wide_rows_as_padding():
    x = np.zeros((3, 10), np.float32)
    x[0, :2] = 1
    x[1, :6] = 2
    v, i = cpu.dense_to_ell(x, 3, cpu.dense_row_nnz(x))
    assert i.tolist() == [[0, 1, -1], [-1, -1, -1], [-1, -1, -1]] and v[1].tolist() == [0, 0, 0]
    v, i, nnz = cpu.csr_to_ell(np.array([0, 2, 8, 8], np.int32), np.array([0, 1, 0, 1, 2, 3, 4, 5], np.int32),
                               np.ones(8, np.float32), 3)
    assert nnz.tolist() == [2, 6, 0] and (i[1] == -1).all()
