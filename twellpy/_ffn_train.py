"""Sparse FFN training step: forward with a saved sparse context, and backward.

Gated FFN (the non-gated ReLU FFN drops ``u``)::

    g = relu(x @ w_gate.T)          pattern P = {g > 0}  (NaN counts as active)
    u = x @ w_up.T                  needed on P only
    h = g * u
    y = h @ w_down.T                penalty  l1 * sum|h| / M

    dh      = (dy @ w_down) on P + (l1 / M) * sign(h)
    du, dg  = dh * g, dh * u
    dw_down = dy.T @ h;  dw_up = du.T @ x;  dw_gate = dg.T @ x
    dx      = du @ w_up + dg @ w_gate

Only the gate GEMM is dense. Its output becomes a Hybrid: an ELL part of
width W for ordinary rows and dense backup rows for every row with more than
W active neurons, so nothing is ever dropped. When the whole gate output fits
``GATE_CHUNK_BYTES`` its ReLU is counted per row, W is chosen from the counts
(the step's one host synchronisation) and the values are packed straight into
the Hybrid (the gate output, at most ``GATE_CHUNK_BYTES``, is held until that
pack); larger batches are consumed in row chunks through a CSR of the
pattern, so the M x H gate output never exists whole.
Every other M x H product runs on the pattern only. The context keeps g and u
on the pattern (ELL values + backup rows), the pattern's indices, x and the
weights -- never an M x H dense array.

Determinism: all kernels (CPU and GPU) are deterministic; no floating-point
atomics are used anywhere, so ``deterministic=True`` costs nothing and the
same inputs always give the same bits.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import _array, backends
from ._array import (as_array, check_finite as _check_finite, check_float, contiguous, count_in_range, device_of,
                     raise_nonfinite, same_device, to_caller, xp_of)
from ._ffn_infer import _check_finite_mode
from .hybrid import quantile_width

__all__ = ["gated_forward_train", "gated_backward", "relu_forward_train", "relu_backward",
           "TrainContext", "choose_width"]

#: Bytes of gate-GEMM output handled at once while extracting the pattern
#: (bounds the only M x H temporary; a dense step keeps several of those).
GATE_CHUNK_BYTES = 192 << 20

#: The one-chunk forward packs relu(z) straight into the Hybrid; False sends it
#: through the CSR path of the chunked forward instead (tests compare the two).
_DIRECT_PACK = True

#: Set to a list to collect ``(phase, cupy.cuda.Event, host seconds)`` marks
#: (benchmarks/train.py): the event gives the device timeline, the host clock
#: says how much of a phase was Python and synchronisation.
_PROFILE = None


def _mark(name, xp):
    if _PROFILE is not None and xp is not np:
        import time

        ev = xp.cuda.Event()
        ev.record()
        _PROFILE.append((name, ev, time.perf_counter()))


class _Stats(Mapping):
    """``ctx.stats``: a read-only mapping whose device scalars become floats on first read.

    Keeping the L1 value on the device avoids a host synchronisation in the
    forward pass; it is read back only when someone asks for it. Being a
    :class:`collections.abc.Mapping` (not a ``dict`` subclass), every way of
    reading it -- ``stats[k]``, ``get``, ``items``, ``dict(stats)``,
    ``{**stats}``, ``copy()`` -- goes through ``__getitem__`` and so sees the
    value, never the deferred computation.
    """

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        v = self._data[key]
        if callable(v):
            v = v()
            self._data[key] = v
        return v

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def copy(self):
        """A plain ``dict`` with every value computed."""
        return dict(self.items())

    def __repr__(self):
        return repr(self.copy())


# ---------------------------------------------------------------------------
def choose_width(token_counts, spec="auto", *, slot_bytes=8, row_bytes=None, n_cols=None):
    """Width W of the ELL part of a Hybrid from the per-row non-zero counts.

    Parameters
    ----------
    token_counts : numpy.ndarray of int
        Non-zeros per row (host array).
    spec : int or str
        ``n`` or ``"fixed:n"``; ``"quantile:p"`` (row count at fraction ``p``
        of the rows, rounded up); ``"min_storage"`` (W minimising the bytes of
        ELL slots plus dense backup rows); ``"auto"`` (the larger of
        ``min_storage`` and ``quantile:0.9``).
    slot_bytes : int
        Bytes of one ELL slot (values plus index).
    row_bytes : int, optional
        Bytes of one dense backup row; defaults to ``n_cols * slot_bytes``.
    n_cols : int, optional
        Row length N (needed when ``row_bytes`` is not given); a fixed width
        larger than N is capped at N.

    Returns
    -------
    int
        W >= 1. Rows with more than W non-zeros become backup rows.
    """
    counts = np.asarray(token_counts, dtype=np.int64)
    M = counts.size
    if isinstance(spec, (bool, np.bool_)):
        raise TypeError(f"width must be an int or a strategy string, got {spec!r}")
    if isinstance(spec, (int, np.integer)):
        if spec < 0:
            raise ValueError(f"width must be >= 0, got {spec}")
        return _at_most_cols(max(int(spec), 1), n_cols)
    if not isinstance(spec, str):
        raise TypeError(f"width must be an int or a strategy string, got {type(spec).__name__}")
    name, _, arg = spec.partition(":")
    if name == "fixed":
        try:
            n = int(arg)
        except ValueError:
            raise ValueError(f"width {spec!r}: expected 'fixed:<int>'") from None
        return choose_width(counts, n, n_cols=n_cols)
    # the strategy is validated before the empty-batch shortcut, so that a bad
    # width raises whatever the batch size
    if name == "quantile":
        try:
            p = float(arg)
        except ValueError:
            raise ValueError(f"width {spec!r}: expected 'quantile:<p>' with 0 <= p <= 1") from None
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"width {spec!r}: quantile p must be in [0, 1], got {p}")
        return max(quantile_width(counts, p), 1)
    if name in ("min_storage", "auto"):
        if arg or spec != name:  # "min_storage:3" would silently ignore its argument
            raise ValueError(f"width {spec!r}: {name!r} takes no argument")
        if M == 0:
            return 1
        if row_bytes is None:
            if n_cols is None:
                raise ValueError("choose_width needs row_bytes or n_cols for min_storage")
            row_bytes = n_cols * slot_bytes
        hist = np.bincount(counts)
        rows_wider = M - np.cumsum(hist)  # rows_wider[w] = rows with count > w
        ws = np.arange(hist.size, dtype=np.int64)
        cost = M * ws * float(slot_bytes) + rows_wider * float(row_bytes)
        w = int(np.argmin(cost))
        if name == "auto":
            w = max(w, quantile_width(counts, 0.9))
        return max(w, 1)
    raise ValueError(f"unknown width strategy {spec!r}; expected an int, 'fixed:n', 'quantile:p', "
                     f"'min_storage' or 'auto'")


def _at_most_cols(w, n_cols):
    """A fixed width past the row length N buys nothing (a row holds at most N entries)
    and would allocate M x w slots, so it is capped at N."""
    return w if n_cols is None else min(w, max(int(n_cols), 1))


class TrainContext:
    """What the forward pass keeps for the backward pass.

    Attributes
    ----------
    gated : bool
        Gated FFN (g and u saved) or ReLU FFN (h saved as ``g``).
    width : int
        ELL width W of the saved Hybrid activations.
    backup_rows : array of int32, shape (R,)
        Rows kept as dense backup rows (more than W active neurons).
    stats : collections.abc.Mapping
        Read-only, dict-like (``dict(ctx.stats)`` gives a plain dict).
        ``"l0"`` mean active neurons per token; ``"l1"`` the penalty value
        ``l1 * sum|h| / M``; ``"l1_coef"`` the coefficient; ``"n_backup_rows"``;
        ``"width"``; ``"token_counts"`` (M,) int32 active neurons per token;
        ``"neuron_counts"`` (H,) int32 tokens firing each neuron (0 = dead in
        this batch); ``"deterministic"`` (always True: no kernel uses fp32
        atomics).

    Notes
    -----
    Memory: ``g`` and ``u`` values on the pattern ((M, W) each plus (R, H) each),
    the (M, W) int32 pattern, (M,) counts, ``w_down`` transposed, and references
    to x and the weights. The M x H gate output is never kept.
    """

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def _hybrid(self, vals):
        from .hybrid import Hybrid  # containers are optional for the training step

        ell, bk = self._be.split_combined(vals, self.M, self.width, self.R, self.H)
        # the activations may legitimately hold NaN/Inf (check_finite=False, 16-bit
        # overflow): no content scan, as for gated_forward's return_activations
        return Hybrid(ell, self.idx, self.ell_nnz, shape=(self.M, self.H), backup=bk,
                      backup_rows=self.backup_rows, check=False, check_finite=False)

    @property
    def g(self):
        """``relu(x @ w_gate.T)`` (gated) or ``h`` (ReLU FFN) as a :class:`twellpy.Hybrid`."""
        return self._hybrid(self.gvals)

    @property
    def u(self):
        """``x @ w_up.T`` on g's pattern as a :class:`twellpy.Hybrid` (gated only)."""
        if not self.gated:
            raise AttributeError("u exists only for the gated FFN")
        return self._hybrid(self.uvals)

    @property
    @_array.quiet_underflow  # g * u rounded to a 16-bit dtype: the caller's under="raise" stays out
    def h(self):
        """The hidden activations ``h`` as a :class:`twellpy.Hybrid`."""
        if not self.gated:
            return self._hybrid(self.gvals)
        be = self._be
        h = be.from_acc(be.to_acc(self.gvals) * be.to_acc(self.uvals), self.dtype)
        return self._hybrid(h)

    def __repr__(self):
        return (f"TrainContext(gated={self.gated}, M={self.M}, D={self.D}, H={self.H}, "
                f"width={self.width}, backup_rows={self.R}, dtype={self.dtype}, device={self.device})")


