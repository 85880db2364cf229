"""ELL (ELLPACK): every row stores up to W (column, value) pairs."""
from __future__ import annotations

import numpy as np

from . import _array, backends
from ._base import (SparseArray, _as_host, _to_int, check_index_array, check_shape,
                    check_value_array)


def _max_int(a) -> int:
    return int(_as_host(a.max())) if a.size else 0


def resolve_fixed_width(width, row_nnz, n_cols, name="width"):
    """Check a user-given ELL width against the row counts (host ints); a width beyond the
    row length ``n_cols`` is capped there, since no row can hold more (a crafted or
    mistaken width such as 2**40 would otherwise allocate M x width slots of padding)."""
    widest = _max_int(row_nnz)
    if width is None:
        return widest
    w = _to_int(width, name)
    if w < 0:
        raise ValueError(f"{name} must be non-negative, got {w}")
    if w < widest:
        n_wide = int(_as_host((row_nnz > w).sum()))
        raise ValueError(f"{name}={w} is too small: {n_wide} rows have more than {w} non-zeros, "
                         f"the widest has {widest}; pass width>={widest} or use Hybrid")
    return min(w, max(int(n_cols), widest))


class ELL(SparseArray):
    """ELLPACK sparse array: (M, W) slot lists, one per row.

    Parameters
    ----------
    values : array, (M, W)
        float16, bfloat16, float32 or float64 values; 0 in padding slots.
    indices : array, (M, W), int32
        Column of each stored value, sorted ascending within a row and packed
        at the front; -1 in padding.
    row_nnz : array, (M,), int32
        Number of stored entries of each row (``<= W``).
    shape : tuple (M, N)
    check : bool or "full"
        ``True`` (default) validates shapes, dtypes and devices and scans the
        contents (vectorised, linear in the size of the arrays; on the GPU one
        device reduction): counts within [0, W], the indices of used slots in
        range and sorted, padding exactly (0, -1), backup rows without slot
        entries; contradicting arrays raise ``ValueError`` naming the argument
        and the first bad position. ``"full"`` is the same (the name is kept
        for compatibility). ``False`` trusts the caller and skips all of it:
        only for arrays that are known to be consistent (e.g. built by
        twellpy itself); kernels then read whatever is there.
    check_finite : bool
        Reject NaN/Inf in ``values`` (``ValueError``).

    Notes
    -----
    ``W`` is the widest row unless a width is requested; an all-zero matrix
    has ``W = 0``. Padding is (value 0, index -1), written always so the same
    input gives the same bits.
    """

    format = "ell"
    _array_names = ("values", "indices", "row_nnz")

    def __init__(self, values, indices, row_nnz, *, shape, check=True, check_finite=True):
        self._validate_check(check)
        m, n = check_shape(shape)
        if check:
            values = check_value_array(values, "values", 2)
            if values.shape[0] != m:
                raise ValueError(f"values has shape {tuple(values.shape)}, expected ({m}, W) for shape {(m, n)}")
            w = values.shape[1]
            indices = check_index_array(indices, "indices", 2, shape=(m, w))
            row_nnz = check_index_array(row_nnz, "row_nnz", 1, shape=(m,))
            _array.same_device([("values", values), ("indices", indices), ("row_nnz", row_nnz)])
        self.values, self.indices, self.row_nnz = values, indices, row_nnz
        self._shape = (m, n)
        self._finish_init(check, check_finite)

    @property
    def width(self) -> int:
        """Slots per row, W."""
        return int(self.values.shape[1])

    def _params(self):
        return {"width": self.width}

    def _slots(self):
        return self.values, self.indices

    def _row_counts(self):
        return self.row_nnz

    @classmethod
    def _init_from_components(cls, d, check, check_finite):
        try:
            obj = cls(d["values"], d["indices"], d["row_nnz"], shape=d["shape"], check=check,
                      check_finite=check_finite)
        except KeyError as e:
            raise ValueError(f"components of an ELL need {e.args[0]!r}") from None
        if check and "width" in d and _to_int(d["width"], "width") != obj.width:
            raise ValueError(f"width is {d['width']}, expected {obj.width} (values.shape[1])")
        return obj

    @classmethod
    def from_dense(cls, x, *, width=None, check_finite=True):
        """Build from a dense (M, N) array.

        Parameters
        ----------
        x : array
            numpy, cupy or any ``__dlpack__`` object; float16, bfloat16,
            float32 or float64.
        width : int, optional
            Slots per row; default the widest row. A smaller width than the
            widest row raises ``ValueError`` (use :class:`Hybrid` instead); a
            larger one than N is capped at N.
        check_finite : bool
            Reject NaN/Inf in ``x``.
        """
        return super().from_dense(x, width=width, check_finite=check_finite)

    @classmethod
    def from_scipy(cls, m, *, width=None, dtype=None, check_finite=True):
        """Build from a scipy.sparse array/matrix; see :meth:`SparseArray.from_scipy`.

        Parameters
        ----------
        m : scipy.sparse array or matrix
            (M, N) matrix; float32 or float64 (integers only with ``dtype``).
        width : int, optional
            Slots per row; default the widest row. A smaller width than the
            widest row raises ``ValueError`` (use :class:`Hybrid` instead); a
            larger one than N is capped at N.
        dtype : dtype, optional
            Value dtype (float16, bfloat16, float32 or float64); default that of ``m``.
        check_finite : bool
            Reject NaN/Inf values.
        """
        return super().from_scipy(m, width=width, dtype=dtype, check_finite=check_finite)

    @classmethod
    def _from_dense_xp(cls, x, width=None, check_finite=False):
        be = backends.get(x)
        row_nnz = cls._dense_row_nnz(x, check_finite)
        w = resolve_fixed_width(width, row_nnz, x.shape[1])
        values, indices = be.dense_to_ell(x, w, row_nnz)
        return cls(values, indices, row_nnz, shape=x.shape, check=False, check_finite=False)

    @classmethod
    def _from_csr(cls, indptr, indices, data, shape, width=None):
        row_nnz = (indptr[1:] - indptr[:-1]).astype(np.int32)
        w = resolve_fixed_width(width, row_nnz, shape[1])
        values, idx, row_nnz = backends.get(data).csr_to_ell(indptr, indices, data, w)
        return cls(values, idx, row_nnz, shape=shape, check=False, check_finite=False)

    def _check_slots_full(self, quick=False):
        xp = self.xp
        m, n = self.shape
        lo = xp.zeros(m, np.int64)
        hi = xp.full(m, n, np.int64)
        return self._check_slot_lists(self.values, self.indices, self.row_nnz, lo, hi,
                                      lambda p: f"row {p[0]}", "row_nnz", quick=quick)
