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

from _containers import bits_equal, host  # noqa: E402
from twellpy._array import gpu_available  # noqa: E402


def _x46():
    x = np.zeros((4, 6), np.float32)
    x[0, [0, 3]] = [1.0, 2.0]
    x[1, 5] = -1.5
    x[3, [1, 2, 4]] = [0.5, 0.75, -2.0]
    return x


def _cont(fmt):
    cls = {"twell": tw.TwELL, "ell": tw.ELL, "hybrid": tw.Hybrid}[fmt]
    kw = {"tile": 4, "slots": 2} if fmt == "twell" else {}
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
    kind: str = "value"              # "value" (float array), "index" (int32 array), "container", "ctx"
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
        {"A": Arg(lambda f=_fmt: _cont(f), kind="container"),
         "W": Arg(lambda: np.ones((6, 3), np.float32), bad_ndim=lambda: np.ones((6, 3, 1), np.float32),
                  bad_shape=lambda: np.ones((5, 3), np.float32), finite=False)})
    ENTRIES[f"W @ {_cls.__name__}"] = Entry(
        lambda a: a["W"] @ a["A"],
        {"A": Arg(lambda f=_fmt: _cont(f), kind="container"),
         "W": Arg(lambda: np.ones((3, 4), np.float32), bad_ndim=lambda: np.ones((3, 4, 1), np.float32),
                  bad_shape=lambda: np.ones((3, 5), np.float32), finite=False)})

ENTRIES["TwELL(...)"] = Entry(
    lambda a: tw.TwELL(a["values"], a["indices"], a["counts"], shape=(2, 6), tile=4,
                       backup=a["backup"], backup_rows=a["backup_rows"]),
    {"values": Arg(lambda: _twell_parts()[0], bad_ndim=lambda: _twell_parts()[0][0],
                   bad_shape=lambda: np.zeros((2, 3, 2), np.float32)),
     "indices": Arg(lambda: _twell_parts()[1], kind="index", bad_ndim=lambda: _twell_parts()[1][0],
                    bad_shape=lambda: _twell_parts()[1][:, :, :1].copy()),
     "counts": Arg(lambda: _twell_parts()[2], kind="index", bad_ndim=lambda: _twell_parts()[2][0],
                   bad_shape=lambda: _twell_parts()[2][:, :1].copy()),
     "backup": Arg(lambda: np.zeros((0, 6), np.float32), bad_ndim=lambda: np.zeros(6, np.float32),
                   bad_shape=lambda: np.zeros((0, 7), np.float32)),
     "backup_rows": Arg(lambda: np.zeros(0, np.int32), kind="index", bad_ndim=lambda: np.zeros((0, 1), np.int32),
                        bad_shape=lambda: np.zeros(1, np.int32))})
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
            if arg.kind == "ctx":
                add("wrong type", lambda: {"x": 1}, TypeError)
                add("wrong forward", lambda g=("relu" in ename): _train_ctx(not g), ValueError)
                continue
            add("wrong type", lambda: object(), TypeError)
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
