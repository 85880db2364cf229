"""Shared base of the padded sparse containers (ELL, TwELL, Hybrid).

Everything that does not depend on the storage layout lives here: conversions
through the CSR hub, products with dense arrays, element-wise value maps
(written once through :meth:`SparseArray._with_data`), device moves,
persistence hooks and the two levels of validation.

A format subclass provides:

* ``format`` (name), ``_array_names`` (component arrays, in order);
* ``_params()`` -> dict of scalar parameters (``tile``, ``width`` ...);
* ``_slots()`` -> ``(values, indices)`` flattened to (M, K) slot lists;
* ``_row_counts()`` -> stored slot entries per row, (M,) int32;
* ``_from_csr(indptr, indices, data, shape, **params)`` (classmethod);
* ``_from_dense_xp(x, **params)`` (classmethod, numpy/cupy input);
* ``_check_slots_full()`` (format-specific content scan);
* ``_init_from_components(d, check, check_finite)`` (classmethod).

It may override ``_spmm``, ``_spmm_t`` and ``_transpose_slots`` to use
format-specific backend fast paths (e.g. ``twell_spmm``); those are looked up
with ``getattr`` so a backend without them falls back to the generic
``slots_*`` functions of the contract.

Formats with dense backup rows keep them in ``backup`` (R, N),
``backup_rows`` (R,) and ``row_map`` (M,); ELL has R = 0 always.
"""
from __future__ import annotations

import inspect
import math
import numbers

import numpy as np

from . import _array
from ._array import FLOAT_DTYPES, INDEX_DTYPE, bfloat16
from . import backends

INT32_MAX = 2**31 - 1

# Internal ``check`` value: the O(1) checks of ``check=True`` without its content
# scan (check_format(full_check=False), and before the detailed scan).
_SHAPES_ONLY = object()

_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_MASK = {2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FFFFFFFFFFFFFFF}


class TileOverflowError(ValueError):
    """A TwELL (row, tile) holds more non-zeros than ``slots`` and ``overflow="raise"``.

    The message names the worst (row, tile), its count and a ``slots`` value
    that is sufficient for the whole matrix.
    """


# ----------------------------------------------------------------------------
# small helpers (numpy and cupy alike)
# ----------------------------------------------------------------------------
def _bits(a):
    return a.view(_BITS[a.dtype.itemsize])


def reduction_axis(axis, what):
    """``axis`` of a 2-D reduction as None, 0 or 1 (-2 and -1 accepted), or a
    TypeError/ValueError naming it; ``what`` names the collection."""
    if axis is None:
        return None
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be None, 0 or 1, got {axis!r}")
    if int(axis) not in (-2, -1, 0, 1):
        raise ValueError(f"axis {int(axis)} is out of range for a 2-D {what}; "
                         f"expected None, 0 (per column) or 1 (per row)")
    return int(axis) % 2


def whole_rows_key(key, n_cols, what):
    """The row part of an index that selects whole rows (``key`` or
    ``(key, <a slice over all n_cols columns>)``); TypeError for anything that
    selects columns. ``what`` names the collection."""
    if not isinstance(key, tuple):
        return key
    if len(key) == 2 and isinstance(key[1], slice) and key[1].indices(n_cols) == (0, n_cols, 1):
        return key[0]
    raise TypeError(f"{what} indexing selects whole rows only (A[rows] or A[rows, :]), got the "
                    f"index {key!r}; for columns use A.to_scipy() or A.toarray()")


def nonzero_mask(a):
    """Boolean array: ``a != 0`` on the bit pattern (NaN true, -0.0 false)."""
    b = _bits(a)
    return (b & b.dtype.type(_MASK[a.dtype.itemsize])) != 0


def _count_nonzero(a) -> int:
    if a is None or a.size == 0:
        return 0
    xp = _array.xp_of(a)
    return int(xp.count_nonzero(nonzero_mask(a)))


def result_dtype(a, b):
    """Dtype of a product of ``a`` and ``b`` values (bfloat16 aware).

    Equal dtypes stay; float64 wins; any other mix (two different 16-bit
    types, or 16-bit with float32) gives float32.
    """
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    if np.dtype(np.float64) in (a, b):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def _value_dtype(dtype, name):
    """``dtype`` as one of the value dtypes, or a TypeError naming ``name``."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} {dtype!r} is not a dtype") from None
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be one of {', '.join(str(d) for d in FLOAT_DTYPES)}, got {dt}")
    return dt


def _acc(dtype):
    return _array.accum_dtype(dtype)


def cast(a, dtype):
    """``a`` in value dtype ``dtype`` (``a`` itself when it already is).

    Uses the backend's ``astype`` when it has one (the CUDA backend's works
    for bfloat16 on every CuPy version), else the array's own ``astype``.
    """
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    fast = getattr(backends.get(a), "astype", None)
    return fast(a, dtype) if fast is not None else a.astype(dtype)


def _sign_bit(a):
    return _bits(a).dtype.type(1 << (8 * a.dtype.itemsize - 1))


def _as_host(a):
    if a is None:
        return None
    return a.get() if _array.is_cupy(a) else np.asarray(a)


def _to_int(v, name):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    return int(v)


def check_shape(shape, name="shape"):
    """Validate a 2-D shape; returns a tuple of two Python ints."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be a tuple (M, N), got {shape!r}") from None
    if len(dims) != 2:
        raise ValueError(f"{name} must have 2 entries (M, N), got {dims!r}")
    m, n = (_to_int(d, name) for d in dims)
    if m < 0 or n < 0:
        raise ValueError(f"{name} must be non-negative, got {(m, n)}")
    if n > INT32_MAX or m > INT32_MAX:
        raise ValueError(f"{name}={(m, n)} exceeds the int32 index range (max {INT32_MAX})")
    return (m, n)


def positive_int(v, name):
    v = _to_int(v, name)
    if v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v}")
    return v


def check_index_array(a, name, ndim, shape=None):
    """Validate an int32 index component (dtype, ndim, shape)."""
    a, _ = _array.as_array(a, name, ndim=ndim)
    if a.dtype != INDEX_DTYPE:
        raise TypeError(f"{name} has dtype {a.dtype}, expected int32")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    return _array.contiguous(a, name)


def check_value_array(a, name, ndim, shape=None, dtype=None):
    """Validate a value component (float dtype, ndim, shape, dtype match)."""
    a, _ = _array.as_array(a, name, ndim=ndim)
    _array.check_float(a, name)
    if dtype is not None and a.dtype != dtype:
        raise TypeError(f"{name} has dtype {a.dtype}, expected {dtype} (the dtype of values)")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    return _array.contiguous(a, name)


def backup_parts(xp, values_dtype, n_rows, n_cols, backup, backup_rows, row_map=None):
    """Validate or default the backup triple; returns ``(backup, backup_rows, row_map)``.

    The row ids are checked always (O(R), and ``row_map`` is built from them):
    sorted, unique, within [0, M).
    """
    if backup is None and backup_rows is None:
        backup = xp.zeros((0, n_cols), values_dtype)
        backup_rows = xp.zeros(0, INDEX_DTYPE)
    elif backup is None or backup_rows is None:
        missing = "backup" if backup is None else "backup_rows"
        raise ValueError(f"{missing} is None but the other backup array was given; "
                         f"pass both backup and backup_rows or neither")
    else:
        backup_rows = check_index_array(backup_rows, "backup_rows", 1)
        r = backup_rows.shape[0]
        backup = check_value_array(backup, "backup", 2, dtype=values_dtype)
        if tuple(backup.shape) != (r, n_cols):
            raise ValueError(f"backup has shape {tuple(backup.shape)}, expected {(r, n_cols)}: one row "
                             f"of length N = {n_cols} per backup_rows entry ({r})")
        if r:
            br = _as_host(backup_rows)
            if br.min() < 0 or br.max() >= n_rows:
                bad = int(br[(br < 0) | (br >= n_rows)][0])
                raise ValueError(f"backup_rows holds row id {bad}, expected ids in [0, {n_rows})")
            if r > 1 and not (np.diff(br) > 0).all():
                k = int(np.nonzero(np.diff(br) <= 0)[0][0])
                raise ValueError(f"backup_rows must be sorted ascending without repeats, "
                                 f"got backup_rows[{k}]={br[k]} then backup_rows[{k + 1}]={br[k + 1]}")
    xp_b = _array.xp_of(backup_rows)
    computed = xp_b.full(n_rows, -1, INDEX_DTYPE)
    if backup_rows.shape[0]:
        computed[backup_rows] = xp_b.arange(backup_rows.shape[0], dtype=INDEX_DTYPE)
    if row_map is not None:
        row_map = check_index_array(row_map, "row_map", 1, shape=(n_rows,))
        if not bool((row_map == computed).all()):
            raise ValueError("row_map is inconsistent with backup_rows: row_map[r] must be the "
                             "position of row r in backup_rows, or -1")
    return backup, backup_rows, computed


