"""Edge cases of the containers found in review: casts in from_scipy, scalar
factors that overflow the accumulator, W @ A with backup rows in 16 bits, the
content scan of the default check, -0.0 in backup rows, Hybrid "auto" widths,
and the messages of smaller misuses."""
import math

import numpy as np
import pytest
import scipy.sparse as sp

import twellpy as tw
from twellpy._array import bfloat16
from twellpy._base import SparseArray
from _containers import bits_equal, host

CLASSES = [tw.ELL, tw.TwELL, tw.Hybrid]
# formats with a dense backup row for the second row of a (2, 4) matrix whose rows hold 1 and 3 values
BACKUP_PARAMS = {tw.ELL: {}, tw.TwELL: {"tile": 4, "slots": 1}, tw.Hybrid: {"width": 1}}


# ---- 1 + 5: from_scipy(dtype=...) ------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("x", [
    [[1e-10, 1.0], [0, 0]],                      # the last row empty, an entry underflows
    [[0, 0], [1e-10, 2.0], [0, 0], [0, 0]],      # empty rows at both ends
    [[1e-10, 1e-12], [0, 0]],                    # every entry underflows
    [[0, 0], [0, 3.0], [1e-9, 0]],               # the last row underflows to empty
], ids=["last-empty", "both-ends", "all-underflow", "last-underflows"])
def test_from_scipy_cast_drops_underflowed_entries(cls, x):
    x = np.array(x)
    A = cls.from_scipy(sp.csr_array(x), dtype=np.float16)
    want = x.astype(np.float16)
    A.check_format(full_check=True)
    assert A.nnz == np.count_nonzero(want)
    assert bits_equal(A.toarray(), want)
    assert (A.to_scipy() != sp.csr_array(want.astype(np.float32))).nnz == 0


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=str)
def test_from_scipy_cast_overflow_is_rejected(cls, dtype):
    big = 1e6 if dtype == np.float16 else 1e39
    m = sp.csr_array(np.array([[big, 1.0], [0, 2.0]]))
    with pytest.raises(ValueError, match=rf"too large for {np.dtype(dtype)}: the cast to .* overflowed"):
        cls.from_scipy(m, dtype=dtype)
    A = cls.from_scipy(m, dtype=dtype, check_finite=False)  # asked for: IEEE semantics
    assert np.isinf(host(A.toarray()).astype(np.float64)[0, 0])


@pytest.mark.parametrize("cls", CLASSES)
def test_from_scipy_integer_input_with_dtype(cls):
    x = np.array([[3, 0, -2], [0, 0, 0], [0, 70000, 0]], np.int64)
    A = cls.from_scipy(sp.csr_array(x), dtype=np.float32)
    assert bits_equal(A.toarray(), x.astype(np.float32))
    with pytest.raises(ValueError, match="overflowed"):  # 70000 > float16 max
        cls.from_scipy(sp.csr_array(x), dtype=np.float16)
    with pytest.raises(TypeError, match=r"m has dtype int64, expected one of .*dtype="):
        cls.from_scipy(sp.csr_array(x))
    with pytest.raises(TypeError, match=r"^dtype must be one of float16, bfloat16, float32, float64, got int32$"):
        cls.from_scipy(sp.csr_array(x), dtype=np.int32)


# ---- 2: scalar factors ------------------------------------------------------------------------
def _backup_matrix(dtype):
    return np.array([[1, 0, 0, 0], [1, 1, 1, 0]], dtype)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16], ids=str)
