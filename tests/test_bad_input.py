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
    with pytest.raises(TypeError, match=r"dtype must be one of float16, bfloat16, float32, float64, got int8"):
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
    with pytest.raises(ValueError, match=msg):  # the default check scans the contents too
        tw.TwELL(v, i, c, shape=(2, 6), tile=4)
    A = tw.TwELL(v, i, c, shape=(2, 6), tile=4, check=False)  # trusted: no scan
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
    with pytest.raises(ValueError, match=msg):  # the default check scans the contents too
        cls(v, i, n, shape=(2, 5))
    A = cls(v, i, n, shape=(2, 5), check=False)  # trusted: no scan
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
    with pytest.raises(ValueError, match=r"(W is on cuda:0 but A is on cpu|A is on cpu but W is on cuda:0)"):
        A @ cupy.zeros((6, 2), np.float32)


# =============================================================================
# Table-driven battery: every public entry point x every kind of bad input.
#
# Each entry point lists its arguments with a good value; the cases below are
# generated from that table (wrong type, wrong dtype, integer data, wrong
# ndim, mismatched shape, NaN, Inf, wrong device) and every one asserts a
# TypeError/ValueError whose message names the argument. Non-contiguous and
# negative-stride inputs must give the same bits as contiguous ones.
# =============================================================================
import dataclasses  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import zipfile  # noqa: E402

from _reliability_util import bits_equal  # noqa: E402

def rmatmul(w, A):
    """``w @ A``; cupy operands call ``A.__rmatmul__`` directly, because whether
    ``cupy.ndarray.__matmul__`` defers to a foreign ``__rmatmul__`` depends on the
    CuPy version (the operator form on cupy is tested once, in test_gpu_reliability)."""
    return w @ A if isinstance(w, np.ndarray) else A.__rmatmul__(w)



def _x46():
    x = np.zeros((4, 6), np.float32)
    x[0, [0, 3]] = [1.0, 2.0]
    x[1, 5] = -1.5
    x[3, [1, 2, 4]] = [0.5, 0.75, -2.0]
    return x


def _cont(fmt):
    cls = {"twell": tw.TwELL, "ell": tw.ELL, "hybrid": tw.Hybrid}[fmt]
    # parameters chosen so that no row needs a backup row (with_values needs no backup)
    kw = {"tile": 4, "slots": 2} if fmt == "twell" else ({"width": 3} if fmt == "hybrid" else {})
    return cls.from_dense(_x46(), **kw)


def _ffn_weights(h=8, d=4, m=5, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((m, d)).astype(np.float32),
            "w_gate": rng.standard_normal((h, d)).astype(np.float32),
            "w_up": rng.standard_normal((h, d)).astype(np.float32),
            "w_down": rng.standard_normal((d, h)).astype(np.float32),
            "dy": rng.standard_normal((m, d)).astype(np.float32)}


@dataclasses.dataclass
class Arg:
    """An argument of an entry point: how to make it good and how to break it."""

    good: object                     # () -> good value
    kind: str = "value"              # "value" (float array), "index" (int32 array), "container", "ctx",
    #                                  "fixed" (an operand the case never replaces)
    optional: bool = False           # None is a valid value
    bad_ndim: object = None          # () -> value with the wrong number of dimensions
    bad_shape: object = None         # () -> value with a mismatched shape
    finite: bool = True              # NaN/Inf raise (False: IEEE semantics, tested separately)


@dataclasses.dataclass
class Entry:
    call: object                     # (dict of argument values) -> result
    args: dict


def _train_ctx(gated):
    w = _ffn_weights()
    if gated:
        return tw.ffn.gated_forward_train(w["x"], w["w_gate"], w["w_up"], w["w_down"])[1]
    return tw.ffn.relu_forward_train(w["x"], w["w_up"], w["w_down"])[1]


_W = _ffn_weights


def _ffn_args(names, train=False):
    bad_shape = {"x": lambda: _W()["x"][:, :3].copy(), "w_gate": lambda: _W()["w_gate"][:, :3].copy(),
                 "w_up": lambda: _W()["w_up"][:7].copy(), "w_down": lambda: _W()["w_down"][:, :7].copy()}
    out = {}
    for n in names:
        nd = (lambda n=n: _W()[n][None]) if (train or n != "x") else (lambda: np.float32(1.0))
        out[n] = Arg(lambda n=n: _W()[n], bad_ndim=nd, bad_shape=bad_shape[n])
    return out


