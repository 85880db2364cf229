"""Numba kernels of the training step and of the training primitives.

Free functions over raw numpy arrays with the same names, argument order and
results as :mod:`twellpy.backends.cuda_train`. Numba has no bfloat16/float16
arithmetic, so 16-bit data is upcast to float32 at the boundary (accumulation
is float32, float64 for float64 data) and results are rounded back to the
storage dtype at the same points as on the GPU (u, h, du, dg are stored
rounded). Every kernel is deterministic: parallel loops only ever write
disjoint outputs, and each sum runs in a fixed order.
"""
from __future__ import annotations

import numba
import numpy as np

_INT32_MAX = 2**31 - 1
_JIT = dict(cache=True, nogil=True)


def compute_dtype(dtype):
    """float64 for float64 data, float32 otherwise (Numba's working dtype)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _up(a):
    """``a`` in its compute dtype, C-contiguous (no copy when already so)."""
    return np.ascontiguousarray(a, dtype=compute_dtype(a.dtype))


def round_to(a, dtype):
    """Round a compute-dtype array through ``dtype`` (a no-op for fp32/fp64)."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 2:
        return a.astype(dtype).astype(a.dtype)
    return a


# ---------------------------------------------------------------------------
@numba.njit(parallel=True, **_JIT)
def _relu_count(z, row_nnz):
    rows, H = z.shape
    for r in numba.prange(rows):
        n = 0
        for c in range(H):
            v = z[r, c]
            if v > 0 or v != v:  # relu(v) != 0: positive (denormals too) or NaN
                n += 1
        row_nnz[r] = n


@numba.njit(parallel=True, **_JIT)
def _relu_pack(z, indptr, col, val):
    rows, H = z.shape
    for r in numba.prange(rows):
        p = indptr[r]
        for c in range(H):
            v = z[r, c]
            if v > 0 or v != v:
                col[p] = c
                val[p] = v
                p += 1


def relu_csr(z):
    """CSR of relu(z) (columns ascending): ``row_nnz, indptr(int64), col, val``.

    ``z`` must already hold values rounded to the storage dtype; ``val`` comes
    back in ``z``'s dtype.
    """
    zc = _up(z)
    rows = zc.shape[0]
    row_nnz = np.empty(rows, dtype=np.int32)
    if rows:
        _relu_count(zc, row_nnz)
    indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(row_nnz, out=indptr[1:])
    nnz = int(indptr[-1])
    col = np.empty(nnz, dtype=np.int32)
    val = np.empty(nnz, dtype=zc.dtype)
    if nnz:
        _relu_pack(zc, indptr, col, val)
    return row_nnz, indptr, col, val.astype(z.dtype, copy=False)


def relu_count(z, out=None):
    """Stored entries of relu(z) per row: (rows,) int32 (into ``out`` if given)."""
    zc = _up(z)
    row_nnz = np.empty(zc.shape[0], dtype=np.int32) if out is None else out
    if zc.shape[0]:
        _relu_count(zc, row_nnz)
    return row_nnz


@numba.njit(parallel=True, **_JIT)
def _relu_to_hybrid(z, row_map, ell_val, ell_idx, ell_nnz, backup):
    M, W = ell_idx.shape
    H = z.shape[1]
    for r in numba.prange(M):
        rm = row_map[r]
        kept = 0
        if rm >= 0:
            for c in range(H):
                v = z[r, c]
                if v > 0 or v != v:
                    backup[rm, c] = v
                else:
                    backup[rm, c] = 0.0
        else:
            for c in range(H):
                v = z[r, c]
                if (v > 0 or v != v) and kept < W:  # the caller routes rows with more than W to backup
                    ell_val[r, kept] = v
                    ell_idx[r, kept] = c
                    kept += 1
        for s in range(kept, W):
            ell_val[r, s] = 0
            ell_idx[r, s] = -1
        ell_nnz[r] = kept


def row_maps(counts, width, n_backup, capacity=False):
    """``[row_map (M,) | backup_rows (R,)]`` (int32) of a Hybrid of ELL width
    ``width``: ``row_map[r]`` is row r's position among the rows with more than
    ``width`` non-zeros (rows in order), or -1; ``backup_rows[k]`` is the k-th
    such row. ``n_backup`` must be their number; see the CUDA twin.

    With ``capacity=True``, ``n_backup`` is only room for that many backup rows
    (the speculative training forward sizes it before it has the counts): wide
    rows past it map to -1 (the caller finds the overflow from the counts), and
    ``backup_rows`` entries past the last wide row are -1, as the kernel writes.
    """
    counts = np.asarray(counts)
    M = counts.shape[0]
    rows = np.flatnonzero(counts > width).astype(np.int32)
    if capacity:
        rows = rows[:n_backup]
    elif rows.size != n_backup:
        raise ValueError(f"n_backup is {n_backup}, but {rows.size} rows have more than {width} non-zeros")
    maps = np.full(M + n_backup, -1, dtype=np.int32)
    maps[rows] = np.arange(rows.size, dtype=np.int32)
    maps[M:M + rows.size] = rows
    return maps