def test_scalar_factor_overflowing_the_accumulator_raises(backend, xp, cls, dtype):
    A = cls.from_dense(xp.asarray(_backup_matrix(dtype)), **BACKUP_PARAMS[cls])
    assert cls is tw.ELL or A.n_backup == 1
    with pytest.raises(ValueError, match=r"scalar factor must be finite in float32, .* got 1e\+39, which overflows"):
        A * 1e39
    with pytest.raises(ValueError, match=r"scalar factor must be finite in float32"):
        -1e39 * A
    with pytest.raises(ValueError, match=r"dividing by 1e-39 multiplies by its reciprocal 1/1e-39, which overflows "
                                         r"to Inf in float32"):
        A / 1e-39
    with pytest.raises(ValueError, match=r"dividing by 1e-320 .* overflows to Inf in float64"):
        A / 1e-320
    with pytest.raises(ValueError, match=r"scalar factor must be finite, got inf"):
        A * float("inf")
    with pytest.raises(ValueError, match=r"divisor must not be NaN"):
        A / float("nan")


@pytest.mark.parametrize("factor", [1e39, 3e38, -2.5, 1e-50])
def test_scalar_factor_result_does_not_depend_on_format(backend, xp, factor):
    for dtype in (np.float64, np.float32):
        x = _backup_matrix(dtype) * np.array([[1e10], [-1e-30]], dtype)
        outs = []
        for cls in CLASSES:
            A = cls.from_dense(xp.asarray(x), **BACKUP_PARAMS[cls])
            try:
                B = A * factor
            except ValueError:
                outs.append(None)
                continue
            B.check_format(full_check=True, check_finite=False)
            outs.append(host(B.toarray()))
            assert not np.isnan(outs[-1]).any()  # no 0 * Inf anywhere
            assert int(B.count_nonzero()) == np.count_nonzero(outs[-1])
        with np.errstate(over="ignore"):
            f_acc = np.dtype(dtype).type(factor)
            if not np.isfinite(f_acc):  # 1e39 on float32: refused by every format alike
                assert outs == [None] * len(CLASSES)
                continue
            want = (x * f_acc + np.dtype(dtype).type(0)).astype(dtype)
        for o in outs:
            assert o is not None and bits_equal(o, want)


# ---- 3: W @ A rounds once ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [bfloat16, np.float16], ids=str)
def test_rmatmul_rounds_once_with_backup_rows(backend, xp, dtype):
    x = np.zeros((3, 3), np.float32)
    x[0, 0] = 256 if dtype == bfloat16 else 2048
    x[1, 0] = 1
    x[2, :] = 1
    xd = x.astype(dtype)
    g = np.ones((2, 3), np.float32)
    g[1] = [1, 0.5, 1]
    want = (g.astype(dtype).astype(np.float64) @ xd.astype(np.float64)).astype(np.float32).astype(dtype)
    params = {tw.ELL: {}, tw.Hybrid: {"width": 1}, tw.TwELL: {"tile": 4, "slots": 1}}
    for cls in CLASSES:
        A = cls.from_dense(xp.asarray(xd), **params[cls])
        assert cls is tw.ELL or A.n_backup == 1
        out = xp.asarray(g.astype(dtype)) @ A
        assert out.dtype == dtype and bits_equal(out, want), (cls.__name__, host(out), want)
        vec = xp.asarray(g[0].astype(dtype)) @ A
        assert bits_equal(vec, want[0])
        # mixed dtypes keep the promoted result (float32) and its single rounding
        out32 = xp.asarray(g) @ A
        assert out32.dtype == np.float32
        assert bits_equal(out32, (g.astype(np.float64) @ xd.astype(np.float64)).astype(np.float32))


# ---- 4: the default check scans the contents -------------------------------------------------
def _ell_arrays(xp, idx01):
    vals = xp.asarray(np.array([[1.0, 2.0], [3.0, 0.0]]))
    idx = xp.asarray(np.array([[0, idx01], [1, -1]], np.int32))
    return vals, idx, xp.asarray(np.array([2, 1], np.int32))


