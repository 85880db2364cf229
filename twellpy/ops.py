"""Backprop primitives on sparse containers: SpMM, SpMM^T, SDDMM, transpose, products.

Every function works on :class:`twellpy.ELL`, :class:`twellpy.TwELL` and
:class:`twellpy.Hybrid`, on the CPU (Numba) and the GPU (CuPy raw kernels in
``raw_kernels/train_ffn.cu``). Dense operands may be numpy, cupy, torch, jax or
any DLPack array; dense results come back in the caller's array type.
Accumulation is float32 (float64 when a float64 operand is involved). All
results are deterministic: no floating-point atomics are used; the transpose
is a counting sort whose entries are ordered by row inside each column.

Backup rows (TwELL rows over tile capacity, Hybrid rows wider than W) are
always honoured: they go through dense products restricted to those rows.
"""
from __future__ import annotations

import numpy as np

from . import _array, backends
from ._base import SparseArray, dense_operand as _dense, nonzero_mask

__all__ = ["spmm", "spmm_t", "sddmm", "transpose", "multiply"]


def _container(A, name):
    if not isinstance(A, SparseArray):
        raise TypeError(f"{name} must be a twellpy ELL, TwELL or Hybrid container, got "
                        f"{type(A).__module__}.{type(A).__name__}")
    return A


def _promote(*dtypes):
    dt = _array.result_dtype(*dtypes)
    if dt not in _array.FLOAT_DTYPES:  # e.g. float16 + bfloat16 -> promote to float32
        dt = np.dtype(np.float32)
    return dt


def _parts(A):
    """Slot arrays (M, K), backup (R, N), backup_rows (R,), row_map (M,) of a container."""
    vals, idx = A._slots()
    m, n = A.shape
    xp = A.xp
    if A.backup is not None:
        backup, backup_rows = A.backup, A.backup_rows
        row_map = A.row_map
        if row_map is None:
            row_map = xp.full(m, -1, dtype=np.int32)
            row_map[backup_rows] = xp.arange(backup_rows.shape[0], dtype=np.int32)
    else:
        backup = xp.zeros((0, n), dtype=A.dtype)
        backup_rows = xp.zeros(0, dtype=np.int32)
        row_map = xp.full(m, -1, dtype=np.int32)
    return (xp.ascontiguousarray(vals), xp.ascontiguousarray(idx), xp.ascontiguousarray(backup),
            backup_rows, xp.ascontiguousarray(row_map))


def _contig(be, a):
    """C-contiguous ``a`` (a byte copy through unsigned views when needed)."""
    if a.flags.c_contiguous:
        return a
    xp = _array.xp_of(a)
    return be.bits(xp.ascontiguousarray(be.bits(a))).view(a.dtype)


def _dense_rhs(A, B, transposed):
    """Checked operands of ``A @ B`` (or ``A.T @ B``): the container, B as 2-D, whether B was
    1-D, B's caller kind and the result dtype."""
    A = _container(A, "A")
    b, kind = _dense(B, "B", (1, 2))
    _array.same_device([("B", b), ("A", A.values)])
    m, n = A.shape
    vec = b.ndim == 1
    b2 = b[:, None] if vec else b
    rows, what = (m, "A.T with A") if transposed else (n, "A")
    if b2.shape[0] != rows:
        raise ValueError(f"B has shape {tuple(b.shape)}, expected ({rows}, K) for {what} of shape {(m, n)}")
    return A, b2, vec, kind, _promote(A.dtype, b.dtype)


@_array.quiet_underflow
def spmm(A, B):
    """``A @ B`` for a sparse ``A`` (M, N) and a dense ``B`` (N,) or (N, K).

    Parameters
    ----------
    A : ELL, TwELL or Hybrid
    B : array_like
        Dense, on A's device.

    Returns
    -------
    array, shape (M,) or (M, K)
        Promoted dtype of A and B, accumulated in float32 (float64 when the
        promoted dtype is float64), the caller's array type.
    """
    A, b2, vec, kind, dt = _dense_rhs(A, B, transposed=False)
    be = backends.get(b2, "train")
    b2 = be.from_acc(_contig(be, b2), dt)
    vals, idx, backup, backup_rows, _ = _parts(A)
    out = be.slots_spmm(be.from_acc(vals, dt), idx, b2)
    if backup_rows.shape[0]:
        # the dense GEMM also multiplies the zeros of the backup rows (0 * Inf is NaN) and
        # backup_gemm redoes those rows; the slot kernels never warn, so neither does this
        with np.errstate(invalid="ignore", over="ignore"):
            prod = backends.backup_gemm(be.from_acc(backup, dt), b2)
        be.put_rows(out, backup_rows, be.from_acc(prod, dt))
    if vec:
        out = out[:, 0]
    return _array.to_caller(out, kind)