def relu_to_hybrid(z, row_map, width, n_backup):
    """relu(z) packed straight into a Hybrid (no CSR); see the CUDA twin.

    ``n_backup`` may exceed the rows ``row_map`` routes there (a capacity); the
    rows past them are zero here and unspecified on the GPU.

    Returns ``vals, ell_idx (M, W), ell_nnz (M,), neuron_counts (H,)``.
    """
    zc = _up(z)
    M, H = zc.shape
    vals = np.empty(M * width + n_backup * H, dtype=zc.dtype)
    # backup rows no row is routed to (a speculative capacity) stay zero here, so the
    # neuron counts below see only routed rows (the CUDA kernel leaves them unwritten)
    vals[M * width:] = 0
    ell_val, backup = split_combined(vals, M, width, n_backup, H)
    ell_idx = np.empty((M, width), dtype=np.int32)
    ell_nnz = np.empty(M, dtype=np.int32)
    if M:
        _relu_to_hybrid(zc, row_map, ell_val, ell_idx, ell_nnz, backup)
    # per-neuron counts after the parallel pass (threads must not share counters)
    neuron_counts = np.bincount(ell_idx[ell_idx >= 0], minlength=H).astype(np.int32)
    if n_backup:
        neuron_counts += np.count_nonzero(backup, axis=0).astype(np.int32)
    return vals.astype(z.dtype, copy=False), ell_idx, ell_nnz, neuron_counts


def relu_count_pack(z, width, n_backup, out=None):
    """``relu_count`` and ``relu_to_hybrid`` for a known W; see the CUDA twin. Rows
    wider than ``width`` keep padding in the ELL part; the backup part is zero here
    (``backup_rows_from_z`` fills it)."""
    counts = relu_count(z, out=out)
    M, H = z.shape
    vals, ell_idx, ell_nnz, _ = relu_to_hybrid(z, np.full(M, -1, np.int32), width, n_backup)
    wide = counts > width
    split_combined(vals, M, width, n_backup, H)[0][wide] = 0
    ell_idx[wide] = -1
    ell_nnz[wide] = 0
    zc = _up(z)
    neuron_counts = np.count_nonzero((zc > 0) | (zc != zc), axis=0).astype(np.int32)
    return vals, ell_idx, ell_nnz, neuron_counts, counts


def gate_count_pack(x, w_act, width, n_backup, out=None, chunks=1):
    """``z = x @ w_act.T`` and :func:`relu_count_pack` of it; see the CUDA twin
    (``chunks``, an L2 matter there, changes nothing here)."""
    z = gemm(x, w_act.T, x.dtype)
    return z, relu_count_pack(z, width, n_backup, out=out)


def gate_count_pack_streamed(x, w_act, width, n_backup, chunk_rows, out=None):
    """The pattern step of a speculative forward of a batch larger than one chunk;
    see the CUDA twin. The chunks are GEMM'd, packed and their wide rows written one
    at a time here too, so the whole gate output never exists. Returns ``packed, maps``."""
    M, H = x.shape[0], w_act.shape[0]
    step = max(1, int(chunk_rows))
    vals = np.zeros(M * width + n_backup * H, dtype=x.dtype)
    ell_idx = np.empty((M, width), dtype=np.int32)
    ell_nnz = np.empty(M, dtype=np.int32)
    neuron_counts = np.zeros(H, dtype=np.int32)
    counts = np.empty(M, dtype=np.int32) if out is None else out
    ell_val = split_combined(vals, M, width, n_backup, H)[0]
    wide_before = 0  # wide rows in the chunks so far (the kernel's running device count)
    for a in range(0, M, step):
        b = min(M, a + step)
        z = gemm(x[a:b], w_act.T, x.dtype)
        cv, ci, cn, cnc, cc = relu_count_pack(z, width, 0)
        ell_val[a:b] = split_combined(cv, b - a, width, 0, H)[0]
        ell_idx[a:b], ell_nnz[a:b], counts[a:b] = ci, cn, cc
        neuron_counts += cnc
        wide = np.flatnonzero(cc > width)
        if n_backup and wide.size:
            # a row's backup position counts the wide rows before it only, so this chunk's
            # maps are its own, shifted by the wide rows of the chunks before (past the
            # capacity: -1, as the whole batch's maps will say)
            chunk_map = np.full(b - a, -1, dtype=np.int32)
            pos = wide_before + np.arange(wide.size)
            kept = pos < n_backup
            chunk_map[wide[kept]] = pos[kept]
            backup_rows_from_z(z, chunk_map, vals, width, n_backup, n_rows=M)
        wide_before += int(wide.size)
    return (vals, ell_idx, ell_nnz, neuron_counts, counts), row_maps(counts, width, n_backup, capacity=True)


