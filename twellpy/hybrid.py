"""Hybrid: an ELL part of width W plus dense backup rows for every wider row.

Width strategies (modelled on Ginkgo's ``hybrid::strategy_type``)
-----------------------------------------------------------------
``width`` accepts:

* an ``int`` n, or ``"fixed:n"``: W = min(n, N) (a row holds at most N entries).
* ``"quantile:p"`` (0 <= p <= 1): W is the row-nnz value at fraction p of the
  rows sorted by nnz, rounded up: ``sorted(row_nnz)[ceil(p*M) - 1]`` (p = 0
  gives the smallest row, p = 1 the widest; ``M = 0`` gives W = 0).
* ``"min_storage"``: the W (among 0 and every distinct row-nnz value) that
  minimises the bytes of ELL slots plus backup rows,
  ``M*W*(itemsize + 4) + R(W)*(N*itemsize + 4)``, where R(W) is the number of
  rows with more than W non-zeros. Ties go to the smaller W.
* ``"auto"`` (default): ``max(min_storage, quantile:0.9)``. min_storage alone
  can push many rows to dense backup when N is small; the quantile term
  (``sorted(row_nnz)[ceil(0.9*M) - 1]``) keeps at least 90% of the rows,
  ``ceil(0.9*M)`` of them, in the sparse ELL part, so products stay sparse,
  while the few widest rows (at most 10%) may still go to backup when that
  saves storage.

Whatever W is, no row is ever dropped: every row with more than W non-zeros
is stored, exactly, as a dense row in ``backup``.
"""
from __future__ import annotations

import math

import numpy as np

from . import _array, backends
from ._base import (SparseArray, _as_host, _to_int, backup_parts, check_index_array, check_shape,
                    check_value_array, csr_rows_to_dense, dense_backup_rows)


def quantile_width(row_nnz, p):
    """``sorted(row_nnz)[ceil(p*M) - 1]`` (0 for M = 0): the narrowest width that keeps
    ``ceil(p*M)`` rows, at least a fraction ``p``, in the ELL part. The Hybrid
    constructors and the training step both use it, so ``"quantile:p"`` means one
    thing everywhere. From a histogram: counts are small non-negative integers."""
    counts = np.asarray(_as_host(row_nnz), dtype=np.int64).ravel()
    if counts.size == 0:
        return 0
    return quantile_width_from_cumulative(np.cumsum(np.bincount(counts)), p)


def quantile_width_from_cumulative(rows_upto, p):
    """:func:`quantile_width` from ``rows_upto[w]``, the rows with at most ``w``
    non-zeros (the cumulative histogram of the counts; ``rows_upto[-1]`` is M >= 1)."""
    m = int(rows_upto[-1])
    rank = min(max(math.ceil(p * m) - 1, 0), m - 1)  # index into the sorted counts
    return int(np.searchsorted(rows_upto, rank, side="right"))


def _min_storage_width(sorted_nnz, n_cols, itemsize):
    m = sorted_nnz.shape[0]
    if m == 0:
        return 0
    cand = np.unique(np.concatenate([[0], sorted_nnz])).astype(np.int64)
    n_backup = m - np.searchsorted(sorted_nnz, cand, side="right")
    cost = m * cand * (itemsize + 4) + n_backup * (n_cols * itemsize + 4)
    return int(cand[int(np.argmin(cost))])  # argmin takes the first (smallest W) on ties


def parse_width(width, name="width"):
    """Normalise a width argument; returns an int or a canonical strategy string.

    ``name`` is the argument named in errors (``width`` or ``width_strategy``).
    """
    if isinstance(width, str):
        w = width.strip()
        if w in ("auto", "min_storage"):
            return w
        kind, _, arg = w.partition(":")
        if kind == "fixed" and arg:
            try:
                n = int(arg)
            except ValueError:
                n = -1
            if n >= 0:
                return n
            raise ValueError(f"{name}={width!r}: 'fixed:n' needs a non-negative integer n")
        if kind == "quantile" and arg:
            try:
                p = float(arg)
            except ValueError:
                p = -1.0
            if 0.0 <= p <= 1.0:
                return f"quantile:{p!r}"
            raise ValueError(f"{name}={width!r}: 'quantile:p' needs 0 <= p <= 1")
        raise ValueError(f"{name}={width!r} is not understood; expected an int, 'fixed:n', "
                         f"'quantile:p', 'min_storage' or 'auto'")
    n = _to_int(width, name)
    if n < 0:
        raise ValueError(f"{name} must be non-negative, got {n}")
    return n