def _transposed(A):
    """Counting-sort transpose of A's pattern plus A's combined values."""
    vals, idx, backup, backup_rows, row_map = _parts(A)
    n = A.shape[1]
    be = backends.get(vals, "train")
    indptr, rows, pos = be.transpose_pattern(idx, row_map, backup, n)
    combined = be.concat([vals, backup])
    return be, indptr, rows, pos, combined


@_array.quiet_underflow
def spmm_t(A, B):
    """``A.T @ B`` without forming a dense A (deterministic, no atomics).

    Parameters
    ----------
    A : ELL, TwELL or Hybrid, shape (M, N)
    B : array_like, shape (M,) or (M, K)

    Returns
    -------
    array, shape (N,) or (N, K)
        Promoted dtype, accumulated in float32 (float64 when the promoted
        dtype is float64), the caller's array type.
    """
    A, b2, vec, kind, dt = _dense_rhs(A, B, transposed=True)
    be, indptr, rows, pos, combined = _transposed(A)
    b2 = be.from_acc(_contig(be, b2), dt)
    out = be.gather_t(indptr, rows, pos, be.from_acc(combined, dt), b2, A.shape[1])
    if vec:
        out = out[:, 0]
    return _array.to_caller(out, kind)


@_array.quiet_underflow
def sddmm(X, Y, pattern):
    """Values of ``X @ Y.T`` at the stored positions of ``pattern``.

    Parameters
    ----------
    X : array_like, shape (M, D)
    Y : array_like, shape (N, D)
    pattern : ELL, TwELL or Hybrid, shape (M, N)
        Its stored slots give the positions; for backup rows the result is the
        dense row of ``X @ Y.T`` masked by the backup row's non-zero pattern.

    Returns
    -------
    container of ``pattern``'s format
        Same indices/counts/backup rows as ``pattern``; values in the promoted
        dtype of X and Y (accumulated in float32, float64 when that dtype is
        float64).

    Notes
    -----
    Slots keep every position of ``pattern``, also where the product is
    exactly 0. Backup rows are dense and so cannot store a zero: there a
    product of exactly 0 is not an entry of the result (``nnz`` and
    :func:`transpose` count fewer entries than for ``pattern``). Combine such
    results with ``pattern`` before transposing (``multiply(result, pattern)``
    compares the slots and backup rows only), or build ``pattern`` without
    backup rows (``ELL``, or a Hybrid wide enough) when the exact pattern
    must survive.
    """
    P = _container(pattern, "pattern")
    x, _ = _dense(X, "X")
    y, _ = _dense(Y, "Y")
    _array.same_device([("X", x), ("Y", y), ("pattern", P.values)])
    m, n = P.shape
    if x.shape[0] != m:
        raise ValueError(f"X has shape {tuple(x.shape)}, expected ({m}, D) for pattern of shape {(m, n)}")
    if y.shape != (n, x.shape[1]):
        raise ValueError(f"Y has shape {tuple(y.shape)}, expected ({n}, {x.shape[1]}) "
                         f"for X of shape {tuple(x.shape)} and pattern of shape {(m, n)}")
    dt = _promote(x.dtype, y.dtype)
    xp = P.xp
    be = backends.get(x, "train")
    x = be.from_acc(_contig(be, x), dt)
    y = be.from_acc(_contig(be, y), dt)
    _, idx, backup, backup_rows, _ = _parts(P)
    vals = be.slots_sddmm(x, y, idx).reshape(P.values.shape)
    new_backup = None
    if P.backup is not None:
        if backup_rows.shape[0]:
            # dense over every column: a NaN it makes off the pattern is masked below, and
            # the slot kernel never warns, so numpy must not warn here either
            with np.errstate(invalid="ignore", over="ignore"):
                dense = be.gemm_acc(be.take_rows(x, backup_rows), y.T)
            new_backup = be.from_acc(xp.where(nonzero_mask(backup), dense, 0), dt)
        else:
            new_backup = xp.zeros((0, n), dtype=dt)
    return _same_pattern(P, vals, new_backup)