def backup_rows_from_z(z, row_map, vals, width, n_backup, n_rows=None):
    """relu(z) of the rows ``row_map`` routes to backup rows, into ``vals``' backup part.
    ``row_map``'s first ``len(z)`` entries are z's rows'; ``n_rows``: the rows of the
    batch ``vals`` holds, when ``z`` is only a chunk of it (default: z's rows)."""
    n, H = z.shape
    M = n if n_rows is None else int(n_rows)
    rm = np.asarray(row_map)[:n]
    sel = np.flatnonzero(rm >= 0)
    if sel.size and n_backup:
        zc = _up(z)[sel]
        backup = split_combined(vals, M, width, n_backup, H)[1]
        backup[rm[sel]] = np.where((zc > 0) | (zc != zc), zc, 0).astype(vals.dtype)


@numba.njit(parallel=True, **_JIT)
def _csr_to_hybrid(indptr, col, val, row_map, ell_val, ell_idx, ell_nnz, backup):
    M, W = ell_idx.shape
    N = backup.shape[1]
    for r in numba.prange(M):
        start = indptr[r]
        n = indptr[r + 1] - start
        rm = row_map[r]
        kept = 0
        if rm >= 0:
            for e in range(n):
                c = col[start + e]
                if 0 <= c < N:
                    backup[rm, c] = val[start + e]
        else:
            kept = min(n, W)
            for s in range(kept):
                ell_val[r, s] = val[start + s]
                ell_idx[r, s] = col[start + s]
        for s in range(kept, W):
            ell_val[r, s] = 0
            ell_idx[r, s] = -1
        ell_nnz[r] = kept


def csr_to_hybrid(indptr, col, val, row_map, width, n_cols, n_backup):
    """Split a CSR into an ELL part of ``width`` and dense backup rows.

    Returns ``vals, ell_idx (M, W), ell_nnz (M,)`` with ``vals`` the combined
    value buffer in ``val``'s dtype: ELL values (M*W) then backup rows (R*N).
    Rows with ``row_map >= 0`` go to ``backup[row_map]``.
    """
    M = row_map.shape[0]
    vc = _up(val)
    vals = np.zeros(M * width + n_backup * n_cols, dtype=vc.dtype)
    ell_val, backup = split_combined(vals, M, width, n_backup, n_cols)
    ell_idx = np.empty((M, width), dtype=np.int32)
    ell_nnz = np.empty(M, dtype=np.int32)
    if M:
        _csr_to_hybrid(indptr, col, vc, row_map, ell_val, ell_idx, ell_nnz, backup)
    return vals.astype(val.dtype, copy=False), ell_idx, ell_nnz


def split_combined(vals, M, W, R, N):
    """Views ``(ell (M, W), backup (R, N))`` of a combined value buffer."""
    return vals[:M * W].reshape(M, W), vals[M * W:M * W + R * N].reshape(R, N)


class _OnHost:
    """What :func:`queue_to_host` returns on the CPU: the data is already there."""

    __slots__ = ("_arr",)

    def __init__(self, arr):
        self._arr = arr

    def read(self):
        """The array itself (nothing to wait for)."""
        return self._arr


def queue_to_host(arr):
    """Twin of the CUDA launcher that starts a copy to the host: here ``read()``
    returns ``arr`` at once (the CPU backend has no host/device split)."""
    return _OnHost(np.asarray(arr))