# ---------------------------------------------------------------------------
def _prep(arr, name, ndim):
    a, kind = as_array(arr, name, ndim=ndim)
    check_float(a, name)
    return contiguous(a, name), kind


def _check_shape(a, name, want, why=""):
    if tuple(a.shape) != tuple(want):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(want)}{why}")


def _check_l1(l1):
    # float() would also take "0.1" and True; reliability.md promises TypeError for them
    if isinstance(l1, (str, bytes, bool, np.bool_)):
        raise TypeError(f"l1 must be a real number, got {type(l1).__name__}")
    try:
        l1f = float(l1)
    except (TypeError, ValueError):
        raise TypeError(f"l1 must be a real number, got {type(l1).__name__}") from None
    except OverflowError:  # an int beyond float range: not finite as a float
        raise ValueError(f"l1 must be a finite number >= 0, got an int of {len(str(abs(int(l1))))} "
                         f"digits (beyond float range)") from None
    if not np.isfinite(l1f) or l1f < 0:
        raise ValueError(f"l1 must be a finite number >= 0, got {l1f}")
    return l1f


def _queue_finite_checks(cp, named, n_tokens):
    """Queue a NaN/Inf count of each (name, cupy array) on the current stream.

    The counts share one device block with the (n_tokens,) int32 active
    counts per token that the forward reads next, so both come back in one
    small copy at the host synchronisation the forward makes anyway (one
    synchronisation per input would stall the queue four times).

    Returns ``(token_counts, read)``: ``token_counts`` is the int32 view the
    caller fills; ``read()`` copies the block, raises the ValueError of
    ``check_finite`` for the first array, in argument order, that has any
    NaN/Inf, and returns the token counts on the host.
    """
    from .backends.cuda import launch_count_nonfinite

    stream = cp.cuda.get_current_stream()
    head = 8 * len(named)  # uint64 counters, then the int32 token counts
    block = cp.empty(head + 4 * n_tokens, dtype=np.uint8)
    cp.cuda.runtime.memsetAsync(block.data.ptr, 0, head, stream.ptr)
    bad = block[:head].view(np.uint64)
    for i, (_, a) in enumerate(named):
        launch_count_nonfinite(a, bad[i:i + 1], stream)

    def read():
        host = block.get(stream=stream)
        for (nm, a), n_bad in zip(named, host[:head].view(np.uint64)):
            if n_bad:
                raise_nonfinite(a, nm)
        return host[head:].view(np.int32)

    return block[head:].view(np.int32), read


