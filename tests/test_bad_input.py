"""Bad input raises TypeError/ValueError whose message names the argument."""
import numpy as np
import pytest
import scipy.sparse as sp

import twellpy as tw

CLASSES = [tw.TwELL, tw.ELL, tw.Hybrid]


def _twell_parts(xp=np):
    # 2 x 6 matrix, tile 4 -> 2 tiles, 2 slots
    vals = np.array([[[1.0, 2.0], [3.0, 0.0]], [[0.0, 0.0], [4.0, 5.0]]], np.float32)
    idx = np.array([[[0, 3], [5, -1]], [[-1, -1], [4, 5]]], np.int32)
    cnt = np.array([[2, 1], [0, 2]], np.int32)
    return vals, idx, cnt


def _ell_parts():
    vals = np.array([[1.0, 2.0], [3.0, 0.0]], np.float32)
    idx = np.array([[0, 4], [2, -1]], np.int32)
    nnz = np.array([2, 1], np.int32)
    return vals, idx, nnz


@pytest.mark.parametrize("cls", CLASSES)
def test_from_dense_bad_input(backend, xp, cls):
    with pytest.raises(ValueError, match=r"x must be 2-D, got 1-D"):
        cls.from_dense(xp.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"x must be 2-D, got 3-D"):
        cls.from_dense(xp.zeros((2, 2, 2), np.float32))
    with pytest.raises(TypeError, match=r"x has dtype int64, expected one of"):
        cls.from_dense(xp.zeros((2, 2), np.int64))
    with pytest.raises(TypeError, match=r"x has dtype complex64"):
        cls.from_dense(xp.zeros((2, 2), np.complex64))
    with pytest.raises(TypeError, match=r"x must be a numpy/cupy array"):
        cls.from_dense({"a": 1})
    with pytest.raises(TypeError, match=r"x must be an array, got None"):
        cls.from_dense(None)
    bad = np.zeros((3, 4), np.float32)
    bad[1, 2] = np.nan
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match=r"x contains 1 NaN and 1 Inf values; pass check_finite=False"):
        cls.from_dense(xp.asarray(bad))
    A = cls.from_dense(xp.asarray(bad), check_finite=False)
    assert A.nnz == 2


@pytest.mark.parametrize("cls", CLASSES)
def test_from_scipy_bad_input(cls):
    with pytest.raises(TypeError, match=r"m must be a scipy.sparse array or matrix, got numpy.ndarray"):
        cls.from_scipy(np.eye(3))
    with pytest.raises(TypeError, match=r"m has dtype int64, expected one of .*astype"):
        cls.from_scipy(sp.csr_array(np.eye(3, dtype=np.int64)))
    with pytest.raises(ValueError, match=r"m contains 1 NaN and 0 Inf"):
        cls.from_scipy(sp.csr_array(np.array([[np.nan, 1.0]])))
    with pytest.raises(TypeError, match=r"dtype int8 has dtype|dtype has dtype int8"):
        cls.from_scipy(sp.csr_array(np.eye(3)), dtype=np.int8)


def test_twell_parameters():
    x = np.eye(4)
    with pytest.raises(ValueError, match="tile must be a positive int, got 0"):
        tw.TwELL.from_dense(x, tile=0)
    with pytest.raises(TypeError, match="slots must be an int, got float"):
        tw.TwELL.from_dense(x, slots=2.0)
    with pytest.raises(ValueError, match="slots must be a positive int, got -3"):
        tw.TwELL.from_dense(x, slots=-3)
    with pytest.raises(ValueError, match="overflow must be 'backup' or 'raise', got 'drop'"):
        tw.TwELL.from_dense(x, overflow="drop")
    with pytest.raises(TypeError, match="unexpected keyword argument 'width'"):
        tw.TwELL.from_dense(x, width=3)


