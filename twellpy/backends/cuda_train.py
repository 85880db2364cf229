"""CUDA launchers of the training kernels (``raw_kernels/train_ffn.cu``).

Free functions over raw cupy arrays, mirroring :mod:`twellpy.backends.cpu_train`
(same names, same argument order, same results up to fp32 rounding). Every
kernel is deterministic: none uses floating-point atomics (see the header of
``train_ffn.cu``), so ``deterministic=True`` in the public API costs nothing.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from .._array import FLOAT_DTYPES, bfloat16, cupy_module, switch_setting
from . import _registry
from .cuda import _NULL_PTR, PendingHost, transpose_cursor

SOURCE = "train_ffn.cu"
WARPS = 8            # keep in sync with TW_WARPS in train_ffn.cu
GATHER_THREADS = 128  # keep in sync with TW_GATHER_THREADS
DH_THREADS = 512      # keep in sync with TW_DH_THREADS
BY_NEURON_NV = (1, 2)  # 16-byte vectors a thread of twellpy_train_wgrad_dh (its instantiations)
MAP_THREADS = 1024    # keep in sync with TW_MAP_THREADS

_INT32_MAX = 2**31 - 1
# unsigned C type of each element width, for kernels that move raw bits
_BIT_CTYPES = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


def _name(base, dtype, gated=None, whole=True):
    """``twellpy_train_<base><T[,GATED[,0]]>``; ``whole=False`` names the split
    variant of the ELL forward / backward (the last product left out)."""
    t = _registry.ctype(dtype)
    if gated is None:
        return f"twellpy_train_{base}<{t}>"
    return f"twellpy_train_{base}<{t},{int(gated)}{'' if whole else ',0'}>"


def _names():
    names = []
    for dt in FLOAT_DTYPES:
        t = _registry.ctype(dt)
        for base in ("relu_count", "relu_pack", "relu_to_hybrid", "csr_to_hybrid", "tr_count", "tr_place",
                     "gather_t", "slots_spmm", "slots_sddmm", "scatter_rows"):
            names.append(f"twellpy_train_{base}<{t}>")
        for dt2 in FLOAT_DTYPES:
            if dt2 != dt and 2 in (dt.itemsize, dt2.itemsize):
                names.append(f"twellpy_train_cast<{t},{_registry.ctype(dt2)}>")
        for base in ("fwd", "bwd", "wgrad", "backup_fwd", "backup_bwd", "backup_exact", "backup_wgrad_exact",
                     "ell_y", "ell_dx"):
            for gated in (0, 1):
                names.append(f"twellpy_train_{base}<{t},{gated}>")
        for base in ("fwd", "bwd"):  # the split kernels: y and dx by twellpy_spmm_resident
            for gated in (0, 1):
                names.append(_name(base, dt, gated, whole=False))
        for gated in (0, 1):
            for nv in BY_NEURON_NV:
                names.append(f"twellpy_train_wgrad_dh<{t},{gated},{nv}>")
    for u in _BIT_CTYPES.values():
        names.append(f"twellpy_train_transpose_dense<{u}>")
    names.append("twellpy_train_transpose_pairs")
    names.append("twellpy_train_row_maps")
    return names


_registry.declare(SOURCE, _names())
# the ELL kernels as the launcher compiles them with the row loops off (_row_defines)
_registry.declare(SOURCE, [_name(base, dt, gated) for dt in FLOAT_DTYPES for base in ("fwd", "bwd", "ell_y", "ell_dx")
                           for gated in (0, 1)], {"TW_ROW_LOOPS": 0, "TW_XSRC_SMEM": 0})


def _k(base, dtype, gated=None, whole=True, **defines):
    return _registry.get_kernel(SOURCE, _name(base, dtype, gated, whole), **defines)


ROW_XREG = 8  # keep in sync with TW_XREG in train_ffn.cu
_ROW_TUNABLES = ("TW_SLOT_BATCH", "TW_XSRC_SMEM", "TW_ROW_MIN_BLOCKS")


def _rows_setting(value):
    """``TWELLPY_TRAIN_ROWS``: "0" (default) off, "1" the kernels' own defines, or a
    comma-separated define set such as ``TW_SLOT_BATCH=1,TW_XSRC_SMEM=1``."""
    if value == "1":
        return {}
    if value == "0":
        return None
    defines = {}
    for item in value.split(","):
        key, _, num = item.strip().partition("=")
        if key not in _ROW_TUNABLES or not num.isdigit():
            raise ValueError(f"TWELLPY_TRAIN_ROWS must be 0, 1 or NAME=INT,... with NAME in {_ROW_TUNABLES}, "
                             f"got {value!r}")
        defines[key] = int(num)
    return defines


#: vec = 2 of the ELL forward and backward kernels: the warp keeps its x (dy) row, read
#: once, instead of re-reading it for every slot's dot product, and gathers the weight
#: rows of TW_SLOT_BATCH slots together; the y and dx products broadcast each slot's
#: column and coefficients by shuffles. Same bits as vec = 1. None (TWELLPY_TRAIN_ROWS=0,
#: the default): off, and the kernels compiled without them (_row_defines); a dict: the
#: defines the two kernels are compiled with ({}, TWELLPY_TRAIN_ROWS=1: the file's
#: defaults). Off by default since the thirty-fourth session: with the row loops compiled
#: out the old loops keep 80 registers instead of 124, and two passes of them were the
#: fastest variant on an H100 (2026-12-07, train.py, forward plus backward: W1-16k 3.10
#: against 3.30 ms for the row loops in shared memory, W1-64k 13.98 against 14.46, W2
#: 31.5 against 32.2; benchmarks/row_loops_probe.py compares every variant).
ROWS = _rows_setting(os.environ.get("TWELLPY_TRAIN_ROWS", "0"))


#: two-pass ELL forward and backward (TWELLPY_TRAIN_TWO_PASS=1): the first kernel computes u
#: (forward) or du, dg (backward) only, and twellpy_train_ell_y / _ell_dx then compute y or dx
#: from them, so each pass gathers rows of fewer weight matrices (the backward's one pass
#: gathers w_down, w_up and w_gate, about 69 MB at W1 bf16, against H100's 50 MB L2).
#: Same bits. The resident split (SPLIT), when it runs, takes precedence. On by default
#: (TWELLPY_TRAIN_TWO_PASS=0 turns it off): on an H100 (2026-12-07) the forward plus
#: backward took 3.50 ms against 4.79 ms in one pass at W1-16k, 31.6 against 40.1 at W2.
TWO_PASS = switch_setting("TWELLPY_TRAIN_TWO_PASS", os.environ.get("TWELLPY_TRAIN_TWO_PASS", "1"))


def _row_defines():
    """Defines of twellpy_train_fwd / _bwd: ROWS, or with the row loops off the old
    loops alone (TW_ROW_LOOPS=0: without the row loops' registers; TW_XSRC_SMEM=0:
    without their shared-memory row buffer)."""
    return {"TW_ROW_LOOPS": 0, "TW_XSRC_SMEM": 0} if ROWS is None else ROWS


def _row_vec(vec, D, itemsize):
    """2 where the row-keeping loops serve (vector loads, D within TW_XREG vectors a lane)."""
    return 2 if vec and ROWS is not None and D <= 32 * (16 // itemsize) * ROW_XREG else vec


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
    count, g, b = _pattern_launch("relu_count", z.dtype, rows)
    vec = _vec_ok(H, z)
    count(g, b, (z, _i64(rows), _i32(H), _i32(vec), row_nnz))
    indptr = cp.empty(rows + 1, dtype=cp.int64)
    indptr[0] = 0
    cp.cumsum(row_nnz, dtype=cp.int64, out=indptr[1:])
    nnz = int(indptr[-1])
    col = cp.empty(nnz, dtype=cp.int32)
    val = cp.empty(nnz, dtype=z.dtype)
    if nnz:
        pack, g, b = _pattern_launch("relu_pack", z.dtype, rows)
        pack(g, b, (z, _i64(rows), _i32(H), _i32(vec), indptr, col, val))
    return row_nnz, indptr, col, val


def relu_count(z, out=None):
    """Stored entries of relu(z) per row: (rows,) int32 (``z`` (rows, H), C-contiguous).

    ``out``, if given, is a contiguous (rows,) int32 cupy array to write into.
    """
    cp = _cp()
    rows, H = z.shape
    row_nnz = cp.empty(rows, dtype=cp.int32) if out is None else out
    if rows:
        count, g, b = _pattern_launch("relu_count", z.dtype, rows)
        count(g, b, (z, _i64(rows), _i32(H), _i32(_vec_ok(H, z)), row_nnz))
    return row_nnz


def row_maps(counts, width, n_backup, capacity=False):
    """Where each row of a Hybrid of ELL width ``width`` goes, on the device.

    Parameters
    ----------
    counts : (M,) int32 cupy array
        Non-zeros per row.
    width : int
        ELL width W; rows with more non-zeros become backup rows.
    n_backup : int
        R, the number of rows with ``counts > width`` (the caller has it from
        the host copy of the counts it chose ``width`` from); with
        ``capacity=True``, only the room for backup rows.
    capacity : bool
        Whether ``n_backup`` is a capacity chosen before the counts were read
        (the speculative training forward). The kernel treats it so either way
        (wide rows past it map to -1, ``backup_rows`` past the last wide row
        is -1); the flag only says that the caller checks the counts itself
        (the CPU twin raises on a mismatch without it).

    Returns
    -------
    (M + R,) int32 cupy array
        ``[row_map | backup_rows]``: ``row_map[r]`` is the row's position among
        the backup rows (rows in order) or -1; ``backup_rows[k]`` is the k-th
        backup row. Same values as :func:`twellpy.backends.cpu_train.row_maps`.
    """
    del capacity  # one kernel for both: see above
    cp = _cp()
    counts = cp.ascontiguousarray(counts, dtype=cp.int32)
    M = int(counts.shape[0])
    maps = cp.empty(M + int(n_backup), dtype=cp.int32)
    if M:
        _launch_row_maps(counts, maps, width, n_backup, 0, M, None, True)
    elif n_backup:
        maps.fill(-1)  # no row, so no launch: the capacity is all unused
    return maps


def _launch_row_maps(counts, maps, width, n_backup, row0, n, running, fill_rest):
    """One launch of ``twellpy_train_row_maps`` over rows ``row0`` to ``row0 + n`` of
    the whole ``counts`` into the whole ``maps``; ``running`` a (1,) int32 device count
    of the wide rows before ``row0`` (advanced by the launch) or None (0)."""
    M = int(counts.shape[0])
    _registry.get_kernel(SOURCE, "twellpy_train_row_maps")(
        (1,), (MAP_THREADS,), (counts, maps, _i64(M), _i32(width), _i64(n_backup), _i64(row0), _i64(n),
                               _NULL_PTR if running is None else running, _i32(int(bool(fill_rest)))))


def queue_to_host(arr):
    """Start copying ``arr`` (contiguous cupy array) to the host on the current stream.

    Returns a :class:`PendingHost`; its ``read()`` gives the numpy copy.
    """
    cp = _cp()
    if not arr.flags.c_contiguous:
        raise ValueError("queue_to_host needs a C-contiguous array")
    return PendingHost(arr, cp.cuda.get_current_stream())


#: Compile-time defines of the pattern kernels ``relu_count``, ``relu_pack`` and
#: ``relu_to_hybrid`` (tunings such as ``TW_PACK_WORDS``, ``TW_PACK_STREAM``,
#: ``TW_PACK_UNROLL``, ``TW_WARPS``; their launches follow ``TW_WARPS`` here). Every
#: tuning gives the same bits.
PACK_DEFINES = {}


def _pattern_launch(base, dtype, rows):
    """The pattern kernel ``base`` with :data:`PACK_DEFINES`, and its grid and block for
    ``rows`` rows (one warp a row)."""
    warps = int(PACK_DEFINES.get("TW_WARPS", WARPS))
    return _k(base, dtype, **PACK_DEFINES), (max(1, -(-int(rows) // warps)),), (32 * warps,)


def relu_to_hybrid(z, row_map, width, n_backup):
    """relu(z) packed straight into a Hybrid (no CSR): the one-chunk forward's path.

    ``z`` (M, H) is the whole gate output; ``row_map`` (M,) int32 sends each row
    to the ELL part (-1) or to its backup row, and must route every row with
    more than ``width`` active entries (``relu_count``) to a backup row (a
    speculative caller that cannot, its capacity being too small, discards the
    result: such a row keeps only its first ``width`` entries, written in
    bounds). ``n_backup`` may exceed the rows routed there (a capacity); the
    rows past them are left unwritten.
    Returns ``vals, ell_idx (M, W), ell_nnz (M,), neuron_counts (H,)`` with
    ``vals`` the combined value buffer (ELL values, then the R backup rows).
    """
    return _launch_relu_to_hybrid(z, 0, width, n_backup, row_map=row_map)


def relu_count_pack(z, width, n_backup, out=None, rows=None, into=None):
    """``relu_count`` and ``relu_to_hybrid`` in one read of ``z`` when W is known
    before the counts (a speculative forward): every row is packed into the ELL
    part; rows with more than ``width`` active entries keep padding there (their
    dense backup rows come from :func:`backup_rows_from_z` once ``row_maps`` has
    placed them). ``out``: as ``relu_count``'s.

    ``rows=(a, b)``: ``z`` holds rows ``a`` to ``b`` of the gate output only, packed
    into the outputs ``into`` of the whole batch (an earlier call's, or from
    :func:`_count_pack_outputs`), so a caller can pack each row chunk just after
    its GEMM wrote it.

    Returns ``vals, ell_idx, ell_nnz, neuron_counts, token_counts``; the backup
    part of ``vals`` is unwritten.
    """
    if rows is not None and into is None:
        raise ValueError("relu_count_pack of a row range needs into, the outputs of the whole batch")
    if into is None:
        into = _count_pack_outputs(z.shape[0], z.shape[1], width, n_backup, z.dtype, out)
    _launch_relu_to_hybrid(z, 1, width, n_backup, into[:4], token_counts=into[4], rows=rows)
    return into


def _count_pack_outputs(M, H, width, n_backup, dtype, out=None):
    """Fresh ``vals, ell_idx, ell_nnz, neuron_counts (zeros), token_counts`` (``out``
    if given) of :func:`relu_count_pack` for a batch of ``M`` rows."""
    cp = _cp()
    return (cp.empty(M * width + n_backup * H, dtype=dtype), cp.empty((M, width), dtype=cp.int32),
            cp.empty(M, dtype=cp.int32), cp.zeros(H, dtype=cp.int32),
            cp.empty(M, dtype=np.int32) if out is None else out)


def _row_chunks(M, step):
    return [(a, min(M, a + step)) for a in range(0, M, max(1, int(step)))]


def gate_count_pack(x, w_act, width, n_backup, out=None, chunks=1):
    """``z = x @ w_act.T`` and :func:`relu_count_pack` of it, the GEMM and the pack
    taking turns over ``chunks`` row chunks, so that each chunk's pack reads the
    part of ``z`` the GEMM has just written while the L2 still holds it.

    Returns ``z, (vals, ell_idx, ell_nnz, neuron_counts, token_counts)``.
    """
    M = x.shape[0]
    step = -(-M // max(1, int(chunks)))
    if step >= M:
        z = gemm(x, w_act.T, x.dtype)
        return z, relu_count_pack(z, width, n_backup, out=out)
    z = _cp().empty((M, w_act.shape[0]), dtype=x.dtype)
    packed = _count_pack_outputs(M, w_act.shape[0], width, n_backup, x.dtype, out)
    for a, b in _row_chunks(M, step):
        gemm(x[a:b], w_act.T, x.dtype, into=z[a:b])
        relu_count_pack(z[a:b], width, n_backup, rows=(a, b), into=packed)
    return z, packed


def gate_count_pack_streamed(x, w_act, width, n_backup, chunk_rows, out=None):
    """A speculative forward's whole pattern step for a batch whose gate output is
    larger than one chunk: ``z`` exists a chunk of ``chunk_rows`` rows at a time (one
    buffer), and each chunk is GEMM'd, counted and packed, mapped (``row_maps`` with
    a running count of wide rows, so chunk by chunk it gives one launch's maps) and
    its wide rows' dense backup rows written, before the next chunk overwrites it.

    Returns ``(vals, ell_idx, ell_nnz, neuron_counts, token_counts), maps`` with
    ``maps`` as :func:`row_maps` (``capacity=True``) gives.
    """
    cp = _cp()
    M, H = x.shape[0], w_act.shape[0]
    packed = _count_pack_outputs(M, H, width, n_backup, x.dtype, out)
    maps = cp.empty(M + int(n_backup), dtype=cp.int32)
    if M == 0:
        maps.fill(-1)
        return packed, maps
    running = cp.zeros(1, dtype=cp.int32)
    zbuf = cp.empty((min(M, max(1, int(chunk_rows))), H), dtype=x.dtype)
    chunks = _row_chunks(M, zbuf.shape[0])
    for a, b in chunks:
        z = zbuf[:b - a]
        gemm(x[a:b], w_act.T, x.dtype, into=z)
        relu_count_pack(z, width, n_backup, rows=(a, b), into=packed)
        _launch_row_maps(packed[4], maps, width, n_backup, a, b - a, running, b == M)
        if n_backup:
            _launch_relu_to_hybrid(z, 2, width, n_backup, (packed[0], None, None, None), row_map=maps[:M],
                                   rows=(a, b))
    return packed, maps


def backup_rows_from_z(z, row_map, vals, width, n_backup):
    """The dense backup rows (relu(z) of the rows ``row_map`` routes there) into the
    combined buffer ``vals`` of :func:`relu_count_pack`; other rows are not read."""
    if n_backup:
        _launch_relu_to_hybrid(z, 2, width, n_backup, (vals, None, None, None), row_map=row_map)


def _launch_relu_to_hybrid(z, mode, width, n_backup, bufs=None, row_map=None, token_counts=None, rows=None):
    """One launch of ``twellpy_train_relu_to_hybrid`` in ``mode`` (see train_ffn.cu).
    ``z`` holds every row of the gate output, or with ``rows=(a, b)`` rows ``a`` to
    ``b`` only; ``bufs`` (``vals, ell_idx, ell_nnz, neuron_counts``; mode 2 needs only
    ``vals``), ``row_map`` and ``token_counts`` are always the whole batch's. Without
    ``bufs`` (mode 0) they are allocated. Returns ``bufs``."""
    cp = _cp()
    rz, H = z.shape
    a, b = (0, rz) if rows is None else (int(rows[0]), int(rows[1]))
    if b - a != rz:
        raise ValueError(f"z has {rz} rows, not the {b - a} of rows {rows}")
    if bufs is None:
        bufs = (cp.empty(rz * width + n_backup * H, dtype=z.dtype), cp.empty((rz, width), dtype=cp.int32),
                cp.empty(rz, dtype=cp.int32), cp.zeros(H, dtype=cp.int32))
    vals, ell_idx, ell_nnz, neuron_counts = bufs
    # the batch's rows: z's own, or (a row range) those of the whole-batch array given
    M = rz if rows is None else int((row_map if row_map is not None else token_counts).shape[0])
    if not 0 <= a <= b <= M:
        raise ValueError(f"rows {rows} are not a row range of the batch's {M} rows")
    ell_val, backup = split_combined(vals, M, width, n_backup, H)
    if b > a:
        kernel, g, blk = _pattern_launch("relu_to_hybrid", z.dtype, b - a)
        vec = _vec_ok(H, z)  # H * itemsize % 16 == 0 too, so every row of z starts aligned
        vec_store = vec and (not n_backup or _vec_ok(H, backup))  # backup starts after M*W values

        def part(arr):  # the launch's rows of a per-row array; NULL for an absent one
            return _NULL_PTR if arr is None else arr[a:b]

        kernel(g, blk, (
            z, _i64(b - a), _i32(H), _i32(vec), _i32(vec_store), part(row_map), _i32(width), ell_val[a:b],
            part(ell_idx), part(ell_nnz), backup, _NULL_PTR if neuron_counts is None else neuron_counts,
            part(token_counts), _i32(mode)))
    return bufs


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
    bits(vals)[M * width:] = 0
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
    """ELL part of the FFN forward: fills ``uval`` (M, W) when gated, returns ``y, habs``.

    ``habs`` (M,) float32 (float64 for float64) is each row's sum of |h| over
    its slots (the L1 statistic). Backup rows (``nnz == 0``, padding only) get
    y = 0 and habs = 0. With ``SPLIT`` the y product runs in
    ``twellpy_spmm_resident`` (a slice of ``w_down`` in shared memory; h = g * u
    formed while staging) instead of the fused kernel (same bits).
    """
    from . import cuda

    cp = _cp()
    M, D = x.shape
    W = idx.shape[1]
    y = cp.empty((M, D), dtype=x.dtype)
    habs = cp.empty(M, dtype=np.float64 if x.dtype == np.float64 else np.float32)
    if M:
        vec = _row_vec(_vec_ok(D, x, w_up if gated else None, w_downT, y), D, x.dtype.itemsize)
        plan = _split_plan(W, (gval, uval if gated else gval), (w_downT,), y)
        g, b = _rows_grid(M)
        two = TWO_PASS and plan is None
        _k("fwd", x.dtype, gated, whole=plan is None and not two, **_row_defines())(
            g, b, (x, w_up if gated else w_downT, w_downT, idx, nnz, gval, uval if gated else gval, y, habs,
                   _i64(M), _i32(W), _i32(D), _i32(vec)))
        if two:
            _k("ell_y", x.dtype, gated, **_row_defines())(
                g, b, (w_downT, idx, nnz, gval, uval if gated else gval, y, _i64(M), _i32(W), _i32(D), _i32(vec)))
        if plan is not None:
            # backup rows have nnz 0: y 0, as the fused kernel writes (the backup path fills them later)
            cuda._resident_spmm(idx, gval, w_downT, y, plan, row_count=nnz, stride=W, row_cap=W,
                                vals2=uval if gated else None, prod=gated)
    return y, habs


def _split_setting(value):
    if value not in ("auto", "0", "1"):
        raise ValueError(f"TWELLPY_TRAIN_SPLIT must be auto, 0 or 1, got {value!r}")
    return {"auto": "auto", "0": False, "1": True}[value]


#: split the ELL forward and backward (TWELLPY_TRAIN_SPLIT=auto|1|0): the fused kernels
#: compute u (forward) and dh, du, dg (backward) only, and twellpy_spmm_resident
#: computes y = h @ w_down^T and dx = du @ w_up + dg @ w_gate (DUAL) from column
#: slices of the weights held in shared memory (each weight read once per slice
#: instead of once per active neuron). Same bits either way. Off (0): measured
#: slower (W1-16k step on an H200, 2026-12-05: 5.14 ms against 3.47 ms fused).
SPLIT = _split_setting(os.environ.get("TWELLPY_TRAIN_SPLIT", "0"))


def _split_plan(W, values, weights, out):
    """Resident-kernel plan for the split ELL product ``out`` (M, D) from the (M, W)
    ``values`` and one or two (H, D) ``weights`` (two: DUAL), or None when the
    fused kernel should compute it (``SPLIT`` off, no slots, or no slice fits)."""
    from . import cuda

    if SPLIT is False or not W or not all(v.flags.c_contiguous for v in values):
        return None
    M, D = out.shape
    return cuda._resident_plan(M, weights[0].shape[0], D, 0, out.dtype, *weights, out, mode=SPLIT,
                               dual=len(weights) == 2)


def ffn_backward_ell(dy, w_downT, w_up, w_gate, idx, nnz, gval, uval, l1_scale, gated, da, db):
    """ELL part of the FFN backward; writes ``da`` (du or dh) and ``db`` (dg), returns dx.

    ``da``/``db`` are (M, W) views (of the combined value buffers) the kernel fills.
    Backup rows of dx are 0. With ``SPLIT`` the dx product runs in
    ``twellpy_spmm_resident`` instead of the fused kernel (same bits).
    """
    from . import cuda

    cp = _cp()
    M, D = dy.shape
    W = idx.shape[1]
    dx = cp.empty((M, D), dtype=dy.dtype)
    if M:
        vec = _row_vec(_vec_ok(D, dy, w_downT, w_up, w_gate if gated else None, dx), D, dy.dtype.itemsize)
        plan = _split_plan(W, (da, db) if gated else (da,), (w_up, w_gate) if gated else (w_up,), dx)
        g, b = _rows_grid(M)
        two = TWO_PASS and plan is None
        _k("bwd", dy.dtype, gated, whole=plan is None and not two, **_row_defines())(
            g, b, (dy, w_downT, w_up, w_gate if gated else w_up, idx, nnz, gval, uval if gated else gval, da,
                   db if gated else da, dx, _i64(M), _i32(W), _i32(D), np.float64(l1_scale), _i32(vec)))
        if two:
            ell_dx(w_up, w_gate if gated else None, idx, nnz, da, db if gated else None, dx)
        if plan is not None:
            # rows' entries are idx[r, :nnz[r]] (stride W); backup rows have nnz 0: dx 0, as fused
            cuda._resident_spmm(idx, da, w_up, dx, plan, row_count=nnz, stride=W, row_cap=W,
                                vals2=db if gated else None, B2=w_gate if gated else None)
    return dx


def ell_dx(w_up, w_gate, idx, nnz, da, db, dx, skip=None):
    """``dx = da @ w_up (+ db @ w_gate)`` over the ELL part into ``dx`` (M, D), one warp
    per row (the two-pass backward's second kernel); rows with ``skip[r] >= 0`` (the
    row map: backup rows whose dx is already written) are left alone."""
    M, D = dx.shape
    W = idx.shape[1]
    if M:
        gated = db is not None
        vec = _row_vec(_vec_ok(D, w_up, w_gate, dx), D, dx.dtype.itemsize)
        g, b = _rows_grid(M)
        _k("ell_dx", dx.dtype, gated, **_row_defines())(
            g, b, (w_up, w_gate if gated else w_up, idx, nnz, da, db if gated else da, dx, _i64(M), _i32(W),
                   _i32(D), _i32(vec), _NULL_PTR if skip is None else skip))
    return dx


#: defines twellpy_train_wgrad_dh is compiled with ({}: the file's defaults); for probes
#: that compare TW_DH_BATCH and TW_DH_PREFETCH on the device.
DH_DEFINES = {}


def _by_neuron_nv(D, itemsize):
    """Vectors a thread of twellpy_train_wgrad_dh for rows of D elements, or None when a
    block of DH_THREADS threads cannot hold a row (the row-oriented flow then runs)."""
    dv = D // (16 // itemsize)
    for nv in BY_NEURON_NV:
        if -(-dv // nv) <= DH_THREADS:
            return nv
    return None


def by_neuron_ok(D, *arrays):
    """Whether the one-pass-by-neuron flow can run: vector loads legal for every
    array and a row within one block's DH_THREADS x 2 vectors."""
    return bool(_vec_ok(D, *arrays)) and _by_neuron_nv(D, arrays[0].dtype.itemsize) is not None