# ---------------------------------------------------------------------------
# reassociation lets LLVM vectorise the dot products (the order is then fixed
# by the compiled code, so results stay deterministic); NaN/Inf semantics kept.
# The kernels take their entries two at a time: two weight rows streamed in one
# pass (two dot products over one X row, or one pass over an output row for two
# updates) keep more loads in flight; on the CPU FFN's sparse step that ran
# 1.7-1.9x faster than one entry at a time (C1, 2026-12-07).
@numba.njit(parallel=True, fastmath={"reassoc", "contract"}, **_JIT)
def _slots_sddmm(X, Y, idx, out, zero):
    M, K = idx.shape
    N, D = Y.shape
    for r in numba.prange(M):
        s = 0
        while s < K:
            k1 = idx[r, s]
            if s + 1 < K and 0 <= k1 < N and 0 <= idx[r, s + 1] < N:
                k2 = idx[r, s + 1]
                acc1 = zero  # typed zero: float32 accumulation for float32 data
                acc2 = zero
                for c in range(D):
                    acc1 += X[r, c] * Y[k1, c]
                    acc2 += X[r, c] * Y[k2, c]
                out[r, s] = acc1
                out[r, s + 1] = acc2
                s += 2
                continue
            acc = zero
            if 0 <= k1 < N:
                for c in range(D):
                    acc += X[r, c] * Y[k1, c]
            out[r, s] = acc
            s += 1


@numba.njit(parallel=True, fastmath={"contract"}, **_JIT)
def _slots_spmm(vals, idx, B, out):
    M, K = idx.shape
    N, Kc = B.shape
    for r in numba.prange(M):
        for c in range(Kc):
            out[r, c] = 0
        s = 0
        while s < K:
            k1 = idx[r, s]
            if not 0 <= k1 < N:
                s += 1
                continue
            t = s + 1  # the next valid slot, if any
            while t < K and not 0 <= idx[r, t] < N:
                t += 1
            a1 = vals[r, s]
            if t < K:
                k2 = idx[r, t]
                a2 = vals[r, t]
                for c in range(Kc):
                    out[r, c] += a1 * B[k1, c] + a2 * B[k2, c]
                s = t + 1
            else:
                for c in range(Kc):
                    out[r, c] += a1 * B[k1, c]
                s = t


@numba.njit(parallel=True, fastmath={"contract"}, **_JIT)
def _slots_spmm2(va, vb, idx, Ba, Bb, out):
    M, K = idx.shape
    N, Kc = Ba.shape
    for r in numba.prange(M):
        for c in range(Kc):
            out[r, c] = 0
        for s in range(K):
            k = idx[r, s]
            if 0 <= k < N:
                a = va[r, s]
                b = vb[r, s]
                for c in range(Kc):
                    out[r, c] += a * Ba[k, c] + b * Bb[k, c]


def slots_sddmm(X, Y, idx):
    """``out[r, s] = X[r] . Y[idx[r, s]]`` (0 in padding), in X's dtype."""
    Xc, Yc = _up(X), _up(Y)
    out = np.empty(idx.shape, dtype=Xc.dtype)
    if idx.size:
        _slots_sddmm(Xc, Yc, idx, out, Xc.dtype.type(0))
    return out.astype(X.dtype, copy=False)


def slots_spmm(vals, idx, B):
    """``out (M, Kc) = A @ B`` over the slot part (padding skipped), in B's dtype."""
    Bc = _up(B)
    out = np.empty((idx.shape[0], B.shape[1]), dtype=Bc.dtype)
    if out.size:
        _slots_spmm(np.ascontiguousarray(vals, dtype=Bc.dtype), idx, Bc, out)
    return out.astype(B.dtype, copy=False)


# ---------------------------------------------------------------------------
def _h_values(gval, uval, gated, dtype):
    """h on the pattern in the compute dtype, rounded like the GPU kernels."""
    if not gated:
        return gval
    return round_to(gval * uval, dtype)


def ffn_forward_ell(x, w_up, w_downT, idx, nnz, gval, uval, gated):
    """ELL part of the FFN forward: fills ``uval`` (M, W) when gated, returns ``y, habs``.

    ``habs`` (M,) in the compute dtype is each row's sum of |h| over its slots.
    Backup rows hold padding only in ``idx``, so their y rows and habs are 0.
    """
    dt = x.dtype
    g = _up(gval)
    u = None
    if gated:
        u = round_to(slots_sddmm(x, w_up, idx).astype(g.dtype, copy=False), dt)
        uval[...] = u
    h = _h_values(g, u, gated, dt)
    return slots_spmm(h, idx, w_downT), np.abs(h).sum(axis=1, dtype=h.dtype)


