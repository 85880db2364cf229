"""numpy's functions on containers (``__array_function__``) and ``todense``.

Before, ``np.sum(A)`` raised "sum() got an unexpected keyword argument 'out'" and
``A.todense()`` did not exist; numpy functions the containers do not implement keep
numpy's default handling."""
import numpy as np
import pytest

import twellpy as tw
from _reliability_util import host

FORMATS = {"twell": (tw.TwELL, {"tile": 64, "slots": 2}), "ell": (tw.ELL, {}), "hybrid": (tw.Hybrid, {"width": 1})}


def _dense(xp):
    x = np.zeros((5, 130), np.float32)
    x[0, 1], x[2, 5], x[3, 129], x[3, 7], x[3, 8] = 1.0, -2.0, 4.0, 0.5, -0.25  # row 3 over slots
    return x, xp.asarray(x)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_numpy_reductions_call_the_container_methods(backend, xp, fmt):
    x, xd = _dense(xp)
    cls, params = FORMATS[fmt]
    A = cls.from_dense(xd, **params)
    assert float(np.sum(A)) == pytest.approx(float(x.sum()))
    assert float(np.mean(A)) == pytest.approx(float(x.mean()))
    assert float(np.max(A)) == 4.0 and float(np.min(A)) == -2.0
    assert float(np.amax(A)) == 4.0 and float(np.amin(A)) == -2.0
    for axis in (0, 1, -1):
        np.testing.assert_allclose(host(np.sum(A, axis)), x.sum(axis=axis), rtol=1e-6)
        np.testing.assert_allclose(host(np.sum(A, axis=axis)), x.sum(axis=axis), rtol=1e-6)
        np.testing.assert_allclose(host(np.mean(A, axis=axis)), x.mean(axis=axis), rtol=1e-6)
        np.testing.assert_array_equal(host(np.max(A, axis=axis)), x.max(axis=axis))
        np.testing.assert_array_equal(host(np.min(A, axis)), x.min(axis=axis))
        np.testing.assert_array_equal(host(np.count_nonzero(A, axis=axis)), np.count_nonzero(x, axis=axis))
    assert int(np.count_nonzero(A)) == 5
    # numpy's defaults, passed explicitly, are accepted
    assert float(np.sum(A, axis=None, dtype=None, out=None, keepdims=False)) == pytest.approx(float(x.sum()))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_numpy_shape_functions_and_copies(backend, xp, fmt):
    x, xd = _dense(xp)
    cls, params = FORMATS[fmt]
    A = cls.from_dense(xd, **params)
    assert np.shape(A) == (5, 130) and np.ndim(A) == 2
    assert np.size(A) == 650 and np.size(A, 0) == 5 and np.size(A, axis=1) == 130
    for T in (np.transpose(A), np.transpose(A, (1, 0)), np.transpose(A, axes=(-1, -2))):
        assert isinstance(T, cls) and T.shape == (130, 5)
        np.testing.assert_array_equal(host(T.toarray()), x.T)
    C = np.copy(A)
    assert isinstance(C, cls) and C is not A
    np.testing.assert_array_equal(host(C.toarray()), x)
    D = A.todense()
    assert type(D) is type(xd) and D.shape == x.shape  # an array of the container's device, not np.matrix
    np.testing.assert_array_equal(host(D), x)


def test_numpy_arguments_the_containers_cannot_honour_are_refused():
    x, _ = _dense(np)
    A = tw.TwELL.from_dense(x)
    with pytest.raises(TypeError, match=r"numpy\.sum of a TwELL supports axis only, got dtype; call A\.sum\(axis\)"):
        np.sum(A, dtype=np.float64)
    with pytest.raises(TypeError, match=r"got keepdims, out"):
        np.max(A, out=np.empty(()), keepdims=True)
    with pytest.raises(ValueError, match=r"axes \(0, 0\) do not transpose a 2-D TwELL"):
        np.transpose(A, (0, 0))


def test_other_numpy_functions_keep_numpys_default_handling():
    """Functions the containers do not implement behave as before (numpy's handling of a
    foreign object): no silent densification, no new error text to depend on."""
    x, _ = _dense(np)
    A = tw.TwELL.from_dense(x)
    assert np.asarray(A).dtype == object  # not dispatched: numpy wraps the object
    with pytest.raises(TypeError):
        np.allclose(A, A)  # numpy subtracts the objects; containers do not subtract
    assert np.concatenate([[1.0], [2.0]]).tolist() == [1.0, 2.0]  # unrelated calls unaffected


def test_fallback_leaves_other_array_libraries_their_turn():
    """The fallback called numpy's own implementation even when another argument's type
    (a dask array) implements __array_function__: np.dot(A, d) and np.tensordot(A, d, 1)
    gave an object array of containers (or raised), where dask computed A @ d before the
    containers had __array_function__ (NEP 18: return NotImplemented for unknown types)."""
    da = pytest.importorskip("dask.array")
    import twellpy.dask  # noqa: F401  (registers the containers as dask chunk types)

    x = np.zeros((4, 6), np.float32)
    x[0, 1], x[2, 5] = 1.0, -2.0
    A = tw.ELL.from_dense(x)
    w = np.arange(18, dtype=np.float32).reshape(6, 3)
    d = da.from_array(w, chunks=(6, 1))  # whole rows of w: dask never slices A's columns
    got = np.dot(A, d)
    assert isinstance(got, da.Array)
    np.testing.assert_array_equal(got.compute(), x @ w)
    np.testing.assert_array_equal(np.tensordot(A, d, 1).compute(), x @ w)
    # numpy arrays beside a container still get numpy's handling, not "no implementation found"
    assert np.result_type(A, np.ones(2)) == np.float64 and not np.may_share_memory(A, x)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_numpy_signatures_as_numpy_takes_them(fmt):
    """Calls numpy accepts for a 2-D array: the array passed by keyword (np.sum(a=A) raised
    the old "unexpected keyword argument 'out'"), where=True (numpy's default), the identity
    permutation of np.transpose (numpy returns the array; it raised), a bare int axes (it
    raised "'int' object is not iterable") and np.size with an axis out of range (IndexError
    "tuple index out of range") or a tuple of axes."""
    x, _ = _dense(np)
    cls, params = FORMATS[fmt]
    A = cls.from_dense(x, **params)
    assert float(np.sum(a=A)) == pytest.approx(float(x.sum()))
    np.testing.assert_array_equal(np.max(a=A, axis=1), x.max(axis=1))
    assert int(np.count_nonzero(a=A)) == 5 and np.shape(a=A) == (5, 130)
    assert isinstance(np.transpose(a=A), cls) and np.copy(a=A).shape == (5, 130)
    assert float(np.sum(A, where=True)) == pytest.approx(float(x.sum()))
    assert float(np.max(A, where=True)) == 4.0
    with pytest.raises(TypeError, match="got where"):
        np.sum(A, where=x != 0)
    for axes in ((0, 1), [-2, -1], (0, -1)):
        assert np.transpose(A, axes) is A
    for axes in (1, (1,), (1, 0, 2), (0, 2), (1.0, 0.0), (True, False)):
        with pytest.raises(ValueError, match="do not transpose a 2-D"):
            np.transpose(A, axes)
    assert np.size(A, (0, 1)) == 650 and np.size(A, (-1,)) == 130
    for axis in (2, -3, (0, 0)):
        with pytest.raises(ValueError, match="axis"):
            np.size(A, axis)