@pytest.mark.parametrize("cls", [tw.ELL, tw.Hybrid])
@pytest.mark.parametrize("bad", [3, 300000000, -1, 0])
def test_default_check_rejects_bad_indices_ell(backend, xp, cls, bad):
    v, i, n = _ell_arrays(xp, bad)
    msg = r"indices are not sorted" if bad == 0 else rf"indices\[0, 1\] = {bad} is out of range"
    with pytest.raises(ValueError, match=msg):
        cls(v, i, n, shape=(2, 3))
    with pytest.raises(ValueError, match=msg):
        SparseArray.from_components({"format": cls.format, "shape": (2, 3), "values": v, "indices": i,
                                     "row_nnz": n})
    cls(v, i, n, shape=(2, 3), check=False)  # the documented way around: no scan at all


@pytest.mark.parametrize("cls", [tw.ELL, tw.Hybrid])
def test_default_check_rejects_counts_and_padding(backend, xp, cls):
    v, i, n = _ell_arrays(xp, 2)
    with pytest.raises(ValueError, match=r"row_nnz\[1\] = 3 \(row 1\), expected a value in \[0, 2\]"):
        cls(v, i, xp.asarray(np.array([2, 3], np.int32)), shape=(2, 3))
    i2 = i.copy()
    i2[1, 1] = 300000000  # a padding slot with an index: slot kernels would read it
    with pytest.raises(ValueError, match=r"padding slot \[1, 1\]"):
        cls(v, i2, n, shape=(2, 3))
    cls(v, i, n, shape=(2, 3))  # consistent arrays pass


def test_default_check_rejects_bad_twell(backend, xp):
    vals = np.array([[[1.0, 2.0], [3.0, 0.0]], [[0.0, 0.0], [4.0, 5.0]]], np.float32)
    idx = np.array([[[0, 3], [5, -1]], [[-1, -1], [4, 5]]], np.int32)
    cnt = np.array([[2, 1], [0, 2]], np.int32)
    tw.TwELL(*(xp.asarray(a) for a in (vals, idx, cnt)), shape=(2, 6), tile=4)
    for pos, bad, msg in [((0, 0, 1), 300000000, r"indices\[0, 0, 1\] = 300000000 is out of range"),
                          ((0, 0, 1), 4, r"indices\[0, 0, 1\] = 4 is out of range: expected a column in \[0, 4\)"),
                          ((1, 1, 0), 5, r"not sorted")]:
        i2 = idx.copy()
        i2[pos] = bad
        with pytest.raises(ValueError, match=msg):
            tw.TwELL(xp.asarray(vals), xp.asarray(i2), xp.asarray(cnt), shape=(2, 6), tile=4)
    c2 = cnt.copy()
    c2[0, 1] = 3
    with pytest.raises(ValueError, match=r"counts\[0, 1\] = 3"):
        tw.TwELL(xp.asarray(vals), xp.asarray(idx), xp.asarray(c2), shape=(2, 6), tile=4)
    # a backup row with slot entries would be counted twice by W @ A
    with pytest.raises(ValueError, match=r"row 1 is stored in backup"):
        tw.TwELL(*(xp.asarray(a) for a in (vals, idx, cnt)), shape=(2, 6), tile=4,
                 backup=xp.zeros((1, 6), np.float32), backup_rows=xp.asarray(np.array([1], np.int32)))


def test_default_check_makes_products_safe(backend, xp):
    # the reviewer's repro segfaulted in A @ W; now construction refuses the arrays
    v, i, n = _ell_arrays(xp, 300000000)
    with pytest.raises(ValueError, match="out of range"):
        tw.ELL(v, i, n, shape=(2, 3)) @ xp.ones((3, 1))
    v, i, n = _ell_arrays(xp, 3)  # toarray() wrote into the next row
    with pytest.raises(ValueError, match="out of range"):
        tw.ELL(v, i, n, shape=(2, 3)).toarray()