def ffn_backward_ell(dy, w_downT, w_up, w_gate, idx, nnz, gval, uval, l1_scale, gated, da, db):
    """ELL part of the FFN backward; fills ``da`` (du or dh) and ``db`` (dg), returns dx.

    dh = (dy @ w_down) on the pattern + ``l1_scale`` * sign(h) (padding stays 0).
    """
    ell_dh(dy, w_downT, idx, gval, uval, l1_scale, gated, da, db)
    dx = np.empty(dy.shape, dtype=dy.dtype)
    return ell_dx(w_up, w_gate if gated else None, idx, nnz, da, db if gated else None, dx)


def ell_dh(dy, w_downT, idx, gval, uval, l1_scale, gated, da, db):
    """The first half of :func:`ffn_backward_ell`: fills ``da`` (du or dh) and ``db`` (dg)
    on the ELL part, padding 0; the weights' products are left to :func:`ell_dx`."""
    dt = dy.dtype
    g = _up(gval)
    u = _up(uval) if gated else None
    h = _h_values(g, u, gated, dt)
    dh = slots_sddmm(dy, w_downT, idx).astype(g.dtype, copy=False)
    if l1_scale:
        dh = dh + g.dtype.type(l1_scale) * np.sign(h)
    if gated:
        da[...] = round_to(dh * g, dt)
        db[...] = round_to(dh * u, dt)
    else:
        da[...] = round_to(dh, dt)


def ell_dx(w_up, w_gate, idx, nnz, da, db, dx, skip=None):
    """``dx = da @ w_up (+ db @ w_gate)`` over the ELL part, into ``dx`` (M, D); rows with
    ``skip[r] >= 0`` (the row map: backup rows, whose dx is already written) are left alone."""
    # every row (no copies) or the rows not skipped
    keep = slice(None) if skip is None else np.flatnonzero(np.asarray(skip) < 0)
    part_idx = idx[keep]
    if not part_idx.shape[0] or not dx.shape[1]:
        return dx
    gated = db is not None
    if gated:
        out = np.empty((part_idx.shape[0], dx.shape[1]), dtype=compute_dtype(dx.dtype))
        _slots_spmm2(_up(da[keep]), _up(db[keep]), part_idx, _up(w_up), _up(w_gate), out)
        dx[keep] = out.astype(dx.dtype, copy=False)
    else:
        dx[keep] = slots_spmm(da[keep], part_idx, w_up)
    return dx


def ffn_backward_by_neuron(indptr, rows, pos, idx, x, dy, w_downT, da, db, gval, uval, l1_scale, n_neurons,
                           gated, base=None):
    """dh on the ELL part (into ``da``, ``db``) and the weight gradients from the
    transposed pattern, as the GPU's one pass by neuron (``twellpy_train_wgrad_dh``);
    here :func:`ell_dh` then :func:`ffn_weight_grads`, the row-oriented flow's values.
    ``da``, ``db``, ``gval``, ``uval`` are the combined buffers, ``idx`` the (M, W) ELL
    columns; backup entries' ``da`` / ``db`` must already be written."""
    M, W = idx.shape
    split = lambda a: a[:M * W].reshape(M, W)  # noqa: E731
    ell_dh(dy, w_downT, idx, split(gval), split(uval) if gated else None, l1_scale, gated, split(da),
           split(db) if gated else None)
    return ffn_weight_grads(indptr, rows, pos, x, dy, da, db, gval, uval, n_neurons, gated, base=base)


def by_neuron_ok(D, *arrays):
    """The CPU runs every shape the one-pass-by-neuron flow may take."""
    return True


# ---------------------------------------------------------------------------
@numba.njit(**_JIT)
def _tr_count(idx, row_map, backup, col_count):
    M, K = idx.shape
    N = col_count.shape[0]
    for r in range(M):
        rm = row_map[r]
        if rm >= 0:
            for c in range(N):
                if backup[rm, c] != 0 or backup[rm, c] != backup[rm, c]:
                    col_count[c] += 1
        else:
            for s in range(K):
                c = idx[r, s]
                if 0 <= c < N:
                    col_count[c] += 1


@numba.njit(**_JIT)
def _tr_place(idx, row_map, backup, cursor, rows, pos):
    M, K = idx.shape
    N = cursor.shape[0]
    base = M * K
    for r in range(M):
        rm = row_map[r]
        if rm >= 0:
            for c in range(N):
                if backup[rm, c] != 0 or backup[rm, c] != backup[rm, c]:
                    p = cursor[c]
                    cursor[c] = p + 1
                    rows[p] = r
                    pos[p] = base + rm * N + c
        else:
            for s in range(K):
                c = idx[r, s]
                if 0 <= c < N:
                    p = cursor[c]
                    cursor[c] = p + 1
                    rows[p] = r
                    pos[p] = r * K + s