def _same_pattern(P, values, backup):
    """Container with P's pattern and new values (padding already 0)."""
    d = P.components()
    d["values"] = values
    if "backup" in d:
        d["backup"] = backup
    return type(P).from_components(d, check=False, check_finite=False)


@_array.quiet_underflow
def transpose(A, format="hybrid", width="auto"):
    """The transpose (N, M) of ``A`` by a deterministic counting sort.

    Parameters
    ----------
    A : ELL, TwELL or Hybrid, shape (M, N)
    format : {"hybrid", "csr"}
        ``"hybrid"``: a :class:`twellpy.Hybrid` (rows of A.T wider than the
        chosen width become dense backup rows). ``"csr"``: a
        ``scipy.sparse.csr_array`` (CPU) or ``cupyx.scipy.sparse.csr_matrix``
        (GPU), float32/float64 only.
    width : int or str
        ELL width strategy of the Hybrid result (see :mod:`twellpy.hybrid`).

    Returns
    -------
    Hybrid or CSR matrix of shape (N, M) with int32 indices; inside each row
    of the result the column (= row of A) ids are ascending.
    """
    A = _container(A, "A")
    if format not in ("hybrid", "csr"):
        raise ValueError(f"unknown format {format!r}; expected 'hybrid' or 'csr'")
    m, n = A.shape
    be, indptr, rows, pos, combined = _transposed(A)
    data = be.take_rows(combined, pos)
    xp = A.xp
    if format == "csr":
        if A.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"format='csr' needs float32 or float64 values, A has {A.dtype}; "
                            f"use format='hybrid' or A.astype('float32')")
        if xp is np:
            import scipy.sparse as sp

            return sp.csr_array((data, rows, indptr), shape=(n, m))
        import cupyx.scipy.sparse as csp

        return csp.csr_matrix((data, rows, indptr), shape=(n, m))
    from .hybrid import Hybrid, choose_width

    row_nnz = indptr[1:] - indptr[:-1]
    W = choose_width(row_nnz, m, A.dtype.itemsize, width)
    row_nnz_host = row_nnz.get() if hasattr(row_nnz, "get") else np.asarray(row_nnz)
    R = int(np.count_nonzero(row_nnz_host > W))
    maps = be.row_maps(row_nnz, W, R)  # [row_map (n,) | backup_rows (R,)], built where the counts are
    row_map, backup_rows = maps[:n], maps[n:]
    vals, ell_idx, ell_nnz = be.csr_to_hybrid(indptr.astype(np.int64), rows, data, row_map, W, m, R)
    ell_val, backup = be.split_combined(vals, n, W, R, m)
    # keep the strategy (not only the width it resolved to), as Hybrid.from_dense does:
    # .T and conversions of the result rebuild with it
    return Hybrid(ell_val, ell_idx, ell_nnz, shape=(n, m), backup=backup,
                  backup_rows=backup_rows, width_strategy=width, check=False, check_finite=False)


@_array.quiet_underflow
def multiply(A, B):
    """Element-wise product of two containers with one shared pattern.

    Parameters
    ----------
    A, B : containers of the same format, shape and sparsity pattern

    Returns
    -------
    container
        Same pattern, values ``A * B`` in the promoted dtype (computed in
        float32, float64 for float64).

    Raises
    ------
    ValueError
        Different formats, shapes or patterns; the same matrix stored with
        different layout parameters (Hybrid ``width``, TwELL ``tile``/``slots``)
        is named as such, with the ``asformat`` call that aligns them.
    """
    A = _container(A, "A")
    B = _container(B, "B")
    layout = [k for k in A._params() if k != "width_strategy"]  # how "auto" was resolved: not layout
    pa, pb = A._params(), B._params()
    if A.format == B.format and A.shape == B.shape and any(pa[k] != pb.get(k) for k in layout):
        # the same matrix stored with another width (tile/slots) has other slots and
        # backup rows: name the layout parameters and how to align them
        diff = ", ".join(f"{k} {pa[k]!r} vs {pb[k]!r}" for k in layout if pa[k] != pb.get(k))
        how = ", ".join(f"{k}={pa[k]!r}" for k in layout)
        raise ValueError(f"B has a different sparsity pattern: A and B store their entries in different "
                         f"layouts ({diff}; backup rows "
                         f"{A.n_backup} vs {B.n_backup}), so their slots cannot be paired; element-wise "
                         f"products need identical patterns: convert one to the other's layout, e.g. "
                         f"B.asformat({A.format!r}, {how})")
    return A._mul_same_pattern(B, "B")
