"""CPU backend: Numba kernels for the container contract of docs/internals.md.

Every public function here has the same name, argument order and return
values as its twin in :mod:`twellpy.backends.cuda`. Inputs are C-contiguous
numpy arrays; outputs are freshly allocated numpy arrays.

Numba has no float16/bfloat16 arithmetic, so kernels that only *move* values
(construction, conversion, transposition) work on the raw bit patterns: a value
array is viewed as unsigned integers of the same width, a value is non-zero when
``bits & 0x7f..f != 0`` (so ``-0.0`` is zero and NaN is non-zero, exactly like
``x != 0``), and copies are bit-exact. Kernels that do arithmetic (SpMM) convert
16-bit inputs to float32 first and accumulate in float32 (float64 for float64).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .._array import float_bit_masks

_INT32_MAX = 2**31 - 1

# Unsigned "bits" dtype and the all-but-sign mask, by itemsize.
_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_MASK = {2: np.uint16(0x7FFF), 4: np.uint32(0x7FFFFFFF), 8: np.uint64(0x7FFFFFFFFFFFFFFF)}


# Output allocation of the Python wrappers (tests swap in a poisoning version).
_empty = np.empty


def _bits(a):
    """``a`` viewed as unsigned integers of the same width (no copy)."""
    return a.view(_BITS[a.dtype.itemsize])


def _accum_dtype(*dtypes):
    """float64 if any input is float64, float32 otherwise."""
    return np.dtype(np.float64) if any(np.dtype(d) == np.float64 for d in dtypes) else np.dtype(np.float32)


def _result_dtype(a, b):
    """Result dtype of a product: equal dtypes stay, float64 wins, else float32."""
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    return _accum_dtype(a, b)


def _check_int32(n, what):
    if n > _INT32_MAX:
        raise ValueError(f"{what} is {n}, which does not fit the int32 index type (max {_INT32_MAX})")


# --------------------------------------------------------------------------
# construction from dense
# --------------------------------------------------------------------------
_CHUNK = 16  # columns tested at once for "all zero" (vectorised max reduction)


@numba.njit(cache=True, nogil=True, parallel=True)
def _k_dense_to_twell(xb, mask, tile, slots, vals, idx, counts, row_max, row_maxbits):
    m, n = xb.shape
    n_tiles = counts.shape[1]
    for i in prange(m):
        pos = np.empty(max(tile, 1), np.int32)
        row = xb[i]
        best = 0
        mb = row_maxbits.dtype.type(0)
        for t in range(n_tiles):
            lo = t * tile
            hi = min(lo + tile, n)
            # Branch-free compaction: always store the column, advance only on
            # a non-zero. Positions are a prefix count, so the result is
            # deterministic and sorted. Activation rows are mostly zero, so
            # chunks whose largest |bits| is 0 are skipped after one
            # vectorised max; that max also finds NaN/Inf (|bits| >= exponent
            # mask) without a second pass over x.
            c = 0
            j = lo
            while j + _CHUNK <= hi:
                cm = row[j] & mask
                for u in range(1, _CHUNK):
                    cm = max(cm, row[j + u] & mask)
                if cm != 0:
                    mb = max(mb, cm)
                    for u in range(_CHUNK):
                        pos[c] = j + u
                        c += (row[j + u] & mask) != 0
                j += _CHUNK
            while j < hi:
                b = row[j] & mask
                mb = max(mb, b)
                pos[c] = j
                c += b != 0
                j += 1
            k = min(c, slots)
            for s in range(k):
                j = pos[s]
                vals[i, t, s] = row[j]
                idx[i, t, s] = j
            for s in range(k, slots):
                vals[i, t, s] = 0
                idx[i, t, s] = -1
            counts[i, t] = k
            if c > best:
                best = c
        row_max[i] = best
        row_maxbits[i] = mb


def _exp_mask(dtype):
    """Bits of the all-ones exponent: ``bits & 0x7f..f >= this`` means NaN or Inf."""
    return float_bit_masks(dtype)[0]


def _dense_to_twell(x, tile, slots):
    m, n = x.shape
    _check_int32(n, "the number of columns")
    # a tile wider than the row is the row (one tile, the same layout), as in the CUDA
    # packer: the kernel sizes a per-row buffer by the tile width
    tile = max(1, min(tile, n))
    n_tiles = -(-n // tile) if n else 0
    vals = _empty((m, n_tiles, slots), x.dtype)
    idx = _empty((m, n_tiles, slots), np.int32)
    counts = _empty((m, n_tiles), np.int32)
    row_max = _empty(m, np.int32)
    xb = _bits(x)
    row_maxbits = _empty(m, xb.dtype)
    _k_dense_to_twell(xb, _MASK[x.dtype.itemsize], tile, slots, _bits(vals), idx, counts, row_max, row_maxbits)
    finite = m == 0 or row_maxbits.max() < _exp_mask(x.dtype)
    return vals, idx, counts, row_max, bool(finite)


def dense_to_twell(x, tile, slots):
    """Pack a dense (M, N) array into TwELL slots in one pass.

    Parameters
    ----------
    x : numpy.ndarray
        (M, N), C-contiguous, any supported float dtype.
    tile, slots : int
        Tile width T and slots per (row, tile) S.

    Returns
    -------
    values : (M, ceil(N/T), S) ndarray, dtype of ``x``
    indices : (M, ceil(N/T), S) int32, global column, -1 in padding
    counts : (M, ceil(N/T)) int32, entries stored (at most S)
    row_max_count : (M,) int32, largest true tile count of each row (may be > S;
        such a row holds only its first S entries per tile).
    """
    return _dense_to_twell(x, tile, slots)[:4]


def dense_to_twell_finite(x, tile, slots):
    """:func:`dense_to_twell` plus a fifth result: True when ``x`` has no NaN/Inf.

    Same single pass over ``x``: the finiteness test is fused into the scan.
    """
    return _dense_to_twell(x, tile, slots)


@numba.njit(cache=True, nogil=True, parallel=True)
def _k_dense_row_nnz(xb, mask, out, row_maxbits):
    m, n = xb.shape
    for i in prange(m):
        c = 0
        mb = row_maxbits.dtype.type(0)
        row = xb[i]
        for j in range(n):
            b = row[j] & mask
            mb = max(mb, b)
            c += b != 0
        out[i] = c
        row_maxbits[i] = mb


def dense_row_nnz_finite(x):
    """:func:`dense_row_nnz` plus True when ``x`` has no NaN/Inf (same pass)."""
    _check_int32(x.shape[1], "the number of columns")
    out = _empty(x.shape[0], np.int32)
    xb = _bits(x)
    row_maxbits = _empty(x.shape[0], xb.dtype)
    _k_dense_row_nnz(xb, _MASK[x.dtype.itemsize], out, row_maxbits)
    finite = x.shape[0] == 0 or row_maxbits.max() < _exp_mask(x.dtype)
    return out, bool(finite)


def dense_row_nnz(x):
    """Number of non-zeros (NaN included, -0.0 excluded) of each row: (M,) int32."""
    return dense_row_nnz_finite(x)[0]


@numba.njit(cache=True, nogil=True, parallel=True)
def _k_dense_to_ell(xb, mask, width, row_nnz, vals, idx):
    m, n = xb.shape
    for i in prange(m):
        c = 0
        if row_nnz[i] <= width:
            row = xb[i]
            for j in range(n):
                v = row[j]
                if (v & mask) != 0:
                    vals[i, c] = v
                    idx[i, c] = j
                    c += 1
                    if c == width:
                        break
        for s in range(c, width):
            vals[i, s] = 0
            idx[i, s] = -1


def dense_to_ell(x, width, row_nnz):
    """Pack a dense (M, N) array into ELL slots of width ``width``.

    Rows with ``row_nnz > width`` are left as padding (the caller stores them
    elsewhere). Returns ``values`` (M, width) and ``indices`` (M, width) int32.
    """
    m, n = x.shape
    vals = _empty((m, width), x.dtype)
    idx = _empty((m, width), np.int32)
    _k_dense_to_ell(_bits(x), _MASK[x.dtype.itemsize], width, row_nnz, _bits(vals), idx)
    return vals, idx


# --------------------------------------------------------------------------
# construction from CSR (sorted column indices, no duplicates)
# --------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True, parallel=True)
def _k_csr_to_twell(indptr, cols, data, tile, slots, vals, idx, counts, row_max):
    m = counts.shape[0]
    n_tiles = counts.shape[1]
    for i in prange(m):
        for t in range(n_tiles):
            counts[i, t] = 0
            for s in range(slots):
                vals[i, t, s] = 0
                idx[i, t, s] = -1
        for p in range(indptr[i], indptr[i + 1]):
            j = cols[p]
            t = j // tile
            c = counts[i, t]
            if c < slots:
                vals[i, t, c] = data[p]
                idx[i, t, c] = j
            counts[i, t] = c + 1
        best = 0
        for t in range(n_tiles):
            c = counts[i, t]
            if c > best:
                best = c
            if c > slots:
                counts[i, t] = slots
        row_max[i] = best


def csr_to_twell(indptr, indices, data, n_cols, tile, slots):
    """TwELL slots from a CSR matrix with sorted, unique column indices.

    Returns ``values, indices, counts, row_max_count`` as :func:`dense_to_twell`.
    """
    m = indptr.shape[0] - 1
    _check_int32(n_cols, "the number of columns")
    tile = max(1, min(tile, n_cols))  # a tile wider than the row is the row (see _dense_to_twell)
    n_tiles = -(-n_cols // tile) if n_cols else 0
    vals = _empty((m, n_tiles, slots), data.dtype)
    idx = _empty((m, n_tiles, slots), np.int32)
    counts = _empty((m, n_tiles), np.int32)
    row_max = _empty(m, np.int32)
    _k_csr_to_twell(indptr, indices, _bits(data), tile, slots, _bits(vals), idx, counts, row_max)
    return vals, idx, counts, row_max


@numba.njit(cache=True, nogil=True, parallel=True)
def _k_csr_to_ell(indptr, cols, data, width, vals, idx, row_nnz):
    m = row_nnz.shape[0]
    for i in prange(m):
        lo = indptr[i]
        n = indptr[i + 1] - lo
        row_nnz[i] = n
        c = 0
        if n <= width:
            for p in range(n):
                vals[i, p] = data[lo + p]
                idx[i, p] = cols[lo + p]
            c = n
        for s in range(c, width):
            vals[i, s] = 0
            idx[i, s] = -1


def csr_to_ell(indptr, indices, data, width):
    """ELL slots of width ``width`` from a CSR matrix with sorted, unique columns.

    Rows wider than ``width`` are left as padding; ``row_nnz`` is the true
    count of every row. Returns ``values, indices, row_nnz``.
    """
    m = indptr.shape[0] - 1
    vals = _empty((m, width), data.dtype)
    idx = _empty((m, width), np.int32)
    row_nnz = _empty(m, np.int32)
    _k_csr_to_ell(indptr, indices, _bits(data), width, _bits(vals), idx, row_nnz)
    return vals, idx, row_nnz


# --------------------------------------------------------------------------
# slot lists back to dense / CSR
# --------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True, parallel=True)
def _k_slots_to_dense(vals, idx, out):
    m, k = vals.shape
    for i in prange(m):
        for s in range(k):
            j = idx[i, s]
            if j >= 0:
                out[i, j] = vals[i, s]


def slots_to_dense(values, indices, n_cols):
    """Dense (M, n_cols) array from flattened slot lists (index -1 = skip)."""
    m = values.shape[0]
    out = np.zeros((m, n_cols), values.dtype)
    _k_slots_to_dense(_bits(values), indices, _bits(out))
    return out


@numba.njit(cache=True, nogil=True, parallel=True)
def _k_slots_to_csr(vals, idx, indptr, col, data):
    m, k = vals.shape
    for i in prange(m):
        p = indptr[i]
        end = indptr[i + 1]
        for s in range(k):
            if p >= end:
                break
            j = idx[i, s]
            if j >= 0:
                col[p] = j
                data[p] = vals[i, s]
                p += 1


def slots_to_csr(values, indices, row_counts):
    """CSR arrays from flattened slot lists.

    Parameters
    ----------
    values, indices : (M, K) arrays, entries sorted by column in slot order.
    row_counts : (M,) int32, stored entries per row.

    Returns
    -------
    indptr : (M+1,) int32
    col : (nnz,) int32
    data : (nnz,) dtype of ``values``
    """
    m = values.shape[0]
    indptr64 = np.zeros(m + 1, np.int64)
    np.cumsum(row_counts, out=indptr64[1:])
    nnz = int(indptr64[-1])
    _check_int32(nnz, "the number of stored entries")
    indptr = indptr64.astype(np.int32)
    col = _empty(nnz, np.int32)
    data = _empty(nnz, values.dtype)
    _k_slots_to_csr(_bits(values), indices, indptr, col, _bits(data))
    return indptr, col, data


# --------------------------------------------------------------------------
# transpose (deterministic counting sort)
# --------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _k_transpose_count(idx, n_cols, indptr):
    m, k = idx.shape
    for i in range(m):
        for s in range(k):
            j = idx[i, s]
            if j >= 0:
                indptr[j + 1] += 1
    for j in range(n_cols):
        indptr[j + 1] += indptr[j]


@numba.njit(cache=True, nogil=True)
def _k_transpose_fill(vals, idx, indptr, col, data):
    m, k = idx.shape
    nxt = indptr[:-1].copy()
    # Rows are visited in increasing order, so every output row is sorted.
    for i in range(m):
        for s in range(k):
            j = idx[i, s]
            if j >= 0:
                p = nxt[j]
                col[p] = i
                data[p] = vals[i, s]
                nxt[j] = p + 1


def _transpose(values, indices, n_cols):
    indptr64 = np.zeros(n_cols + 1, np.int64)
    _k_transpose_count(indices, n_cols, indptr64)
    nnz = int(indptr64[-1])
    _check_int32(nnz, "the number of stored entries")
    col = _empty(nnz, np.int32)
    data = _empty(nnz, values.dtype)
    _k_transpose_fill(values, indices, indptr64, col, data)
    return indptr64.astype(np.int32), col, data


def transpose_slots(values, indices, n_cols):
    """CSR arrays ``(indptr, col, data)`` of the transpose (n_cols, M).

    Deterministic: a counting sort over the columns, rows visited in order.
    """
    _check_int32(values.shape[0], "the number of rows")
    indptr, col, data = _transpose(_bits(values), indices, n_cols)
    return indptr, col, data.view(values.dtype)


# --------------------------------------------------------------------------
# sparse @ dense
# --------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _row_axpys(o, vv, jj, n, b):
    """``o = sum_q vv[q] * b[jj[q]]`` over the first ``n`` entries.

    Four B rows per pass over ``o`` (the output row is read and written a
    quarter as often); the order of the additions is fixed, so results are
    deterministic.
    """
    ncol = b.shape[1]
    for c in range(ncol):
        o[c] = 0
    q = 0
    while q + 4 <= n:
        v0 = vv[q]
        v1 = vv[q + 1]
        v2 = vv[q + 2]
        v3 = vv[q + 3]
        b0 = b[jj[q]]
        b1 = b[jj[q + 1]]
        b2 = b[jj[q + 2]]
        b3 = b[jj[q + 3]]
        for c in range(ncol):
            o[c] += v0 * b0[c] + v1 * b1[c] + v2 * b2[c] + v3 * b3[c]
        q += 4
    while q < n:
        v0 = vv[q]
        b0 = b[jj[q]]
        for c in range(ncol):
            o[c] += v0 * b0[c]
        q += 1


@numba.njit(cache=True, nogil=True, parallel=True)
def _k_slots_spmm(vals, idx, b, out):
    m, k = vals.shape
    for i in prange(m):
        vv = np.empty(k, vals.dtype)
        jj = np.empty(k, np.int64)
        n = 0
        for s in range(k):
            j = idx[i, s]
            if j >= 0:
                vv[n] = vals[i, s]
                jj[n] = j
                n += 1
        _row_axpys(out[i], vv, jj, n, b)


def _as_acc(a, acc):
    return a if a.dtype == acc else a.astype(acc)


def slots_spmm(values, indices, B):
    """``A @ B`` for A given by flattened slot lists (M, K) and dense B (N, P).

    Accumulates in float32 (float64 when either side is float64); the result
    has the promoted dtype of ``values`` and ``B``.
    """
    res = _result_dtype(values.dtype, B.dtype)
    acc = _accum_dtype(res)
    out = _empty((values.shape[0], B.shape[1]), acc)
    _k_slots_spmm(_as_acc(values, acc), indices, np.ascontiguousarray(_as_acc(B, acc)), out)
    return out if res == acc else out.astype(res)


@numba.njit(cache=True, nogil=True, parallel=True)
def _k_csr_spmm(indptr, col, data, b, out):
    m = out.shape[0]
    for i in prange(m):
        lo = indptr[i]
        hi = indptr[i + 1]
        _row_axpys(out[i], data[lo:hi], col[lo:hi], hi - lo, b)


def slots_spmm_t(values, indices, B, n_cols):
    """``A.T @ B`` for A (M, n_cols) given by slot lists and dense B (M, P).

    Deterministic: A is transposed by a counting sort (rows visited in order)
    and each output row is then gathered in parallel, so every output element
    is summed over the rows of A in increasing order whatever the thread
    count. Returns (n_cols, P) in the promoted dtype.
    """
    res = _result_dtype(values.dtype, B.dtype)
    acc = _accum_dtype(res)
    indptr, col, data = _transpose(_as_acc(values, acc), indices, n_cols)
    out = _empty((n_cols, B.shape[1]), acc)
    _k_csr_spmm(indptr, col, data, np.ascontiguousarray(_as_acc(B, acc)), out)
    return out if res == acc else out.astype(res)


# --------------------------------------------------------------------------
# TwELL fast paths: use the counts, never scan padding
# --------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True, parallel=True)
def _k_twell_spmm(vals, idx, counts, b, out):
    m, n_tiles, slots = vals.shape
    for i in prange(m):
        tot = 0
        for t in range(n_tiles):
            tot += min(counts[i, t], slots)
        vv = np.empty(tot, vals.dtype)
        jj = np.empty(tot, np.int64)
        n = 0
        for t in range(n_tiles):
            for s in range(min(counts[i, t], slots)):
                vv[n] = vals[i, t, s]
                jj[n] = idx[i, t, s]
                n += 1
        _row_axpys(out[i], vv, jj, n, b)


def twell_spmm(values, indices, counts, B):
    """``A @ B`` for TwELL slots (M, n_tiles, S) with their counts; as :func:`slots_spmm`."""
    res = _result_dtype(values.dtype, B.dtype)
    acc = _accum_dtype(res)
    out = _empty((values.shape[0], B.shape[1]), acc)
    _k_twell_spmm(_as_acc(values, acc), indices, counts, np.ascontiguousarray(_as_acc(B, acc)), out)
    return out if res == acc else out.astype(res)


@numba.njit(cache=True, nogil=True)
def _k_twell_transpose_count(idx, counts, n_cols, indptr):
    m, n_tiles, slots = idx.shape
    for i in range(m):
        for t in range(n_tiles):
            for s in range(min(counts[i, t], slots)):
                indptr[idx[i, t, s] + 1] += 1
    for j in range(n_cols):
        indptr[j + 1] += indptr[j]


@numba.njit(cache=True, nogil=True)
def _k_twell_transpose_fill(vals, idx, counts, indptr, col, data):
    m, n_tiles, slots = idx.shape
    nxt = indptr[:-1].copy()
    for i in range(m):
        for t in range(n_tiles):
            for s in range(min(counts[i, t], slots)):
                j = idx[i, t, s]
                p = nxt[j]
                col[p] = i
                data[p] = vals[i, t, s]
                nxt[j] = p + 1


def _twell_transpose(values, indices, counts, n_cols):
    indptr64 = np.zeros(n_cols + 1, np.int64)
    _k_twell_transpose_count(indices, counts, n_cols, indptr64)
    nnz = int(indptr64[-1])
    _check_int32(nnz, "the number of stored entries")
    col = _empty(nnz, np.int32)
    data = _empty(nnz, values.dtype)
    _k_twell_transpose_fill(values, indices, counts, indptr64, col, data)
    return indptr64, col, data


def twell_transpose(values, indices, counts, n_cols):
    """CSR of the transpose from TwELL slots and counts; as :func:`transpose_slots`."""
    _check_int32(values.shape[0], "the number of rows")
    indptr, col, data = _twell_transpose(_bits(values), indices, counts, n_cols)
    return indptr.astype(np.int32), col, data.view(values.dtype)


def twell_spmm_t(values, indices, counts, B, n_cols):
    """``A.T @ B`` for TwELL slots with their counts; as :func:`slots_spmm_t`."""
    res = _result_dtype(values.dtype, B.dtype)
    acc = _accum_dtype(res)
    indptr, col, data = _twell_transpose(_as_acc(values, acc), indices, counts, n_cols)
    out = _empty((n_cols, B.shape[1]), acc)
    _k_csr_spmm(indptr, col, data, np.ascontiguousarray(_as_acc(B, acc)), out)
    return out if res == acc else out.astype(res)


@numba.njit(cache=True, nogil=True, parallel=True)
def _k_rows_spmm(a, b, out):
    r, n = a.shape
    ncol = b.shape[1]
    for i in prange(r):
        o = out[i]
        for c in range(ncol):
            o[c] = 0
        row = a[i]
        for j in range(n):
            v = row[j]
            if v != 0:
                bj = b[j]
                for c in range(ncol):
                    o[c] += v * bj[c]


def dense_rows_spmm(rows, B):
    """``rows @ B`` for the dense backup rows (R, N) and dense B (N, K), skipping zeros.

    The backup rows are mostly zeros on activation data, so skipping them
    beats a BLAS call for the few rows involved.
    """
    res = _result_dtype(rows.dtype, B.dtype)
    acc = _accum_dtype(res)
    out = _empty((rows.shape[0], B.shape[1]), acc)
    _k_rows_spmm(_as_acc(rows, acc), np.ascontiguousarray(_as_acc(B, acc)), out)
    return out if res == acc else out.astype(res)


@numba.njit(cache=True, nogil=True, parallel=True)
def _k_rows_spmm_t(a, b, out, chunk):
    r, n = a.shape
    ncol = b.shape[1]
    n_chunks = (n + chunk - 1) // chunk
    # Threads own disjoint blocks of output rows (columns of a): no races,
    # summation over the backup rows in increasing order.
    for ch in prange(n_chunks):
        j0 = ch * chunk
        j1 = min(j0 + chunk, n)
        for j in range(j0, j1):
            for c in range(ncol):
                out[j, c] = 0
        for i in range(r):
            bi = b[i]
            row = a[i]
            for j in range(j0, j1):
                v = row[j]
                if v != 0:
                    o = out[j]
                    for c in range(ncol):
                        o[c] += v * bi[c]


def dense_rows_spmm_t(rows, B):
    """``rows.T @ B`` for dense backup rows (R, N) and dense B (R, P), skipping zeros: (N, P)."""
    res = _result_dtype(rows.dtype, B.dtype)
    acc = _accum_dtype(res)
    n = rows.shape[1]
    out = _empty((n, B.shape[1]), acc)
    chunk = max(64, -(-n // (4 * numba.get_num_threads())))
    _k_rows_spmm_t(_as_acc(rows, acc), np.ascontiguousarray(_as_acc(B, acc)), out, chunk)
    return out if res == acc else out.astype(res)


# --------------------------------------------------------------------------
# helpers without a CUDA twin requirement (containers probe with getattr)
# --------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True, parallel=True)
def _k_count_nonfinite(xb, exp_mask):
    m = xb.shape[0]
    bad = 0
    for i in prange(m):
        row = xb[i]
        c = 0
        for j in range(row.shape[0]):
            c += (row[j] & exp_mask) == exp_mask
        bad += c
    return bad




def all_finite(x):
    """True when the 2-D float array ``x`` holds no NaN/Inf (one pass, no temporaries)."""
    exp = _exp_mask(x.dtype)
    if x.size == 0:
        return True
    x2 = x if x.ndim == 2 else x.reshape(1, -1)
    return _k_count_nonfinite(_bits(np.ascontiguousarray(x2)), exp) == 0
