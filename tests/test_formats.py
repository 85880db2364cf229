"""Containers built from dense inputs: maker grid x formats x dtypes x backends."""
import numpy as np
import pytest

import twellpy as tw
from _containers import FORMATS, bits_equal, host
from conftest import DTYPES
from makers import MAKERS, random_sparse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("maker", MAKERS)
def test_from_dense_roundtrip(backend, xp, maker, fmt, dtype):
    rng = np.random.default_rng(7)
    x64 = MAKERS[maker](rng)
    x = xp.asarray(x64.astype(dtype))
    cls, params = FORMATS[fmt]
    A = cls.from_dense(x, **params)
    A.check_format(full_check=True)
    assert A.format == cls.format
    assert A.shape == x64.shape and A.ndim == 2
    assert A.dtype == dtype
    assert A.device == ("cpu" if backend == "cpu" else "cuda:0")
    assert A.nnz == np.count_nonzero(x64)
    assert A.xp is xp
    assert bits_equal(A.toarray(), x)
    assert A.nbytes == sum(host(a).nbytes for k, a in A.components().items() if hasattr(a, "nbytes"))


@pytest.mark.parametrize("maker", ["over_capacity", "full_rows", "one_hot_row", "wide"])
def test_twell_backup_rows_hold_overflowing_rows(backend, xp, maker):
    x64 = MAKERS[maker](np.random.default_rng(3))
    A = tw.TwELL.from_dense(xp.asarray(x64.astype(np.float32)), tile=256, slots=32)
    counts_per_tile = np.array([[np.count_nonzero(r[t:t + 256]) for t in range(0, max(x64.shape[1], 1), 256)]
                                for r in x64]).reshape(x64.shape[0], -1)
    expect = np.nonzero((counts_per_tile > 32).any(axis=1))[0]
    assert np.array_equal(host(A.backup_rows), expect)
    assert np.array_equal(host(A.backup), x64[expect].astype(np.float32))
    assert (host(A.counts)[expect] == 0).all()
    rm = host(A.row_map)
    assert (rm[expect] == np.arange(expect.size)).all() and (np.delete(rm, expect) == -1).all()


def test_twell_overflow_raise_names_tile_and_sufficient_slots(backend, xp):
    x = np.zeros((4, 600))
    x[2, 256:256 + 40] = 1.0   # row 2, tile 1: 40 non-zeros
    x[1, :35] = 1.0            # row 1, tile 0: 35
    with pytest.raises(tw.TileOverflowError, match=r"row 2, tile 1 .*holds 40 .*slots=40") as e:
        tw.TwELL.from_dense(xp.asarray(x), overflow="raise")
    assert isinstance(e.value, ValueError)
    assert "2 rows overflow" in str(e.value)
    # The suggested slots value is sufficient.
    A = tw.TwELL.from_dense(xp.asarray(x), slots=40, overflow="raise")
    assert A.n_backup == 0 and bits_equal(A.toarray(), xp.asarray(x))


def test_twell_overflow_raise_from_scipy():
    import scipy.sparse as sp

    x = np.zeros((3, 300))
    x[0, 10:50] = 2.0
    with pytest.raises(tw.TileOverflowError, match=r"row 0, tile 0 .*holds 40"):
        tw.TwELL.from_scipy(sp.csr_array(x), overflow="raise")


def test_twell_layout_padding_and_global_indices(backend, xp):
    x = np.zeros((2, 300))
    x[0, [3, 1, 299]] = [1.0, 2.0, 3.0]
    A = tw.TwELL.from_dense(xp.asarray(x), tile=256, slots=4)
    assert host(A.values).shape == (2, 2, 4)
    assert host(A.indices)[0].tolist() == [[1, 3, -1, -1], [299, -1, -1, -1]]
    assert host(A.values)[0].tolist() == [[2.0, 1.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]]
    assert host(A.counts).tolist() == [[2, 1], [0, 0]]
    assert (host(A.indices)[1] == -1).all() and not host(A.values)[1].any()
    assert host(A.backup).shape == (0, 300) and host(A.backup_rows).shape == (0,)


