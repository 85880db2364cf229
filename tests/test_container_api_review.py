"""The containers as a scipy.sparse user meets them, found in an API review:
scalar factors that are complex or too large for a float, products with dense
operands through ``*``, ``with_values`` and its padding slots, and ``==``.
Every numeric result is compared with a float64 numpy reference."""
import numpy as np
import pytest

import twellpy as tw
from twellpy._array import bfloat16

CLASSES = [tw.ELL, tw.TwELL, tw.Hybrid]
# the second row of X goes to a dense backup row in TwELL and Hybrid with these parameters
BACKUP_PARAMS = {tw.ELL: {}, tw.TwELL: {"tile": 4, "slots": 1}, tw.Hybrid: {"width": 1}}
DTYPES = [np.float16, bfloat16, np.float32, np.float64]


def _x(dtype=np.float32):
    return np.array([[0, 1.5, 0, -2], [3, 0, 4, 5], [0, 0, 0, 0]]).astype(dtype)


def _build(cls, dtype=np.float32):
    return cls.from_dense(_x(dtype), **BACKUP_PARAMS[cls])


def _f64(a):
    return np.asarray(a).astype(np.float64)


# ---- complex scalar factors --------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("factor", [np.complex64(1 + 2j), np.complex128(1 + 2j), 1 + 2j, np.complex64(3 + 0j)],
                         ids=["c64", "c128", "py-complex", "c64-real-valued"])
@pytest.mark.parametrize("op", ["mul", "rmul", "div", "multiply"])
def test_complex_scalar_is_refused_not_truncated(cls, factor, op):
    """A real container times a complex number is complex: the imaginary part must
    not be dropped in silence (numpy.complex64 is no Python complex, and float()
    of it discards the imaginary part with only a ComplexWarning)."""
    A = _build(cls)
    call = {"mul": lambda: A * factor, "rmul": lambda: factor * A, "div": lambda: A / factor,
            "multiply": lambda: A.multiply(factor)}[op]
    with pytest.raises(TypeError, match=r"(?s)real.*complex"):
        call()


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("factor", [np.float32(2.5), np.int8(-3), 7, np.float64(0.25)])
def test_real_numpy_scalars_still_scale(cls, factor):
    A = _build(cls)
    ref = _x().astype(np.float64) * float(factor)
    np.testing.assert_allclose(_f64((A * factor).toarray()), ref, rtol=1e-6)
    np.testing.assert_allclose(_f64((factor * A).toarray()), ref, rtol=1e-6)
    np.testing.assert_allclose(_f64((A / factor).toarray()), _x().astype(np.float64) / float(factor), rtol=1e-6)


# ---- scalars too large for a float ---------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("big", [10**400, -(10**400)], ids=["pos", "neg"])
def test_factor_too_large_for_float_is_a_value_error(cls, big):
    """float(10**400) raises OverflowError ("int too large to convert to float"), which
    named neither the argument nor the rule; such a factor is as non-finite as 1e39."""
    A = _build(cls)
    with pytest.raises(ValueError, match=r"factor must be finite"):
        A * big
    with pytest.raises(ValueError, match=r"factor must be finite"):
        big * A
    with pytest.raises(ValueError, match=r"factor must be finite"):
        A.multiply(big)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("big", [10**400, -(10**400)], ids=["pos", "neg"])
def test_division_by_int_too_large_for_float_gives_zeros(cls, dtype, big):
    """x / 10**400 underflows to 0 in every dtype, as A / inf already gives."""
    A = _build(cls, dtype)
    B = A / big
    assert B.dtype == A.dtype
    ref = _x(dtype).astype(np.float64) / 1e300 / 1e100  # 0 everywhere
    np.testing.assert_array_equal(_f64(B.toarray()), ref)
    np.testing.assert_array_equal(_f64(B.toarray()), _f64((A / np.inf).toarray()))
    assert not np.signbit(_f64(B.toarray())).any()  # stored entries are +0.0, as every product gives