ENTRIES = {}
for _fmt, _cls in (("twell", tw.TwELL), ("ell", tw.ELL), ("hybrid", tw.Hybrid)):
    ENTRIES[f"{_cls.__name__}.from_dense"] = Entry(
        lambda a, c=_cls: c.from_dense(a["x"]),
        {"x": Arg(_x46, bad_ndim=lambda: _x46()[None])})
    ENTRIES[f"{_cls.__name__}.with_values"] = Entry(
        lambda a, f=_fmt: _cont(f).with_values(a["values"]),
        {"values": Arg(lambda f=_fmt: _cont(f).values.copy(), bad_ndim=lambda f=_fmt: _cont(f).values[None],
                       bad_shape=lambda f=_fmt: np.zeros((4, 9), np.float32))})
    ENTRIES[f"{_cls.__name__} @ W"] = Entry(
        lambda a: a["A"] @ a["W"],
        {"A": Arg(lambda f=_fmt: _cont(f), kind="fixed"),
         "W": Arg(lambda: np.ones((6, 3), np.float32), bad_ndim=lambda: np.ones((6, 3, 1), np.float32),
                  bad_shape=lambda: np.ones((5, 3), np.float32), finite=False)})
    ENTRIES[f"W @ {_cls.__name__}"] = Entry(
        lambda a: rmatmul(a["W"], a["A"]),
        {"A": Arg(lambda f=_fmt: _cont(f), kind="fixed"),
         "W": Arg(lambda: np.ones((3, 4), np.float32), bad_ndim=lambda: np.ones((3, 4, 1), np.float32),
                  bad_shape=lambda: np.ones((3, 5), np.float32), finite=False)})

def _twell_backup_parts():
    """_twell_parts with row 1 moved to a dense backup row."""
    v, i, c = _twell_parts()
    v[1], i[1], c[1] = 0, -1, 0
    backup = np.array([[0, 0, 0, 0, 4.0, 5.0]], np.float32)
    return v, i, c, backup, np.array([1], np.int32)


ENTRIES["TwELL(...)"] = Entry(
    lambda a: tw.TwELL(a["values"], a["indices"], a["counts"], shape=(2, 6), tile=4,
                       backup=a["backup"], backup_rows=a["backup_rows"], check="full"),
    {"values": Arg(lambda: _twell_backup_parts()[0], bad_ndim=lambda: _twell_parts()[0][0],
                   bad_shape=lambda: np.zeros((2, 3, 2), np.float32)),
     "indices": Arg(lambda: _twell_backup_parts()[1], kind="index", bad_ndim=lambda: _twell_parts()[1][0],
                    bad_shape=lambda: _twell_parts()[1][:, :, :1].copy()),
     "counts": Arg(lambda: _twell_backup_parts()[2], kind="index", bad_ndim=lambda: _twell_parts()[2][0],
                   bad_shape=lambda: _twell_parts()[2][:, :1].copy()),
     "backup": Arg(lambda: _twell_backup_parts()[3], optional=True, bad_ndim=lambda: np.zeros(6, np.float32),
                   bad_shape=lambda: np.zeros((1, 7), np.float32)),
     "backup_rows": Arg(lambda: _twell_backup_parts()[4], kind="index", optional=True,
                        bad_ndim=lambda: np.ones((1, 1), np.int32), bad_shape=lambda: np.array([0, 1], np.int32))})
for _cls in (tw.ELL, tw.Hybrid):
    ENTRIES[f"{_cls.__name__}(...)"] = Entry(
        lambda a, c=_cls: c(a["values"], a["indices"], a["row_nnz"], shape=(2, 5)),
        {"values": Arg(lambda: _ell_parts()[0], bad_ndim=lambda: _ell_parts()[0][0],
                       bad_shape=lambda: np.zeros((3, 2), np.float32)),
         "indices": Arg(lambda: _ell_parts()[1], kind="index", bad_ndim=lambda: _ell_parts()[1][0],
                        bad_shape=lambda: _ell_parts()[1][:, :1].copy()),
         "row_nnz": Arg(lambda: _ell_parts()[2], kind="index", bad_ndim=lambda: _ell_parts()[2][None],
                        bad_shape=lambda: _ell_parts()[2][:1].copy())})

ENTRIES["ops.spmm"] = Entry(
    lambda a: tw.ops.spmm(a["A"], a["B"]),
    {"A": Arg(lambda: _cont("twell"), kind="container"),
     "B": Arg(lambda: np.ones((6, 3), np.float32), bad_ndim=lambda: np.ones((6, 3, 1), np.float32),
              bad_shape=lambda: np.ones((5, 3), np.float32), finite=False)})
ENTRIES["ops.spmm_t"] = Entry(
    lambda a: tw.ops.spmm_t(a["A"], a["B"]),
    {"A": Arg(lambda: _cont("hybrid"), kind="container"),
     "B": Arg(lambda: np.ones((4, 3), np.float32), bad_ndim=lambda: np.ones((4, 3, 1), np.float32),
              bad_shape=lambda: np.ones((6, 3), np.float32), finite=False)})
ENTRIES["ops.sddmm"] = Entry(
    lambda a: tw.ops.sddmm(a["X"], a["Y"], a["pattern"]),
    {"X": Arg(lambda: np.ones((4, 2), np.float32), bad_ndim=lambda: np.ones(4, np.float32),
              bad_shape=lambda: np.ones((5, 2), np.float32), finite=False),
     "Y": Arg(lambda: np.ones((6, 2), np.float32), bad_ndim=lambda: np.ones((6, 2, 1), np.float32),
              bad_shape=lambda: np.ones((6, 3), np.float32), finite=False),
     "pattern": Arg(lambda: _cont("ell"), kind="container")})