def _is_real_scalar(v, name):
    """Whether ``v`` is a real scalar operand: a real number or a 0-d numpy/cupy array, torch
    tensor or JAX array of a real dtype, as for numpy and scipy.sparse. TypeError naming ``name`` for a complex or
    boolean one: ``numpy.complex64`` is no Python ``complex``, and ``float()`` of it would
    drop the imaginary part with only a warning."""
    if isinstance(v, bool):
        return False  # Python's own "unsupported operand" error names both types
    if (isinstance(v, np.ndarray) or _array.is_cupy(v)) and v.ndim == 0:
        kind = "f" if v.dtype == bfloat16 else v.dtype.kind
    elif isinstance(v, np.generic):
        kind = "f" if v.dtype == bfloat16 else v.dtype.kind
    elif getattr(v, "ndim", None) == 0 and (_array._torch_kind(v) or _array._jax_kind(v)):
        # a 0-d torch tensor or JAX array scales like a 0-d numpy array (float() reads it)
        dt = _array.as_array(v, name)[0].dtype
        kind = "f" if dt == bfloat16 else dt.kind
    elif isinstance(v, numbers.Number):
        kind = "f" if isinstance(v, numbers.Real) or not isinstance(v, numbers.Complex) else "c"
    else:
        return False
    if kind not in "fiu":
        what = "complex" if kind == "c" else ("boolean" if kind == "b" else "non-numeric")
        raise TypeError(f"{name} must be a real number, got the {what} {type(v).__name__} {v!r}; "
                        f"containers hold real values only")
    return True


def _is_array_like(v):
    """Whether ``v`` offers its data as an array (numpy, CuPy, DLPack producers)."""
    return hasattr(v, "__array__") or hasattr(v, "__dlpack__") or hasattr(v, "__cuda_array_interface__")


def _refuse_dense(v, op):
    """TypeError for ``A <op> W`` with a dense array ``W``: numpy's own error ("operand does
    not support ufuncs") names neither ``W`` nor the method that does the product."""
    if isinstance(v, SparseArray) or hasattr(v, "tocsr"):
        return
    if _is_array_like(v):
        shape = getattr(v, "shape", None)
        raise TypeError(f"A {op} W with a dense array W ({type(v).__module__}.{type(v).__name__} of shape "
                        f"{tuple(shape) if shape is not None else '?'}) is not supported; use "
                        f"A.multiply(W) for the element-wise product (it keeps A's pattern) or A @ W "
                        f"for the matrix product")


def _first_true(mask):
    """Index tuple of the first True entry of ``mask`` (host ints)."""
    xp = _array.xp_of(mask)
    pos = _as_host(xp.argwhere(mask)[0])
    return tuple(int(p) for p in pos)


def _prepare_scipy(m, name="m", *, cast=False):
    """CSR arrays from any scipy.sparse array/matrix: duplicates summed, explicit zeros dropped.

    ``cast``: the caller casts the values to a float dtype afterwards, so
    integer data is accepted too.
    """
    import scipy.sparse as sp

    if not sp.issparse(m):
        raise TypeError(f"{name} must be a scipy.sparse array or matrix, got {type(m).__module__}.{type(m).__name__}")
    if m.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got {m.ndim}-D")
    if m.dtype not in FLOAT_DTYPES and not (cast and m.dtype.kind in "iu"):
        raise TypeError(f"{name} has dtype {m.dtype}, expected one of float16, bfloat16, float32, float64 "
                        f"(or integers together with dtype=...); convert first, e.g. "
                        f"{name}.astype(numpy.float32), or pass dtype=numpy.float32")
    csr = sp.csr_array(m, copy=True)
    csr.sum_duplicates()   # also sorts the column indices
    csr.eliminate_zeros()  # exact: an explicit zero adds nothing to the matrix
    return csr


# ----------------------------------------------------------------------------
# the base class
# ----------------------------------------------------------------------------
def dense_operand(x, name, ndim_ok=(2,)):
    """``x`` as a float array of one of the dimensions ``ndim_ok``, and its caller kind.

    The one operand check of every sparse-dense product (``A @ W``, ``W @ A``,
    :func:`twellpy.ops.spmm`, :func:`twellpy.ops.sddmm` ...); it names ``name`` in its errors.
    """
    if isinstance(x, SparseArray):
        raise TypeError(f"{name} must be a dense array, got a sparse {type(x).__name__}; sparse @ sparse "
                        f"is not supported (convert one side with .toarray())")
    arr, kind = _array.as_array(x, name)
    if arr.ndim not in ndim_ok:
        want = " or ".join(f"{d}-D" for d in ndim_ok)
        raise ValueError(f"{name} must be {want}, got {arr.ndim}-D array of shape {tuple(arr.shape)}")
    _array.check_float(arr, name)
    return arr, kind