# ---- dense arrays and odd scalars with * and / ---------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("shape", [(3, 4), (4,), (1, 4), (3, 1)])
def test_star_with_dense_array_names_multiply(cls, shape):
    """``A * W`` and ``W * A`` for a dense W used to fail inside numpy with "operand 'ELL'
    does not support ufuncs (__array_ufunc__=None)", which names neither W nor what to do."""
    A = _build(cls)
    W = np.full(shape, 2.0, np.float32)
    for call in (lambda: A * W, lambda: W * A, lambda: A / W):
        with pytest.raises(TypeError, match=r"(?s)W|dense.*multiply"):
            call()
    # the documented way does the element-wise product
    np.testing.assert_allclose(_f64(A.multiply(W).toarray()), _x().astype(np.float64) * 2.0)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_dim_array_is_a_scalar(cls, dtype):
    """A 0-d array is a scalar for numpy and scipy.sparse (``csr * np.array(2.0)`` and
    ``csr.multiply(np.array(2.0))`` both scale); it scales the container the same way
    as the numpy scalar of its dtype does (the container keeps its dtype)."""
    A = _build(cls, dtype)
    ref = _x(dtype).astype(np.float64) * 2.5
    for f in (np.array(2.5), np.array(2.5, np.float32), np.array(5, np.int64) / 2):
        for B in (A * f, f * A, A.multiply(f)):
            assert B.dtype == A.dtype
            np.testing.assert_allclose(_f64(B.toarray()), ref, rtol=1e-2 if A.dtype.itemsize == 2 else 1e-12)
            np.testing.assert_array_equal(_f64(B.toarray()), _f64((A * float(f)).toarray()))
        B = A / (1 / f)  # multiplies by 1 / 0.4, which need not be 2.5 exactly
        assert B.dtype == A.dtype
        np.testing.assert_allclose(_f64(B.toarray()), ref, rtol=1e-2 if A.dtype.itemsize == 2 else 1e-6)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("bad", [np.bool_(True), np.array(True), np.array(1 + 2j)], ids=["np.bool_", "bool-0d", "complex-0d"])
def test_bool_and_complex_0d_operands_are_refused_clearly(cls, bad):
    A = _build(cls)
    for call in (lambda: A * bad, lambda: bad * A, lambda: A / bad, lambda: A.multiply(bad)):
        with pytest.raises(TypeError, match=r"real number"):
            call()


# ---- with_values: padding slots are ignored, non-finite ones too ----------------------------------
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_with_values_ignores_nonfinite_padding(cls, dtype):
    """The docstring says values in padding slots are ignored (stored as 0); a map of the
    values such as 1 / A.values turns padding (0) into Inf, and the NaN/Inf check used to
    reject it although only the stored entries are kept."""
    A = _build(cls, dtype)
    x = _x(dtype).astype(np.float64)
    with np.errstate(divide="ignore"):
        inv = (1 / A.values.astype(np.float32)).astype(dtype)
    assert not np.isfinite(inv.astype(np.float64)).all()  # padding slots hold Inf
    b = None if A.backup is None else A.backup.copy()
    B = A.with_values(inv, b)
    ref = x.copy()
    slot_rows = np.ones(x.shape[0], bool)
    if A.n_backup:
        slot_rows[A.backup_rows] = False
    ref[slot_rows] = np.where(x[slot_rows] != 0, 1 / np.where(x[slot_rows] != 0, x[slot_rows], 1), 0)
    np.testing.assert_allclose(_f64(B.toarray()), ref, rtol=1e-2 if A.dtype.itemsize == 2 else 1e-6)
    B.check_format(full_check=True)  # padding is (0, -1) again
    assert B.nnz == A.nnz


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_with_values_still_rejects_nonfinite_stored_values(cls, bad):
    A = cls.from_dense(_x(), **({"width": 3} if cls is tw.Hybrid else {}))  # no backup rows
    assert A.n_backup == 0
    v = A.values.copy()
    used = A.indices >= 0
    v[used] = np.where(np.arange(used.sum()) == 0, bad, v[used])
    b = None if A.backup is None else A.backup.copy()
    with pytest.raises(ValueError, match=r"values contains"):
        A.with_values(v, b)
    B = A.with_values(v, b, check_finite=False)
    assert np.isnan(B.sum()) if np.isnan(bad) else np.isinf(B.sum())


