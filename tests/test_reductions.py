"""``A.sum(axis)`` and ``A.count_nonzero(axis)`` of every format against float64
numpy, on both backends: backup rows, NaN/Inf, explicit zeros, empty shapes,
determinism and bad axes."""
import numpy as np
import pytest

import twellpy as tw
from _containers import FORMATS, bits_equal, host
from conftest import DTYPES
from makers import MAKERS, SMALL_MAKERS

FORMATS_AND_BACKUP = dict(FORMATS, twell_backup=(tw.TwELL, {"tile": 64, "slots": 4, "overflow": "backup"}))


def _build(xp, x, fmt):
    cls, params = FORMATS_AND_BACKUP[fmt]
    return cls.from_dense(xp.asarray(x), **params)


def _close(got, x64, axis, acc):
    """A float32 (float64) running sum is within n * eps of the exact sum, relative
    to the sum of |x| along the axis (the usual summation error bound)."""
    got = np.asarray(host(got), np.float64)
    want = x64.sum() if axis is None else x64.sum(axis=axis)
    bound = np.abs(x64).sum() if axis is None else np.abs(x64).sum(axis=axis)
    n = x64.size if axis is None else x64.shape[axis]
    eps = np.finfo(acc).eps
    return bool(np.all(np.abs(got - want) <= 2 * max(n, 1) * eps * bound + 1e-300))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS_AND_BACKUP)
@pytest.mark.parametrize("maker", SMALL_MAKERS)
def test_sum_and_count_match_numpy(backend, xp, maker, fmt, dtype):
    x = MAKERS[maker](np.random.default_rng(13)).astype(dtype)
    A = _build(xp, x, fmt)
    x64 = x.astype(np.float64)
    acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    s0, s1 = A.sum(axis=0), A.sum(axis=1)
    assert s0.shape == (x.shape[1],) and s1.shape == (x.shape[0],)
    assert s0.dtype == acc and s1.dtype == acc and type(s0) is type(xp.zeros(0))
    assert _close(s0, x64, 0, acc) and _close(s1, x64, 1, acc)
    assert _close(A.sum(), x64, None, acc) and isinstance(A.sum(), float)
    assert np.array_equal(host(A.sum(axis=-1)), host(s1)) and np.array_equal(host(A.sum(axis=-2)), host(s0))
    assert A.count_nonzero() == np.count_nonzero(x64)
    assert np.array_equal(host(A.count_nonzero(axis=1)), np.count_nonzero(x64, axis=1))
    assert np.array_equal(host(A.count_nonzero(axis=0)), np.count_nonzero(x64, axis=0))
    assert host(A.count_nonzero(axis=0)).dtype == np.int64


def test_sums_are_the_same_bits_every_run(backend, xp):
    rng = np.random.default_rng(3)
    x = np.where(rng.random((300, 2000)) < 0.02, rng.standard_normal((300, 2000)), 0).astype(np.float32)
    x[7] = rng.standard_normal(2000)                       # a backup row
    A = _build(xp, x, "twell_backup")
    for axis in (0, 1):
        assert bits_equal(A.sum(axis=axis), A.sum(axis=axis))
    assert A.sum() == A.sum()


def test_nan_and_inf_propagate_and_explicit_zeros_are_not_counted(backend, xp):
    x = np.zeros((4, 300), np.float32)
    x[0, 3], x[1, 4], x[1, 5], x[2, 6] = np.nan, np.inf, 1.0, -2.0
    A = tw.ELL.from_dense(xp.asarray(x), check_finite=False)
    s1 = host(A.sum(axis=1))
    assert np.isnan(s1[0]) and s1[1] == np.inf and s1[2] == -2.0 and s1[3] == 0.0
    assert host(A.count_nonzero(axis=1)).tolist() == [1, 2, 1, 0]
    with np.errstate(invalid="ignore"):
        Z = A * 0.0                                        # stored entries, zero values
    assert Z.nnz == A.nnz and Z.count_nonzero() == 2       # NaN * 0 and Inf * 0 are NaN
    assert host(Z.count_nonzero(axis=0))[[3, 4, 5, 6]].tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_shapes(backend, xp, shape):
    A = tw.Hybrid.from_dense(xp.zeros(shape, np.float32))
    assert A.sum() == 0.0 and A.count_nonzero() == 0
    assert host(A.sum(axis=0)).shape == (shape[1],) and host(A.sum(axis=1)).shape == (shape[0],)
    assert host(A.count_nonzero(axis=0)).tolist() == [0] * shape[1]


@pytest.mark.parametrize("axis,exc,msg", [
    (2, ValueError, "axis 2 is out of range for a 2-D ELL; expected None, 0 \\(per column\\) or 1 \\(per row\\)"),
    (-3, ValueError, "axis -3 is out of range"),
    (1.0, TypeError, "axis must be None, 0 or 1, got 1.0"),
    (True, TypeError, "axis must be None, 0 or 1, got True"),
    ((0, 1), TypeError, "axis must be None, 0 or 1"),
])
def test_bad_axis(backend, xp, axis, exc, msg):
    A = tw.ELL.from_dense(xp.asarray(np.eye(3, 5, dtype=np.float32)))
    for fn in (A.sum, A.count_nonzero):
        with pytest.raises(exc, match=msg):
            fn(axis=axis)