ENTRIES["ops.transpose"] = Entry(lambda a: tw.ops.transpose(a["A"]),
                                 {"A": Arg(lambda: _cont("twell"), kind="container")})
ENTRIES["ops.multiply"] = Entry(
    lambda a: tw.ops.multiply(a["A"], a["B"]),
    {"A": Arg(lambda: _cont("twell"), kind="container"),
     "B": Arg(lambda: _cont("twell"), kind="container", bad_shape=lambda: tw.TwELL.from_dense(
         np.eye(4, 7, dtype=np.float32), tile=4, slots=2))})
ENTRIES["ffn.gated_forward"] = Entry(
    lambda a: tw.ffn.gated_forward(a["x"], a["w_gate"], a["w_up"], a["w_down"]),
    _ffn_args(("x", "w_gate", "w_up", "w_down")))
ENTRIES["ffn.relu_forward"] = Entry(
    lambda a: tw.ffn.relu_forward(a["x"], a["w_up"], a["w_down"]), _ffn_args(("x", "w_up", "w_down")))
ENTRIES["ffn.GatedFFN()(x)"] = Entry(
    lambda a: tw.ffn.GatedFFN(a["w_gate"], a["w_up"], a["w_down"])(a["x"]),
    _ffn_args(("x", "w_gate", "w_up", "w_down")))
ENTRIES["ffn.gated_forward_train"] = Entry(
    lambda a: tw.ffn.gated_forward_train(a["x"], a["w_gate"], a["w_up"], a["w_down"]),
    _ffn_args(("x", "w_gate", "w_up", "w_down"), train=True))
ENTRIES["ffn.relu_forward_train"] = Entry(
    lambda a: tw.ffn.relu_forward_train(a["x"], a["w_up"], a["w_down"]),
    _ffn_args(("x", "w_up", "w_down"), train=True))
for _gated, _name in ((True, "gated_backward"), (False, "relu_backward")):
    ENTRIES[f"ffn.{_name}"] = Entry(
        lambda a, n=_name: getattr(tw.ffn, n)(a["ctx"], a["dy"]),
        {"ctx": Arg(lambda g=_gated: _train_ctx(g), kind="ctx"),
         "dy": Arg(lambda: _W()["dy"], bad_ndim=lambda: _W()["dy"][None],
                   bad_shape=lambda: _W()["dy"][:, :3].copy())})
ENTRIES["save"] = Entry(lambda a: tw.save(os.devnull, a["A"]),
                        {"A": Arg(lambda: _cont("hybrid"), kind="container")})
for _fmt, _cls in (("twell", tw.TwELL), ("ell", tw.ELL), ("hybrid", tw.Hybrid)):
    ENTRIES[f"{_cls.__name__}.multiply"] = Entry(
        lambda a: a["A"].multiply(a["other"]),
        {"A": Arg(lambda f=_fmt: _cont(f), kind="fixed"),
         "other": Arg(lambda: np.full((4, 6), 1.5, np.float32), bad_ndim=lambda: np.ones((4, 6, 1), np.float32),
                      bad_shape=lambda: np.ones((4, 5), np.float32), finite=False)})
ENTRIES["vstack"] = Entry(
    lambda a: tw.vstack(a["parts"]),
    {"parts": Arg(lambda: [_cont("hybrid"), _cont("hybrid")], kind="container",
                  bad_shape=lambda: [_cont("hybrid"), tw.Hybrid.from_dense(np.eye(4, 7, dtype=np.float32))])})


def _nonfinite(a, value):
    a = np.array(a, copy=True)
    a.reshape(-1)[min(1, a.size - 1)] = value
    return a


def _generated_cases():
    """(entry, argument, case kind, replacement factory, expected exception)."""
    cases = []
    for ename, e in ENTRIES.items():
        for aname, arg in e.args.items():
            def add(kind, make, exc):
                cases.append((ename, aname, kind, make, exc))

            if arg.kind == "container":
                add("wrong type", lambda: np.zeros((4, 6), np.float32), TypeError)
                add("wrong type (None)", lambda: None, TypeError)
                if arg.bad_shape:
                    add("mismatched shape", arg.bad_shape, ValueError)
                continue
            if arg.kind == "fixed":
                continue
            if arg.kind == "ctx":
                add("wrong type", lambda: {"x": 1}, TypeError)
                add("wrong forward", lambda g=("relu" in ename): _train_ctx(g), ValueError)
                continue
            add("wrong type", lambda: object(), TypeError)
            if not arg.optional:
                add("wrong type (None)", lambda: None, TypeError)
            if arg.kind == "index":
                add("wrong dtype (int64)", lambda g=arg.good: g().astype(np.int64), TypeError)
                add("wrong dtype (float)", lambda g=arg.good: g().astype(np.float32), TypeError)
            else:
                add("wrong dtype (complex)", lambda g=arg.good: g().astype(np.complex64), TypeError)
                add("integer data", lambda g=arg.good: g().astype(np.int32), TypeError)
                add("bool data", lambda g=arg.good: g() != 0, TypeError)
            if arg.bad_ndim:
                add("wrong ndim", arg.bad_ndim, ValueError)
            if arg.bad_shape:
                add("mismatched shape", arg.bad_shape, ValueError)
            if arg.kind == "value" and arg.finite:
                add("NaN", lambda g=arg.good: _nonfinite(g(), np.nan), ValueError)
                add("Inf", lambda g=arg.good: _nonfinite(g(), -np.inf), ValueError)
    return cases