def _grad_outputs(H, D, dtype, gated, base):
    """The (H, D) weight-gradient outputs ``dw_a, dw_b (gated) or None, dw_downT`` and
    the kernels' three ``base`` pointers' arrays (checked; None when there is no base)."""
    cp = _cp()
    dw_a = cp.empty((H, D), dtype=dtype)
    dw_b = cp.empty((H, D), dtype=dtype) if gated else None
    dw_dT = cp.empty((H, D), dtype=dtype)
    if base is not None:
        _check_base(base, dtype, H, D, gated)
        base = (base[0], base[1] if gated else base[0], base[2])
    return dw_a, dw_b, dw_dT, base


def ffn_backward_by_neuron(indptr, rows, pos, idx, x, dy, w_downT, da, db, gval, uval, l1_scale, n_neurons,
                           gated, base=None):
    """dh on the ELL entries (du, dg into the combined ``da``, ``db``; backup entries'
    read from there) and the weight gradients, in one pass over the transposed pattern.

    ``idx`` is the (M, W) ELL part (entries at combined positions below its size).
    Returns ``dw_up (H, D), dw_gate (H, D) or None, dw_downT (H, D)`` as
    :func:`ffn_weight_grads`, ``base`` likewise. Needs :func:`by_neuron_ok`.
    """
    H, D, dt = int(n_neurons), x.shape[1], x.dtype
    dw_a, dw_b, dw_dT, base = _grad_outputs(H, D, dt, gated, base)
    if not by_neuron_ok(D, x, dy, w_downT):
        raise ValueError(f"ffn_backward_by_neuron: rows of {D} {dt} elements need 16-byte aligned rows of at "
                         f"most {DH_THREADS * max(BY_NEURON_NV)} vectors; use ffn_weight_grads")
    if H and D:
        nv = _by_neuron_nv(D, dt.itemsize)
        per_nv = -(-(D // (16 // dt.itemsize)) // nv)  # threads holding one row's vectors
        kern = _registry.get_kernel(SOURCE, f"twellpy_train_wgrad_dh<{_registry.ctype(dt)},{int(gated)},{nv}>",
                                    **DH_DEFINES)
        kern((H,), (32 * -(-per_nv // 32),), (
            indptr, rows, pos, _i64(idx.size), x, dy, w_downT, da, db if gated else da, gval,
            uval if gated else gval, dw_a, dw_b if gated else dw_a, dw_dT, _i32(D), np.float64(l1_scale))
            + (base or (_NULL_PTR,) * 3))
    return dw_a, dw_b, dw_dT


def _transpose_blocks(M, n_cols):
    """Row-block size and count for the counting sort (bounded scratch memory)."""
    budget = 8 << 20  # counters per pass: 32 MiB of int32 at most (and at least one block)
    nb = max(1, min(-(-M // 16), budget // max(1, n_cols)))
    rpb = max(1, -(-M // nb))
    nb = max(1, -(-M // rpb))
    return rpb, nb


def transpose_pattern(idx, row_map, backup, n_cols, nnz=None):
    """Deterministic counting-sort transpose of a slots+backup pattern.

    Parameters
    ----------
    idx : (M, K) int32 slot columns (-1 = padding)
    row_map : (M,) int32, -1 or the row's position in ``backup``
    backup : (R, N) dense backup rows (their non-zeros are entries)
    n_cols : int, N
    nnz : int, optional
        The number of entries when the caller knows it exactly (saves a
        device-to-host read); it must equal the true count.

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
    # one zero fill for the per-block counts and, in the last row, the column totals
    # (int32 is enough for those: M*K + R*N < 2**31 was checked above)
    zeroed = cp.zeros((nb + 1, n_cols), dtype=cp.int32)
    counts, col_tot = zeroed[:nb], zeroed[nb]
    g, b = _rows_grid(nb)
    args = (idx, row_map, backup, _i64(M), _i32(K), _i32(n_cols), _i32(rpb), _i32(nb))
    _k("tr_count", backup.dtype)(g, b, args + (counts, col_tot))
    indptr64 = cp.zeros(n_cols + 1, dtype=cp.int64)
    cp.cumsum(col_tot, dtype=cp.int64, out=indptr64[1:])
    nnz = int(indptr64[-1]) if nnz is None else int(nnz)
    if nnz > _INT32_MAX:
        raise ValueError(f"transpose has {nnz} entries, more than int32 indices can address")
    indptr = indptr64.astype(cp.int32)
    cursor = transpose_cursor(counts, indptr)  # indptr[c] + entries of column c in earlier blocks
    del counts, col_tot, zeroed
    rows = cp.empty(nnz, dtype=cp.int32)
    pos = cp.empty(nnz, dtype=cp.int32)
    if nnz:
        _k("tr_place", backup.dtype)(g, b, args + (cursor, rows, pos))
    return indptr, rows, pos


def ffn_weight_grads(indptr, rows, pos, x, dy, da, db, gval, uval, n_neurons, gated, base=None):
    """Weight gradients from the transposed pattern.

    ``base``, if given, is ``(dw_up, dw_gate or None, dw_downT)`` partial sums
    (H, D) in the accumulator dtype (the backup rows' GEMM products): each
    gradient is that sum plus the pattern's entries, rounded once.

    Returns ``dw_up (H, D), dw_gate (H, D) or None, dw_downT (H, D)``.
    """
    H, D, dt = int(n_neurons), x.shape[1], x.dtype
    dw_a, dw_b, dw_dT, base = _grad_outputs(H, D, dt, gated, base)
    if H and D:
        vec = _vec_ok(D, x, dy, dw_a, dw_b, dw_dT)
        g, b = _gather_grid(H, D, dt.itemsize)
        _k("wgrad", dt, gated)(g, b, (indptr, rows, pos, x, dy, da, db if gated else da, gval,
                                      uval if gated else gval, dw_a, dw_b if gated else dw_a, dw_dT,
                                      _i32(H), _i32(D), _i32(vec)) + (base or (_NULL_PTR,) * 3))
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


# ---------------------------------------------------------------------------
# dense helpers that work for bfloat16 whatever CuPy's own bfloat16 support is:
# data movement goes through same-width unsigned views, casts through
# twellpy_train_cast, GEMMs straight to cublasGemmEx.
_CUDA_DTYPE = {np.dtype(np.float16): 2, bfloat16: 14, np.dtype(np.float32): 0, np.dtype(np.float64): 1}
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_COMPUTE_32F, _CUBLAS_COMPUTE_64F = 68, 70
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_POINTER_MODE_HOST = 0
_CUBLAS_DEFAULT_MATH = 0


def bits(a):
    """Same-width unsigned view of a 16-bit float array (a itself otherwise)."""
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def _unbits(a, dtype):
    return a.view(dtype) if a.dtype != dtype else a


def take_rows(a, rows):
    """``a[rows]`` (rows an int array) for any value dtype."""
    return _unbits(bits(a)[rows], a.dtype)


def put_rows(dst, rows, src):
    """``dst[rows] = src`` for any value dtype (same dtype on both sides)."""
    bits(dst)[rows] = bits(src)


def concat(arrays):
    """1-D concatenation for any value dtype."""
    cp = _cp()
    dt = arrays[0].dtype
    return _unbits(cp.concatenate([bits(a).reshape(-1) for a in arrays]), dt)


#: 16-bit ``transpose_copy`` through ``twellpy_train_transpose_pairs`` (32-bit words, 64 x 64
#: tiles) where the shape and alignment allow (TWELLPY_PAIR_TRANSPOSE=1|0). On by default
#: since an H100 run (2026-12-07, W1-16k): step 3.07 against 3.10 ms, same bits.
PAIR_TRANSPOSE = switch_setting("TWELLPY_PAIR_TRANSPOSE", os.environ.get("TWELLPY_PAIR_TRANSPOSE", "1"))


def transpose_copy(a):
    """C-contiguous copy of ``a.T`` (``a`` 2-D) for any value dtype.

    A tiled shared-memory transpose on the raw bits; CuPy's strided copy of
    ``a.T`` was several times slower on the (D, H) weights.
    """
    cp = _cp()
    if a.ndim != 2:
        raise ValueError(f"transpose_copy needs a 2-D array, got {a.ndim}-D of shape {tuple(a.shape)}")
    if a.dtype.itemsize not in _BIT_CTYPES:
        raise TypeError(f"transpose_copy: unsupported dtype {a.dtype}")
    if not a.flags.c_contiguous:
        a = _unbits(cp.ascontiguousarray(bits(a)), a.dtype)
    rows, cols = a.shape
    out = cp.empty((cols, rows), dtype=a.dtype)
    if a.size:
        if PAIR_TRANSPOSE and a.dtype.itemsize == 2 and rows % 2 == 0 and cols % 2 == 0 and a.data.ptr % 4 == 0:
            # 16-bit elements two at a time (32-bit words; 64 x 64 tiles)
            k, tile = _registry.get_kernel(SOURCE, "twellpy_train_transpose_pairs"), 64
        else:
            k, tile = _registry.get_kernel(SOURCE, f"twellpy_train_transpose_dense<{_BIT_CTYPES[a.dtype.itemsize]}>"), 32
        grid = (min(-(-cols // tile), 1 << 20), min(-(-rows // tile), 65535))
        k(grid, (32, 8), (a, out, _i64(rows), _i64(cols)))
    return out


_SIDE_STREAMS = threading.local()  # per thread: {device id: its high-priority side stream}
_HIGHEST_PRIORITY = -1000  # lower is higher; clamped by CUDA to the device's greatest


def _side_stream():
    """This thread's side stream on the current device: non-blocking (no implicit
    ordering with the legacy stream) and of the device's highest priority, so its
    blocks are dispatched as soon as the main stream's long kernel frees a slot."""
    cp = _cp()
    dev = cp.cuda.Device().id
    streams = getattr(_SIDE_STREAMS, "by_device", None)
    if streams is None:
        streams = _SIDE_STREAMS.by_device = {}
    s = streams.get(dev)
    if s is None:
        # CuPy has no cudaDeviceGetStreamPriorityRange; CUDA clamps a priority past the
        # range to its greatest (H100: -5), so this asks for the highest there is
        s = streams[dev] = cp.cuda.Stream(non_blocking=True, priority=_HIGHEST_PRIORITY)
    return s


class SideWork:
    """Kernels queued on a second stream, to run beside what the current stream runs next.

    ``with side:`` makes the side stream current after it waits for everything
    queued so far on the current (main) stream; leaving the block records where
    the side work ends and makes the main stream current again. ``join()`` makes
    the main stream wait for that point; call it before the main stream uses the
    side work's results, and before any array the side work reads or writes can be
    freed (a freed block goes back to the main stream's pool and may be reused at
    once). Arrays the side work allocates return to the side stream's pool, whose
    every later use starts by waiting for the main stream, so their reuse is safe.
    ``start_here()`` makes the side work wait only for what is queued on the main
    stream at that call, so that the main stream's next kernel can be launched
    first and the side work, launched after it, still runs beside it. The side
    work must then not touch what the main stream does after that call: arrays it
    writes, and blocks it frees (the side stream's pool blocks are safe to reuse
    only after everything queued on the main stream before that point).
    Events only, so a CUDA graph capture of the main stream takes the side work in.
    ``enabled=False`` leaves the work on the main stream, in order (every method a no-op).
    """

    def __init__(self, enabled=True):
        self._on = bool(enabled)
        self._end = None
        self._start = None
        if self._on:
            cp = _cp()
            self._main = cp.cuda.get_current_stream()
            self._side = _side_stream()

    def start_here(self):
        if self._on:
            self._start = self._main.record()
        return self

    def __enter__(self):
        if self._on:
            start, self._start = self._start, None
            self._side.wait_event(self._main.record() if start is None else start)
            self._side.__enter__()
        return self

    def __exit__(self, *exc):
        if self._on:
            self._side.__exit__(*exc)
            self._end = self._side.record()
        return False

    def join(self):
        if self._end is not None:
            self._main.wait_event(self._end)
            self._end = None


def _acc_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _check_operand(name, a, dtype, shape):
    """Launch guard of the internal backup-row kernels: a buffer of the wrong
    dtype, shape or layout would be read or written out of bounds."""
    dtype = np.dtype(dtype)
    if a.dtype != dtype or tuple(a.shape) != tuple(shape) or not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous {dtype} array of shape {tuple(shape)}, got "
                         f"{a.dtype} of shape {tuple(a.shape)} (C-contiguous: {a.flags.c_contiguous})")


def _check_base(base, dtype, H, D, gated):
    """Guard of the fp32 (fp64) weight-gradient sums ``(dw_up, dw_gate or None, dw_downT)``."""
    acc = _acc_dtype(dtype)
    for nm, a in (("dw_up", base[0]), ("dw_downT", base[2])) + ((("dw_gate", base[1]),) if gated else ()):
        if a is None:
            raise ValueError(f"base {nm}: expected a C-contiguous {acc} array of shape {(H, D)}, got None")
        _check_operand(f"base {nm}", a, acc, (H, D))


def _elementwise_grid(n):
    return (max(1, min(-(-int(n) // 256), 65535 * 16)),), (256,)


def backup_rows_forward(g_bk, u_acc, u_bk, backup_rows, habs, gated):
    """u, h and the |h| sums of the dense backup rows, in one pass.

    Parameters
    ----------
    g_bk : (R, H) ReLU values of the backup rows (a view of the combined buffer).
    u_acc : (R, H) accumulator dtype, ``x[backup_rows] @ w_up.T`` (gated; else None).
    u_bk : (R, H) view to fill with u on the pattern, 0 elsewhere (gated; else None).
    backup_rows : (R,) int32 row numbers.
    habs : (M,) accumulator dtype; ``habs[backup_rows]`` is set to each row's sum of |h|.
    gated : bool

    Returns
    -------
    h : (R, H), ``g * u`` rounded to the value dtype (gated), or ``g_bk`` itself.
    """
    cp = _cp()
    R, H = g_bk.shape
    dt, acc = g_bk.dtype, _acc_dtype(g_bk.dtype)
    _check_operand("g_bk", g_bk, dt, (R, H))
    _check_operand("backup_rows", backup_rows, np.int32, (R,))
    _check_operand("habs", habs, acc, habs.shape[:1])
    if gated:
        _check_operand("u_acc", u_acc, acc, (R, H))
        _check_operand("u_bk", u_bk, dt, (R, H))
        h = cp.empty((R, H), dtype=dt)
    else:
        u_acc = u_bk = h = g_bk  # placeholders, not read by the non-gated kernel
    if R:
        k = _k("backup_fwd", dt, gated)
        k((min(R, 1 << 20),), (256,), (g_bk, u_acc, u_bk, h, backup_rows, _i32(R), _i32(H), habs))
    return h if gated else g_bk


def backup_rows_backward(dh_acc, g_bk, u_bk, l1_scale, gated, da_bk, db_bk, h_out=None):
    """Fill ``da_bk`` (du, or dh when not gated) and ``db_bk`` (dg) of the backup rows.

    ``dh_acc`` (R, H) in the accumulator dtype is ``dy[backup_rows] @ w_down``;
    dh is that on the pattern (non-zero g) plus ``l1_scale * sign(h)`` when
    ``l1_scale`` is non-zero, and 0 elsewhere; every output is rounded once.
    ``h_out`` (R, H), gated only, also receives h (the forward's bits; 0 off
    the pattern), the backup rows' operand of the dw_down GEMM.
    """
    R, H = g_bk.shape
    dt, acc = g_bk.dtype, _acc_dtype(g_bk.dtype)
    _check_operand("dh_acc", dh_acc, acc, (R, H))
    _check_operand("g_bk", g_bk, dt, (R, H))
    _check_operand("da_bk", da_bk, dt, (R, H))
    if gated:
        _check_operand("u_bk", u_bk, dt, (R, H))
        _check_operand("db_bk", db_bk, dt, (R, H))
        if h_out is not None:
            _check_operand("h_out", h_out, dt, (R, H))
    else:
        if h_out is not None:
            raise ValueError("h_out: the non-gated FFN's h is g itself; pass None")
        u_bk = db_bk = g_bk  # placeholders, not read or written by the non-gated kernel
    n = R * H
    if n:
        g, b = _elementwise_grid(n)
        _k("backup_bwd", dt, gated)(g, b, (dh_acc, g_bk, u_bk, np.float64(l1_scale), da_bk, db_bk, _i64(n),
                                           _NULL_PTR if h_out is None else h_out))


def backup_exact(out, g_bk, a, b, a2=None, b2=None):
    """Redo the rows of a backup-row product that came out non-finite, on their pattern only.

    ``out`` (R, D) accumulator dtype holds ``a @ b`` (plus ``a2 @ b2``) from the
    GEMM; ``a``/``a2`` (R, H) are 0 off the pattern of ``g_bk`` and
    ``b``/``b2`` (H, D) are weights. A row with a NaN/Inf is summed again over
    its active neurons (so a non-finite weight of an inactive neuron adds
    nothing); a finite row is only read. One launch, no host synchronisation.
    """
    R, D = out.shape
    H = g_bk.shape[1]
    dt, acc = g_bk.dtype, _acc_dtype(g_bk.dtype)
    dual = a2 is not None
    _check_operand("out", out, acc, (R, D))
    _check_operand("g_bk", g_bk, dt, (R, H))
    _check_operand("a", a, dt, (R, H))
    _check_operand("b", b, dt, (H, D))
    if dual:
        _check_operand("a2", a2, dt, (R, H))
        _check_operand("b2", b2, dt, (H, D))
    else:
        a2, b2 = a, b  # placeholders, not read when DUAL is 0
    if R and D:
        _k("backup_exact", dt, dual)((min(R, 1 << 20),), (256,), (out, g_bk, a, a2, b, b2, _i32(R), _i32(H), _i32(D)))
    return out


def backup_wgrad_exact(base, g_bk, u_bk, da_bk, db_bk, x, dy, backup_rows, gated):
    """Redo, over the active entries only, the elements of the backup rows'
    weight-gradient GEMM sums that came out non-finite (in place).

    ``base`` is ``(dw_up, dw_gate or None, dw_downT)`` (H, D) in the
    accumulator dtype: ``da_bk^T @ x[rows]``, ``db_bk^T @ x[rows]``,
    ``h^T @ dy[rows]``. With unchecked inputs a NaN/Inf in x or dy of a backup
    row meets the zeros of that row's inactive neurons there (0 * NaN = NaN);
    finite elements are already exact and cost one read.
    """
    R, H = g_bk.shape
    D = x.shape[1]
    dt = g_bk.dtype
    _check_base(base, dt, H, D, gated)
    _check_operand("g_bk", g_bk, dt, (R, H))
    _check_operand("da_bk", da_bk, dt, (R, H))
    _check_operand("backup_rows", backup_rows, np.int32, (R,))
    _check_operand("x", x, dt, (x.shape[0], D))
    _check_operand("dy", dy, dt, (x.shape[0], D))
    if gated:
        _check_operand("u_bk", u_bk, dt, (R, H))
        _check_operand("db_bk", db_bk, dt, (R, H))
    if not (R and H and D):
        return base
    b_b = base[1] if gated else base[0]
    _k("backup_wgrad_exact", dt, gated)((H, -(-D // 256)), (256,),
                                        (base[0], b_b, base[2], g_bk, u_bk if gated else g_bk, da_bk,
                                         db_bk if gated else da_bk, x, dy, backup_rows, _i32(R), _i32(H), _i32(D)))
    return base


def put_rows_from_acc(dst, rows, src):
    """``dst[rows] = src`` with ``src`` (R, D) in the accumulator dtype, rounded once."""
    M, D = dst.shape
    R = rows.shape[0]
    _check_operand("dst", dst, dst.dtype, (M, D))
    _check_operand("rows", rows, np.int32, (R,))
    _check_operand("src", src, _acc_dtype(dst.dtype), (R, D))
    if R and D:
        g, b = _elementwise_grid(R * D)
        _k("scatter_rows", dst.dtype)(g, b, (src, rows, dst, _i32(R), _i32(D)))


def _cast(a, dtype):
    cp = _cp()
    a = cp.ascontiguousarray(a) if a.dtype.itemsize != 2 else _unbits(cp.ascontiguousarray(bits(a)), a.dtype)
    out = cp.empty(a.shape, dtype=dtype)
    n = a.size
    if n:
        k = _registry.get_kernel(SOURCE, f"twellpy_train_cast<{_registry.ctype(a.dtype)},{_registry.ctype(dtype)}>")
        blocks = min(max(1, (n + 255) // 256), 65535 * 8)
        k((blocks,), (256,), (a, out, np.int64(n)))
    return out


def to_acc(a):
    """``a`` as float32 (float64 stays float64); 16-bit data is converted."""
    if a.dtype in (np.float32, np.float64):
        return a
    return _cast(a, np.dtype(np.float32))


def from_acc(a, dtype):
    """``a`` (any float dtype) rounded once to ``dtype``."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    if a.dtype.itemsize != 2 and dtype.itemsize != 2:
        return a.astype(dtype)
    return _cast(a, dtype)


def _gemm_operand(a):
    """(cuBLAS op, leading dim, array) for a row-major operand or a transposed view of one."""
    cp = _cp()
    if a.flags.c_contiguous:
        return _CUBLAS_OP_N, max(1, a.shape[1]), a
    if a.flags.f_contiguous:
        return _CUBLAS_OP_T, max(1, a.shape[0]), a
    a = _unbits(cp.ascontiguousarray(bits(a)), a.dtype)
    return _CUBLAS_OP_N, max(1, a.shape[1]), a


def gemm(a, b, out_dtype, out=None, into=None):
    """Dense ``a @ b`` through cublasGemmEx with fp32 (fp64) accumulation.

    ``a`` (m, k) and ``b`` (k, n) may be C-contiguous or transposed views of
    C-contiguous arrays (no copy then). Inputs share one dtype; the result is
    (m, n) in ``out_dtype`` (any supported float dtype, e.g. float32 from
    bfloat16 inputs). With ``out`` (a C-contiguous (m, n) ``out_dtype``
    array) the product is added to it (cuBLAS beta = 1) and ``out`` returned;
    with ``into`` (the same kind of array) it is written there (beta = 0).
    """
    cp = _cp()
    from cupy_backends.cuda.libs import cublas

    out_dtype = np.dtype(out_dtype)
    if a.dtype != b.dtype:
        raise TypeError(f"gemm operands have dtypes {a.dtype} and {b.dtype}, expected one dtype")
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"gemm shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
    if out is not None and into is not None:
        raise ValueError("gemm takes out (add to it) or into (write there), not both")
    if out is not None:
        _check_operand("out", out, out_dtype, (m, n))
        c, beta = out, 1
    elif into is not None:
        _check_operand("into", into, out_dtype, (m, n))
        c, beta = into, 0
    else:
        c, beta = cp.empty((m, n), dtype=out_dtype), 0
    if m == 0 or n == 0:
        return c
    if k == 0:
        if out is None:  # a fresh or written-into result is zeros; an added-to one is unchanged
            c.view(np.uint8)[...] = 0
        return c
    # row-major C = A B  <=>  column-major C^T = B^T A^T
    op_b, ld_b, b = _gemm_operand(b)
    op_a, ld_a, a = _gemm_operand(a)
    f64 = a.dtype == np.float64
    scal = np.float64 if f64 else np.float32
    one, beta = np.array(1, dtype=scal), np.array(beta, dtype=scal)
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    mode = cublas.getPointerMode(handle)
    math_mode = cublas.getMathMode(handle)
    cublas.setPointerMode(handle, _CUBLAS_POINTER_MODE_HOST)
    cublas.setMathMode(handle, _CUBLAS_DEFAULT_MATH)  # never TF32 for float32 data
    try:
        cublas.gemmEx(handle, op_b, op_a, n, m, k, one.ctypes.data, b.data.ptr, _CUDA_DTYPE[b.dtype], ld_b,
                      a.data.ptr, _CUDA_DTYPE[a.dtype], ld_a, beta.ctypes.data, c.data.ptr,
                      _CUDA_DTYPE[out_dtype], n, _CUBLAS_COMPUTE_64F if f64 else _CUBLAS_COMPUTE_32F,
                      _CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
        cublas.setMathMode(handle, math_mode)
    return c


def gemm_acc(a, b, out=None):
    """Dense ``a @ b`` with a float32 result (float64 for float64 inputs).

    Used for the few backup rows, where rounding an intermediate product to a
    16-bit dtype would add an avoidable rounding step. With ``out`` the
    product is added to it (see :func:`gemm`).
    """
    return gemm(a, b, np.float64 if a.dtype == np.float64 else np.float32, out=out)
