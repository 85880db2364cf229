"""CUDA launchers of the training kernels (``raw_kernels/train_ffn.cu``).

Free functions over raw cupy arrays, mirroring :mod:`twellpy.backends.cpu_train`
(same names, same argument order, same results up to fp32 rounding). Every
kernel is deterministic: none uses floating-point atomics (see the header of
``train_ffn.cu``), so ``deterministic=True`` in the public API costs nothing.
"""
from __future__ import annotations

import numpy as np

from .._array import FLOAT_DTYPES, cupy_module
from . import _registry

SOURCE = "train_ffn.cu"
WARPS = 8            # keep in sync with TW_WARPS in train_ffn.cu
GATHER_THREADS = 128  # keep in sync with TW_GATHER_THREADS

_INT32_MAX = 2**31 - 1


def _names():
    names = []
    for dt in FLOAT_DTYPES:
        t = _registry.ctype(dt)
        for base in ("relu_count", "relu_pack", "csr_to_hybrid", "tr_count", "tr_place",
                     "gather_t", "slots_spmm", "slots_sddmm"):
            names.append(f"twellpy_train_{base}<{t}>")
        for base in ("fwd", "bwd", "wgrad"):
            for gated in (0, 1):
                names.append(f"twellpy_train_{base}<{t},{gated}>")
    return names


_registry.declare(SOURCE, _names())


def _k(base, dtype, gated=None):
    t = _registry.ctype(dtype)
    name = f"twellpy_train_{base}<{t}>" if gated is None else f"twellpy_train_{base}<{t},{int(gated)}>"
    return _registry.get_kernel(SOURCE, name)


def _cp():
    return cupy_module()


def _vec_ok(width, *arrays):
    """Whether 16-byte vector loads are legal: rows start 16-byte aligned."""
    itemsize = None
    for a in arrays:
        if a is None:
            continue
        itemsize = a.dtype.itemsize
        if a.data.ptr % 16:
            return 0
    if itemsize is None:
        return 0
    return int((width * itemsize) % 16 == 0)