class SparseArray:
    """Base of :class:`twellpy.ELL`, :class:`twellpy.TwELL` and :class:`twellpy.Hybrid`.

    Containers are immutable by convention: every operation returns a new
    container (component arrays may be shared between containers, so do not
    write into the arrays returned by :meth:`components`).
    """

    format: str = ""
    _array_names: tuple = ()
    # numpy defers ``ndarray @ container`` to __rmatmul__; cupy checks the priority.
    __array_ufunc__ = None
    __array_priority__ = 100.0

    backup = None
    backup_rows = None
    row_map = None

    # -- basic attributes -----------------------------------------------------
    @property
    def shape(self) -> tuple:
        """(M, N)."""
        return self._shape

    @property
    def ndim(self) -> int:
        return 2

    @property
    def dtype(self):
        """Value dtype."""
        return self.values.dtype

    @property
    def xp(self):
        """numpy or cupy: the module owning the component arrays."""
        return _array.xp_of(self.values)

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        return _array.device_of(self.values)

    @property
    def n_backup(self) -> int:
        """Number R of rows stored densely in ``backup``."""
        return 0 if self.backup_rows is None else int(self.backup_rows.shape[0])

    @property
    def nnz(self) -> int:
        """Stored entries: slot entries (sum of counts) plus the non-zeros of the backup rows.

        Slot entries count even when their value is zero (e.g. after ``A * 0``
        or a cast that underflows), as scipy's ``nnz`` counts explicit zeros;
        a dense backup row cannot tell a stored zero from an absent one, so
        only its non-zeros count. The two can therefore differ between
        formats after such operations; :meth:`count_nonzero` never does.
        """
        if self._nnz is None:
            self._nnz = int(self._row_counts().sum()) + _count_nonzero(self.backup)
        return self._nnz

    @property
    def nbytes(self) -> int:
        """Bytes held by all component arrays (padding and backup included)."""
        return int(sum(getattr(self, k).nbytes for k in self._array_names))

    def _backend(self):
        return backends.get(self.values)

    def __repr__(self):
        m, n = self.shape
        extra = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        if self.backup is not None:
            extra += f", backup_rows={self.n_backup}"
        return (f"<{type(self).__name__} {m}x{n} {self.dtype}, nnz={self.nnz}, device={self.device}, "
                f"{extra}>")

    def __len__(self):
        raise TypeError(f"len() of a {type(self).__name__} is ambiguous; use .shape")

    def __bool__(self):
        # without this, Python would ask __len__ and complain about len()
        raise TypeError(f"the truth value of a {type(self).__name__} is ambiguous; test A.nnz, "
                        f"A.count_nonzero() or A.shape instead")

    def __iter__(self):
        # without this, Python would iterate through __getitem__ with 0, 1, 2, ...
        raise TypeError(f"a {type(self).__name__} is not iterable; select rows with A[i:j] or A[[i, j]], "
                        f"or convert with A.toarray()")

    def __contains__(self, item):
        raise TypeError(f"'in' is not defined for a {type(self).__name__}; compare A.toarray() instead")

    # scipy.sparse and numpy compare element-wise; the default (identity) would answer
    # A == A.copy() with False in silence, so comparisons with a matrix or a number raise.
    # Anything else (None, a string ...) still compares unequal, and hashing stays by identity.
    __hash__ = object.__hash__

    def __eq__(self, other):
        return self._compare(other, "==")

    def __ne__(self, other):
        return self._compare(other, "!=")

    def _compare(self, other, op):
        if (isinstance(other, (SparseArray, numbers.Number, np.generic)) or hasattr(other, "tocsr")
                or _is_array_like(other)):
            raise TypeError(f"A {op} B is not defined for a {type(self).__name__} (got B of type "
                            f"{type(other).__module__}.{type(other).__name__}): element-wise comparisons "
                            f"are not offered; compare dense values, e.g. A.toarray() {op} B.toarray(), "
                            f"or test A is B for identity")
        return NotImplemented

    # -- components / construction ------------------------------------------
    def components(self) -> dict:
        """Component arrays and parameters.

        Returns
        -------
        dict
            ``{"format", "shape", <arrays by name>, <params>}``; accepted by
            :meth:`from_components` and :func:`twellpy.save`. The arrays are
            the container's own (not copies).
        """
        d = {"format": self.format, "shape": self.shape}
        for k in self._array_names:
            d[k] = getattr(self, k)
        d.update(self._params())
        return d

    @classmethod
    def from_components(cls, d, *, check=True, check_finite=True):
        """Rebuild a container from :meth:`components` output.

        Parameters
        ----------
        d : dict
            Must hold ``"format"``; the format's arrays and parameters.
        check : bool or "full"
            ``True`` (default): validate shapes, dtypes and devices and scan
            the contents as :meth:`check_format` with ``full_check=True``
            does (vectorised, linear in the size of the arrays); ``"full"``:
            the same; ``False``: trust the caller.
        check_finite : bool
            Reject NaN/Inf in the value arrays.
        """
        from . import ell, hybrid, twell

        fmt = d.get("format") if isinstance(d, dict) else None
        if not isinstance(d, dict):
            raise TypeError(f"d must be a dict from components(), got {type(d).__name__}")
        classes = {"ell": ell.ELL, "twell": twell.TwELL, "hybrid": hybrid.Hybrid}
        if fmt not in classes:
            raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(classes)}")
        target = classes[fmt]
        if cls is not SparseArray and cls is not target:
            raise ValueError(f"components describe format {fmt!r}, not {cls.format!r}")
        return target._init_from_components(d, check=check, check_finite=check_finite)

    @staticmethod
    def _validate_check(check):
        if check is _SHAPES_ONLY:
            return
        if check not in (True, False, "full"):
            raise ValueError(f"check must be True, False or 'full', got {check!r}")

    def _finish_init(self, check, check_finite):
        self._nnz = None
        if check_finite:
            _array.check_finite(self.values, "values")
            if self.backup is not None:
                _array.check_finite(self.backup, "backup")
        if check and check is not _SHAPES_ONLY:
            self._check_contents()

    def _check_contents(self):
        """The content scan of ``check=True``: vectorised, one host sync when all is well.

        Component arrays that contradict each other (counts outside
        [0, slots], indices out of range or not sorted, padding that is not
        (0, -1), a backup row with slot entries) would make the kernels read
        out of bounds or give wrong results; the detailed scan of
        :meth:`check_format` names the first offence.
        """
        bad = self._check_slots_full(quick=True)
        if self.n_backup:
            bad = bad | (self._row_counts()[self.backup_rows] != 0).any()
        if bool(bad):
            self._check_slots_full()
            self._check_backup_rows_empty()
            raise AssertionError("content scan flagged a problem the detailed scan did not find")  # pragma: no cover

    @classmethod
    @_array.quiet_underflow
    def from_dense(cls, x, *, check_finite=True, **params):
        """Build from a dense 2-D array (numpy, cupy, or any ``__dlpack__`` object).

        Only non-zero entries are stored (NaN counts as non-zero, -0.0 as
        zero). The container lives on the device of ``x``. Format parameters
        are documented on the subclass.
        """
        x, _ = _array.as_array(x, "x", ndim=2)
        _array.check_float(x, "x")
        check_shape(x.shape, "x.shape")
        x = _array.contiguous(x, "x")
        return cls._from_dense_xp(x, check_finite=bool(check_finite), **params)

    @staticmethod
    def _check_dense_finite(x):
        """NaN/Inf check of a dense input: backend fast path, else the generic one."""
        fast = getattr(backends.get(x), "all_finite", None)
        if fast is None or not fast(x):
            _array.check_finite(x, "x")  # builds the message (and is the fallback)

    @staticmethod
    def _dense_row_nnz(x, check_finite):
        """Row non-zero counts of a dense input, with the finiteness check fused when possible."""
        be = backends.get(x)
        fused = getattr(be, "dense_row_nnz_finite", None)
        if check_finite and fused is not None:
            row_nnz, finite = fused(x)
            if not finite:
                _array.check_finite(x, "x")
            return row_nnz
        if check_finite:
            SparseArray._check_dense_finite(x)
        return be.dense_row_nnz(x)

    @classmethod
    @_array.quiet_underflow
    def from_scipy(cls, m, *, dtype=None, check_finite=True, **params):
        """Build from any ``scipy.sparse`` array or matrix (result on the CPU).

        Exact: duplicate entries are summed first (by scipy's
        ``sum_duplicates``), then explicit zeros (stored entries equal to 0,
        including sums that cancel) are dropped; neither changes the matrix.
        The float rounding of a sum of three or more duplicates depends on
        their order: ``m.toarray()`` adds them in another order and can differ
        from the container in the last bit, while ``m.sum_duplicates()``
        followed by ``m.toarray()`` gives the container's values exactly.
        Column order in the input does not matter. ``dtype`` casts the values
        (scipy has no 16-bit types, so this is how float16/bfloat16
        containers are made from scipy; integer matrices are accepted when
        ``dtype`` is given); values that the cast rounds to zero are dropped
        too. With ``check_finite`` the values are checked before and after
        the cast, so a cast that overflows to Inf raises ``ValueError``.

        Parameters
        ----------
        m : scipy.sparse array or matrix
            (M, N), any sparse format; float32 or float64 values (integers
            only together with ``dtype``).
        dtype : dtype, optional
            Value dtype of the container: float16, bfloat16, float32 or
            float64. Default: the dtype of ``m``.
        check_finite : bool
            Reject NaN/Inf in the values (before and after the cast).
        **params
            Format parameters, as for :meth:`from_dense` of the subclass
            (``tile``, ``slots``, ``overflow`` for TwELL; ``width`` for ELL
            and Hybrid).

        Returns
        -------
        SparseArray
            A container of the calling class, on the CPU.

        Raises
        ------
        TypeError
            ``m`` is not a scipy.sparse array or matrix, or has integer
            values and no ``dtype``.
        ValueError
            NaN/Inf values with ``check_finite``, a cast that overflows to
            Inf, or invalid format parameters (including
            :class:`TileOverflowError` with ``overflow="raise"``).
        """
        if dtype is not None:
            dtype = _value_dtype(dtype, "dtype")
        csr = _prepare_scipy(m, cast=dtype is not None)
        shape = check_shape(csr.shape, "m.shape")
        data = np.ascontiguousarray(csr.data)
        if check_finite:
            _array.check_finite(data, "m")
        if csr.nnz > INT32_MAX:
            raise ValueError(f"m has {csr.nnz} non-zeros, more than the int32 index range allows")
        indptr = np.ascontiguousarray(csr.indptr, dtype=np.int64)
        indices = np.ascontiguousarray(csr.indices, dtype=np.int32)
        if dtype is not None and data.dtype != dtype:
            with np.errstate(over="ignore"):  # overflow is reported below, with a better message
                data = np.ascontiguousarray(data.astype(dtype))
            if check_finite:
                n_nan, n_inf = _array.nan_inf_counts(data)
                if n_inf:
                    raise ValueError(f"m holds {n_inf} value(s) too large for {dtype}: the cast to {dtype} "
                                     f"overflowed them to Inf (largest magnitude in m: "
                                     f"{float(np.abs(csr.data).max())!r}); pass check_finite=False to "
                                     f"keep the Inf values")
            keep = nonzero_mask(data)
            if not keep.all():
                # Entries that the cast rounded to zero are dropped: the new row
                # pointers are the running count of kept entries at the old ones.
                kept = np.zeros(data.shape[0] + 1, np.int64)
                np.cumsum(keep, out=kept[1:])
                indptr = kept[indptr]
                data, indices = np.ascontiguousarray(data[keep]), np.ascontiguousarray(indices[keep])
        return cls._from_csr(indptr.astype(np.int32), indices, data, shape, **params)

    @classmethod
    @_array.quiet_underflow
    def from_cupyx(cls, m, *, check_finite=True, **params):
        """Build from a ``cupyx.scipy.sparse`` matrix (result on its GPU).

        Duplicates are summed and explicit zeros dropped, as in :meth:`from_scipy`.
        """
        try:
            import cupyx.scipy.sparse as csp
        except Exception as e:  # pragma: no cover - needs cupy
            raise TypeError(f"from_cupyx needs CuPy: {e}") from None
        if not csp.issparse(m):
            raise TypeError(f"m must be a cupyx.scipy.sparse matrix, got {type(m).__module__}.{type(m).__name__}")
        if m.dtype not in FLOAT_DTYPES:
            raise TypeError(f"m has dtype {m.dtype}, expected a float dtype")
        shape = check_shape(m.shape, "m.shape")
        import cupy

        # Canonicalise with plain cupy sorts rather than cupyx's sum_duplicates /
        # eliminate_zeros, whose cuSPARSE-based results were seen unsorted on
        # CUDA 13. Keys are row * N + col in int64, so any shape is safe.
        coo = m.tocoo()
        n_cols = shape[1]
        key = coo.row.astype(cupy.int64) * n_cols + coo.col.astype(cupy.int64)
        data = coo.data
        if key.size > 1 and not bool((key[1:] > key[:-1]).all()):
            order = cupy.argsort(key)  # CUB radix sort: stable, deterministic
            key, data = key[order], data[order]
            if bool((key[1:] == key[:-1]).any()):
                # Duplicates: sum them on the host so the bits never depend on
                # atomic ordering (rare input; documented).
                host = m.get().tocsr()
                host.sum_duplicates()
                hc = host.tocoo()
                key = cupy.asarray(hc.row.astype(np.int64) * n_cols + hc.col.astype(np.int64))
                data = cupy.asarray(hc.data)
        keep = data != 0
        if data.dtype.kind == "f":
            keep |= cupy.isnan(data)
        if not bool(keep.all()):
            key, data = key[keep], data[keep]
        data = cupy.ascontiguousarray(data)
        if check_finite:
            _array.check_finite(data, "m")
        rows = key // max(n_cols, 1)
        indices = cupy.ascontiguousarray((key - rows * n_cols).astype(np.int32))
        counts = cupy.bincount(rows, minlength=shape[0]) if rows.size else cupy.zeros(shape[0], np.int64)
        indptr = cupy.zeros(shape[0] + 1, np.int64)
        indptr[1:] = cupy.cumsum(counts)
        indptr = indptr.astype(np.int32)
        return cls._from_csr(indptr, indices, data, shape, **params)

    # -- the CSR hub ----------------------------------------------------------
    def _csr(self):
        """CSR arrays ``(indptr, col, data)`` (int32, int32, dtype) on the container's device."""
        vals, idx = self._slots()
        indptr, col, data = self._backend().slots_to_csr(vals, idx, self._row_counts())
        if self.n_backup == 0:
            return indptr, col, data
        xp = self.xp
        m, n = self.shape
        # Backup rows have no slot entries, so the two parts are merged by row.
        rb, cb = xp.nonzero(nonzero_mask(self.backup))
        rows_b = self.backup_rows[rb].astype(np.int64)
        rows_s = (xp.searchsorted(indptr, xp.arange(col.shape[0]), side="right") - 1).astype(np.int64)
        rows = xp.concatenate([rows_s, rows_b])
        cols = xp.concatenate([col.astype(np.int64), cb.astype(np.int64)])
        # values travel as bit patterns (no 16-bit gather support needed on the device)
        datas = xp.concatenate([_bits(data), _bits(self.backup)[rb, cb]])
        indptr, col, datas = _coo_to_csr(xp, rows, cols, datas, m, n)
        return indptr, col, datas.view(self.dtype)

    def to_scipy(self, fmt="csr"):
        """Copy to a ``scipy.sparse`` array (``csr_array`` family) on the host.

        Parameters
        ----------
        fmt : str
            Any scipy format name (``"csr"``, ``"csc"``, ``"coo"`` ...).

        Notes
        -----
        scipy.sparse has no bfloat16/float16 kernels, so 16-bit values come
        back as float32 (lossless).
        """
        import scipy.sparse as sp

        indptr, col, data = (_as_host(a) for a in self._csr())
        if data.dtype.itemsize == 2:
            data = data.astype(np.float32)
        m = sp.csr_array((data, col, indptr), shape=self.shape)
        return m.asformat(fmt)

    def to_cupyx(self, fmt="csr"):
        """Copy to a ``cupyx.scipy.sparse`` matrix on the GPU (16-bit values become float32)."""
        import cupyx.scipy.sparse as csp

        a = self if self.device != "cpu" else self.to_device("cuda")
        indptr, col, data = a._csr()
        if data.dtype.itemsize == 2:
            data = cast(data, np.float32)
        return csp.csr_matrix((data, col, indptr), shape=self.shape).asformat(fmt)

    def toarray(self):
        """Dense (M, N) numpy or cupy array (the container's device)."""
        vals, idx = self._slots()
        out = self._backend().slots_to_dense(vals, idx, self.shape[1])
        if self.n_backup:
            _bits(out)[self.backup_rows] = _bits(self.backup)
        return out

    def todense(self):
        """Dense (M, N) numpy or cupy array; the same as :meth:`toarray` (as for
        ``scipy.sparse`` arrays, not ``np.matrix``)."""
        return self.toarray()

    def __array_function__(self, func, types, args, kwargs):
        """numpy's functions on a container.

        ``np.sum``, ``np.mean``, ``np.max``/``np.amax``, ``np.min``/``np.amin`` and
        ``np.count_nonzero`` (with ``axis``), ``np.transpose``, ``np.copy``,
        ``np.shape``, ``np.ndim`` and ``np.size`` call the container's own
        methods and attributes. Any other numpy function keeps numpy's default
        handling of a foreign object; convert with :meth:`toarray` first. When
        another argument's type implements ``__array_function__`` too (a dask
        array, say), that library gets its turn (NEP 18: ``NotImplemented``).
        """
        own = _NUMPY_FUNCTIONS.get(func)
        if own is not None and not args and kwargs.get("a") is self:
            kwargs = dict(kwargs)  # np.sum(a=A): numpy's functions name their array "a"
            args = (kwargs.pop("a"),)
        if own is not None and args and args[0] is self:
            return own(func, self, *args[1:], **kwargs)
        if not all(issubclass(t, SparseArray) or t.__array_function__ is np.ndarray.__array_function__
                   for t in types):
            return NotImplemented  # e.g. np.dot(A, dask_array): dask's implementation decides
        implementation = getattr(func, "_implementation", None)
        if implementation is None:
            return NotImplemented
        return implementation(*args, **kwargs)

    @_array.quiet_underflow
    def asformat(self, fmt, **params):
        """Convert to another twellpy format (through CSR).

        Parameters
        ----------
        fmt : {"ell", "twell", "hybrid"}
        **params
            Parameters of the target format (``tile``, ``slots``, ``width`` ...).
            Converting to the same format with no parameters returns ``self``.
        """
        from . import ell, hybrid, twell

        classes = {"ell": ell.ELL, "twell": twell.TwELL, "hybrid": hybrid.Hybrid}
        if fmt not in classes:
            raise ValueError(f"unknown format {fmt!r}; expected one of 'ell', 'twell', 'hybrid' "
                             f"(use to_scipy(fmt) for scipy formats)")
        if fmt == self.format and not params:
            return self
        target = classes[fmt]
        accepted = [k for k in inspect.signature(target._from_csr).parameters
                    if k not in ("indptr", "indices", "data", "shape")]
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            raise TypeError(f"asformat({fmt!r}) got unexpected parameter(s) {', '.join(map(repr, unknown))}; "
                            f"{target.__name__} accepts {', '.join(map(repr, accepted))}")
        indptr, col, data = self._csr()
        return target._from_csr(indptr, col, data, self.shape, **params)

    def _transpose_params(self):
        return {}

    @_array.quiet_underflow
    def transpose(self):
        """The transpose (N, M), in the same format; deterministic."""
        m, n = self.shape
        if self.n_backup == 0:
            indptr, col, data = self._transpose_slots()
        else:
            xp = self.xp
            indptr0, col0, data0 = self._csr()
            rows = (xp.searchsorted(indptr0, xp.arange(col0.shape[0]), side="right") - 1).astype(np.int64)
            indptr, col, data = _coo_to_csr(xp, col0.astype(np.int64), rows, _bits(data0), n, m)
            data = data.view(self.dtype)
        return type(self)._from_csr(indptr, col, data, (n, m), **self._transpose_params())

    @property
    def T(self):
        """The transpose, see :meth:`transpose`."""
        return self.transpose()

    # -- value maps, written once --------------------------------------------
    def _with_data(self, values, backup=None):
        """Same structure, new values (and backup). Padding slots are re-zeroed."""
        xp = self.xp
        # Done on the bit patterns: exact, and needs no 16-bit arithmetic on the device.
        vb = _bits(xp.ascontiguousarray(values))
        values = xp.where(self.indices >= 0, vb, vb.dtype.type(0)).astype(vb.dtype).view(values.dtype)
        d = self.components()
        d["values"] = values
        if "backup" in d:
            d["backup"] = backup if backup is not None else cast(self.backup, values.dtype)
        return type(self)._init_from_components(d, check=False, check_finite=False)

    @_array.quiet_underflow
    def with_values(self, values, backup=None, *, check_finite=True):
        """A container with the same pattern and new values.

        Parameters
        ----------
        values : array
            Same shape as ``self.values``; any supported float dtype. Values in
            padding slots are ignored (stored as 0), NaN/Inf included.
        backup : array, optional
            (R, N) dense backup rows, same dtype as ``values``. Required when
            this container has backup rows (R > 0).
        check_finite : bool
            Reject NaN/Inf (``ValueError``) in the stored entries of ``values``
            and anywhere in ``backup``.
        """
        xp = self.xp
        values, _ = _array.as_array(values, "values")
        _array.check_float(values, "values")
        if tuple(values.shape) != tuple(self.values.shape):
            raise ValueError(f"values has shape {tuple(values.shape)}, expected {tuple(self.values.shape)}")
        _array.same_device([("values", values), ("self.values", self.values)])
        if self.backup is not None:
            if backup is None:
                if self.n_backup:
                    raise ValueError(f"backup is required: this {type(self).__name__} has "
                                     f"{self.n_backup} backup rows")
                backup = xp.zeros((0, self.shape[1]), values.dtype)
            backup = check_value_array(backup, "backup", 2, shape=(self.n_backup, self.shape[1]),
                                       dtype=values.dtype)
            _array.same_device([("backup", backup), ("self.values", self.values)])
        elif backup is not None:
            raise ValueError(f"backup must be None for format {self.format!r} (it has no backup rows)")
        out = self._with_data(_array.contiguous(values, "values"), backup)
        if check_finite:
            # checked after _with_data has zeroed the padding slots: what a map such as
            # 1 / A.values leaves there (Inf) is ignored, as documented, and never stored
            _array.check_finite(out.values, "values")
            if backup is not None:
                _array.check_finite(backup, "backup")
        return out

    @_array.quiet_underflow
    def astype(self, dtype, *, check_finite=True):
        """Copy with values cast to ``dtype`` (float16, bfloat16, float32, float64).

        Parameters
        ----------
        dtype : dtype-like
        check_finite : bool
            Raise ``ValueError`` when the cast overflows finite values to Inf
            (e.g. 1e5 to float16), as :meth:`from_scipy` does with ``dtype``.
            NaN/Inf that the container already held are not an error.

        Notes
        -----
        A cast may round small values to zero; those entries stay stored
        (:attr:`nnz` may then count them; :meth:`count_nonzero` does not).
        """
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype {dtype!r} is not a dtype") from None
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype {dtype} is not supported; expected one of "
                            f"{', '.join(str(d) for d in FLOAT_DTYPES)}")

        def conv(a):
            return a.copy() if a.dtype == dtype else cast(a, dtype)

        with np.errstate(over="ignore"):  # overflow is reported below, with a better message
            b = conv(self.backup) if self.backup is not None else None
            vals = conv(self.values)
        if check_finite and _array.finfo(dtype).max < _array.finfo(self.dtype).max:
            # only a cast to a type of smaller range can overflow
            for name, src, dst in (("values", self.values, vals), ("backup", self.backup, b)):
                if src is None or src.size == 0:
                    continue
                new_inf = _array.nan_inf_counts(dst)[1] - _array.nan_inf_counts(src)[1]
                if new_inf:
                    raise ValueError(f"astype({dtype}) overflows {new_inf} finite value(s) of {name} to Inf "
                                     f"(largest {dtype}: {float(_array.finfo(dtype).max):.6g}); pass "
                                     f"check_finite=False to keep them as Inf")
        return self._with_data(vals, b)

    def copy(self):
        """Deep copy (every component array copied)."""
        d = self.components()
        for k in self._array_names:
            d[k] = d[k].copy()
        return type(self)._init_from_components(d, check=False, check_finite=False)

    # -- reductions ----------------------------------------------------------------
    def _reduction_axis(self, axis):
        return reduction_axis(axis, type(self).__name__)

    @_array.quiet_underflow
    def sum(self, axis=None):
        """Sum of the values.

        Parameters
        ----------
        axis : None, 0 or 1
            ``None``: one number; ``1``: per row, shape (M,); ``0``: per
            column, shape (N,). ``-1`` and ``-2`` are accepted.

        Returns
        -------
        float or array
            ``axis=None``: a Python float on the host, whatever the device (the
            per-row float32 sums added in float64). Otherwise an array of the
            container's array module, accumulated in and returned as float32
            (float64 for float64 data), as the products are. NaN and Inf
            propagate as in numpy. The result has the same bits on every run
            (per-column sums go through the deterministic product ``ones @ A``).
        """
        axis = self._reduction_axis(axis)
        xp = self.xp
        acc = _acc(self.dtype)
        A = self if self.dtype == acc else self.astype(acc)
        if axis == 0:
            return (xp.ones((1, self.shape[0]), acc) @ A)[0]
        vals, _ = A._slots()
        rows = vals.sum(axis=1, dtype=acc)  # padding slots hold 0
        if A.n_backup:
            rows[A.backup_rows] = A.backup.sum(axis=1, dtype=acc)  # their slots are empty
        return rows if axis == 1 else float(rows.sum(dtype=np.float64))

    @_array.quiet_underflow
    def mean(self, axis=None):
        """Mean over the stored values and the zeros: :meth:`sum` divided by the
        number of elements along ``axis`` (M, N or M * N).

        Parameters
        ----------
        axis : None, 0 or 1
            As for :meth:`sum`.

        Returns
        -------
        float or array
            ``axis=None``: a Python float (see :meth:`sum`); otherwise a float32
            array (float64 for float64 data). NaN for an empty axis, as numpy gives.
        """
        axis = self._reduction_axis(axis)
        m, n = self.shape
        total = self.sum(axis=axis)
        count = m * n if axis is None else (m if axis == 0 else n)
        if axis is None:
            return total / count if count else float("nan")
        with np.errstate(invalid="ignore", divide="ignore"):
            return total / total.dtype.type(count) if count else total * total.dtype.type(np.nan)

    def max(self, axis=None):
        """Largest element, the zeros that are not stored included (as ``scipy.sparse``).

        Parameters
        ----------
        axis : None, 0 or 1
            ``None``: one number; ``1``: per row (M,); ``0``: per column (N,).

        Returns
        -------
        float or array
            ``axis=None``: a Python float on the host, whatever the device
            (exact: every value dtype converts to float64 without rounding).
            Otherwise an array in the container's dtype and array module
            (exact). A NaN in a row or column makes its result NaN, as
            ``numpy.max`` does.

        Raises
        ------
        ValueError
            The reduction is over an empty axis (no identity), e.g. ``max()``
            of a container with no elements.
        """
        return self._extreme("max", axis)

    def min(self, axis=None):
        """Smallest element, the zeros that are not stored included; as :meth:`max`
        (``axis=None`` gives a Python float, an axis an array in the container's dtype)."""
        return self._extreme("min", axis)

    def _extreme(self, op, axis):
        axis = self._reduction_axis(axis)
        m, n = self.shape
        if (axis is None and m * n == 0) or (axis == 1 and n == 0 and m) or (axis == 0 and m == 0 and n):
            raise ValueError(f"{op}() of a {type(self).__name__} of shape {self.shape} along axis {axis} "
                             f"reduces over zero elements, which has no identity")
        if axis == 0:
            # columns are the rows of the (deterministic) transpose; through a Hybrid, whose
            # width strategy keeps a popular column (thousands of rows) in one dense backup row
            # instead of widening every row as an ELL transpose would
            hybrid = self if self.format == "hybrid" else self.asformat("hybrid")
            return hybrid.T._extreme(op, 1)
        xp = self.xp
        acc = _acc(self.dtype)
        A = self if self.dtype == acc else self.astype(acc)  # widening is exact
        vals, idx = A._slots()
        reduce, pair = (xp.max, xp.maximum) if op == "max" else (xp.min, xp.minimum)
        fill = acc.type(-np.inf if op == "max" else np.inf)
        stored = idx >= 0
        if vals.shape[1]:
            rows = reduce(xp.where(stored, vals, fill), axis=1)
        else:
            rows = xp.full(m, fill, acc)
        # a row with fewer stored entries than columns holds zeros too (NaN still wins: IEEE max/min)
        rows = xp.where(stored.sum(axis=1) < n, pair(rows, acc.type(0)), rows)
        if A.n_backup:
            rows[A.backup_rows] = reduce(A.backup, axis=1)  # dense rows: their zeros are there
        if axis == 1:
            return cast(rows, self.dtype)
        return float(reduce(rows))

    def count_nonzero(self, axis=None):
        """Non-zero values (NaN counts, zeros stored explicitly do not).

        Parameters
        ----------
        axis : None, 0 or 1
            ``None``: one int; ``1``: per row (M,) int64, the active neurons per
            token of an activation; ``0``: per column (N,) int64, how often each
            neuron fires.

        Returns
        -------
        int or int64 array of the container's array module
            Unlike :attr:`nnz`, which counts stored entries, an entry whose
            value is zero (e.g. after ``A * 0``) is not counted, as in
            ``scipy.sparse``.
        """
        axis = self._reduction_axis(axis)
        vals, idx = self._slots()
        live = nonzero_mask(vals) & (idx >= 0)
        if axis == 0:
            out = _array.count_in_range(idx[live], self.shape[1]).astype(np.int64)
            if self.n_backup:
                out = out + nonzero_mask(self.backup).sum(axis=0, dtype=np.int64)
            return out
        rows = live.sum(axis=1, dtype=np.int64)
        if self.n_backup:
            rows[self.backup_rows] = nonzero_mask(self.backup).sum(axis=1, dtype=np.int64)
        return rows if axis == 1 else int(rows.sum())

    # -- row selection -----------------------------------------------------------
    _BACKUP_NAMES = ("backup", "backup_rows", "row_map")

    def __getitem__(self, key):
        """Whole rows of the container, as a container of the same format.

        Parameters
        ----------
        key : slice, integer array or boolean mask
            Rows to select (numpy, cupy or a list; ``A[rows, :]`` is accepted
            too). Integer arrays may repeat rows and give them in any order;
            negative indices count from the end; a mask has one entry per row.
            A single row is ``A[[i]]`` or ``A[i:i + 1]``: containers are 2-D,
            so a bare integer, which would drop a dimension, is refused.

        Returns
        -------
        container
            Shape ``(number of selected rows, N)``, same format and parameters,
            the selected rows bit for bit in the order given. Rows kept as
            dense backup rows stay backup rows.

        Raises
        ------
        TypeError
            A column selection (``A[:, j]``), a bare integer or boolean scalar,
            or indices that are neither integers nor booleans.
        IndexError
            A row index out of range, a mask of the wrong length, or an index
            array that is not one-dimensional.
        """
        return self._take_rows(self._row_selection(key))

    def _row_selection(self, key):
        """``key`` as an int64 array of row ids in [0, M) on the container's device."""
        xp = self.xp
        m = self.shape[0]
        name = type(self).__name__
        key = whole_rows_key(key, self.shape[1], name)
        if key is None or key is Ellipsis or isinstance(key, (bool, np.bool_)):
            raise TypeError(f"{name} row index must be a slice, an integer array or a boolean mask, "
                            f"got {key!r}")
        if isinstance(key, numbers.Integral):
            raise TypeError(f"{name} has no 1-D rows: select row {int(key)} as A[[{int(key)}]] or "
                            f"A[{int(key)}:{int(key) + 1 if int(key) != -1 else ''}] (shape (1, N))")
        if isinstance(key, slice):
            return xp.arange(*key.indices(m), dtype=np.int64)
        on_device = _array.is_cupy(key)
        if not on_device:
            key = np.asarray(key)  # dtype checked before any copy: cupy cannot hold an object array
        if key.dtype != np.bool_ and key.dtype.kind not in "iu" and key.size:
            raise TypeError(f"{name} row indices must be integers or booleans, got dtype {key.dtype}")
        if xp is np:
            key = key.get() if on_device else key
        elif not on_device:
            key = xp.asarray(key)
        elif key.device != self.values.device:
            with self.values.device:
                key = xp.array(key)  # an index array on another GPU: copied here
        if key.ndim == 0:
            raise TypeError(f"{name} row index must be a slice, an integer array or a boolean mask, "
                            f"got a 0-d array ({key.dtype}); select one row as A[[i]]")
        if key.ndim != 1:
            raise IndexError(f"{name} row indices must be one-dimensional, got shape {tuple(key.shape)}")
        if key.dtype == np.bool_:
            if key.shape[0] != m:
                raise IndexError(f"boolean row mask has {key.shape[0]} entries, expected one per row ({m})")
            return xp.nonzero(key)[0].astype(np.int64)
        if key.size == 0:
            return xp.zeros(0, dtype=np.int64)
        lo, hi = int(key.min()), int(key.max())
        if lo < -m or hi >= m:
            bad = lo if lo < -m else hi
            raise IndexError(f"row index {bad} is out of range for a {name} with {m} rows")
        key = key.astype(np.int64)
        return xp.where(key < 0, key + m, key)

    def _take_rows(self, rows):
        xp = self.xp
        d = self.components()
        d["shape"] = (int(rows.shape[0]), self.shape[1])

        def take(a, idx):  # moves bits, so every value (NaN payloads, -0.0) is kept exactly
            if a.dtype.kind in "iu":
                return xp.ascontiguousarray(a[idx])
            return xp.ascontiguousarray(_bits(a)[idx]).view(a.dtype)

        for k in self._array_names:
            if k not in self._BACKUP_NAMES:
                d[k] = take(d[k], rows)
        if "backup" in d:
            if self.n_backup:
                pos = self.row_map[rows]                      # backup position of each selected row, or -1
                picked = xp.nonzero(pos >= 0)[0]              # ascending positions in the selection
                d["backup"] = take(self.backup, pos[picked])
                d["backup_rows"] = picked.astype(INDEX_DTYPE)
            else:
                d["backup"] = d["backup_rows"] = None
            d["row_map"] = None                               # rebuilt from backup_rows
        return type(self)._init_from_components(d, check=False, check_finite=False)

    def _map(self, fn):
        b = None if self.backup is None else fn(self.backup)
        return self._with_data(fn(self.values), b)

    def __neg__(self):
        # Exact and dtype-agnostic: flip the sign bit of the non-zeros only, so
        # zeros stay +0.0 (the same bits as before).
        xp = self.xp

        def neg(a):
            b = _bits(a)
            return xp.where(nonzero_mask(a), b ^ _sign_bit(a), b).astype(b.dtype).view(a.dtype)

        return self._map(neg)

    def __pos__(self):
        return self

    def abs(self):
        """Element-wise absolute value."""
        def absolute(a):  # clear the sign bit: exact, and -0.0 becomes +0.0
            b = _bits(a)
            return (b & (_sign_bit(a) - b.dtype.type(1))).view(a.dtype)

        return self._map(absolute)

    __abs__ = abs

    @_array.quiet_underflow
    def __mul__(self, other):
        """Scalar multiply, or element-wise product with a container of identical pattern.

        A scalar factor must be finite in the dtype the product is computed in
        (float32 for 16- and 32-bit data, float64 for float64): a factor such
        as ``1e39`` on float32 data would be Inf there and turn the zeros of
        dense backup rows into NaN, so it raises ``ValueError`` instead, on
        every format alike. A scalar is a real number or a 0-d array of a real
        dtype (the container keeps its dtype); a complex or boolean one raises
        ``TypeError``, and so does a dense array, whose element-wise product is
        :meth:`multiply`.
        """
        if isinstance(other, SparseArray):
            return self._mul_same_pattern(other)
        if _is_real_scalar(other, "factor"):
            return self._scale(_array.float_or_inf(other), other)
        _refuse_dense(other, "*")
        return NotImplemented

    __rmul__ = __mul__

    def _scale(self, s, given):
        """Multiply every value by the float ``s`` (``given``: the factor as the caller wrote it)."""
        if not np.isfinite(s):
            shown = repr(given) if np.isnan(s) or len(repr(given)) <= 40 else f"{s} (beyond float64)"
            raise ValueError(f"scalar factor must be finite, got {shown}")
        s_acc = self._factor_in_acc(s)
        if s_acc is None:
            acc = _acc(self.dtype)
            raise ValueError(f"scalar factor must be finite in {acc}, the dtype {self.dtype} values are "
                             f"multiplied in, got {given!r}, which overflows to Inf there (largest {acc}: "
                             f"{float(_array.finfo(acc).max):.4g})")
        acc = s_acc.dtype

        def scale(a):
            return cast(cast(a, acc) * s_acc + acc.type(0), a.dtype)

        return self._map(scale)

    def _factor_in_acc(self, s):
        """``s`` as a scalar of the accumulation dtype, or None when it is not finite there."""
        acc = _acc(self.dtype)
        with np.errstate(over="ignore"):
            s_acc = acc.type(s)
        return s_acc if np.isfinite(s_acc) else None

    @_array.quiet_underflow
    def __truediv__(self, other):
        """Division by a non-zero scalar: multiplication by its reciprocal (see :meth:`__mul__`).

        An int beyond the float64 range divides as ``inf`` does (every value becomes 0).

        Raises
        ------
        TypeError
            ``other`` is complex, boolean or a dense array.
        ZeroDivisionError
            ``other`` is zero.
        ValueError
            ``other`` is NaN, or its reciprocal is not finite in the dtype the
            product is computed in (e.g. ``A / 1e-320``, or ``A / 1e-39`` on
            float32 data).
        """
        if _is_real_scalar(other, "divisor"):
            if other == 0:
                raise ZeroDivisionError("division of a sparse container by zero")
            d = _array.float_or_inf(other)  # 1 / (an int beyond float64) is 0, as 1 / inf
            if np.isnan(d):
                raise ValueError(f"divisor must not be NaN, got {other!r}")
            with np.errstate(over="ignore", divide="ignore"):
                r = float(np.float64(1.0) / np.float64(d))
            if not np.isfinite(r) or self._factor_in_acc(r) is None:
                where = ("float64" if not np.isfinite(r) else
                         f"{_acc(self.dtype)}, the dtype {self.dtype} values are multiplied in")
                raise ValueError(f"dividing by {other!r} multiplies by its reciprocal 1/{other!r}, which "
                                 f"overflows to Inf in {where}; divide by a larger number, or scale in "
                                 f"two steps")
            return self._scale(r, r)
        _refuse_dense(other, "/")
        return NotImplemented

    @_array.quiet_underflow
    def multiply(self, other):
        """Element-wise product that keeps the sparsity pattern.

        Parameters
        ----------
        other : scalar, container or dense array
            A real scalar or 0-d array, a container with this one's pattern (as ``self * other``),
            or a dense float array on this container's device of shape (M, N)
            or one that broadcasts to it: (1, N), (N,), (M, 1) or (1, 1).

        Returns
        -------
        container
            Same format and pattern; each stored entry becomes
            ``self[r, c] * other[r, c]`` in the promoted dtype (computed in
            float32, float64 for float64, and rounded once). Entries that are
            not stored stay zero whatever ``other`` holds there, Inf and NaN
            included, as ``scipy.sparse`` does.

        Raises
        ------
        ValueError
            ``other`` has a shape that does not broadcast to (M, N), or lives on
            another device.
        TypeError
            ``other`` is not a float array, or is a complex scalar.
        """
        if isinstance(other, SparseArray) or _is_real_scalar(other, "other"):
            return self * other
        arr, _ = _array.as_array(other, "other")
        _array.check_float(arr, "other")
        _array.same_device([("other", arr), ("A", self.values)])
        m, n = self.shape
        d2 = arr.reshape(1, -1) if arr.ndim == 1 else arr
        if d2.ndim != 2 or d2.shape[0] not in (1, m) or d2.shape[1] not in (1, n):
            raise ValueError(f"other has shape {tuple(arr.shape)}, expected ({m}, {n}) or a shape that "
                             f"broadcasts to it: (1, {n}), ({n},), ({m}, 1) or (1, 1)")
        xp = self.xp
        res = result_dtype(self.dtype, arr.dtype)
        acc = _acc(res)
        dense = cast(d2, acc)
        vals, idx = self._slots()
        r_idx = xp.arange(m, dtype=np.int64)[:, None] if dense.shape[0] == m else xp.zeros((m, 1), np.int64)
        c_idx = xp.maximum(idx, 0).astype(np.int64) if dense.shape[1] == n else xp.zeros_like(idx, np.int64)
        # padding slots and the zeros of backup rows meet other's values too (0 * Inf is
        # NaN there); they are set back to zero below, so numpy need not warn about them
        with np.errstate(invalid="ignore"):
            # + 0: an entry whose product is -0.0 is stored as +0.0, as the other products do
            prod = cast(cast(vals, acc) * dense[r_idx, c_idx] + acc.type(0), res).reshape(self.values.shape)
            backup = None
            if self.backup is not None:
                rows = self.backup_rows
                db = dense[rows] if dense.shape[0] == m else xp.broadcast_to(dense, (rows.shape[0], dense.shape[1]))
                pb = cast(self.backup, acc) * db + acc.type(0)
                pb = xp.where(nonzero_mask(self.backup), pb, acc.type(0))  # the zeros of a backup row stay zero
                backup = cast(xp.ascontiguousarray(pb), res)
        return self._with_data(prod, backup)  # re-zeroes the padding slots

    def _mul_same_pattern(self, other, name="other"):
        """``self * other`` for a container ``other`` (called ``name`` in errors) on self's pattern."""
        if other.format != self.format or other.shape != self.shape:
            raise ValueError(f"{name} must have the same format and shape: got {other.format!r} "
                             f"{other.shape}, expected {self.format!r} {self.shape}")
        _array.same_device([(name, other.values), ("self", self.values)])
        xp = self.xp
        for k in self._array_names:
            if k in ("values", "backup"):
                continue
            a, b = getattr(self, k), getattr(other, k)
            if a.shape != b.shape or not bool(xp.array_equal(a, b)):
                raise ValueError(f"{name} has a different sparsity pattern ({k} differ); "
                                 f"element-wise products need identical patterns")
        # Hybrid's width_strategy only says how a rebuild (.T, asformat) picks a width: the
        # same pattern may come from "auto" or an int, so it is no reason to refuse the pair
        mine, theirs = ({k: v for k, v in a._params().items() if k != "width_strategy"}
                        for a in (self, other))
        if mine != theirs:
            raise ValueError(f"{name} has parameters {theirs}, expected {mine}")
        res = result_dtype(self.dtype, other.dtype)
        acc = _acc(res)

        def prod(a, b):
            return cast(cast(a, acc) * cast(b, acc) + acc.type(0), res)

        b = None if self.backup is None else prod(self.backup, other.backup)
        return self._with_data(prod(self.values, other.values), b)

    # -- products with dense arrays -------------------------------------------
    def _dense_operand(self, w, name):
        arr, kind = dense_operand(w, name, (1, 2))
        _array.same_device([(name, arr), ("A", self.values)])
        return arr, kind

    @_array.quiet_underflow
    def __matmul__(self, w):
        """``A @ W`` for a dense ``W`` of shape (N,) or (N, K).

        Accumulates in float32 (float64 if either side is float64); the
        result has the promoted dtype and the caller's array type (numpy,
        cupy, torch ...). No NaN/Inf check is made on ``W``: as in scipy.sparse, a
        NaN/Inf in row j of ``W`` reaches exactly the rows of A that store column j,
        whatever the format (dense backup rows included).
        """
        w, kind = self._dense_operand(w, "W")
        m, n = self.shape
        vec = w.ndim == 1
        b = w[:, None] if vec else w
        if b.shape[0] != n:
            raise ValueError(f"W has shape {tuple(w.shape)}, expected ({n}, K) to multiply a "
                             f"{m}x{n} {type(self).__name__}")
        b = _array.contiguous(b, "W")
        out = self._spmm(b)
        if self.n_backup:
            out[self.backup_rows] = cast(self._backup_spmm(b), out.dtype)
        if vec:
            out = out[:, 0]
        return _array.to_caller(out, kind)

    @_array.quiet_underflow
    def __rmatmul__(self, w):
        """``W @ A`` for a dense ``W`` of shape (M,) or (P, M); see :meth:`__matmul__`."""
        w, kind = self._dense_operand(w, "W")
        m, n = self.shape
        vec = w.ndim == 1
        wt = w[:, None] if vec else w.T  # (M, P)
        if wt.shape[0] != m:
            raise ValueError(f"W has shape {tuple(w.shape)}, expected (P, {m}) to multiply a "
                             f"{m}x{n} {type(self).__name__} from the left")
        wt = _array.contiguous(wt, "W")
        if not self.n_backup:
            out_t = self._spmm_t(wt)  # (N, P)
        else:
            # The slot part and the backup rows add into the same outputs: both
            # stay in the accumulation dtype (W cast up, exactly, so the backend
            # returns its accumulator unrounded) and the sum is rounded once.
            res = result_dtype(self.dtype, wt.dtype)
            acc = _acc(res)
            wt_acc = cast(wt, acc)
            out_t = self._spmm_t(wt_acc)
            extra = self._backup_spmm_t(_array.contiguous(wt_acc[self.backup_rows], "W"))
            out_t = cast(cast(out_t, acc) + cast(extra, acc), res)
        out = out_t[:, 0] if vec else self.xp.ascontiguousarray(out_t.T)
        return _array.to_caller(out, kind)

    def _transpose_slots(self):
        """CSR of the slot part's transpose."""
        vals, idx = self._slots()
        return self._backend().transpose_slots(vals, idx, self.shape[1])

    def _spmm(self, b):
        """Slot part of ``A @ b`` (backup rows are filled by the caller)."""
        vals, idx = self._slots()
        return self._backend().slots_spmm(vals, idx, b)

    def _spmm_t(self, b):
        """Slot part of ``A.T @ b``."""
        vals, idx = self._slots()
        return self._backend().slots_spmm_t(vals, idx, b, self.shape[1])

    def _backup_spmm(self, b):
        """``backup @ b`` (R, K): a backend fast path when present (it skips zeros), else
        a GEMM whose non-finite rows are summed again over the row's stored entries only.
        The GEMM multiplies a backup row's zeros too, so a NaN/Inf row of ``b`` would
        reach every backup row, where the slots (and scipy) add only the stored entries."""
        fast = getattr(self._backend(), "dense_rows_spmm", None)
        if fast is not None:
            return fast(self.backup, b)
        res = result_dtype(self.dtype, b.dtype)
        return backends.backup_gemm(cast(self.backup, res), _array.contiguous(cast(b, res), "W"))

    def _backup_spmm_t(self, b):
        """``backup.T @ b`` (N, P) for b (R, P); as :meth:`_backup_spmm`, a NaN/Inf row of
        ``b`` reaches only the columns its backup row stores."""
        fast = getattr(self._backend(), "dense_rows_spmm_t", None)
        if fast is not None:
            return fast(self.backup, b)
        res = result_dtype(self.dtype, b.dtype)
        at = self.xp.ascontiguousarray(cast(self.backup, res).T)  # (N, R): R is small
        return backends.backup_gemm(at, _array.contiguous(cast(b, res), "W"))

    def dot(self, w):
        """Same as ``self @ w``."""
        return self.__matmul__(w)

    # -- devices --------------------------------------------------------------
    def to_device(self, device):
        """Copy to ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; returns ``self`` if already there."""
        if not isinstance(device, str):
            raise TypeError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        if device == "cpu":
            if self.device == "cpu":
                return self
            move = _as_host
        elif device == "cuda" or device.startswith("cuda:"):
            cp = _array.cupy_module()
            if cp is None or not _array.gpu_available():
                raise ValueError(f"device {device!r} requested but no CUDA GPU is available")
            dev_id = cp.cuda.Device().id if device == "cuda" else None
            if dev_id is None:
                try:
                    dev_id = int(device.split(":", 1)[1])
                except ValueError:
                    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
            n_dev = cp.cuda.runtime.getDeviceCount()
            if not 0 <= dev_id < n_dev:  # cupy would raise a bare CUDARuntimeError
                raise ValueError(f"device {device!r} does not exist: this machine has {n_dev} CUDA "
                                 f"device(s), cuda:0 to cuda:{n_dev - 1}")
            if self.device == f"cuda:{dev_id}":
                return self

            def move(a):
                with cp.cuda.Device(dev_id):
                    if _array.is_cupy(a):
                        return a.copy()
                    return cp.asarray(a)
        else:
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        d = self.components()
        for k in self._array_names:
            d[k] = move(d[k])
        return type(self)._init_from_components(d, check=False, check_finite=False)

    # -- validation -----------------------------------------------------------
    def check_format(self, full_check=False, *, check_finite=True):
        """Validate the container.

        Parameters
        ----------
        full_check : bool
            ``False``: O(1) checks (shapes, dtypes, devices). ``True``: also
            scan the contents: counts within [0, slots], indices in range and
            in the right tile, sorted and packed at the front, padding exactly
            (0, -1), backup rows consistent with ``row_map`` and free of slot
            entries.
        check_finite : bool
            With ``full_check``, also reject NaN/Inf values.

        Raises
        ------
        ValueError, TypeError
            Naming the offending array and the first bad position.
        """
        d = self.components()
        type(self)._init_from_components(d, check=_SHAPES_ONLY, check_finite=False)
        if not full_check:
            return
        self._check_slots_full()
        self._check_backup_rows_empty()
        if check_finite:
            _array.check_finite(self.values, "values")
            if self.backup is not None:
                _array.check_finite(self.backup, "backup")

    def _check_backup_rows_empty(self):
        """ValueError when a backup row also has slot entries."""
        if self.n_backup:
            cnt = self._row_counts()[self.backup_rows]
            if bool((cnt != 0).any()):
                k = _first_true(cnt != 0)[0]
                r = int(_as_host(self.backup_rows[k]))
                raise ValueError(f"row {r} is stored in backup (backup_rows[{k}]) but also has "
                                 f"{int(_as_host(cnt[k]))} slot entries; backup rows must have none")

    def _check_slot_lists(self, vals, idx, counts, lo, hi, label, count_name, quick=False):
        """Shared content scan of slot lists.

        ``vals``/``idx`` are (..., S); ``counts`` (...,) entries used; the valid
        column range of each list is [lo, hi) (broadcast against counts).
        ``label(pos)`` renders a position for messages. ``quick``: return a
        0-d boolean array, true when anything is wrong, without syncing the
        device (the caller reruns the detailed scan for the message).
        """
        xp = self.xp
        s = vals.shape[-1]
        if quick:
            bad = xp.zeros((), dtype=bool)
            if counts.size:
                bad = bad | ((counts < 0) | (counts > s)).any()
            if vals.size == 0:
                return bad
            used = xp.arange(s, dtype=np.int32) < counts[..., None]
            # one boolean per slot: a used slot out of its range, a padding slot
            # that is not (index -1, value bits 0)
            wrong = xp.where(used, (idx < lo[..., None]) | (idx >= hi[..., None]),
                             (idx != -1) | (_bits(vals) != 0))
            bad = bad | wrong.any()
            if s > 1:
                bad = bad | (used[..., 1:] & (idx[..., 1:] <= idx[..., :-1])).any()
            return bad
        if counts.size and (bool((counts < 0).any()) or bool((counts > s).any())):
            bad = (counts < 0) | (counts > s)
            p = _first_true(bad)
            raise ValueError(f"{count_name}{list(p)} = {int(_as_host(counts[p]))} ({label(p)}), "
                             f"expected a value in [0, {s}]")
        if vals.size == 0:
            return
        slot = xp.arange(s, dtype=np.int32)
        used = slot < counts[..., None]
        lo_b = lo[..., None]
        hi_b = hi[..., None]
        bad = used & ((idx < lo_b) | (idx >= hi_b))
        if bool(bad.any()):
            p = _first_true(bad)
            raise ValueError(f"indices{list(p)} = {int(_as_host(idx[p]))} is out of range: expected a "
                             f"column in [{int(_as_host(lo[p[:-1]]))}, {int(_as_host(hi[p[:-1]]))}) "
                             f"for {label(p[:-1])}")
        pad = ~used
        bad = pad & ((idx != -1) | (_bits(vals) != 0))
        if bool(bad.any()):
            p = _first_true(bad)
            raise ValueError(f"padding slot {list(p)} (beyond the count of {label(p[:-1])}) holds index "
                             f"{int(_as_host(idx[p]))} and a value with bits "
                             f"{int(_as_host(_bits(vals)[p]))}; padding must be index -1 with value 0")
        if s > 1:
            unsorted = used[..., 1:] & (idx[..., 1:] <= idx[..., :-1])
            if bool(unsorted.any()):
                p = _first_true(unsorted)
                q = p[:-1] + (p[-1] + 1,)
                raise ValueError(f"indices are not sorted ascending (without repeats) within "
                                 f"{label(p[:-1])}: indices{list(q)} = {int(_as_host(idx[q]))} follows "
                                 f"{int(_as_host(idx[p]))}")