CASES = _generated_cases()


def _good_args(e):
    return {k: a.good() for k, a in e.args.items()}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_entry_point_good_call_works(entry):
    """The baseline every bad case departs from is itself valid."""
    e = ENTRIES[entry]
    e.call(_good_args(e))


@pytest.mark.parametrize("entry,arg,kind,make,exc", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_battery(entry, arg, kind, make, exc):
    e = ENTRIES[entry]
    a = _good_args(e)
    a[arg] = make()
    with pytest.raises(exc) as info:
        e.call(a)
    msg = str(info.value)
    assert re.search(rf"(?<![A-Za-z_]){re.escape(arg)}(?![A-Za-z_])", msg), \
        f"message does not name {arg!r}: {msg}"


# ---- parameters (non-array arguments) ----------------------------------------
_A_TW = lambda: _cont("twell")  # noqa: E731
PARAM_CASES = [
    # (entry, argument, call, exception)
    ("TwELL.from_dense", "tile", lambda: tw.TwELL.from_dense(_x46(), tile=-4), ValueError),
    ("TwELL.from_dense", "tile", lambda: tw.TwELL.from_dense(_x46(), tile="4"), TypeError),
    ("TwELL.from_dense", "tile", lambda: tw.TwELL.from_dense(_x46(), tile=2.5), TypeError),
    ("TwELL.from_dense", "slots", lambda: tw.TwELL.from_dense(_x46(), slots=0), ValueError),
    ("TwELL.from_dense", "overflow", lambda: tw.TwELL.from_dense(_x46(), overflow=None), ValueError),
    ("TwELL.from_dense", "slots", lambda: tw.TwELL.from_dense(_x46(), tile=4, slots=1, overflow="raise"),
     tw.TileOverflowError),
    ("ELL.from_dense", "width", lambda: tw.ELL.from_dense(_x46(), width=-1), ValueError),
    ("ELL.from_dense", "width", lambda: tw.ELL.from_dense(_x46(), width=2), ValueError),
    ("ELL.from_dense", "width", lambda: tw.ELL.from_dense(_x46(), width="wide"), (TypeError, ValueError)),
    ("Hybrid.from_dense", "width", lambda: tw.Hybrid.from_dense(_x46(), width="quantile:2"), ValueError),
    ("Hybrid.from_dense", "width", lambda: tw.Hybrid.from_dense(_x46(), width="fixed:-1"), ValueError),
    ("Hybrid.from_dense", "width", lambda: tw.Hybrid.from_dense(_x46(), width="bogus"), ValueError),
    ("Hybrid.from_dense", "width", lambda: tw.Hybrid.from_dense(_x46(), width=-3), ValueError),
    ("Hybrid.from_dense", "width", lambda: tw.Hybrid.from_dense(_x46(), width=2.5), TypeError),
    ("astype", "dtype", lambda: _A_TW().astype("int32"), TypeError),
    ("astype", "dtype", lambda: _A_TW().astype("nonsense"), TypeError),
    ("asformat", "format", lambda: _A_TW().asformat("csr"), ValueError),
    ("asformat", "bogus", lambda: _A_TW().asformat("ell", bogus=1), TypeError),
    ("to_device", "device", lambda: _A_TW().to_device("tpu"), ValueError),
    ("to_device", "device", lambda: _A_TW().to_device(0), TypeError),
    ("__mul__", "scalar", lambda: _A_TW() * float("nan"), ValueError),
    ("ops.transpose", "format", lambda: tw.ops.transpose(_A_TW(), format="coo"), ValueError),
    ("ops.transpose", "width", lambda: tw.ops.transpose(_A_TW(), width=-1), ValueError),
    ("ops.transpose", "format", lambda: tw.ops.transpose(_A_TW().astype("float16"), format="csr"), TypeError),
    ("from_components", "d", lambda: tw.SparseArray.from_components([1, 2]), TypeError),
    ("from_components", "format", lambda: tw.SparseArray.from_components({"format": "csr"}), ValueError),
    ("from_components", "format", lambda: tw.ELL.from_components(_A_TW().components()), ValueError),
    ("ffn.gated_forward", "mode", lambda: tw.ffn.gated_forward(*(_W()[k] for k in ("x", "w_gate", "w_up", "w_down")),
                                                                 mode="fast"), ValueError),
    ("ffn.gated_forward", "tile", lambda: tw.ffn.gated_forward(*(_W()[k] for k in ("x", "w_gate", "w_up", "w_down")),
                                                                 tile=0), ValueError),
    ("ffn.relu_forward", "slots", lambda: tw.ffn.relu_forward(_W()["x"], _W()["w_up"], _W()["w_down"], slots=-1),
     ValueError),
    ("ffn.gated_forward", "w_up", lambda: tw.ffn.gated_forward(_W()["x"], _W()["w_gate"],
                                                                 _W()["w_up"].astype(np.float64), _W()["w_down"]),
     TypeError),
    ("ffn.gated_forward", "x", lambda: tw.ffn.gated_forward(_W()["x"].astype(np.float64), _W()["w_gate"],
                                                              _W()["w_up"], _W()["w_down"]), TypeError),
    ("ffn.gated_forward_train", "l1", lambda: tw.ffn.gated_forward_train(
        _W()["x"], _W()["w_gate"], _W()["w_up"], _W()["w_down"], l1=-1.0), ValueError),
    ("ffn.gated_forward_train", "l1", lambda: tw.ffn.gated_forward_train(
        _W()["x"], _W()["w_gate"], _W()["w_up"], _W()["w_down"], l1="big"), TypeError),
    ("ffn.gated_forward_train", "l1", lambda: tw.ffn.gated_forward_train(
        _W()["x"], _W()["w_gate"], _W()["w_up"], _W()["w_down"], l1=float("inf")), ValueError),
    ("ffn.relu_forward_train", "width", lambda: tw.ffn.relu_forward_train(
        _W()["x"], _W()["w_up"], _W()["w_down"], width=-2), ValueError),
    ("ffn.relu_forward_train", "width", lambda: tw.ffn.relu_forward_train(
        _W()["x"], _W()["w_up"], _W()["w_down"], width="bogus"), ValueError),
    ("ffn.relu_forward_train", "w_up", lambda: tw.ffn.relu_forward_train(
        _W()["x"], _W()["w_up"].astype(np.float64), _W()["w_down"]), TypeError),
    ("ffn.gated_backward", "dy", lambda: tw.ffn.gated_backward(_train_ctx(True), _W()["dy"].astype(np.float64)),
     TypeError),
    ("load", "device", lambda: _saved_then_load(device="tpu"), ValueError),
    ("__getitem__", "row", lambda: _A_TW()[1.5], TypeError),
    ("__getitem__", "row", lambda: _A_TW()[2], TypeError),
    ("__getitem__", "row", lambda: _A_TW()[[0, 9]], IndexError),
    ("__getitem__", "rows", lambda: _A_TW()[:, 1], TypeError),
    ("__getitem__", "row", lambda: _A_TW()[np.ones(3, bool)], IndexError),
    ("sum", "axis", lambda: _A_TW().sum(axis=3), ValueError),
    ("sum", "axis", lambda: _A_TW().sum(axis="rows"), TypeError),
    ("count_nonzero", "axis", lambda: _A_TW().count_nonzero(axis=-3), ValueError),
    ("max", "axis", lambda: _A_TW().max(axis=2), ValueError),
    ("min", "axis", lambda: tw.ELL.from_dense(np.zeros((0, 3), np.float32)).min(), ValueError),
    ("vstack", "parts", lambda: tw.vstack(_A_TW()), TypeError),
    ("vstack", "parts", lambda: tw.vstack(None), TypeError),
    ("vstack", "parts", lambda: tw.vstack([_A_TW(), _A_TW().astype("float64")]), TypeError),
]


def _saved_then_load(**kw):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "a.npz")
        tw.save(p, _A_TW())
        return tw.load(p, **kw)