# ---- Hybrid * Hybrid: width_strategy is no part of the pattern ---------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", ["fixed", "int", "quantile:0.5", "min_storage"])
def test_hybrid_product_ignores_width_strategy(dtype, strategy):
    """Two Hybrids with the same width, indices and backup rows hold the same pattern
    whatever strategy chose their width ("auto" or an int); A * B and ops.multiply
    (whose docstring says as much) used to refuse the pair over width_strategy."""
    x = np.zeros((11, 16))
    x[np.arange(1, 11), np.arange(1, 11)] = np.arange(1, 11) / 4
    x[0] = np.linspace(-3, 3, 16)  # the one full row: a dense backup row
    x = x.astype(dtype)
    A = tw.Hybrid.from_dense(x)  # "auto"
    assert (A.width, A.n_backup) == (1, 1)
    width = {"fixed": f"fixed:{A.width}", "int": A.width}.get(strategy, strategy)
    B = tw.Hybrid.from_dense((2 * x.astype(np.float64)).astype(dtype), width=width)
    assert B.width == A.width and B.width_strategy != A.width_strategy
    np.testing.assert_array_equal(B.backup_rows, A.backup_rows)
    ref = x.astype(np.float64) * (2 * x.astype(np.float64))
    rtol = 1e-2 if np.dtype(dtype).itemsize == 2 else 1e-6
    for P in (A * B, tw.ops.multiply(A, B)):
        assert P.width_strategy == A.width_strategy  # the left operand's, as its other components
        np.testing.assert_allclose(_f64(P.toarray()), ref, rtol=rtol)
        P.check_format(full_check=True)
    np.testing.assert_allclose(_f64((B * A).toarray()), ref, rtol=rtol)


# ---- == and != -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
def test_equality_operators_do_not_answer_by_identity(cls):
    """scipy.sparse answers A == B element-wise; the containers answered by identity, so
    A == A.copy() was False and A != A.copy() True, in silence, for equal matrices (and
    A == A.toarray() was False too). They raise TypeError naming what to compare instead."""
    A = _build(cls)
    x = _x()
    for other in (A.copy(), A, x, 0.0, 1):
        for call in (lambda: A == other, lambda: A != other, lambda: other == A, lambda: other != A):
            with pytest.raises(TypeError, match=r"toarray"):
                call()
    # the documented comparison still works, against the float64 reference
    np.testing.assert_array_equal(A.toarray().astype(np.float64), x.astype(np.float64))
    # unrelated objects still compare unequal, containers stay hashable, and `is` is untouched
    assert (A == None) is False and (A != None) is True  # noqa: E711
    assert (A == "A") is False
    assert A in [None, "x", A]
    assert {A: 1}[A] == 1