def _numpy_method(method, *, axis_name="axis", defaults=()):
    """Adapter from a numpy function's signature to the container method ``method``:
    the one positional-or-keyword argument ``axis_name`` passes through; any other
    argument is refused unless it has numpy's default value (``defaults``)."""
    default = dict(defaults)

    def call(func, a, *args, **kwargs):
        if len(args) > 1:
            raise TypeError(f"numpy.{func.__name__} of a {type(a).__name__} takes the array and "
                            f"{axis_name} only, got {1 + len(args)} positional arguments")
        if args:  # numpy's own signature has refused an axis given twice
            kwargs[axis_name] = args[0]
        axis = kwargs.pop(axis_name, None)
        # numpy's defaults here are the singletons None, False and True
        extra = sorted(k for k, v in kwargs.items() if k not in default or v is not default[k])
        if extra:
            raise TypeError(f"numpy.{func.__name__} of a {type(a).__name__} supports {axis_name} only, "
                            f"got {', '.join(extra)}; call A.{method}({axis_name}) and convert its result, "
                            f"or use A.toarray() for numpy's full signature")
        return getattr(a, method)(axis) if axis_name == "axis" else _transpose_axes(a, axis)

    return call


def _transpose_axes(a, axes):
    if axes is None:
        return a.transpose()
    perm = tuple(axes) if np.iterable(axes) else (axes,)
    if len(perm) == 2 and all(isinstance(p, numbers.Integral) and not isinstance(p, (bool, np.bool_))
                              and -2 <= p < 2 for p in perm):
        perm = tuple(int(p) % 2 for p in perm)
        if perm == (1, 0):
            return a.transpose()
        if perm == (0, 1):
            return a  # numpy returns the array itself (a view); containers are immutable
    raise ValueError(f"axes {axes!r} do not transpose a 2-D {type(a).__name__}: only (1, 0), "
                     f"or (0, 1) for the container itself")