@pytest.mark.parametrize("entry,arg,call,exc", PARAM_CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(PARAM_CASES)])
def test_parameter_battery(entry, arg, call, exc):
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert re.search(rf"(?<![A-Za-z_]){re.escape(arg)}(?![A-Za-z_])", msg), \
        f"message does not name {arg!r}: {msg}"


# ---- non-contiguous and negative-stride inputs: same bits as contiguous ------
def _negative_stride(a):
    return a[::-1].copy()[::-1]


def _fortran(a):
    return np.asfortranarray(a)


def _step2(a):
    buf = np.full(a.shape[:-1] + (2 * a.shape[-1],), 7, dtype=a.dtype)
    buf[..., ::2] = a
    return buf[..., ::2]


LAYOUTS = {"negative_stride": _negative_stride, "fortran": _fortran, "step2": _step2}


def _containers_equal(A, B):
    return A.format == B.format and all(bits_equal(getattr(A, k), getattr(B, k)) for k in A._array_names)


def _ffn_call(gated, train):
    def call(a):
        if train:
            if gated:
                y, ctx = tw.ffn.gated_forward_train(a["x"], a["w_gate"], a["w_up"], a["w_down"], l1=1e-3)
                return (y,) + tuple(tw.ffn.gated_backward(ctx, a["dy"]))
            y, ctx = tw.ffn.relu_forward_train(a["x"], a["w_up"], a["w_down"], l1=1e-3)
            return (y,) + tuple(tw.ffn.relu_backward(ctx, a["dy"]))
        if gated:
            return tw.ffn.gated_forward(a["x"], a["w_gate"], a["w_up"], a["w_down"])
        return tw.ffn.relu_forward(a["x"], a["w_up"], a["w_down"])
    return call