def test_twell_constructor_o1_checks(backend, xp):
    v, i, c = (xp.asarray(a) for a in _twell_parts())
    tw.TwELL(v, i, c, shape=(2, 6), tile=4, check="full")
    with pytest.raises(ValueError, match=r"values has shape \(2, 2, 2\), expected \(2, 3, slots\) for shape \(2, 9\)"):
        tw.TwELL(v, i, c, shape=(2, 9), tile=4)
    with pytest.raises(ValueError, match=r"values must be 3-D, got 2-D"):
        tw.TwELL(v[0], i, c, shape=(2, 6), tile=4)
    with pytest.raises(TypeError, match=r"values has dtype int32, expected one of"):
        tw.TwELL(i, i, c, shape=(2, 6), tile=4)
    with pytest.raises(TypeError, match=r"indices has dtype int64, expected int32"):
        tw.TwELL(v, i.astype(np.int64), c, shape=(2, 6), tile=4)
    with pytest.raises(ValueError, match=r"indices has shape \(2, 2, 1\), expected \(2, 2, 2\)"):
        tw.TwELL(v, xp.ascontiguousarray(i[:, :, :1]), c, shape=(2, 6), tile=4)
    with pytest.raises(ValueError, match=r"counts has shape \(2, 1\), expected \(2, 2\)"):
        tw.TwELL(v, i, xp.ascontiguousarray(c[:, :1]), shape=(2, 6), tile=4)
    with pytest.raises(ValueError, match=r"shape must be non-negative, got \(2, -6\)"):
        tw.TwELL(v, i, c, shape=(2, -6), tile=4)
    with pytest.raises(ValueError, match=r"shape must have 2 entries"):
        tw.TwELL(v, i, c, shape=(2, 6, 1), tile=4)
    with pytest.raises(ValueError, match=r"shape=\(2, 4294967296\) exceeds the int32 index range"):
        tw.TwELL(v, i, c, shape=(2, 2**32), tile=4)
    with pytest.raises(ValueError, match=r"check must be True, False or 'full', got 'yes'"):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, check="yes")
    vn = v.copy()
    vn[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match=r"values contains 1 NaN"):
        tw.TwELL(vn, i, c, shape=(2, 6), tile=4)


def test_twell_backup_arguments(backend, xp):
    v, i, c = (xp.asarray(a) for a in _twell_parts())
    z = xp.zeros((1, 6), np.float32)
    with pytest.raises(ValueError, match="backup_rows is None but the other backup array was given"):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, backup=z)
    with pytest.raises(ValueError, match="backup is None but the other backup array was given"):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, backup_rows=xp.zeros(1, np.int32))
    with pytest.raises(ValueError, match=r"backup_rows holds row id 7, expected ids in \[0, 2\)"):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, backup=z, backup_rows=xp.asarray([7], np.int32))
    with pytest.raises(ValueError, match=r"backup_rows holds row id -1"):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, backup=z, backup_rows=xp.asarray([-1], np.int32))
    with pytest.raises(ValueError, match=r"backup has shape \(1, 6\), expected \(2, 6\)"):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, backup=z, backup_rows=xp.asarray([0, 1], np.int32))
    with pytest.raises(TypeError, match=r"backup has dtype float64, expected float32 \(the dtype of values\)"):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, backup=z.astype(np.float64), backup_rows=xp.asarray([1], np.int32))
    with pytest.raises(ValueError, match=r"backup_rows must be sorted ascending without repeats"):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, backup=xp.zeros((2, 6), np.float32),
                 backup_rows=xp.asarray([1, 1], np.int32))
    with pytest.raises(ValueError, match="row_map is inconsistent with backup_rows"):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, backup=z, backup_rows=xp.asarray([1], np.int32),
                 row_map=xp.asarray([0, -1], np.int32))
    # a backup row must not also have slot entries (row 1 has counts)
    with pytest.raises(ValueError, match=r"row 1 is stored in backup \(backup_rows\[0\]\) but also has 2 slot entries"):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, backup=z, backup_rows=xp.asarray([1], np.int32), check="full")


@pytest.mark.parametrize("mutate,msg", [
    (lambda v, i, c: c.__setitem__((0, 0), 3), r"counts\[0, 0\] = 3 \(row 0, tile 0\), expected a value in \[0, 2\]"),
    (lambda v, i, c: c.__setitem__((1, 1), -1), r"counts\[1, 1\] = -1"),
    (lambda v, i, c: i.__setitem__((0, 0, 0), -5), r"indices\[0, 0, 0\] = -5 is out of range: expected a column in \[0, 4\) for row 0, tile 0"),
    (lambda v, i, c: i.__setitem__((0, 1, 0), 2), r"indices\[0, 1, 0\] = 2 is out of range: expected a column in \[4, 6\) for row 0, tile 1"),
    (lambda v, i, c: i.__setitem__((1, 1, 1), 6), r"indices\[1, 1, 1\] = 6 is out of range"),
    (lambda v, i, c: i.__setitem__((0, 0, 1), 0), r"indices are not sorted ascending \(without repeats\) within row 0, tile 0"),
    (lambda v, i, c: i.__setitem__((0, 1, 1), 5), r"padding slot \[0, 1, 1\] \(beyond the count of row 0, tile 1\) holds index 5"),
    (lambda v, i, c: v.__setitem__((1, 0, 0), 9.0), r"padding slot \[1, 0, 0\]"),
])
def test_twell_full_check(backend, xp, mutate, msg):
    v, i, c = (xp.asarray(a.copy()) for a in _twell_parts())
    mutate(v, i, c)
    A = tw.TwELL(v, i, c, shape=(2, 6), tile=4)  # O(1) checks pass
    with pytest.raises(ValueError, match=msg):
        A.check_format(full_check=True)
    with pytest.raises(ValueError, match=msg):
        tw.TwELL(v, i, c, shape=(2, 6), tile=4, check="full")