def test_internal_paths_skip_the_content_scan(backend, xp, monkeypatch):
    rng = np.random.default_rng(5)
    x = np.where(rng.random((40, 70)) < 0.1, rng.standard_normal((40, 70)), 0).astype(np.float32)
    x[3] = 1.0  # a backup row
    built = {cls: cls.from_dense(xp.asarray(x), **p) for cls, p in
             ((tw.ELL, {}), (tw.TwELL, {"tile": 16, "slots": 2}), (tw.Hybrid, {"width": 4}))}

    def scan(self):
        raise AssertionError("content scan on an internal path")

    monkeypatch.setattr(SparseArray, "_check_contents", scan)
    for cls, A in built.items():
        params = {"tile": 16, "slots": 2} if cls is tw.TwELL else {}
        cls.from_dense(xp.asarray(x), **params)
        if backend == "cpu":
            cls.from_scipy(sp.csr_array(x), **params)
        for B in (A.T, A.asformat("hybrid", width=2), A.asformat("twell", tile=8, slots=1), A[5:9],
                  A[[3, 1]], tw.vstack([A, A]), A * 2.0, A / 3, -A, A.abs(), A.astype(np.float16),
                  A.copy(), A.multiply(A), A.to_device("cpu")):
            B.check_format()  # O(1) level only: must not scan either
    monkeypatch.undo()
    A = built[tw.ELL]
    with pytest.raises(AssertionError, match="content scan"):
        monkeypatch.setattr(SparseArray, "_check_contents", scan)
        type(A)(A.values, A.indices, A.row_nnz, shape=A.shape)  # the public default does scan


# ---- 6: -0.0 never reaches a backup row -------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, bfloat16], ids=str)
def test_negative_zero_dropped_in_backup_rows(backend, xp, dtype):
    y = np.array([[-0.0, -1, -2, -3], [-0.0, -1, 0, 0], [0, 0, -0.0, 2]], np.float32).astype(dtype)
    want = (y.astype(np.float64) + 0.0).astype(dtype)  # -0.0 -> +0.0
    E = tw.ELL.from_dense(xp.asarray(y))
    for A in (tw.TwELL.from_dense(xp.asarray(y), tile=4, slots=2), tw.Hybrid.from_dense(xp.asarray(y), width=2),
              tw.Hybrid.from_dense(xp.asarray(y), width=0)):
        assert A.n_backup >= 1
        assert not np.signbit(host(A.backup).astype(np.float32)[host(A.backup) == 0]).any()
        assert bits_equal(A.toarray(), want) and bits_equal(A.toarray(), E.toarray())
        assert bits_equal(A.max(axis=1), E.max(axis=1))
        assert bits_equal(A.min(axis=0), E.min(axis=0))
        assert A.nnz == E.nnz == np.count_nonzero(y.astype(np.float64))


# ---- 7: Hybrid "auto" keeps at least 90% of the rows sparse ------------------------------------
def test_hybrid_auto_reviewer_case():
    x = np.zeros((9, 60), np.float32)
    x[:8, 0] = 1
    x[8, :50] = 1
    H = tw.Hybrid.from_dense(x)
    assert H.n_backup == 0 and H.width == 50  # 8 of 9 rows (88.9%) would not be enough
    assert bits_equal(H.toarray(), x)


@pytest.mark.parametrize("m", [1, 5, 9, 10, 11, 19, 20, 21, 29, 99, 100, 101, 1000, 1001])
def test_hybrid_auto_width_keeps_ninety_percent_sparse(m):
    rng = np.random.default_rng(m)
    n = 64  # small N: min_storage alone would send many rows to backup
    row_nnz = rng.integers(0, n + 1, m)
    x = np.zeros((m, n), np.float32)
    for r, k in enumerate(row_nnz):
        x[r, rng.choice(n, k, replace=False)] = 1.0
    H = tw.Hybrid.from_dense(x)
    assert m - H.n_backup >= 0.9 * m, (m, H.width, H.n_backup)
    q = tw.Hybrid.from_dense(x, width="quantile:0.9").width
    assert H.width == max(tw.Hybrid.from_dense(x, width="min_storage").width, q)
    assert q == np.sort(row_nnz)[math.ceil(0.9 * m) - 1]
    assert bits_equal(H.toarray(), x)
    assert tw.Hybrid.from_scipy(sp.csr_array(x)).width == H.width