def transpose_pattern(idx, row_map, backup, n_cols, nnz=None):
    """Deterministic counting-sort transpose of a slots+backup pattern.

    Returns ``indptr (N+1,) int32, rows (nnz,) int32, pos (nnz,) int32``; see
    :func:`twellpy.backends.cuda_train.transpose_pattern`.
    """
    M, K = idx.shape
    R = backup.shape[0]
    if M * K + R * n_cols > _INT32_MAX:
        raise ValueError(f"pattern too large for int32 positions: M*K + R*N = {M * K + R * n_cols} "
                         f"exceeds 2**31-1 (M={M}, K={K}, R={R}, N={n_cols})")
    bk = _up(backup) if R else np.zeros((0, n_cols), dtype=np.float32)
    col_count = np.zeros(n_cols, dtype=np.int64)
    _tr_count(idx, row_map, bk, col_count)
    indptr64 = np.zeros(n_cols + 1, dtype=np.int64)
    np.cumsum(col_count, out=indptr64[1:])
    if nnz is not None and int(nnz) != int(indptr64[-1]):
        raise ValueError(f"nnz={nnz} given, but the pattern holds {int(indptr64[-1])} entries")
    nnz = int(indptr64[-1])
    if nnz > _INT32_MAX:
        raise ValueError(f"transpose has {nnz} entries, more than int32 indices can address")
    cursor = indptr64[:-1].copy()
    rows = np.empty(nnz, dtype=np.int32)
    pos = np.empty(nnz, dtype=np.int32)
    if nnz:
        _tr_place(idx, row_map, bk, cursor, rows, pos)
    return indptr64.astype(np.int32), rows, pos


@numba.njit(parallel=True, fastmath={"contract"}, **_JIT)
def _gather_t(indptr, rows, pos, vals, B, out, zero=True):
    """``out = A^T @ B`` (``zero=False``: added to what ``out`` holds)."""
    n_out, Kc = out.shape
    for k in numba.prange(n_out):
        if zero:
            for c in range(Kc):
                out[k, c] = 0
        e = indptr[k]
        end = indptr[k + 1]
        while e + 1 < end:  # two entries per pass over out[k]
            a1 = vals[pos[e]]
            a2 = vals[pos[e + 1]]
            m1 = rows[e]
            m2 = rows[e + 1]
            for c in range(Kc):
                out[k, c] += a1 * B[m1, c] + a2 * B[m2, c]
            e += 2
        if e < end:
            a = vals[pos[e]]
            m = rows[e]
            for c in range(Kc):
                out[k, c] += a * B[m, c]


@numba.njit(parallel=True, fastmath={"contract"}, **_JIT)
def _gather_t_dual(indptr, rows, pos, va, vb, B, out_a, out_b, zero=True):
    """``out_a = A^T @ B`` and ``out_b = Bv^T @ B`` for two value sets on one
    pattern: each B row is read once for both (dw_up and dw_gate share x).
    ``zero=False``: the products are added to what the outputs hold."""
    n_out, Kc = out_a.shape
    for k in numba.prange(n_out):
        if zero:
            for c in range(Kc):
                out_a[k, c] = 0
                out_b[k, c] = 0
        for e in range(indptr[k], indptr[k + 1]):
            p = pos[e]
            a = va[p]
            b = vb[p]
            m = rows[e]
            for c in range(Kc):
                bv = B[m, c]
                out_a[k, c] += a * bv
                out_b[k, c] += b * bv


def gather_t(indptr, rows, pos, vals, B, n_out):
    """``out (n_out, Kc) = A^T @ B`` from A's transposed pattern and combined values."""
    Bc = _up(B)
    out = np.empty((n_out, B.shape[1]), dtype=Bc.dtype)
    if out.size:
        _gather_t(indptr, rows, pos, np.ascontiguousarray(vals, dtype=Bc.dtype), Bc, out)
    return out.astype(B.dtype, copy=False)