_RNG = np.random.default_rng(11)
STRIDED = {
    # entry -> (call(arrays) -> result, arrays)
    **{f"{c.__name__}.from_dense": (lambda a, c=c: c.from_dense(a["x"]), {"x": _x46()})
       for c in (tw.TwELL, tw.ELL, tw.Hybrid)},
    "TwELL(...)": (lambda a: tw.TwELL(a["values"], a["indices"], a["counts"], shape=(2, 6), tile=4,
                                      check="full"), dict(zip(("values", "indices", "counts"), _twell_parts()))),
    "ELL(...)": (lambda a: tw.ELL(a["values"], a["indices"], a["row_nnz"], shape=(2, 5), check="full"),
                 dict(zip(("values", "indices", "row_nnz"), _ell_parts()))),
    "with_values": (lambda a: _cont("twell").with_values(a["values"]),
                    {"values": _RNG.standard_normal(_cont("twell").values.shape).astype(np.float32)}),
    "A @ W": (lambda a: _cont("hybrid") @ a["W"], {"W": _RNG.standard_normal((6, 3)).astype(np.float32)}),
    "W @ A": (lambda a: a["W"] @ _cont("twell"), {"W": _RNG.standard_normal((3, 4)).astype(np.float32)}),
    "ops.spmm": (lambda a: tw.ops.spmm(_cont("ell"), a["B"]), {"B": _RNG.standard_normal((6, 3)).astype(np.float32)}),
    "multiply": (lambda a: _cont("hybrid").multiply(a["other"]),
                 {"other": _RNG.standard_normal((4, 6)).astype(np.float32)}),
    "ops.spmm_t": (lambda a: tw.ops.spmm_t(_cont("twell"), a["B"]),
                   {"B": _RNG.standard_normal((4, 3)).astype(np.float32)}),
    "ops.sddmm": (lambda a: tw.ops.sddmm(a["X"], a["Y"], _cont("twell")),
                  {"X": _RNG.standard_normal((4, 3)).astype(np.float32),
                   "Y": _RNG.standard_normal((6, 3)).astype(np.float32)}),
    "ffn.gated_forward": (_ffn_call(True, False), _W(seed=3)),
    "ffn.relu_forward": (_ffn_call(False, False), _W(seed=4)),
    "ffn.gated_forward_train+backward": (_ffn_call(True, True), _W(seed=5)),
    "ffn.relu_forward_train+backward": (_ffn_call(False, True), _W(seed=6)),
}


def _same_result(a, b):
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same_result(u, v) for u, v in zip(a, b))
    if isinstance(a, tw.SparseArray):
        return _containers_equal(a, b)
    return bits_equal(a, b)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("entry", list(STRIDED))
def test_non_contiguous_inputs_work(entry, layout):
    call, arrays = STRIDED[entry]
    views = {k: LAYOUTS[layout](v) for k, v in arrays.items()}
    if any(v.ndim > 1 for v in views.values()):
        assert not all(v.flags.c_contiguous for v in views.values() if v.ndim > 1)
    for k, v in views.items():
        assert np.array_equal(v, arrays[k])
    want = call({k: np.ascontiguousarray(v) for k, v in arrays.items()})
    got = call(views)
    assert _same_result(got, want)


# ---- NaN/Inf semantics where they are allowed (IEEE, documented) -------------
def test_nan_in_dense_operand_follows_ieee():
    A = _cont("twell")  # no backup rows: only stored entries touch B
    assert A.n_backup == 0
    x = _x46()
    B = np.ones((6, 2), np.float32)
    B[5, 0] = np.nan  # column 5 is stored only in row 1
    for y in (A @ B, tw.ops.spmm(A, B)):
        assert np.isnan(y[1, 0]) and np.isfinite(np.delete(y[:, 0], 1)).all()
        np.testing.assert_array_equal(y[:, 1], x.sum(1))


def test_nan_relu_input_is_kept_and_active():
    w = _W()
    x = w["x"].copy()
    x[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"x contains 1 NaN"):
        tw.ffn.relu_forward(x, w["w_up"], w["w_down"])
    y, h = tw.ffn.relu_forward(x, w["w_up"], w["w_down"], check_finite=False, return_activations=True)
    assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, axis=0)).all()
    hd = h.toarray()
    assert np.isnan(hd[2]).all()  # relu(NaN) = NaN: every neuron of that token counts as active
    y2, ctx = tw.ffn.relu_forward_train(x, w["w_up"], w["w_down"], check_finite=False)
    assert np.isnan(y2[2]).all() and int(ctx.stats["token_counts"][2]) == w["w_up"].shape[0]


def test_nan_kept_with_check_finite_false():
    x = _x46()
    x[2, 3] = np.nan
    x[0, 5] = -np.inf
    for cls in CLASSES:
        A = cls.from_dense(x, check_finite=False)
        d = A.toarray()
        assert np.isnan(d[2, 3]) and d[0, 5] == -np.inf and A.nnz == np.count_nonzero(_x46()) + 2


# ---- files: truncated, corrupted, foreign npz --------------------------------
def _write_valid(path, fmt="twell"):
    tw.save(path, _cont(fmt))
    return path


def _rewrite(path, **changes):
    """Re-save the npz at ``path`` with entries replaced (value None deletes)."""
    with np.load(path) as z:
        d = {k: z[k] for k in z.files}
    for k, v in changes.items():
        if v is None:
            d.pop(k)
        else:
            d[k] = v
    with open(path, "wb") as f:
        np.savez(f, **d)