# ---- 8: messages and smaller contracts --------------------------------------------------------
def test_asformat_names_accepted_parameters():
    A = tw.TwELL.from_dense(np.eye(4, dtype=np.float32))
    with pytest.raises(TypeError, match=r"asformat\('ell'\) got unexpected parameter\(s\) 'slots'; ELL accepts 'width'"):
        A.asformat("ell", slots=3)
    with pytest.raises(TypeError, match=r"TwELL accepts 'tile', 'slots', 'overflow'"):
        A.asformat("twell", width=3)
    assert A.asformat("hybrid", width=2).width == 2


def test_width_strategy_errors_name_width_strategy(tmp_path):
    H = tw.Hybrid.from_dense(np.eye(4, dtype=np.float32), width=1)
    with pytest.raises(ValueError, match=r"^width_strategy='bogus' is not understood"):
        tw.Hybrid(H.values, H.indices, H.row_nnz, shape=H.shape, width_strategy="bogus")
    with pytest.raises(ValueError, match=r"^width_strategy must be non-negative"):
        tw.Hybrid(H.values, H.indices, H.row_nnz, shape=H.shape, width_strategy=-2)
    p = tmp_path / "h.npz"
    tw.save(p, H)
    z = dict(np.load(p))
    z["param_width_strategy"] = np.str_("bogus")
    np.savez(p, **z)
    with pytest.raises(ValueError, match=r"width_strategy='bogus' is not understood"):
        tw.load(p)


@pytest.mark.parametrize("cls", CLASSES)
def test_truth_value_is_ambiguous(cls):
    A = cls.from_dense(np.eye(3, dtype=np.float32))
    with pytest.raises(TypeError, match=rf"^the truth value of a {cls.__name__} is ambiguous"):
        bool(A)
    with pytest.raises(TypeError, match="truth value"):
        if A:
            pass


@pytest.mark.parametrize("shape", [[9.5, 30], [9.0, 30]])
def test_load_rejects_non_integer_shape(tmp_path, shape):
    A = tw.ELL.from_dense(np.eye(9, 30, dtype=np.float32))
    p = tmp_path / "a.npz"
    tw.save(p, A)
    z = dict(np.load(p))
    z["shape"] = np.asarray(shape, np.float64)
    np.savez(p, **z)
    with pytest.raises(ValueError, match=r"shape must be a 1-D integer array"):
        tw.load(p)
    z["shape"] = np.asarray([9, 30], np.int64)
    z["param_width"] = np.float64(30.0)
    np.savez(p, **z)
    with pytest.raises(ValueError, match=r"parameter 'width' must be a string or an integer"):
        tw.load(p)


def test_vstack_hybrid_width_strategy_is_consistent(backend, xp):
    x = np.array([[1, 0, 0, 0], [1, 1, 1, 0]], np.float32)
    a, b = tw.Hybrid.from_dense(xp.asarray(x), width=1), tw.Hybrid.from_dense(xp.asarray(x), width=3)
    S = tw.vstack([a, b])
    assert S.width == 3 and S.width_strategy == 3 and S.n_backup == 1
    assert bits_equal(S.toarray(), np.vstack([x, x]))
    S.check_format(full_check=True)
    assert S.T.T.width == 3
    c, d = tw.Hybrid.from_dense(xp.asarray(x)), tw.Hybrid.from_dense(xp.asarray(x[::-1].copy()))
    assert tw.vstack([c, d]).width_strategy == "auto"


@pytest.mark.parametrize("cls", CLASSES)
def test_scalar_reductions_return_python_floats(backend, xp, cls):
    x = np.array([[1, 0, -3], [0, 0.5, 0]], np.float32).astype(bfloat16)
    A = cls.from_dense(xp.asarray(x))
    for op, want in (("sum", -1.5), ("mean", -0.25), ("max", 1.0), ("min", -3.0)):
        got = getattr(A, op)()
        assert type(got) is float and got == want, (op, got)
        assert "Python float" in getattr(SparseArray, op).__doc__  # as documented