def ffn_weight_grads(indptr, rows, pos, x, dy, da, db, gval, uval, n_neurons, gated, base=None):
    """Weight gradients from the transposed pattern.

    ``base``, if given, is ``(dw_up, dw_gate or None, dw_downT)`` partial sums
    (H, D) in the compute dtype (the backup rows' GEMM products): each
    gradient is that sum plus the pattern's entries, rounded once.

    Returns ``dw_up (H, D), dw_gate (H, D) or None, dw_downT (H, D)``.
    """
    dt = x.dtype
    H = int(n_neurons)
    g = _up(gval)
    h = _h_values(g, _up(uval) if gated else None, gated, dt)
    xc, dyc = _up(x), _up(dy)
    cd = xc.dtype
    shape = (H, x.shape[1])
    if base is None:
        out_a = np.empty(shape, dtype=cd)
        out_h = np.empty_like(out_a)
        out_b = np.empty_like(out_a) if gated else None
    else:
        want = [("dw_up", base[0]), ("dw_downT", base[2])] + ([("dw_gate", base[1])] if gated else [])
        for nm, a in want:
            if a is None or a.dtype != cd or a.shape != shape:
                got = "None" if a is None else f"{a.dtype} {a.shape}"
                raise ValueError(f"base {nm}: expected a {cd} array of shape {shape}, got {got}")
        out_a, out_h = base[0].copy(), base[2].copy()
        out_b = base[1].copy() if gated else None
    zero = base is None
    if out_a.size:
        if gated:
            _gather_t_dual(indptr, rows, pos, _up(da), _up(db), xc, out_a, out_b, zero)
        else:
            _gather_t(indptr, rows, pos, _up(da), xc, out_a, zero)
        _gather_t(indptr, rows, pos, h, dyc, out_h, zero)
    cast = lambda a: None if a is None else a.astype(dt, copy=False)  # noqa: E731
    return cast(out_a), cast(out_b), cast(out_h)