def _truncate(p):
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2])


def _corrupt(p):
    data = bytearray(open(p, "rb").read())
    start = data.find(b"\x93NUMPY")  # first member's array header
    for i in range(start + 200, start + 260):
        data[i] ^= 0xFF
    open(p, "wb").write(bytes(data))


FILE_CASES = {
    "truncated": _truncate,
    "corrupted bytes": _corrupt,
    "empty file": lambda p: open(p, "wb").close(),
    "text file": lambda p: open(p, "w").write("format,shape\ntwell,2x6\n"),
    "foreign npz": lambda p: np.savez(open(p, "wb"), a=np.arange(3), b=np.eye(2)),
    "newer version": lambda p: _rewrite(p, __twellpy_version__=np.int64(99)),
    "version 0": lambda p: _rewrite(p, __twellpy_version__=np.int64(0)),
    "unreadable version": lambda p: _rewrite(p, __twellpy_version__=np.str_("one")),
    "unknown format": lambda p: _rewrite(p, format=np.str_("csr")),
    "missing indices": lambda p: _rewrite(p, indices=None),
    "missing shape": lambda p: _rewrite(p, shape=None),
    "indices int64": lambda p: _rewrite(p, indices=np.load(p)["indices"].astype(np.int64)),
    "unknown dtype": lambda p: _rewrite(p, dtype=np.str_("int8")),
    "value itemsize mismatch": lambda p: _rewrite(p, dtype=np.str_("float16")),
    "counts > slots": lambda p: _rewrite(p, counts=np.full_like(np.load(p)["counts"], 9)),
    "index out of range": lambda p: _rewrite(p, indices=np.where(np.load(p)["indices"] >= 0, 50,
                                                                     np.load(p)["indices"]).astype(np.int32)),
    "shape disagrees": lambda p: _rewrite(p, shape=np.array([3, 6], np.int64)),
    "pickled object entry": lambda p: np.savez(open(p, "wb"), __twellpy_version__=np.int64(1),
                                               format=np.array([{"a": 1}], dtype=object)),
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_load_rejects_bad_files(tmp_path, case):
    p = str(tmp_path / "a.npz")
    _write_valid(p)
    FILE_CASES[case](p)
    with pytest.raises(ValueError) as info:
        tw.load(p)
    assert p in str(info.value), f"message does not name the file: {info.value}"
    if case == "newer version":
        assert "version 99" in str(info.value) and "upgrade" in str(info.value)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        tw.load(str(tmp_path / "nope.npz"))


def test_save_records_version_and_parameters(tmp_path):
    p = str(tmp_path / "a.npz")
    tw.save(p, tw.TwELL.from_dense(_x46(), tile=4, slots=2))
    with zipfile.ZipFile(p) as z:
        names = set(z.namelist())
    assert {"__twellpy_version__.npy", "param_tile.npy", "format.npy", "shape.npy"} <= names
    with np.load(p) as z:
        assert int(z["__twellpy_version__"]) == tw.io.FORMAT_VERSION and int(z["param_tile"]) == 4


# ---- devices (GPU) -----------------------------------------------------------
def _to_gpu_value(v):
    import cupy

    if isinstance(v, tw.SparseArray):
        return v.to_device("cuda")
    if isinstance(v, list):  # vstack's parts
        return [_to_gpu_value(x) for x in v]
    return cupy.asarray(v)


DEVICE_CASES = [(e, a) for e, entry in ENTRIES.items()
                for a, arg in entry.args.items()
                if arg.kind in ("value", "index", "container")
                and sum(x.kind in ("value", "index", "container", "fixed", "ctx") for x in entry.args.values()) > 1]


@pytest.mark.gpu
@pytest.mark.parametrize("entry,arg", DEVICE_CASES, ids=[f"{e}-{a}" for e, a in DEVICE_CASES])
def test_mixed_devices_battery(entry, arg):
    """One argument on the GPU, the others on the CPU: ValueError naming a device."""
    e = ENTRIES[entry]
    a = _good_args(e)
    a[arg] = _to_gpu_value(a[arg])
    with pytest.raises(ValueError, match=r"cuda:0") as info:
        e.call(a)
    assert re.search(r"\bcpu\b", str(info.value))


@pytest.mark.gpu
def test_all_on_gpu_matches_cpu_for_every_entry():
    """The same good calls with every argument on the GPU give the CPU answer."""
    from conftest import rel_err

    for name, e in ENTRIES.items():
        # with_values calls build their container on the CPU; ctx/save have no GPU twin here
        if any(x.kind == "ctx" for x in e.args.values()) or name == "save" or "with_values" in name:
            continue
        a = _good_args(e)
        want = e.call(a)
        got = e.call({k: _to_gpu_value(v) for k, v in a.items()})
        if isinstance(want, tuple):  # forward_train: (y, ctx)
            want, got = want[0], got[0]
        if isinstance(want, tw.SparseArray):
            want, got = want.toarray(), got.toarray()
        assert rel_err(got, want) <= 1e-5, name


def _gpu_twin_exists(entry):
    # as in test_all_on_gpu_matches_cpu_for_every_entry: ctx/save/with_values have no GPU twin here
    e = ENTRIES[entry]
    return not (any(x.kind == "ctx" for x in e.args.values()) or entry == "save" or "with_values" in entry)


NONFINITE_GPU_CASES = [c for c in CASES if c[2] in ("NaN", "Inf") and _gpu_twin_exists(c[0])]


@pytest.mark.gpu
@pytest.mark.parametrize("entry,arg,kind,make,exc", NONFINITE_GPU_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in NONFINITE_GPU_CASES])
def test_nonfinite_battery_on_gpu(entry, arg, kind, make, exc):
    """NaN/Inf with every argument on the GPU: the device-side checks (some read their count
    only at a later synchronisation) raise the same error, naming the argument."""
    e = ENTRIES[entry]
    a = {k: _to_gpu_value(v) for k, v in _good_args(e).items()}
    a[arg] = _to_gpu_value(make())
    with pytest.raises(exc, match=r"contains \d+ NaN and \d+ Inf values") as info:
        e.call(a)
    assert re.search(rf"(?<![A-Za-z_]){re.escape(arg)}(?![A-Za-z_])", str(info.value))