def test_nan_is_kept_and_negative_zero_dropped(backend, xp):
    x = np.zeros((2, 10), np.float32)
    x[0, 2] = np.nan
    x[1, 4] = -0.0
    x[1, 5] = np.inf
    for cls in (tw.TwELL, tw.ELL, tw.Hybrid):
        A = cls.from_dense(xp.asarray(x), check_finite=False)
        assert A.nnz == 2
        d = host(A.toarray())
        assert np.isnan(d[0, 2]) and np.isinf(d[1, 5]) and np.count_nonzero(d) == 2
        A.check_format(full_check=True, check_finite=False)
        with pytest.raises(ValueError, match="values contains 1 NaN and 1 Inf"):
            A.check_format(full_check=True)


def test_construction_is_deterministic(backend, xp):
    x = xp.asarray(MAKERS["over_capacity"](np.random.default_rng(1)).astype(np.float32))
    for cls, params in FORMATS.values():
        a, b = cls.from_dense(x, **params), cls.from_dense(x, **params)
        for k in a._array_names:
            assert bits_equal(getattr(a, k), getattr(b, k)), (cls, k)


def test_ell_width(backend, xp):
    x = random_sparse(np.random.default_rng(0), 8, 100, 6)
    x[3] = 0.0
    x[3, :20] = 1.0
    A = tw.ELL.from_dense(xp.asarray(x))
    assert A.width == 20
    assert tw.ELL.from_dense(xp.asarray(x), width=25).width == 25
    with pytest.raises(ValueError, match=r"width=10 is too small: 1 rows have more than 10 non-zeros, the widest has 20"):
        tw.ELL.from_dense(xp.asarray(x), width=10)
    assert tw.ELL.from_dense(xp.zeros((3, 5))).width == 0


@pytest.mark.parametrize("width,expect_w", [(3, 3), ("fixed:5", 5), ("quantile:0.5", 5), ("quantile:1", 60),
                                            ("quantile:0", 1), ("min_storage", 9), ("auto", 9)])
def test_hybrid_width_strategies(backend, xp, width, expect_w):
    # rows: nnz 1..9 (one each) and one row with 60 non-zeros among N=64 columns.
    x = np.zeros((10, 64))
    for r in range(9):
        x[r, :r + 1] = 1.0
    x[9, :60] = 2.0
    H = tw.Hybrid.from_dense(xp.asarray(x), width=width)
    H.check_format(full_check=True)
    assert H.width == expect_w
    assert bits_equal(H.toarray(), xp.asarray(x))
    wide_rows = [r for r in range(10) if np.count_nonzero(x[r]) > expect_w]
    assert host(H.backup_rows).tolist() == wide_rows
    assert (host(H.row_nnz)[wide_rows] == 0).all()


def test_hybrid_auto_keeps_most_rows_sparse():
    # min_storage alone would send half of these rows to backup (N is tiny).
    x = np.zeros((20, 8))
    x[:10, :2] = 1.0
    x[10:, :7] = 1.0
    from twellpy.hybrid import choose_width

    nnz = np.count_nonzero(x, axis=1)
    assert choose_width(nnz, 8, 4, "min_storage") == 2
    assert choose_width(nnz, 8, 4, "auto") == 7


@pytest.mark.parametrize("bad", ["fixed:-1", "quantile:1.5", "quantile:x", "magic", -2, 2.5])
def test_hybrid_bad_width(bad):
    err = TypeError if isinstance(bad, float) else ValueError
    with pytest.raises(err, match="width"):
        tw.Hybrid.from_dense(np.eye(3), width=bad)