@pytest.mark.parametrize("cls", [tw.ELL, tw.Hybrid])
@pytest.mark.parametrize("mutate,msg", [
    (lambda v, i, n: n.__setitem__(0, 3), r"row_nnz\[0\] = 3 \(row 0\), expected a value in \[0, 2\]"),
    (lambda v, i, n: i.__setitem__((1, 0), 9), r"indices\[1, 0\] = 9 is out of range: expected a column in \[0, 5\) for row 1"),
    (lambda v, i, n: i.__setitem__((0, 1), -2), r"indices\[0, 1\] = -2 is out of range"),
    (lambda v, i, n: i.__setitem__((0, 1), 0), r"not sorted ascending .* within row 0"),
    (lambda v, i, n: i.__setitem__((1, 1), 3), r"padding slot \[1, 1\]"),
])
def test_ell_full_check(backend, xp, cls, mutate, msg):
    v, i, n = (xp.asarray(a.copy()) for a in _ell_parts())
    mutate(v, i, n)
    A = cls(v, i, n, shape=(2, 5))
    with pytest.raises(ValueError, match=msg):
        A.check_format(full_check=True)


@pytest.mark.parametrize("cls", [tw.ELL, tw.Hybrid])
def test_ell_constructor_o1_checks(backend, xp, cls):
    v, i, n = (xp.asarray(a) for a in _ell_parts())
    cls(v, i, n, shape=(2, 5), check="full")
    with pytest.raises(ValueError, match=r"values has shape \(2, 2\), expected \(3, W\)"):
        cls(v, i, n, shape=(3, 5))
    with pytest.raises(ValueError, match=r"indices has shape \(2, 1\), expected \(2, 2\)"):
        cls(v, xp.ascontiguousarray(i[:, :1]), n, shape=(2, 5))
    with pytest.raises(ValueError, match=r"row_nnz has shape \(1,\), expected \(2,\)"):
        cls(v, i, n[:1], shape=(2, 5))
    with pytest.raises(TypeError, match=r"row_nnz has dtype float32, expected int32"):
        cls(v, i, v[:, 0].copy(), shape=(2, 5))
    with pytest.raises(ValueError, match=r"indices must be 2-D, got 1-D"):
        cls(v, i[0], n, shape=(2, 5))


def test_hybrid_backup_row_must_have_no_ell_entries(backend, xp):
    v, i, n = (xp.asarray(a) for a in _ell_parts())
    with pytest.raises(ValueError, match=r"row 0 is stored in backup"):
        tw.Hybrid(v, i, n, shape=(2, 5), backup=xp.zeros((1, 5), np.float32),
                  backup_rows=xp.asarray([0], np.int32), check="full")


def test_with_values_bad_input():
    A = tw.TwELL.from_dense(np.eye(4, dtype=np.float32))
    with pytest.raises(TypeError, match=r"values has dtype int64"):
        A.with_values(np.zeros(A.values.shape, np.int64))
    bad = np.zeros(A.values.shape, np.float32)
    bad[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match=r"values contains 0 NaN and 1 Inf"):
        A.with_values(bad)
    E = tw.ELL.from_dense(np.eye(3))
    with pytest.raises(ValueError, match="backup must be None for format 'ell'"):
        E.with_values(E.values, np.zeros((0, 3)))


@pytest.mark.gpu
def test_mixed_devices_are_refused():
    import cupy

    v, i, c = _twell_parts()
    with pytest.raises(ValueError, match=r"indices is on cuda:0 but values is on cpu"):
        tw.TwELL(v, cupy.asarray(i), c, shape=(2, 6), tile=4)
    A = tw.TwELL(v, i, c, shape=(2, 6), tile=4)
    with pytest.raises(ValueError, match=r"W is on cuda:0 but A is on cpu"):
        A @ cupy.zeros((6, 2), np.float32)