def _numpy_size(func, a, axis=None):
    if axis is None:
        return a.shape[0] * a.shape[1]
    axes = [reduction_axis(ax, type(a).__name__) for ax in (axis if isinstance(axis, tuple) else (axis,))]
    if len(set(axes)) != len(axes):
        raise ValueError(f"axis {axis!r} repeats an axis")
    return math.prod(a.shape[ax] for ax in axes)


def _numpy_copy(func, a, order="K", subok=False):
    return a.copy()


_REDUCTION_DEFAULTS = (("dtype", None), ("out", None), ("keepdims", False), ("where", True))
#: numpy function -> ``handler(func, container, *args, **kwargs)`` (see ``__array_function__``)
_NUMPY_FUNCTIONS = {
    np.sum: _numpy_method("sum", defaults=_REDUCTION_DEFAULTS),
    np.mean: _numpy_method("mean", defaults=_REDUCTION_DEFAULTS),
    np.max: _numpy_method("max", defaults=(("out", None), ("keepdims", False), ("where", True))),
    np.min: _numpy_method("min", defaults=(("out", None), ("keepdims", False), ("where", True))),
    np.count_nonzero: _numpy_method("count_nonzero", defaults=(("keepdims", False),)),
    np.transpose: _numpy_method("transpose", axis_name="axes"),
    np.copy: _numpy_copy,
    np.shape: lambda func, a: a.shape,
    np.ndim: lambda func, a: a.ndim,
    np.size: _numpy_size,
}
for _name, _twin in (("amax", "max"), ("amin", "min")):
    if hasattr(np, _name) and getattr(np, _name) is not getattr(np, _twin):
        _NUMPY_FUNCTIONS[getattr(np, _name)] = _NUMPY_FUNCTIONS[getattr(np, _twin)]