def test_repr_shows_structure(backend, xp):
    x = np.zeros((4, 300), np.float32)
    x[1, :40] = 1.0
    x[0, 5] = 2.0
    r = repr(tw.TwELL.from_dense(xp.asarray(x)))
    assert r.startswith("<TwELL 4x300 float32, nnz=41, device=")
    assert "tile=256, slots=32, backup_rows=1" in r
    # "auto" keeps at least 90% of the rows sparse: with 20 rows, the one wide row may go to backup
    x20 = np.zeros((20, 300), np.float32)
    x20[:4] = x
    assert "width=1, width_strategy='auto', backup_rows=1" in repr(tw.Hybrid.from_dense(xp.asarray(x20)))
    assert "<ELL 4x300 float32, nnz=41" in repr(tw.ELL.from_dense(xp.asarray(x)))


def test_components_roundtrip(backend, xp):
    x = xp.asarray(MAKERS["over_capacity"](np.random.default_rng(2)))
    for cls, params in FORMATS.values():
        A = cls.from_dense(x, **params)
        d = A.components()
        assert d["format"] == A.format and d["shape"] == A.shape
        B = tw.SparseArray.from_components(d, check="full")
        C = cls.from_components(d)
        assert type(B) is cls and type(C) is cls
        assert bits_equal(B.toarray(), x) and bits_equal(C.toarray(), x)


def test_from_components_rejects_wrong_class():
    A = tw.ELL.from_dense(np.eye(3))
    with pytest.raises(ValueError, match="components describe format 'ell', not 'twell'"):
        tw.TwELL.from_components(A.components())
    with pytest.raises(ValueError, match="unknown format 'csr'"):
        tw.SparseArray.from_components({"format": "csr"})


def test_public_constructor_from_components(backend, xp):
    vals = xp.asarray(np.array([[[1.0, 2.0], [0.0, 0.0]]], np.float32))
    idx = xp.asarray(np.array([[[0, 3], [-1, -1]]], np.int32))
    cnt = xp.asarray(np.array([[2, 0]], np.int32))
    A = tw.TwELL(vals, idx, cnt, shape=(1, 6), tile=4, check="full")
    assert host(A.toarray()).tolist() == [[1, 0, 0, 2, 0, 0]]
    backup = xp.asarray(np.array([[0, 5, 0, 0, 0, 7]], np.float32))
    A2 = tw.TwELL(vals * 0, idx * 0 - 1, cnt * 0, shape=(1, 6), tile=4, backup=backup,
                  backup_rows=xp.asarray(np.array([0], np.int32)), check="full")
    assert host(A2.toarray()).tolist() == [[0, 5, 0, 0, 0, 7]] and A2.nnz == 2


def test_lazy_submodules_and_exports():
    import importlib

    import twellpy

    for name in ("ELL", "TwELL", "Hybrid", "TileOverflowError", "save", "load", "__version__"):
        assert hasattr(twellpy, name)
    assert issubclass(twellpy.TileOverflowError, ValueError)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        twellpy.nope  # noqa: B018
    assert "ops" in dir(twellpy)
    # a lazy name resolves to the submodule of the same name (when it imports).
    try:
        mod = importlib.import_module("twellpy.ffn")
    except ImportError:
        return
    assert twellpy.ffn is mod


class _DLPackOnly:
    """An object that is only a DLPack producer (like a torch/jax array)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


@pytest.mark.parametrize("cls", [tw.TwELL, tw.ELL, tw.Hybrid])
def test_from_dense_accepts_any_dlpack_producer(cls):
    x = MAKERS["ragged_n"](np.random.default_rng(0)).astype(np.float32)
    A = cls.from_dense(_DLPackOnly(x))
    assert A.device == "cpu" and bits_equal(A.toarray(), x)
    w = np.random.default_rng(1).standard_normal((x.shape[1], 3)).astype(np.float32)
    got = A @ _DLPackOnly(w)
    assert isinstance(got, np.ndarray) and np.allclose(got, x @ w, rtol=1e-5, atol=1e-5)