def test_counts():
    """Coverage is visible: the battery is at least as large as its design says."""
    n_contradiction = 8 + 2 * 5 + 1 + 9  # test_twell_full_check, test_ell_full_check, hybrid, backup args
    total = len(CASES) + len(PARAM_CASES) + len(STRIDED) * len(LAYOUTS) + len(FILE_CASES) + n_contradiction
    print(f"bad-input battery: {len(ENTRIES)} entry points, {len(CASES)} generated array cases, "
          f"{len(PARAM_CASES)} parameter cases, {len(STRIDED) * len(LAYOUTS)} layout cases, "
          f"{len(FILE_CASES)} file cases, {n_contradiction} component contradictions; total {total}")
    assert len(ENTRIES) >= 25 and len(CASES) >= 250 and total >= 400


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda:99", "cuda:-1", "cuda:x", "gpu"])
def test_to_device_nonexistent_gpu(device):
    A = _cont("twell")
    with pytest.raises(ValueError, match=r"device"):
        A.to_device(device)
    with pytest.raises(ValueError, match=r"device"):
        _saved_then_load(device=device)


# ---- the one NaN/Inf bit table (twellpy._array) --------------------------------------------------
from twellpy._array import bfloat16  # noqa: E402
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_nan_inf_counts_every_16_bit_pattern(dtype):
    from twellpy._array import nan_inf_counts

    vals = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    wide = vals.astype(np.float32)  # ml_dtypes upcast: an independent NaN/Inf test
    assert nan_inf_counts(vals) == (int(np.isnan(wide).sum()), int(np.isinf(wide).sum()))
    assert nan_inf_counts(vals[::7]) == (int(np.isnan(wide[::7]).sum()), int(np.isinf(wide[::7]).sum()))


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64])
def test_check_finite_counts_planted_values(dtype):
    from twellpy._array import check_finite

    rng = np.random.default_rng(7)
    a = rng.standard_normal((37, 53)).astype(dtype)
    assert check_finite(a, "a") is a and check_finite(a[:, ::3], "a") is not None
    flat = a.reshape(-1)
    flat[1 + rng.choice(flat.size - 2, 5, replace=False)] = np.nan  # the two ends get the Infs
    flat[flat.size - 1], flat[0] = np.inf, -np.inf
    with pytest.raises(ValueError, match=r"^a contains 5 NaN and 2 Inf values"):
        check_finite(a, "a")
    view, wide = a[:, ::2], a[:, ::2].astype(np.float64)
    want = rf"^view contains {int(np.isnan(wide).sum())} NaN and {int(np.isinf(wide).sum())} Inf values"
    with pytest.raises(ValueError, match=want):
        check_finite(view, "view")  # a strided view: counted on its own elements only
    assert check_finite(np.arange(6), "ints") is not None  # integers are always finite


@pytest.mark.parametrize("cls", CLASSES)
def test_sparse_operand_of_a_dense_product_is_named(backend, xp, cls):
    # one operand check serves A @ W, W @ A and the ops functions: each names its own argument
    A = cls.from_dense(xp.eye(4, 8, dtype=np.float32))
    S = cls.from_dense(xp.eye(8, 3, dtype=np.float32))
    with pytest.raises(TypeError, match=r"W must be a dense array, got a sparse .*\.toarray\(\)"):
        A @ S
    with pytest.raises(TypeError, match=r"W must be a dense array, got a sparse"):
        S.__rmatmul__(A)
    with pytest.raises(TypeError, match=r"B must be a dense array, got a sparse"):
        tw.ops.spmm(A, S)
    with pytest.raises(TypeError, match=r"B must be a dense array, got a sparse"):
        tw.ops.spmm_t(A, S)
    with pytest.raises(ValueError, match=r"W must be 1-D or 2-D, got 3-D"):
        A @ xp.zeros((8, 2, 2), np.float32)