# ---------------------------------------------------------------------------
# multiply: element-wise with a dense array, keeping the pattern
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("other_shape", ["full", "row", "vector", "column", "one"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS_AND_BACKUP)
def test_multiply_by_dense_keeps_the_pattern(backend, xp, fmt, dtype, other_shape):
    rng = np.random.default_rng(23)
    m, n = 30, 600
    x = np.where(rng.random((m, n)) < 0.03, rng.standard_normal((m, n)), 0).astype(dtype)
    x[4] = rng.standard_normal(n).astype(dtype)           # a backup row where the format keeps them
    d = rng.standard_normal((m, n)).astype(np.float32)
    d[0] = np.inf                                          # Inf where row 0 holds zeros stays out
    d[5, ::2] = np.nan
    other = {"full": d, "row": d[:1], "vector": d[1], "column": d[:, :1], "one": d[:1, :1]}[other_shape]
    A = _build(xp, x, fmt)
    B = A.multiply(xp.asarray(other))
    res = np.result_type(np.float32, np.dtype(dtype)) if np.dtype(dtype) != np.float16 else np.dtype(np.float32)
    assert type(B) is type(A) and B.dtype == res and B.shape == A.shape
    x64 = host(A.toarray()).astype(np.float64)
    d64 = np.broadcast_to(np.asarray(other, np.float64).reshape(-1, other.shape[-1]), (m, n))
    with np.errstate(invalid="ignore"):
        want = (np.where(x64 != 0, x64 * d64, 0) + 0.0).astype(res)
    # one rounding: the same bits as float64 rounded (x * NaN: any NaN, see bits_equal)
    assert bits_equal(B.toarray(), want, any_nan=True)
    B.check_format(full_check=True, check_finite=False)   # NaN from other's NaN is a value like any other


def test_multiply_by_scalar_and_container_and_bad_others(backend, xp):
    x = np.eye(4, 8, dtype=np.float32) * 3
    A = tw.Hybrid.from_dense(xp.asarray(x))
    assert bits_equal(A.multiply(2.0).toarray(), x * 2)
    assert bits_equal(A.multiply(A).toarray(), x * x)
    with pytest.raises(ValueError, match=r"other has shape \(4, 7\), expected \(4, 8\) or a shape that broadcasts"):
        A.multiply(xp.ones((4, 7), np.float32))
    with pytest.raises(ValueError, match=r"other has shape \(2, 2, 8\)"):
        A.multiply(xp.ones((2, 2, 8), np.float32))
    with pytest.raises(TypeError, match="other"):
        A.multiply(xp.ones((4, 8), np.int32))


@pytest.mark.parametrize("fmt", FORMATS_AND_BACKUP)
def test_mean_is_the_sum_over_the_element_count(backend, xp, fmt):
    rng = np.random.default_rng(29)
    x = np.where(rng.random((25, 300)) < 0.05, rng.standard_normal((25, 300)), 0).astype(np.float32)
    x[2] = rng.standard_normal(300).astype(np.float32)
    A = _build(xp, x, fmt)
    assert bits_equal(A.mean(axis=1), host(A.sum(axis=1)) / np.float32(300))
    assert bits_equal(A.mean(axis=0), host(A.sum(axis=0)) / np.float32(25))
    assert A.mean() == A.sum() / x.size
    assert _close(A.mean(axis=0), x.astype(np.float64) / 25, 0, np.float32)
    E = tw.ELL.from_dense(xp.zeros((0, 4), np.float32))
    assert np.isnan(E.mean()) and np.isnan(host(E.mean(axis=0))).all() and host(E.mean(axis=1)).shape == (0,)


# ---------------------------------------------------------------------------
# max / min: the zeros that are not stored count, NaN wins, exact
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS_AND_BACKUP)
@pytest.mark.parametrize("maker", [k for k in SMALL_MAKERS if k != "empty"])
def test_max_and_min_match_numpy(backend, xp, maker, fmt, dtype):
    x = MAKERS[maker](np.random.default_rng(31)).astype(dtype)
    A = _build(xp, x, fmt)
    dense = host(A.toarray())
    for op in ("max", "min"):
        f = getattr(np, op)
        for axis in (0, 1):
            if dense.shape[1 - axis] == 0:
                continue
            got = getattr(A, op)(axis=axis)
            assert type(got) is type(xp.zeros(0)) and got.dtype == A.dtype, (op, axis)
            assert bits_equal(host(got) + np.zeros((), dense.dtype), f(dense, axis=axis) + np.zeros((), dense.dtype)), (op, axis)
        if dense.size:
            assert getattr(A, op)() == float(f(dense.astype(np.float64)))


def test_max_min_nan_full_rows_and_empty_axes(backend, xp):
    x = np.zeros((4, 3), np.float32)
    x[0] = [1.0, 2.0, 3.0]                                 # full: no implicit zero
    x[1, 1] = -5.0
    x[2, 0] = np.nan
    A = tw.Hybrid.from_dense(xp.asarray(x), check_finite=False)
    assert host(A.max(axis=1)).tolist()[:2] == [3.0, 0.0] and np.isnan(host(A.max(axis=1))[2])
    assert host(A.min(axis=1)).tolist()[:2] == [1.0, -5.0] and host(A.min(axis=1))[3] == 0.0  # row 0 is full
    assert np.isnan(A.max()) and np.isnan(host(A.min(axis=0))[0]) and host(A.min(axis=0))[1] == -5.0
    E = tw.ELL.from_dense(xp.zeros((0, 3), np.float32))
    assert host(E.max(axis=1)).shape == (0,)
    with pytest.raises(ValueError, match=r"max\(\) of a ELL of shape \(0, 3\) along axis None reduces over zero"):
        E.max()
    with pytest.raises(ValueError, match="along axis 0 reduces over zero elements"):
        E.min(axis=0)