# ---------------------------------------------------------------------------
# dense helpers (same names as in cuda_train, where they avoid CuPy bfloat16 gaps)
class SideWork:
    """The CPU runs everything in order: a no-op twin of ``cuda_train.SideWork``."""

    def __init__(self, enabled=True):
        del enabled  # in order either way

    def start_here(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def join(self):
        pass


def bits(a):
    return a


def take_rows(a, rows):
    """``a[rows]``."""
    return a[rows]


def put_rows(dst, rows, src):
    """``dst[rows] = src``."""
    dst[rows] = src


def concat(arrays):
    """1-D concatenation."""
    return np.concatenate([a.reshape(-1) for a in arrays])


def transpose_copy(a):
    """C-contiguous copy of ``a.T``."""
    return np.ascontiguousarray(a.T)


def to_acc(a):
    """``a`` in its compute dtype (float32, float64 for float64)."""
    return a.astype(compute_dtype(a.dtype), copy=False)


def from_acc(a, dtype):
    """``a`` rounded once to ``dtype``."""
    return a.astype(dtype, copy=False)


def gemm(a, b, out_dtype):
    """Dense ``a @ b`` (numpy BLAS in the compute dtype), result in ``out_dtype``."""
    cd = compute_dtype(a.dtype)
    out = np.matmul(a.astype(cd, copy=False), b.astype(cd, copy=False))
    return out.astype(out_dtype, copy=False)


def gemm_acc(a, b, out=None):
    """Dense ``a @ b`` with a float32 result (float64 for float64 inputs).

    With ``out`` (C-contiguous, (m, n), that dtype) the product is added to it
    and ``out`` returned.
    """
    cd = compute_dtype(a.dtype)
    # the backup-row GEMMs also multiply the zeros of inactive neurons: a NaN/Inf
    # weight there gives 0 * Inf, which the callers mask or redo (backup_exact), so
    # numpy's "invalid value" warning (an error under np.errstate(invalid="raise"))
    # would be about a value that never reaches the result
    with np.errstate(invalid="ignore"):
        prod = np.matmul(a.astype(cd, copy=False), b.astype(cd, copy=False))
    if out is None:
        return prod
    with np.errstate(invalid="ignore", over="ignore"):  # Inf + -Inf: the caller's values
        out += prod
    return out


# ---------------------------------------------------------------------------
# dense backup rows: the element-wise work around their GEMMs (twins of the
# one-pass kernels of cuda_train)
def backup_rows_forward(g_bk, u_acc, u_bk, backup_rows, habs, gated):
    """u, h and the |h| sums of the dense backup rows.

    Fills ``u_bk`` with u on the pattern (non-zero g, NaN included) and 0
    elsewhere (gated), sets ``habs[backup_rows]`` to each row's sum of |h| and
    returns h (rounded to the value dtype; ``g_bk`` itself when not gated).
    """
    dt = g_bk.dtype
    g = _up(g_bk)
    on = g_bk != 0
    if not gated:
        habs[backup_rows] = np.abs(g).sum(axis=1, dtype=g.dtype)
        return g_bk
    u = round_to(np.where(on, u_acc, 0).astype(g.dtype, copy=False), dt)
    u_bk[...] = u
    h = np.where(on, round_to(g * u, dt), 0).astype(g.dtype, copy=False)
    habs[backup_rows] = np.abs(h).sum(axis=1, dtype=h.dtype)
    return h.astype(dt, copy=False)


def backup_rows_backward(dh_acc, g_bk, u_bk, l1_scale, gated, da_bk, db_bk, h_out=None):
    """Fill ``da_bk`` (du, or dh when not gated) and ``db_bk`` (dg) of the backup rows.

    dh is ``dh_acc`` (= dy[backup_rows] @ w_down) on the pattern plus
    ``l1_scale * sign(h)`` when ``l1_scale`` is non-zero, 0 elsewhere.
    ``h_out`` (gated only) also receives h on the pattern, 0 elsewhere.
    """
    dt = g_bk.dtype
    g = _up(g_bk)
    on = g_bk != 0
    u = _up(u_bk) if gated else None
    h = round_to(g * u, dt) if gated else g
    if h_out is not None:
        if not gated:
            raise ValueError("h_out: the non-gated FFN's h is g itself; pass None")
        h_out[...] = np.where(on, h, 0).astype(dt, copy=False)
    d = dh_acc.astype(g.dtype, copy=False)
    if l1_scale:
        d = d + g.dtype.type(l1_scale) * np.sign(h)
    d = np.where(on, d, 0).astype(g.dtype, copy=False)
    if gated:
        # +0.0 off the pattern, as the CUDA kernel writes (d * g would give -0.0 where g is -0.0)
        da_bk[...] = np.where(on, d * g, 0).astype(dt, copy=False)
        db_bk[...] = np.where(on, d * u, 0).astype(dt, copy=False)
    else:
        da_bk[...] = d.astype(dt, copy=False)


def backup_exact(out, g_bk, a, b, a2=None, b2=None):
    """Redo the rows of a backup-row product that came out non-finite, on their pattern only.

    ``out`` (R, D) in the compute dtype holds ``a @ b`` (plus ``a2 @ b2``) from
    a dense GEMM, ``a``/``a2`` (R, H) being 0 off the pattern of ``g_bk``
    (R, H) and ``b``/``b2`` (H, D) weights. The GEMM also multiplies those
    zeros, so a NaN/Inf weight of a neuron inactive in a row would turn the
    row into NaN; such a product always leaves a NaN in the row, so only rows
    with a NaN/Inf are summed again over their active neurons (in place).
    """
    if not out.size:
        return out
    bad = np.flatnonzero(~np.isfinite(out).all(axis=1))
    for r in bad:  # rare: a non-finite weight or an overflow
        on = np.flatnonzero(g_bk[r] != 0)  # NaN is active, -0.0 is not (as the pattern)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf here are the caller's values
            acc = _up(a[r, on]) @ _up(b[on])
            if a2 is not None:
                acc = acc + _up(a2[r, on]) @ _up(b2[on])
        out[r] = acc
    return out


def backup_wgrad_exact(base, g_bk, u_bk, da_bk, db_bk, x, dy, backup_rows, gated):
    """Redo the non-finite elements of the backup rows' weight-gradient GEMM
    sums over the active entries only (in place); see
    :func:`twellpy.backends.cuda_train.backup_wgrad_exact`."""
    on = g_bk != 0  # NaN is active, -0.0 is not (as the pattern)
    h = _h_values(_up(g_bk), _up(u_bk) if gated else None, gated, g_bk.dtype)
    factors = [(base[0], da_bk, x), (base[2], h, dy)] + ([(base[1], db_bk, x)] if gated else [])
    for out, a, src in factors:
        a = _up(a)
        bad = ~np.isfinite(out)
        for c in np.flatnonzero(bad.any(axis=0)):  # rare: unchecked NaN/Inf inputs
            ks = np.flatnonzero(bad[:, c])
            s = _up(src[backup_rows, c])[:, None]
            with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf here are the caller's values
                # inactive (row, neuron) pairs add nothing, not 0 * NaN
                out[ks, c] = np.where(on[:, ks], a[:, ks] * s, 0).sum(axis=0)
    return base


def put_rows_from_acc(dst, rows, src):
    """``dst[rows] = src`` with ``src`` in the compute dtype, rounded once."""
    dst[rows] = src.astype(dst.dtype, copy=False)