@pytest.mark.parametrize("cls", CLASSES)
def test_astype_overflow(backend, xp, cls):
    x = np.array([[1e5, 1.0], [0, -7e4]], np.float32)
    A = cls.from_dense(xp.asarray(x))
    with pytest.raises(ValueError, match=r"astype\(float16\) overflows 2 finite value\(s\) of values to Inf"):
        A.astype(np.float16)
    B = A.astype(np.float16, check_finite=False)
    assert bits_equal(B.toarray(), x.astype(np.float16))
    assert bits_equal(A.astype(bfloat16).toarray(), x.astype(bfloat16))  # in range: fine
    # Inf already held (check_finite=False at construction) is not a new overflow
    held = np.array([[np.inf, 1.0], [0, 2.0]], np.float32)
    C = cls.from_dense(xp.asarray(held), check_finite=False)
    assert bits_equal(C.astype(np.float16).toarray(), held.astype(np.float16))
    with pytest.raises(TypeError, match="dtype int32 is not supported"):
        A.astype(np.int32)


def test_nnz_documents_stored_zeros():
    x = np.array([[1, 0, 0, 0], [1, 1, 1, 0]], np.float32)
    for cls in CLASSES:
        Z = cls.from_dense(x, **BACKUP_PARAMS[cls]) * 0.0
        assert Z.count_nonzero() == 0 and not Z.toarray().any()
    assert "count_nonzero" in SparseArray.nnz.__doc__ and "differ between" in SparseArray.nnz.__doc__


@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=str)
def test_nan_in_w_reaches_only_rows_storing_its_column(backend, xp, dtype):
    # A @ W and W @ A with a NaN/Inf in W where A stores nothing: as scipy.sparse, the
    # result must not depend on the format (dense backup rows multiply their zeros too)
    rng = np.random.default_rng(4)
    x = np.zeros((6, 8), np.float32)
    x[0, :7] = rng.standard_normal(7)            # a full-ish row: a backup row below
    x[1, 2], x[2, 5], x[3, 1], x[4, 0] = 1.5, -2.0, 0.5, 3.0
    x = x.astype(dtype)
    W = rng.standard_normal((8, 3)).astype(dtype)
    W[7] = np.nan                                # column 7 is stored by no row
    W[6, 1] = np.inf                             # column 6 is stored by row 0 only
    G = rng.standard_normal((2, 6)).astype(dtype)
    G[1, 5] = np.nan                             # row 5 of A is empty
    G[0, 0] = np.nan                             # row 0 of A (a backup row) stores columns 0-6, not 7
    ref = sp.csr_array(x.astype(np.float64))
    with np.errstate(invalid="ignore"):
        want = ref @ W.astype(np.float64)
        want_l = (ref.T @ G.astype(np.float64).T).T
    params = {tw.ELL: {}, tw.TwELL: {"tile": 4, "slots": 1}, tw.Hybrid: {"width": 1}}
    rtol = 1e-5 if dtype == np.float32 else 1e-2  # one rounding of the fp32-accumulated sum
    for cls, kw in params.items():
        A = cls.from_dense(xp.asarray(x), **kw)
        assert cls is tw.ELL or A.n_backup == 1
        got = np.asarray(host(A @ xp.asarray(W)), np.float64)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=cls.__name__)
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=cls.__name__)
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, err_msg=cls.__name__)
        got_l = np.asarray(host(xp.asarray(G) @ A), np.float64)
        np.testing.assert_array_equal(np.isnan(got_l), np.isnan(want_l), err_msg=cls.__name__)
        fin = np.isfinite(want_l)
        np.testing.assert_allclose(got_l[fin], want_l[fin], rtol=rtol, err_msg=cls.__name__)