def _forward(x, w_gate, w_up, w_down, l1, width, deterministic, check_finite, gated):
    names = ("x", "w_gate", "w_up", "w_down") if gated else ("x", "w_up", "w_down")
    raw = (x, w_gate, w_up, w_down) if gated else (x, w_up, w_down)
    arrs, kinds = [], []
    for nm, a in zip(names, raw):
        a2, k = _prep(a, nm, 2)
        arrs.append(a2)
        kinds.append(k)
    kind = kinds[0]
    same_device(list(zip(names, arrs)))
    x = arrs[0]
    dt = x.dtype
    for nm, a in zip(names[1:], arrs[1:]):
        if a.dtype != dt:
            raise TypeError(f"{nm} has dtype {a.dtype}, expected {dt} (the dtype of x)")
    if gated:
        w_gate, w_up, w_down = arrs[1:]
    else:
        w_up, w_down = arrs[1:]
        w_gate = None
    M, D = x.shape
    H = w_up.shape[0]
    # name the argument each dimension came from, so a mismatch names both sides
    _check_shape(w_up, "w_up", (H, D), f" (D = {D} from x of shape {tuple(x.shape)})")
    if gated:
        _check_shape(w_gate, "w_gate", (H, D), " (the shape of w_up)")
    _check_shape(w_down, "w_down", (D, H), f" (nn.Linear layout (D, H) for w_up of shape {(H, D)})")
    if H < 1 or D < 1:  # as the inference functions: an empty layer is a caller's mistake
        raise ValueError(f"w_up has shape {tuple(w_up.shape)}, expected (H, D) with H, D >= 1")
    l1 = _check_l1(l1)
    # the inference validator; "sync" is True here (the forward always waits for its counts)
    check_finite = bool(_check_finite_mode(check_finite))
    be = backends.get(x, "train")
    xp = xp_of(x)
    read_checked = None  # reads the NaN/Inf counts and the token counts in one copy
    counts_out = None
    if check_finite:
        if xp is np:
            for nm, a in zip(names, arrs):
                _check_finite(a, nm)
        else:  # counted on the device now, read at the forward's one host synchronisation
            counts_out, read_checked = _queue_finite_checks(xp, list(zip(names, arrs)), M)

    # 1) pattern: dense GEMM of the activation that is ReLU'd. When the whole
    # gate output fits the chunk budget, relu(z) is counted now and packed
    # straight into the Hybrid once the width is chosen (one host
    # synchronisation, no CSR); otherwise row chunks go through a CSR, so the
    # M x H gate output never exists whole.
    _mark("start", xp)
    w_act = w_gate if gated else w_up
    chunk = max(256, GATE_CHUNK_BYTES // max(1, H * dt.itemsize))
    one_chunk = _DIRECT_PACK and 0 < M <= chunk
    if one_chunk:
        z = be.gemm(x, w_act.T, dt)
        token_counts = be.relu_count(z, out=counts_out)
    else:
        counts, cols, vals = [], [], []
        for a in range(0, M, chunk):
            zc = be.gemm(x[a:a + chunk], w_act.T, dt)
            c, _, col, val = be.relu_csr(zc)
            del zc
            counts.append(c)
            cols.append(col)
            vals.append(val)
        if M:
            token_counts = xp.concatenate(counts) if len(counts) > 1 else counts[0]
            if counts_out is not None:
                counts_out[...] = token_counts
                token_counts = counts_out
            col = xp.concatenate(cols) if len(cols) > 1 else cols[0]
            val = be.concat(vals) if len(vals) > 1 else vals[0]
        else:
            token_counts = xp.zeros(0, dtype=np.int32) if counts_out is None else counts_out
            col = xp.zeros(0, dtype=np.int32)
            val = xp.zeros(0, dtype=dt)
        del counts, cols, vals
        indptr = xp.zeros(M + 1, dtype=np.int64)
        if M:
            xp.cumsum(token_counts, dtype=np.int64, out=indptr[1:])

    _mark("gate GEMM + pattern", xp)
    # work that does not need the width is queued before the host reads the
    # counts, so the device keeps busy while the host picks W
    if not one_chunk:
        neuron_counts = count_in_range(col, H)  # no host sync (cupy.bincount would sync twice)
    w_downT = be.transpose_copy(w_down)
    _mark("neuron counts + w_down^T", xp)

    # 2) Hybrid layout: width from the counts, backup rows for wider rows
    if read_checked is not None:
        counts_host = read_checked()
    else:
        counts_host = token_counts.get() if hasattr(token_counts, "get") else token_counts
    _mark("counts to host (sync)", xp)
    n_vals = 2 if gated else 1
    W = choose_width(counts_host, width, slot_bytes=n_vals * dt.itemsize + 4,
                     row_bytes=n_vals * dt.itemsize * H, n_cols=H)
    R = int(np.count_nonzero(counts_host > W))
    # [row_map (M,) | backup_rows (R,)], built where the counts are (on the GPU:
    # one launch, no host work or upload while the device waits)
    maps = be.row_maps(token_counts, W, R)
    row_map, backup_rows = maps[:M], maps[M:]
    _mark("width + row maps", xp)
    if one_chunk:
        gvals, idx, ell_nnz, neuron_counts = be.relu_to_hybrid(z, row_map, W, R)
        del z
    else:
        gvals, idx, ell_nnz = be.csr_to_hybrid(indptr, col, val, row_map, W, H, R)
        del col, val, indptr
    g_ell, g_bk = be.split_combined(gvals, M, W, R, H)

    # 3) forward on the pattern: ELL rows in one fused kernel (which also sums
    # |h| per row for the L1 statistic), backup rows dense
    uvals = xp.empty_like(gvals) if gated else None
    u_ell, u_bk = be.split_combined(uvals, M, W, R, H) if gated else (None, None)
    _mark("pattern -> hybrid", xp)
    y, h_abs_rows = be.ffn_forward_ell(x, w_up, w_downT, idx, ell_nnz, g_ell, u_ell, gated)
    _mark("fused fwd kernel", xp)
    if R:
        # two GEMMs over the R rows; one pass each side does the element-wise
        # work (u on the pattern, h, the rows' |h| sums into h_abs_rows)
        u_acc = be.gemm_acc(be.take_rows(x, backup_rows), w_up.T) if gated else None
        hb = be.backup_rows_forward(g_bk, u_acc, u_bk, backup_rows, h_abs_rows, gated)
        del u_acc
        yb = be.gemm_acc(hb, w_down.T)
        # the GEMM also multiplies the zeros of inactive neurons: rows it left
        # non-finite are summed again over their pattern (finite rows: one read)
        be.backup_exact(yb, g_bk, hb, w_downT)
        be.put_rows_from_acc(y, backup_rows, yb)
        del hb, yb

    _mark("backup rows fwd", xp)
    # 4) statistics (the L1 value stays on the device until read)
    h_abs = h_abs_rows.sum() if M else 0.0
    stats = _Stats({
        "l0": float(counts_host.sum()) / M if M else 0.0,
        "l1": (lambda: l1 * float(h_abs) / M) if M else 0.0,
        "l1_coef": l1,
        "n_backup_rows": R,
        "width": W,
        "token_counts": token_counts,
        "neuron_counts": neuron_counts,
        "deterministic": True,
    })
    _mark("stats", xp)
    ctx = TrainContext(gated=gated, nnz_total=int(counts_host.sum()), kind=kind, xp=xp, _be=be, device=device_of(x),
                       dtype=dt, M=M, D=D, H=H, width=W, R=R, x=x, w_gate=w_gate, w_up=w_up,
                       w_down=w_down, w_downT=w_downT, idx=idx, ell_nnz=ell_nnz, row_map=row_map,
                       backup_rows=backup_rows, gvals=gvals, uvals=uvals, l1_coef=l1,
                       check_finite=check_finite, deterministic=bool(deterministic), stats=stats)
    return to_caller(y, kind), ctx


def _backward(ctx, dy, gated):
    if not isinstance(ctx, TrainContext):
        raise TypeError(f"ctx must be the TrainContext returned by the forward pass, got {type(ctx).__name__}")
    if ctx.gated != gated:
        want = "gated_forward_train" if gated else "relu_forward_train"
        raise ValueError(f"ctx comes from the {'gated' if ctx.gated else 'ReLU'} forward; "
                         f"this backward needs a ctx from {want}")
    dy, kind = _prep(dy, "dy", 2)
    _check_shape(dy, "dy", (ctx.M, ctx.D))
    if dy.dtype != ctx.dtype:
        raise TypeError(f"dy has dtype {dy.dtype}, expected {ctx.dtype} (the dtype of x)")
    same_device([("x", ctx.x), ("dy", dy)])
    be, xp, dt = ctx._be, ctx.xp, ctx.dtype
    dy_count = None  # NaN/Inf count of dy, read just before returning (GPU)
    if ctx.check_finite:
        if xp is np:
            _check_finite(dy, "dy")
        else:
            # counted first, read after every kernel of the backward is queued: the read
            # waits for the count only, so the device goes straight on from the forward
            # to the backward instead of idling while the host launches it
            from .backends.cuda import queue_count_nonfinite

            dy_count = queue_count_nonfinite(dy)
    M, D, H, W, R = ctx.M, ctx.D, ctx.H, ctx.width, ctx.R
    l1s = ctx.l1_coef / M if M else 0.0

    # 1) dh on the pattern (+ fused L1), du/dg, and the ELL rows of dx
    _mark("start", xp)
    da = xp.empty(M * W + R * H, dtype=dt)
    db = xp.empty_like(da) if gated else None
    da_ell, da_bk = be.split_combined(da, M, W, R, H)
    db_ell, db_bk = be.split_combined(db, M, W, R, H) if gated else (None, None)
    g_ell, g_bk = be.split_combined(ctx.gvals, M, W, R, H)
    u_ell, u_bk = be.split_combined(ctx.uvals, M, W, R, H) if gated else (None, None)
    dx = be.ffn_backward_ell(dy, ctx.w_downT, ctx.w_up, ctx.w_gate, ctx.idx, ctx.ell_nnz, g_ell, u_ell,
                             l1s, gated, da_ell, db_ell)
    _mark("fused bwd kernel", xp)

    # 2) backup rows: dense products restricted to those rows
    if R:
        br = ctx.backup_rows
        dh_acc = be.gemm_acc(be.take_rows(dy, br), ctx.w_down)
        be.backup_rows_backward(dh_acc, g_bk, u_bk, l1s, gated, da_bk, db_bk)
        del dh_acc
        dxb = be.gemm_acc(da_bk, ctx.w_up)
        if gated:
            be.gemm_acc(db_bk, ctx.w_gate, out=dxb)
        # as in the forward: an inactive neuron's NaN/Inf weights must add nothing
        be.backup_exact(dxb, g_bk, da_bk, ctx.w_up, db_bk if gated else None, ctx.w_gate if gated else None)
        be.put_rows_from_acc(dx, br, dxb)
        del dxb

    _mark("backup rows bwd", xp)
    # 3) weight gradients from the deterministic transpose of the pattern
    # the forward already counted the entries, so the transpose needs no sync
    indptr, rows, pos = be.transpose_pattern(ctx.idx, ctx.row_map, g_bk, H, nnz=ctx.nnz_total)
    _mark("transpose (counting sort)", xp)
    dw_up, dw_gate, dw_downT = be.ffn_weight_grads(indptr, rows, pos, ctx.x, dy, da, db, ctx.gvals,
                                                   ctx.uvals, H, gated)
    _mark("weight grads", xp)
    dw_down = be.transpose_copy(dw_downT)
    _mark("dw_down^T", xp)
    if dy_count is not None and dy_count.read():
        # the traceback would keep the gradients alive: drop them first
        del dx, da, db, dw_up, dw_gate, dw_downT, dw_down
        with dy.device:
            xp.cuda.get_current_stream().synchronize()  # the queued kernels are done with dy
        raise_nonfinite(dy, "dy")
    out_kind = kind if kind not in (None, "numpy", "cupy") else ctx.kind
    if gated:
        return tuple(to_caller(a, out_kind) for a in (dx, dw_gate, dw_up, dw_down))
    return tuple(to_caller(a, out_kind) for a in (dx, dw_up, dw_down))


# ---------------------------------------------------------------------------
@_array.quiet_underflow
def gated_forward_train(x, w_gate, w_up, w_down, l1=0.0, width="auto", deterministic=False,
                        check_finite=True):
    """Forward pass of the gated ReLU FFN that keeps a sparse context for backward.

    Parameters
    ----------
    x : array_like, shape (M, D)
        Tokens; numpy, cupy, torch, jax or any DLPack array.
    w_gate, w_up : array_like, shape (H, D)
        Gate and up projections (``nn.Linear`` layout).
    w_down : array_like, shape (D, H)
        Down projection.
    l1 : float
        L1 coefficient on h; the penalty ``l1 * sum|h| / M`` is reported in
        ``ctx.stats["l1"]`` and its gradient is injected in the backward.
    width : int or str
        ELL width strategy of the saved activations (see :func:`choose_width`).
        Rows with more active neurons become dense backup rows.
    deterministic : bool
        Accepted for API stability: every kernel is already deterministic.
    check_finite : bool or "sync"
        Raise ``ValueError`` on NaN/Inf in the inputs (and in dy later).
        ``"sync"`` is accepted as True (the forward always waits for the
        count); any other value raises ``ValueError``/``TypeError``.

    Returns
    -------
    y : array, shape (M, D)
        ``(relu(x w_gate^T) * (x w_up^T)) w_down^T`` in the caller's array type.
    ctx : TrainContext
        Sparse activations, the pattern, references to x and the weights, and
        ``ctx.stats``.

    Raises
    ------
    TypeError
        Non-float dtypes, or arrays of different dtypes.
    TypeError
        Also for an ``l1`` that is not a real number (a string, a bool).
    ValueError
        Mismatched shapes, different devices, NaN/Inf, negative ``l1``.
    """
    return _forward(x, w_gate, w_up, w_down, l1, width, deterministic, check_finite, gated=True)


@_array.quiet_underflow
def gated_backward(ctx, dy):
    """Backward pass of :func:`gated_forward_train`.

    Parameters
    ----------
    ctx : TrainContext
        From :func:`gated_forward_train`.
    dy : array_like, shape (M, D)
        Gradient of the loss with respect to y.

    Returns
    -------
    dx : array, shape (M, D)
    dw_gate, dw_up : arrays, shape (H, D)
    dw_down : array, shape (D, H)
        Gradients including the L1 term ``(l1 / M) * sign(h)`` on h's pattern,
        in the dtype of x and the caller's array type.
    """
    return _backward(ctx, dy, gated=True)


@_array.quiet_underflow
def relu_forward_train(x, w_up, w_down, l1=0.0, width="auto", deterministic=False, check_finite=True):
    """Forward pass of the ReLU FFN ``relu(x @ w_up.T) @ w_down.T`` keeping a sparse context.

    Parameters are as in :func:`gated_forward_train` without ``w_gate``; the
    context keeps ``h = relu(x @ w_up.T)`` on its pattern.

    Returns
    -------
    y : array, shape (M, D)
    ctx : TrainContext
    """
    return _forward(x, None, w_up, w_down, l1, width, deterministic, check_finite, gated=False)


@_array.quiet_underflow
def relu_backward(ctx, dy):
    """Backward pass of :func:`relu_forward_train`.

    Returns
    -------
    dx : array, shape (M, D)
    dw_up : array, shape (H, D)
    dw_down : array, shape (D, H)
    """
    return _backward(ctx, dy, gated=False)