def _rows_grid(rows):
    return (max(1, (int(rows) + WARPS - 1) // WARPS),), (32 * WARPS,)


def _gather_grid(n_out, width, itemsize):
    per_block = GATHER_THREADS * (16 // itemsize)
    chunks = max(1, (int(width) + per_block - 1) // per_block)
    if chunks > 65535:
        raise ValueError(f"row width {width} is too large for one launch (at most {65535 * per_block})")
    return (max(1, int(n_out)), chunks), (GATHER_THREADS,)


def _i64(v):
    return np.int64(v)


def _i32(v):
    return np.int32(v)


# ---------------------------------------------------------------------------
def relu_csr(z):
    """CSR of relu(z) (columns ascending): ``row_nnz, indptr(int64), col, val``.

    ``z`` is (rows, H), C-contiguous. Deterministic (warp ballot prefix counts).
    """
    cp = _cp()
    rows, H = z.shape
    row_nnz = cp.empty(rows, dtype=cp.int32)
    if rows == 0:
        return row_nnz, cp.zeros(1, cp.int64), cp.empty(0, cp.int32), cp.empty(0, z.dtype)
    g, b = _rows_grid(rows)
    _k("relu_count", z.dtype)(g, b, (z, _i64(rows), _i32(H), row_nnz))
    indptr = cp.empty(rows + 1, dtype=cp.int64)
    indptr[0] = 0
    cp.cumsum(row_nnz, dtype=cp.int64, out=indptr[1:])
    nnz = int(indptr[-1])
    col = cp.empty(nnz, dtype=cp.int32)
    val = cp.empty(nnz, dtype=z.dtype)
    if nnz:
        _k("relu_pack", z.dtype)(g, b, (z, _i64(rows), _i32(H), indptr, col, val))
    return row_nnz, indptr, col, val


def csr_to_hybrid(indptr, col, val, row_map, width, n_cols, n_backup):
    """Split a CSR into an ELL part of ``width`` and dense backup rows.

    Returns ``vals, ell_idx (M, W), ell_nnz (M,)`` where ``vals`` is the
    combined value buffer: the (M, W) ELL values followed by the (R, N) backup
    rows (see :func:`split_combined`). Rows with ``row_map >= 0`` go to
    ``backup[row_map]``; the caller sends every row wider than ``width`` there.
    """
    cp = _cp()
    M = row_map.shape[0]
    vals = cp.empty(M * width + n_backup * n_cols, dtype=val.dtype)
    vals[M * width:] = 0
    ell_val, backup = split_combined(vals, M, width, n_backup, n_cols)
    ell_idx = cp.empty((M, width), dtype=cp.int32)
    ell_nnz = cp.empty(M, dtype=cp.int32)
    if M:
        g, b = _rows_grid(M)
        _k("csr_to_hybrid", val.dtype)(g, b, (indptr, col, val, row_map, _i64(M), _i32(width),
                                              _i32(n_cols), ell_val, ell_idx, ell_nnz, backup))
    return vals, ell_idx, ell_nnz


def split_combined(vals, M, W, R, N):
    """Views ``(ell (M, W), backup (R, N))`` of a combined value buffer."""
    return vals[:M * W].reshape(M, W), vals[M * W:M * W + R * N].reshape(R, N)


def ffn_forward_ell(x, w_up, w_downT, idx, nnz, gval, uval, gated):
    """ELL part of the FFN forward: fills ``uval`` (M, W) when gated, returns y.

    Backup rows (``nnz == 0``, padding only) get y = 0.
    """
    cp = _cp()
    M, D = x.shape
    W = idx.shape[1]
    y = cp.empty((M, D), dtype=x.dtype)
    if M:
        vec = _vec_ok(D, x, w_up if gated else None, w_downT, y)
        g, b = _rows_grid(M)
        _k("fwd", x.dtype, gated)(g, b, (x, w_up if gated else w_downT, w_downT, idx, nnz, gval,
                                         uval if gated else gval, y, _i64(M), _i32(W), _i32(D),
                                         _i32(vec)))
    return y


def ffn_backward_ell(dy, w_downT, w_up, w_gate, idx, nnz, gval, uval, l1_scale, gated, da, db):
    """ELL part of the FFN backward; writes ``da`` (du or dh) and ``db`` (dg), returns dx.

    ``da``/``db`` are (M, W) views (of the combined value buffers) the kernel fills.
    Backup rows of dx are 0.
    """
    cp = _cp()
    M, D = dy.shape
    W = idx.shape[1]
    dx = cp.empty((M, D), dtype=dy.dtype)
    if M:
        vec = _vec_ok(D, dy, w_downT, w_up, w_gate if gated else None, dx)
        g, b = _rows_grid(M)
        _k("bwd", dy.dtype, gated)(g, b, (dy, w_downT, w_up, w_gate if gated else w_up, idx, nnz,
                                          gval, uval if gated else gval, da, db if gated else da, dx,
                                          _i64(M), _i32(W), _i32(D), np.float32(l1_scale), _i32(vec)))
    return dx


def _transpose_blocks(M, n_cols):
    """Row-block size and count for the counting sort (bounded scratch memory)."""
    budget = 8 << 20  # counters per pass: 32 MiB of int32 at most (and at least one block)
    nb = max(1, min(-(-M // 16), budget // max(1, n_cols)))
    rpb = max(1, -(-M // nb))
    nb = max(1, -(-M // rpb))
    return rpb, nb


def transpose_pattern(idx, row_map, backup, n_cols):
    """Deterministic counting-sort transpose of a slots+backup pattern.

    Parameters
    ----------
    idx : (M, K) int32 slot columns (-1 = padding)
    row_map : (M,) int32, -1 or the row's position in ``backup``
    backup : (R, N) dense backup rows (their non-zeros are entries)
    n_cols : int, N

    Returns
    -------
    indptr : (N+1,) int32, rows : (nnz,) int32 (sorted inside each column),
    pos : (nnz,) int32 positions in the combined value buffer
    (``r*K + s`` for slots, ``M*K + row_map[r]*N + c`` for backup rows).
    """
    cp = _cp()
    M, K = idx.shape
    R = backup.shape[0]
    if M * K + R * n_cols > _INT32_MAX:
        raise ValueError(f"pattern too large for int32 positions: M*K + R*N = {M * K + R * n_cols} "
                         f"exceeds 2**31-1 (M={M}, K={K}, R={R}, N={n_cols})")
    if M == 0 or n_cols == 0:
        return cp.zeros(n_cols + 1, cp.int32), cp.empty(0, cp.int32), cp.empty(0, cp.int32)
    rpb, nb = _transpose_blocks(M, n_cols)
    counts = cp.zeros((nb, n_cols), dtype=cp.int32)
    g, b = _rows_grid(nb)
    args = (idx, row_map, backup, _i64(M), _i32(K), _i32(n_cols), _i32(rpb), _i32(nb))
    _k("tr_count", backup.dtype)(g, b, args + (counts,))
    col_tot = counts.sum(axis=0, dtype=cp.int64)
    indptr64 = cp.zeros(n_cols + 1, dtype=cp.int64)
    cp.cumsum(col_tot, out=indptr64[1:])
    nnz = int(indptr64[-1])
    if nnz > _INT32_MAX:
        raise ValueError(f"transpose has {nnz} entries, more than int32 indices can address")
    indptr = indptr64.astype(cp.int32)
    # cursor[b, c] = indptr[c] + entries of column c in blocks before b
    cursor = cp.cumsum(counts, axis=0, dtype=cp.int32)
    cursor -= counts
    cursor += indptr[None, :-1]
    del counts
    rows = cp.empty(nnz, dtype=cp.int32)
    pos = cp.empty(nnz, dtype=cp.int32)
    if nnz:
        _k("tr_place", backup.dtype)(g, b, args + (cursor, rows, pos))
    return indptr, rows, pos


def ffn_weight_grads(indptr, rows, pos, x, dy, da, db, gval, uval, n_neurons, gated):
    """Weight gradients from the transposed pattern.

    Returns ``dw_up (H, D), dw_gate (H, D) or None, dw_downT (H, D)``.
    """
    cp = _cp()
    M, D = x.shape
    H = int(n_neurons)
    dt = x.dtype
    dw_a = cp.empty((H, D), dtype=dt)
    dw_b = cp.empty((H, D), dtype=dt) if gated else None
    dw_dT = cp.empty((H, D), dtype=dt)
    if H and D:
        vec = _vec_ok(D, x, dy, dw_a, dw_b, dw_dT)
        g, b = _gather_grid(H, D, dt.itemsize)
        _k("wgrad", dt, gated)(g, b, (indptr, rows, pos, x, dy, da, db if gated else da, gval,
                                      uval if gated else gval, dw_a, dw_b if gated else dw_a, dw_dT,
                                      _i32(H), _i32(D), _i32(vec)))
    return dw_a, dw_b, dw_dT


def gather_t(indptr, rows, pos, vals, B, n_out):
    """``out (n_out, Kc) = A^T @ B`` from A's transposed pattern and combined values."""
    cp = _cp()
    Kc = B.shape[1]
    out = cp.empty((n_out, Kc), dtype=B.dtype)
    if n_out and Kc:
        vec = _vec_ok(Kc, B, out)
        g, b = _gather_grid(n_out, Kc, B.dtype.itemsize)
        _k("gather_t", B.dtype)(g, b, (indptr, rows, pos, vals, B, out, _i32(Kc), _i32(vec)))
    return out


def slots_spmm(vals, idx, B):
    """``out (M, Kc) = A @ B`` over the slot part (padding skipped)."""
    cp = _cp()
    M, K = idx.shape
    N, Kc = B.shape
    out = cp.empty((M, Kc), dtype=B.dtype)
    if M and Kc:
        vec = _vec_ok(Kc, B, out)
        g, b = _rows_grid(M)
        _k("slots_spmm", B.dtype)(g, b, (vals, idx, B, out, _i64(M), _i32(K), _i32(N), _i32(Kc),
                                         _i32(vec)))
    return out


def slots_sddmm(X, Y, idx):
    """``out[r, s] = X[r] . Y[idx[r, s]]`` (0 in padding)."""
    cp = _cp()
    M, K = idx.shape
    N, D = Y.shape
    out = cp.empty((M, K), dtype=X.dtype)
    if M and K:
        vec = _vec_ok(D, X, Y)
        g, b = _rows_grid(M)
        _k("slots_sddmm", X.dtype)(g, b, (X, Y, idx, out, _i64(M), _i32(K), _i32(N), _i32(D),
                                          _i32(vec)))
    return out


_BF16_GEMM_OK = None


def gemm(a, b, out_dtype):
    """Dense ``a @ b`` through cuBLAS (cupy.matmul), result in ``out_dtype``.

    16-bit inputs go to cuBLAS in their own dtype (fp32 accumulation) when the
    installed CuPy supports it; otherwise both are upcast to float32 once.
    """
    global _BF16_GEMM_OK
    cp = _cp()
    if a.dtype.itemsize == 2 and _BF16_GEMM_OK is not False:
        try:
            out = cp.matmul(a, b)
            _BF16_GEMM_OK = True
        except Exception:  # pragma: no cover - depends on the CuPy build
            _BF16_GEMM_OK = False
        else:
            return out if out.dtype == out_dtype else out.astype(out_dtype)
    if a.dtype.itemsize == 2:
        out = cp.matmul(a.astype(cp.float32), b.astype(cp.float32))
    else:
        out = cp.matmul(a, b)
    return out if out.dtype == out_dtype else out.astype(out_dtype)


def gemm_acc(a, b):
    """Dense ``a @ b`` with a float32 result (float64 for float64 inputs).

    Used for the few backup rows, where rounding an intermediate product to a
    16-bit dtype would add an avoidable rounding step.
    """
    cp = _cp()
    acc = cp.float64 if a.dtype == cp.float64 else cp.float32
    return cp.matmul(a.astype(acc, copy=False), b.astype(acc, copy=False))