def _coo_to_csr(xp, rows, cols, data, n_rows, n_cols):
    """CSR from COO arrays with unique (row, col) pairs; int64 rows/cols in."""
    key = rows * max(n_cols, 1) + cols
    order = xp.argsort(key)
    col = cols[order].astype(np.int32)
    data = data[order]
    counts = xp.bincount(rows, minlength=n_rows)[:n_rows] if rows.size else xp.zeros(n_rows, np.int64)
    indptr = xp.zeros(n_rows + 1, np.int64)
    indptr[1:] = xp.cumsum(counts)
    if col.shape[0] > INT32_MAX:
        raise ValueError(f"the matrix has {col.shape[0]} stored entries, more than int32 indexing allows")
    return indptr.astype(np.int32), col, xp.ascontiguousarray(data)


def csr_rows_to_dense(indptr, cols, data, row_map, n_backup, n_cols):
    """Dense (R, n_cols) block holding the CSR rows ``r`` with ``row_map[r] >= 0``.

    Works on numpy and cupy; values are moved as bit patterns (exact, and
    independent of 16-bit arithmetic support).
    """
    xp = _array.xp_of(data)
    out = xp.zeros((n_backup, n_cols), data.dtype)
    if n_backup == 0 or cols.shape[0] == 0:
        return out
    ent_rows = xp.searchsorted(indptr, xp.arange(cols.shape[0]), side="right") - 1
    pos = row_map[ent_rows]
    sel = pos >= 0
    _bits(out)[pos[sel], cols[sel]] = _bits(data)[sel]
    return out