def choose_width(row_nnz, n_cols, itemsize, width="auto"):
    """ELL width W for the row counts ``row_nnz`` (any array) and strategy ``width``.

    See the module docstring for the strategies.
    """
    strat = parse_width(width)
    if isinstance(strat, int):
        # a row holds at most n_cols entries: a wider ELL part would only allocate padding
        # (a width strategy read from a file could otherwise ask for any amount of memory)
        return min(strat, int(n_cols))
    s = np.sort(np.asarray(_as_host(row_nnz), dtype=np.int64))
    if strat == "min_storage":
        return _min_storage_width(s, n_cols, itemsize)
    if strat == "auto":
        # quantile:0.9 is the narrowest width that keeps ceil(0.9*M) rows, at least 90%, sparse
        return max(_min_storage_width(s, n_cols, itemsize), quantile_width(s, 0.9))
    return quantile_width(s, float(strat.split(":", 1)[1]))


class Hybrid(SparseArray):
    """ELL part of width W plus exact dense backup rows for rows wider than W.

    Parameters
    ----------
    values : array, (M, W)
        ELL values; 0 in padding.
    indices : array, (M, W), int32
        Columns, sorted within a row, -1 in padding.
    row_nnz : array, (M,), int32
        Entries in the ELL part of each row; 0 for backup rows.
    shape : tuple (M, N)
    backup : array, (R, N), optional
        Dense backup rows (same dtype as ``values``).
    backup_rows : array, (R,), int32, optional
        Sorted row ids stored in ``backup``.
    width_strategy : int or str, optional
        Strategy used by :attr:`T` and conversions to rebuild (default W).
    check : bool or "full"
        See :class:`ELL`.
    check_finite : bool
        Reject NaN/Inf in ``values``/``backup``.

    Notes
    -----
    See the :mod:`twellpy.hybrid` module docstring for the width strategies.
    """

    format = "hybrid"
    _array_names = ("values", "indices", "row_nnz", "backup", "backup_rows", "row_map")

    def __init__(self, values, indices, row_nnz, *, shape, backup=None, backup_rows=None,
                 row_map=None, width_strategy=None, check=True, check_finite=True):
        self._validate_check(check)
        m, n = check_shape(shape)
        if check:
            values = check_value_array(values, "values", 2)
            if values.shape[0] != m:
                raise ValueError(f"values has shape {tuple(values.shape)}, expected ({m}, W) for shape {(m, n)}")
            w = values.shape[1]
            indices = check_index_array(indices, "indices", 2, shape=(m, w))
            row_nnz = check_index_array(row_nnz, "row_nnz", 1, shape=(m,))
            xp = _array.xp_of(values)
            backup, backup_rows, row_map = backup_parts(xp, values.dtype, m, n, backup, backup_rows, row_map)
            _array.same_device([("values", values), ("indices", indices), ("row_nnz", row_nnz),
                                ("backup", backup), ("backup_rows", backup_rows)])
        elif row_map is None or backup is None:
            backup, backup_rows, row_map = backup_parts(_array.xp_of(values), values.dtype, m, n,
                                                        backup, backup_rows)
        self.values, self.indices, self.row_nnz = values, indices, row_nnz
        self.backup, self.backup_rows, self.row_map = backup, backup_rows, row_map
        self._shape = (m, n)
        self.width_strategy = (parse_width(self.values.shape[1]) if width_strategy is None
                               else parse_width(width_strategy, "width_strategy"))
        self._finish_init(check, check_finite)

    @property
    def width(self) -> int:
        """Slots per row of the ELL part, W."""
        return int(self.values.shape[1])

    def _params(self):
        return {"width": self.width, "width_strategy": self.width_strategy}

    def _transpose_params(self):
        return {"width": self.width_strategy}

    def _slots(self):
        return self.values, self.indices

    def _row_counts(self):
        return self.row_nnz

    @classmethod
    def _init_from_components(cls, d, check, check_finite):
        try:
            strat = d.get("width_strategy")
            if strat is not None and not isinstance(strat, (str, int)):
                strat = strat.item() if hasattr(strat, "item") else strat
            obj = cls(d["values"], d["indices"], d["row_nnz"], shape=d["shape"], backup=d.get("backup"),
                      backup_rows=d.get("backup_rows"), row_map=d.get("row_map") if check else None,
                      width_strategy=strat, check=check, check_finite=check_finite)
        except KeyError as e:
            raise ValueError(f"components of a Hybrid need {e.args[0]!r}") from None
        if check and "width" in d and _to_int(d["width"], "width") != obj.width:
            raise ValueError(f"width is {d['width']}, expected {obj.width} (values.shape[1])")
        return obj

    @classmethod
    def from_dense(cls, x, *, width="auto", check_finite=True):
        """Build from a dense (M, N) array.

        Parameters
        ----------
        x : array
            numpy, cupy or any ``__dlpack__`` object.
        width : int or str
            ELL width or strategy (``"auto"``, ``"min_storage"``,
            ``"quantile:p"``, ``"fixed:n"``); see :mod:`twellpy.hybrid`.
        check_finite : bool
            Reject NaN/Inf in ``x``.
        """
        return super().from_dense(x, width=width, check_finite=check_finite)

    @classmethod
    def from_scipy(cls, m, *, width="auto", dtype=None, check_finite=True):
        """Build from a scipy.sparse array/matrix; see :meth:`SparseArray.from_scipy`.

        Parameters
        ----------
        m : scipy.sparse array or matrix
            (M, N) matrix; float32 or float64 (integers only with ``dtype``).
        width : int or str
            ELL width or strategy (``"auto"``, ``"min_storage"``,
            ``"quantile:p"``, ``"fixed:n"``); see :mod:`twellpy.hybrid`.
        dtype : dtype, optional
            Value dtype (float16, bfloat16, float32 or float64); default that of ``m``.
        check_finite : bool
            Reject NaN/Inf values.
        """
        return super().from_scipy(m, width=width, dtype=dtype, check_finite=check_finite)

    @classmethod
    def _from_dense_xp(cls, x, width="auto", check_finite=False):
        xp = _array.xp_of(x)
        m, n = x.shape
        be = backends.get(x)
        row_nnz = cls._dense_row_nnz(x, check_finite)
        w = choose_width(row_nnz, n, x.dtype.itemsize, width)
        values, indices = be.dense_to_ell(x, w, row_nnz)
        over = row_nnz > w
        backup_rows = xp.nonzero(over)[0].astype(np.int32)
        backup = dense_backup_rows(x, backup_rows)  # -0.0 becomes +0.0, as in the slots
        row_nnz = xp.where(over, 0, row_nnz).astype(np.int32)
        return cls(values, indices, row_nnz, shape=(m, n), backup=backup, backup_rows=backup_rows,
                   width_strategy=width, check=False, check_finite=False)

    @classmethod
    def _from_csr(cls, indptr, indices, data, shape, width="auto"):
        xp = _array.xp_of(data)
        m, n = shape
        true_nnz = (indptr[1:] - indptr[:-1]).astype(np.int32)
        w = choose_width(true_nnz, n, data.dtype.itemsize, width)
        values, idx, row_nnz = backends.get(data).csr_to_ell(indptr, indices, data, w)
        over = row_nnz > w
        backup_rows = xp.nonzero(over)[0].astype(np.int32)
        r = int(backup_rows.shape[0])
        row_map = xp.full(m, -1, np.int32)
        row_map[backup_rows] = xp.arange(r, dtype=np.int32)
        backup = csr_rows_to_dense(indptr, indices, data, row_map, r, n)
        row_nnz = xp.where(over, 0, row_nnz).astype(np.int32)
        return cls(values, idx, row_nnz, shape=(m, n), backup=backup, backup_rows=backup_rows,
                   row_map=row_map, width_strategy=width, check=False, check_finite=False)

    def _check_slots_full(self, quick=False):
        xp = self.xp
        m, n = self.shape
        lo = xp.zeros(m, np.int64)
        hi = xp.full(m, n, np.int64)
        return self._check_slot_lists(self.values, self.indices, self.row_nnz, lo, hi,
                                      lambda p: f"row {p[0]}", "row_nnz", quick=quick)