# ---- TwELL tiles wider than the matrix -----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [2**40, 2**33, 2**31 - 1])
@pytest.mark.parametrize("source", ["dense", "scipy"])
def test_twell_tile_wider_than_matrix_is_one_tile(dtype, tile, source):
    """A tile wider than the row is the whole row, one tile (the CUDA backend clamps it so);
    the CPU packer allocated a buffer of ``tile`` int32 per row, so tile=2**40 failed with
    a SystemError from Numba and tile=2**31-1 reserved 8 GiB per row being packed."""
    import scipy.sparse as sp

    x = _x(dtype)
    build = ((lambda **kw: tw.TwELL.from_dense(x, **kw)) if source == "dense" else
             (lambda **kw: tw.TwELL.from_scipy(sp.csr_array(x.astype(np.float64)), dtype=dtype, **kw)))
    A = build(tile=tile, slots=2)
    ref = build(tile=x.shape[1], slots=2)
    assert A.tile == tile and A.n_tiles == 1
    for k in ("values", "indices", "counts", "backup", "backup_rows"):
        np.testing.assert_array_equal(getattr(A, k).view(np.uint8), getattr(ref, k).view(np.uint8))
    A.check_format(full_check=True)
    np.testing.assert_array_equal(_f64(A.toarray()), x.astype(np.float64))
    np.testing.assert_array_equal(_f64(A.T.toarray()), x.astype(np.float64).T)
    W = np.arange(8, dtype=np.float64).reshape(4, 2)
    np.testing.assert_allclose(_f64(A @ W), x.astype(np.float64) @ W, rtol=1e-2)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bfloat16_scalar_factor(cls, dtype):
    """An ml_dtypes.bfloat16 scalar is a numpy.generic but no numbers.Number: A * it used
    to fall through to numpy and fail with "operand does not support ufuncs"."""
    A = _build(cls, dtype)
    f = bfloat16.type(2.5)
    ref = _x(dtype).astype(np.float64) * 2.5
    rtol = 1e-2 if A.dtype.itemsize == 2 else 1e-12
    for B in (A * f, f * A, A.multiply(f)):
        assert B.dtype == A.dtype
        np.testing.assert_allclose(_f64(B.toarray()), ref, rtol=rtol)
    B = A / bfloat16.type(0.5)
    assert B.dtype == A.dtype
    np.testing.assert_allclose(_f64(B.toarray()), _x(dtype).astype(np.float64) * 2, rtol=rtol)


def test_bfloat16_limits_do_not_need_numpys_finfo(monkeypatch):
    """Older ml_dtypes releases do not register bfloat16 with ``np.finfo`` (the device's did not on
    2026-12-06: 171 GPU tests of bfloat16 astype, sums and value maps failed there with "data type
    dtype(bfloat16) not compatible with finfo" while they passed here). Every limit twellpy reads
    goes through ``_array.finfo``; with numpy's finfo made to refuse bfloat16 they all still work."""
    real = np.finfo

    def finfo_without_bfloat16(dtype):
        if np.dtype(dtype) == bfloat16:
            raise ValueError("data type dtype(bfloat16) not compatible with finfo")
        return real(dtype)

    monkeypatch.setattr(np, "finfo", finfo_without_bfloat16)
    x = np.zeros((5, 300), np.float32)
    x[0, 3], x[2, 299], x[4, 0] = 1.5, -2.25, 3.0e38
    for cls in (tw.TwELL, tw.ELL, tw.Hybrid):
        A = cls.from_dense(x.astype(bfloat16))
        assert A.astype(np.float32).toarray().tolist() == x.astype(bfloat16).astype(np.float32).tolist()
        assert float(A.sum()) == float(x.astype(bfloat16).astype(np.float64).sum())
        with pytest.raises(ValueError, match=r"overflows 1 finite value.*largest float16: 65504"):
            A.astype(np.float16)
        big = cls.from_dense(np.where(x > 1e38, np.float32(3.4e38), x))
        with pytest.raises(ValueError, match=r"astype\(bfloat16\) overflows 1 finite value.*largest bfloat16: 3\.38953e\+38"):
            big.astype(bfloat16)


@pytest.mark.parametrize("width", [41, 1000, 2**40])
def test_ell_width_beyond_the_row_length_is_capped(backend, xp, width):
    """ELL kept M x width slots for a width past N: pure padding, and 2**40 asked for
    terabytes. No row holds more than N entries, so the width stops at N (as Hybrid's)."""
    import scipy.sparse as sp

    x = np.zeros((3, 40), np.float32)
    x[0, :7] = 1.0
    x[2, 39] = -2.0
    for A in (tw.ELL.from_dense(xp.asarray(x), width=width), tw.ELL.from_scipy(sp.csr_array(x), width=width)):
        assert A.width == 40 and A.components()["values"].shape == (3, 40)
        np.testing.assert_array_equal(A.to_scipy().toarray(), x)
    assert tw.ELL.from_dense(xp.asarray(x), width=12).width == 12  # within N: as asked