def dense_backup_rows(x, rows):
    """Rows ``rows`` of the dense array ``x`` as a contiguous backup block.

    Moved as bit patterns (exact, no 16-bit arithmetic needed on the device),
    except that -0.0 becomes +0.0: a -0.0 is a zero, which no format stores,
    so a backup row must hold the same bits the slot formats would give.
    """
    xp = _array.xp_of(x)
    b = _bits(x)[rows]  # gathered as bits: no 16-bit float gather needed on the device
    live = (b & b.dtype.type(_MASK[x.dtype.itemsize])) != 0
    b = xp.where(live, b, b.dtype.type(0)).astype(b.dtype)
    return xp.ascontiguousarray(b).view(x.dtype)


def zero_rows(rows, *arrays_and_fill):
    """Set ``a[rows] = fill`` for each ``(a, fill)``; values are written as bits."""
    for a, fill in arrays_and_fill:
        if a.dtype.kind == "f" or a.dtype == bfloat16:
            _bits(a)[rows] = 0
        else:
            a[rows] = fill


def worst_tile(cols, tile):
    """(tile index, count) of the fullest tile given one row's column ids (host)."""
    cols = np.asarray(cols, dtype=np.int64)
    if cols.size == 0:
        return 0, 0
    cnt = np.bincount(cols // tile)
    t = int(np.argmax(cnt))
    return t, int(cnt[t])
