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
pattern, so the M x H gate output never exists whole. With ``speculate`` (on
for GPU arrays by default), W and room for the backup rows come from the
layer's previous step, and the host reads the counts only after the ELL
kernel is queued; a step whose counts pick another W, or need more backup
rows, runs again on the exact path.
Every other M x H product runs on the pattern only. The context keeps g and u
on the pattern (ELL values + backup rows), the pattern's indices, x and the
weights -- never an M x H dense array.

Determinism: all kernels (CPU and GPU) are deterministic; no floating-point
atomics are used anywhere, so ``deterministic=True`` costs nothing and the
same inputs always give the same bits, with or without ``speculate``: a
speculative step is kept only when its layout is the one the exact path picks
from the step's own counts, so a layer's history (another thread's step of the
same layer, a weight buffer re-used by another layer, an entry forgotten by
the LRU) can cost a re-run, never change a bit.
"""
from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from . import _array, backends
from ._array import (as_array, check_finite as _check_finite, check_float, contiguous, count_in_range, device_of,
                     raise_nonfinite, same_device, switch_setting as _switch_setting, to_caller, xp_of)
from ._ffn_infer import _check_finite_mode
from .hybrid import quantile_width_from_cumulative

__all__ = ["gated_forward_train", "gated_backward", "relu_forward_train", "relu_backward",
           "TrainContext", "choose_width"]

#: Bytes of gate-GEMM output handled at once while extracting the pattern
#: (bounds the only M x H temporary; a dense step keeps several of those).
GATE_CHUNK_BYTES = 192 << 20

#: Bytes of each accumulator-dtype (float32) temporary of the backup rows'
#: GEMMs: the rows go through those GEMMs in chunks of about this size, so a
#: step whose rows are mostly backup rows never holds an R x H float32 array.
BACKUP_CHUNK_BYTES = 192 << 20

#: The backup rows' weight gradients are dense GEMMs (x, dy and the rows'
#: du / dg / h, summed in the accumulator dtype; the ELL entries are then
#: gathered onto those sums) once there are at least this many backup rows
#: holding, on average, at least ``BACKUP_WGRAD_GEMM_MIN_MEAN`` active
#: neurons each; otherwise their entries join the gather with the ELL rows'.
#: Per row the GEMMs cost 6 H D flops whatever the row's count, the gather
#: 2 D values a row read per entry (from L2), so the GEMMs win past a count
#: of about 3 H x (L2 bytes/s) / (GEMM flop/s x itemsize): about 90 at
#: H = 5632 in bf16 on an H100.
BACKUP_WGRAD_GEMM_MIN_ROWS = 256
BACKUP_WGRAD_GEMM_MIN_MEAN = 64


#: Whether the route above may run at all (TWELLPY_TRAIN_BACKUP_GEMM=0|1; on by default).
#: On an H100 (2026-12-07) it made the step 3% faster at W3 (632 backup rows), 1.5% at
#: sigma 0.3 (589), and 30% at W2 with width 48 (28.7 against 40.8 ms by gather).
BACKUP_WGRAD_GEMM = _switch_setting("TWELLPY_TRAIN_BACKUP_GEMM", os.environ.get("TWELLPY_TRAIN_BACKUP_GEMM", "1"))

#: The one-chunk forward packs relu(z) straight into the Hybrid; False sends it
#: through the CSR path of the chunked forward instead (tests compare the two).
_DIRECT_PACK = True

#: A speculative one-chunk forward counts and packs relu(z) in one read of the gate
#: output (``relu_count_pack``, then the few wide rows' backup rows) instead of
#: counting, then packing (TWELLPY_TRAIN_COUNT_PACK=1|0). Same bits. On by default
#: since an H100 run (2026-12-07, W1-16k): forward 1.41 against 1.49 ms, step 3.29
#: against 3.37 ms, the exact path's bits.
COUNT_PACK = _switch_setting("TWELLPY_TRAIN_COUNT_PACK", os.environ.get("TWELLPY_TRAIN_COUNT_PACK", "1"))

#: A batch whose gate output passes ``GATE_CHUNK_BYTES`` speculates too
#: (TWELLPY_TRAIN_SPECULATE_CHUNKED=1|0): with a remembered layout, each row chunk's GEMM
#: output is counted and packed into the Hybrid, mapped and its wide rows written while it
#: is there (``gate_count_pack_streamed``), instead of going through a CSR of the chunk and
#: waiting for the counts. Same bits as the exact path (a step whose layout differs runs
#: again). On by default since an H100 run (2026-12-07): W1-64k step 12.61 against 13.82
#: ms, W2 30.70 against 31.82 ms, the exact path's bits.
SPECULATE_CHUNKED = _switch_setting("TWELLPY_TRAIN_SPECULATE_CHUNKED",
                                    os.environ.get("TWELLPY_TRAIN_SPECULATE_CHUNKED", "1"))

def _positive_setting(name, value):
    """The int of a positive-integer environment variable ``name`` (anything else raises)."""
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


#: Row chunks of a counted-and-packed forward's gate GEMM (TWELLPY_TRAIN_GATE_CHUNKS, a
#: positive integer; 1 by default): the GEMM and the count-and-pack take turns over them,
#: so each chunk's pack reads gate output the L2 may still hold. Same bits when cuBLAS
#: computes a row range's product as it does the whole batch's (it may pick another kernel
#: for fewer rows; the step is then as exact, not bit-identical). Stays 1: on an H100
#: (2026-12-07, W1-16k) 2, 4 and 8 chunks were slower (step 3.12, 3.17, 3.29 against 3.08
#: ms): the count and pack is not bound by re-reading the gate output from DRAM.
GATE_CHUNKS = _positive_setting("TWELLPY_TRAIN_GATE_CHUNKS", os.environ.get("TWELLPY_TRAIN_GATE_CHUNKS", "1"))

#: The backward's dh by neuron (TWELLPY_TRAIN_DH_BY_NEURON=1|0): one pass over the
#: transposed pattern computes dh, du and dg on the ELL entries together with the weight
#: gradients, from the dy and x rows those gather anyway, so no w_down row is gathered per
#: entry; dx follows from du and dg (``ell_dx``). On the GPU the dot products are summed in
#: another (fixed) order than the row-oriented kernels', so du and dg may differ from
#: theirs in the last bit; the CPU computes the same values either way. Off: on an H100
#: (2026-12-07) its backward was slower (2.37 against 1.72 ms at W1-16k; the per-entry
#: block reduction and barrier leave the kernel latency-bound; docs/performance.md).
DH_BY_NEURON = _switch_setting("TWELLPY_TRAIN_DH_BY_NEURON", os.environ.get("TWELLPY_TRAIN_DH_BY_NEURON", "0"))

#: Work that does not feed the next kernel runs beside it on a second stream
#: (TWELLPY_TRAIN_SIDE_STREAM=1|0): in the backward, the pattern's transpose (counting
#: sort, several small launches) beside the fused ELL backward kernel, which does not
#: need it; in a forward that counts and packs in one read, the row maps and the wide
#: rows' backup rows beside the ELL forward kernel. Same kernels, same bits. On by
#: default since an H100 run (2026-12-07): W1-16k step 3.03 against 3.08 ms, W1-64k
#: and W2 unchanged within noise.
SIDE_STREAM = _switch_setting("TWELLPY_TRAIN_SIDE_STREAM", os.environ.get("TWELLPY_TRAIN_SIDE_STREAM", "1"))


#: The backward launches its fused ELL kernel before the pattern's transpose
#: (TWELLPY_TRAIN_BWD_ELL_FIRST=1|0), which still runs beside it on the side stream:
#: at W1-16k the host seemed to reach the backward's first kernel after the device had
#: finished the forward, and the transpose's dozen launches came first. Same results.
#: On since an H100 run (2026-12-07): W1-16k step 2.99-3.06 against 3.07-3.15 ms (backward
#: 1.74-1.78 against 1.88-1.95) in every round of two calls; W1-64k and W2 unchanged within noise.
BWD_ELL_FIRST = _switch_setting("TWELLPY_TRAIN_BWD_ELL_FIRST", os.environ.get("TWELLPY_TRAIN_BWD_ELL_FIRST", "1"))


def _side_work(be, wanted=True):
    """``be.SideWork``, on a second stream when the side stream is on and ``wanted``."""
    return be.SideWork(enabled=SIDE_STREAM and wanted)


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


def _deferred_l1(xp, h_abs_rows, l1, M):
    """The L1 statistic ``l1 * sum(|h|) / M`` as a read deferred to the first
    ``ctx.stats["l1"]``, so the step launches no reduction on the host's path
    from the forward's count read to the backward's first kernel. The read waits
    for an event recorded after the forward's kernels, then sums on the current
    stream: the forward's own stream (a torch stream behind a CuPy
    ExternalStream, say) may be gone by then."""
    if xp is np:
        return lambda: l1 * float(h_abs_rows.sum()) / M
    written = xp.cuda.get_current_stream().record()

    def read():
        with h_abs_rows.device:
            written.synchronize()
            return l1 * float(h_abs_rows.sum()) / M
    return read


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
        ``min_storage`` and ``quantile:0.9``, rounded up to a multiple of
        ``max(8, 2**(floor(log2 W) - 1))``, steps of at most half of W, so
        that W stays put while a layer's counts drift a little from step to
        step, and the rows just past the raw width stay ELL rows; see
        ``speculate`` in :func:`gated_forward_train`).
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
    counts = token_counts if isinstance(token_counts, _CountSummary) else None
    if counts is None:
        counts = np.asarray(token_counts, dtype=np.int64).ravel()
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
        return max(_summary(counts).quantile_width(p), 1)
    if name in ("min_storage", "auto"):
        if arg or spec != name:  # "min_storage:3" would silently ignore its argument
            raise ValueError(f"width {spec!r}: {name!r} takes no argument")
        if M == 0:
            return 1
        if row_bytes is None:
            if n_cols is None:
                raise ValueError("choose_width needs row_bytes or n_cols for min_storage")
            row_bytes = n_cols * slot_bytes
        summary = _summary(counts)
        rows_wider = M - summary.rows_upto  # rows_wider[w] = rows with count > w
        ws = np.arange(rows_wider.size, dtype=np.int64)
        cost = M * ws * float(slot_bytes) + rows_wider * float(row_bytes)
        w = int(np.argmin(cost))
        if name == "auto":
            return _stable_width(max(w, summary.quantile_width(0.9), 1), n_cols)
        return max(w, 1)
    raise ValueError(f"unknown width strategy {spec!r}; expected an int, 'fixed:n', 'quantile:p', "
                     f"'min_storage' or 'auto'")


class _CountSummary:
    """A step's token counts on the host, summarised once by their histogram.

    The width choice (:func:`choose_width`), the wide rows at a width, the ELL
    entries and the total all read the histogram (a few hundred bins) instead
    of passing over the M counts each: at W1-16k those passes took about 0.1 ms
    of host time, between the speculative forward's read of the counts and the
    backward's first kernel, where the device may run out of queued work.
    ``choose_width`` accepts a summary in place of the counts (same width).

    Parameters
    ----------
    counts : numpy.ndarray of int
        Non-negative non-zeros per row (host, 1-D).
    """

    __slots__ = ("counts", "size", "rows_upto", "entries_upto_w")

    def __init__(self, counts):
        counts = np.asarray(counts)
        self.counts = counts
        self.size = int(counts.size)
        hist = np.bincount(counts) if self.size else np.zeros(1, np.int64)
        self.rows_upto = np.cumsum(hist)  # rows_upto[w]: rows with at most w entries
        self.entries_upto_w = np.cumsum(hist * np.arange(hist.size, dtype=np.int64))

    def _bin(self, w):
        return min(int(w), self.rows_upto.size - 1)

    def wider(self, w):
        """Rows with more than ``w >= 0`` entries."""
        return self.size - int(self.rows_upto[self._bin(w)])

    def entries_upto(self, w):
        """Entries of the rows with at most ``w >= 0`` entries (the ELL part at width w)."""
        return int(self.entries_upto_w[self._bin(w)])

    @property
    def total(self):
        """Entries of all rows."""
        return int(self.entries_upto_w[-1])

    def quantile_width(self, p):
        """:func:`twellpy.hybrid.quantile_width` of the counts (0 for no rows)."""
        return quantile_width_from_cumulative(self.rows_upto, p) if self.size else 0


def _summary(counts):
    """``counts`` as a :class:`_CountSummary` (made here unless it is one)."""
    return counts if isinstance(counts, _CountSummary) else _CountSummary(counts)


def _stable_width(w, n_cols=None):
    """``w`` rounded up to a coarse grid: a multiple of ``max(8, 2**(floor(log2 w) - 1))``.

    The grid's steps are at most half of W: 8, 16, 24, 32, 48, 64, 96, 128,
    192, 256, 384, ... A layer's counts drift a little from step to step, and
    with them the raw ``min_storage`` / quantile width (50 to 55 at W1-16k
    sizes, 138 to 142 at W2's, 290 to 356 at sigma 0.3); on the grid W stays
    put, which is what lets a speculative step (``speculate``) reuse the
    previous step's layout and still be this step's exact path. The step also
    leaves room above the raw width, so the few rows just past it (the
    token-count tail) are usually ELL rows rather than dense backup rows, each
    of which costs whole-weight GEMMs: at W1-16k, W = 64 (no backup row) took
    3.29-3.32 ms a step against 3.42-3.44 ms at W = 56 (one backup row; H100,
    2026-12-07). The slots added are padding that the products skip (each row
    runs to its own count); they cost memory (at most half the ELL part) and
    the transpose's slot scan.

    Parameters
    ----------
    w : int
        A width >= 1.
    n_cols : int, optional
        Row length N; the result is at most N.

    Returns
    -------
    int
    """
    w = max(int(w), 1)
    step = max(8, 1 << max(w.bit_length() - 2, 0))
    return _at_most_cols(-(-w // step) * step, n_cols)


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
    speculation : str
        Which layout the forward used: ``"off"`` (speculation not asked),
        ``"exact"`` (asked, but no previous step of this layer, a chunked
        batch, or a layer backing off after a re-run: the counts were read
        first), ``"hit"`` (the previous step's
        width was this step's and its backup capacity was enough) or
        ``"rerun"`` (they were not: the step ran again on the exact path).

    Notes
    -----
    Memory: ``g`` and ``u`` values on the pattern ((M, W) each plus (R, H) each;
    after a speculative step the buffers are views of allocations with room for
    the capacity's rows, so up to (capacity - R, H) each is held unused until the
    context is freed),
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

    Returns ``(block, token_counts)``: ``token_counts`` is the int32 view of
    ``block`` the caller fills; once ``block`` is on the host,
    :func:`_counts_from_block` raises the ValueError of ``check_finite`` for
    the first array, in argument order, that has any NaN/Inf, and returns the
    token counts.
    """
    from .backends.cuda import launch_count_nonfinite

    stream = cp.cuda.get_current_stream()
    head = 8 * len(named)  # uint64 counters, then the int32 token counts
    block = cp.empty(head + 4 * n_tokens, dtype=np.uint8)
    cp.cuda.runtime.memsetAsync(block.data.ptr, 0, head, stream.ptr)
    bad = block[:head].view(np.uint64)
    for i, (_, a) in enumerate(named):
        launch_count_nonfinite(a, bad[i:i + 1], stream)
    return block, block[head:].view(np.int32)


def _counts_from_block(host, named):
    """Token counts from the host copy of the block of :func:`_queue_finite_checks`
    (``named`` empty: the block is the int32 counts alone); raises for NaN/Inf."""
    head = 8 * len(named)
    for (nm, a), n_bad in zip(named, host[:head].view(np.uint64)):
        if n_bad:
            raise_nonfinite(a, nm)
    return host[head:].view(np.int32) if head else host


# ---------------------------------------------------------------------------
# Speculative layout: the Hybrid's width W and its backup-row capacity come
# from the previous step of the same layer, so the forward queues its kernels
# without reading the token counts first; the counts come back while the ELL
# kernel runs, and a step whose counts pick another W, or whose wide rows exceed
# the capacity, is run again on the exact path (nothing is dropped, the layout
# follows the counts, and the layer backs off to the exact path for a while).
def _speculate_setting(value):
    if value not in ("0", "1", "auto"):
        raise ValueError(f"TWELLPY_TRAIN_SPECULATE must be 0, 1 or auto, got {value!r}")
    return "auto" if value == "auto" else value == "1"


#: Default of ``speculate`` (TWELLPY_TRAIN_SPECULATE=0|1|auto). "auto": on for GPU
#: arrays, where it saves the host's wait for the counts (3.77 against 3.91 ms a W1-16k
#: step, H100, 2026-12-06), off on the CPU, where there is no wait to save. A hit is
#: always the exact path's layout for the step's own counts, so it never changes bits.
SPECULATE = _speculate_setting(os.environ.get("TWELLPY_TRAIN_SPECULATE", "auto"))

#: Extra backup rows of a speculative layout, as a fraction of the wide rows of
#: the step it comes from; doubled (up to ``_SPEC_MAX_SLACK``) after an overflow.
_SPEC_SLACK = 0.25
_SPEC_MAX_SLACK = 2.0
#: at least this many extra rows (a few wide rows fluctuate by more than 25%),
#: and capacities in multiples of ``_SPEC_ALIGN`` rows
_SPEC_MIN_EXTRA = 16
_SPEC_ALIGN = 16
#: layers remembered (least recently used dropped first)
_SPEC_MAX_LAYERS = 256
#: After a re-run (about one forward's cost) a layer takes the exact path for its
#: next ``backoff`` steps; the backoff doubles with each re-run, up to this, and
#: halves with each hit, so a layer whose W keeps moving mostly runs exact.
_SPEC_MAX_BACKOFF = 32


def _backup_capacity(n_wide, n_rows, slack=_SPEC_SLACK):
    """Backup rows to make room for before a step's counts are known.

    Parameters
    ----------
    n_wide : int
        Rows wider than the width in the step the layout comes from.
    n_rows : int
        M, the rows of the step (no capacity beyond M is ever needed).
    slack : float
        Extra rows as a fraction of ``n_wide``.

    Returns
    -------
    int
        ``n_wide + max(_SPEC_MIN_EXTRA, ceil(slack * n_wide))`` rounded up to a
        multiple of ``_SPEC_ALIGN``, at most ``n_rows``.
    """
    n_wide, n_rows = int(n_wide), int(n_rows)
    if n_wide < 0 or n_rows < 0 or not slack >= 0:
        raise ValueError(f"backup capacity needs n_wide, n_rows, slack >= 0, got {n_wide}, {n_rows}, {slack}")
    extra = max(_SPEC_MIN_EXTRA, math.ceil(slack * n_wide))
    cap = -(-(n_wide + extra) // _SPEC_ALIGN) * _SPEC_ALIGN
    return min(cap, n_rows)


def _next_layout(token_counts, width, *, n_cols, slot_bytes, row_bytes, slack=_SPEC_SLACK, overflowed=False,
                 backoff=(0, 0)):
    """The speculative layout of a layer's next step from this step's counts.

    Parameters
    ----------
    token_counts : numpy.ndarray of int or _CountSummary
        This step's active neurons per token (host), or their summary.
    width : int or str
        The caller's width strategy (see :func:`choose_width`).
    n_cols, slot_bytes, row_bytes : int
        As for :func:`choose_width`.
    slack : float
        The layer's current slack.
    overflowed : bool
        This step's speculative capacity was too small: the slack doubles.
    backoff : tuple of int
        ``(backoff, skip)`` of the next layout (see :func:`_backoff_after`).

    Returns
    -------
    _Layout
        ``width``: what the exact path picks from these counts; ``capacity``:
        :func:`_backup_capacity` of the rows wider than it; ``slack``;
        ``backoff``, ``skip``.
    """
    if overflowed:
        slack = min(max(2.0 * slack, _SPEC_SLACK), _SPEC_MAX_SLACK)
    counts = _summary(token_counts)
    W = choose_width(counts, width, slot_bytes=slot_bytes, row_bytes=row_bytes, n_cols=n_cols)
    return _Layout(W, _backup_capacity(counts.wider(W), counts.size, slack), slack, *backoff)


def _backoff_after(prev, how):
    """``(backoff, skip)`` for a layer's next step after one that took path ``how``
    (``"hit"``, ``"rerun"`` or ``"exact"``) with the layout ``prev`` (None: its first)."""
    if prev is None:
        return 0, 0
    if how == "rerun":
        b = min(max(1, 2 * prev.backoff), _SPEC_MAX_BACKOFF)
        return b, b
    if how == "hit":
        return prev.backoff // 2, 0
    return prev.backoff, max(prev.skip - 1, 0)   # an exact step while backing off


class _Layout(NamedTuple):
    """What one step of a layer leaves for its next: ELL width, backup capacity,
    slack, and the re-run backoff (``skip``: exact steps still to take)."""

    width: int
    capacity: int
    slack: float
    backoff: int = 0
    skip: int = 0


_LAYOUTS: OrderedDict = OrderedDict()
_LAYOUTS_LOCK = threading.Lock()


def _data_ptr(a):
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def _layout_key(x, w_act, gated, width):
    """A layer is told apart by where its activation weight lives (the same buffer
    step after step when an optimiser updates it in place) and by the shapes and
    options; a reused buffer or a stale entry can only cost a re-run."""
    return (device_of(x), _data_ptr(w_act), tuple(w_act.shape), tuple(x.shape), str(x.dtype), bool(gated),
            repr(width))


def _layout_get(key):
    with _LAYOUTS_LOCK:
        lay = _LAYOUTS.get(key)
        if lay is not None:
            _LAYOUTS.move_to_end(key)
        return lay


def _layout_put(key, lay):
    with _LAYOUTS_LOCK:
        _LAYOUTS[key] = lay
        _LAYOUTS.move_to_end(key)
        while len(_LAYOUTS) > _SPEC_MAX_LAYERS:
            _LAYOUTS.popitem(last=False)


def _speculate_option(speculate, on_gpu):
    if speculate is None:
        return on_gpu if SPECULATE == "auto" else SPECULATE
    if isinstance(speculate, (bool, np.bool_)):
        return bool(speculate)
    raise TypeError(f"speculate must be True, False or None, got {type(speculate).__name__}")


def _forward(x, w_gate, w_up, w_down, l1, width, deterministic, check_finite, gated, speculate=None):
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
    spec_on = _speculate_option(speculate, xp is not np)
    n_vals = 2 if gated else 1
    sizes = dict(n_cols=H, slot_bytes=n_vals * dt.itemsize + 4, row_bytes=n_vals * dt.itemsize * H)
    key = _layout_key(x, w_gate if gated else w_up, gated, width) if spec_on and M else None
    lay = _layout_get(key) if key is not None else None

    def run(layout, check_inputs):
        return _forward_pass(be, xp, list(zip(names, arrs)), x, w_gate, w_up, w_down, l1, width, gated,
                             check_inputs, layout, sizes)

    y, ctx, counts_host, speculated = run(lay if lay is None or not lay.skip else None, check_finite)
    how = "off" if key is None else "hit" if speculated else "exact"
    if ctx is None:
        # more wide rows than the capacity: this step again on the exact path (its
        # inputs are checked already); the speculative results are dropped unread
        y, ctx, counts_host, _ = run(None, False)
        how = "rerun"
    if key is not None:
        # the slack grows only when the room was short for the layout's own W (not
        # when W alone changed): the wide rows counted at that W, not at the new one
        short = how == "rerun" and counts_host.wider(lay.width) > lay.capacity
        _layout_put(key, _next_layout(counts_host, width, slack=lay.slack if lay else _SPEC_SLACK,
                                      overflowed=short, backoff=_backoff_after(lay, how), **sizes))
    ctx.__dict__.update(kind=kind, check_finite=check_finite, deterministic=bool(deterministic), speculation=how)
    return to_caller(y, kind), ctx


def _forward_pass(be, xp, named, x, w_gate, w_up, w_down, l1, width, gated, check_inputs, layout, sizes):
    """One forward on raw arrays of one backend.

    ``layout`` None: the exact path (the counts are read before the width is
    chosen). A :class:`_Layout`: its width and backup capacity are used
    without reading the counts first (with chunked speculation, batches of
    several gate chunks too); the counts are read once the ELL kernel is queued.

    Returns ``(y, ctx, counts, speculated)``: ``counts`` the token counts on
    the host (a :class:`_CountSummary`), ``speculated`` whether ``layout`` was
    used. When more rows are wide than its capacity holds, ``y`` and ``ctx``
    are None (nothing of that pass may be used).
    """
    M, D = x.shape
    H = w_up.shape[0]
    dt = x.dtype
    block = None  # what comes back to the host: NaN/Inf counters (GPU checks) and the token counts
    counts_out = None
    checked = []
    if check_inputs:
        if xp is np:
            for nm, a in named:
                _check_finite(a, nm)
        else:  # counted on the device now, read with the token counts
            checked = named
            block, counts_out = _queue_finite_checks(xp, named, M)

    # 1) pattern: dense GEMM of the activation that is ReLU'd. When the whole
    # gate output fits the chunk budget, relu(z) is counted now and packed
    # straight into the Hybrid once the width is known (no CSR); otherwise
    # row chunks go through a CSR, so the M x H gate output never exists whole.
    _mark("start", xp)
    w_act = w_gate if gated else w_up
    chunk = max(256, GATE_CHUNK_BYTES // max(1, H * dt.itemsize))
    one_chunk = _DIRECT_PACK and 0 < M <= chunk
    # a batch larger than one chunk speculates only by counting and packing each chunk
    # as its GEMM writes it (no CSR, maps and backup rows chunk by chunk)
    spec = layout if one_chunk or (M > 0 and SPECULATE_CHUNKED and COUNT_PACK) else None
    streamed = spec is not None and not one_chunk
    packed = None  # relu_count_pack's outputs (a speculative forward, COUNT_PACK)
    maps = None  # the row maps, when the pattern step built them already
    if streamed:
        packed, maps = be.gate_count_pack_streamed(x, w_act, spec.width, spec.capacity, chunk, out=counts_out)
        token_counts = packed[4]
    elif one_chunk:
        if spec is not None and COUNT_PACK:
            z, packed = be.gate_count_pack(x, w_act, spec.width, spec.capacity, out=counts_out, chunks=GATE_CHUNKS)
            token_counts = packed[4]
        else:
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
    # the counts (and NaN/Inf counters) start for the host now; the exact path
    # waits for them below, the speculative one only after the ELL kernel
    pending = be.queue_to_host(token_counts if block is None else block)

    _mark("gate GEMM + pattern", xp)
    # work that does not need the width is queued before the host reads the
    # counts, so the device keeps busy while the host picks W
    if not one_chunk and not streamed:
        neuron_counts = count_in_range(col, H)  # no host sync (cupy.bincount would sync twice)
    w_downT = be.transpose_copy(w_down)
    _mark("neuron counts + w_down^T", xp)

    # 2) Hybrid layout: width from the counts (exact) or from the previous step
    # (speculative, with room for `cap` backup rows); backup rows for wider rows
    if spec is None:
        counts_host = _CountSummary(_counts_from_block(pending.read(), checked))
        _mark("counts to host (sync)", xp)
        W = choose_width(counts_host, width, **sizes)
        R = cap = counts_host.wider(W)
    else:
        W, cap = spec.width, spec.capacity
    # [row_map (M,) | backup_rows (cap,)], built where the counts are (on the GPU:
    # one launch, no host work or upload while the device waits). After a count and
    # pack the ELL forward kernel needs neither the maps nor the backup rows (wide
    # rows kept no ELL entries), so they are built beside it
    side = _side_work(be, packed is not None and maps is None)
    with side:
        if maps is None:
            maps = be.row_maps(token_counts, W, cap, capacity=spec is not None)
            if packed is not None:
                be.backup_rows_from_z(z, maps[:M], packed[0], W, cap)
        row_map = maps[:M]
    try:  # the side work reads z and writes gvals: joined before either may be freed
        _mark("width + row maps", xp)
        if packed is not None:
            gvals, idx, ell_nnz, neuron_counts = packed[:4]
            del packed
        elif one_chunk:
            gvals, idx, ell_nnz, neuron_counts = be.relu_to_hybrid(z, row_map, W, cap)
            z = None  # no side work read it
        else:
            gvals, idx, ell_nnz = be.csr_to_hybrid(indptr, col, val, row_map, W, H, cap)
            del col, val, indptr
        g_ell, _ = be.split_combined(gvals, M, W, cap, H)

        # 3) forward on the pattern: ELL rows in one fused kernel (which also sums
        # |h| per row for the L1 statistic), backup rows dense
        uvals = xp.empty_like(gvals) if gated else None
        u_ell = be.split_combined(uvals, M, W, cap, H)[0] if gated else None
        _mark("pattern -> hybrid", xp)
        y, h_abs_rows = be.ffn_forward_ell(x, w_up, w_downT, idx, ell_nnz, g_ell, u_ell, gated)
    finally:
        side.join()
    z = None
    _mark("fused fwd kernel", xp)
    if spec is not None:
        # the host waits here, with the ELL kernel queued behind the counts' copy
        counts_host = _CountSummary(_counts_from_block(pending.read(), checked))
        R = counts_host.wider(W)
        _mark("counts to host (wait)", xp)
        # a hit must be the layout the exact path picks from these counts (its W,
        # room for its wide rows), so that a step's bits never depend on the past
        if R > cap or choose_width(counts_host, width, **sizes) != W:
            return None, None, counts_host, True
        # from here on, the exact path's sizes: the unused capacity is never read
        gvals = gvals[:M * W + R * H]
        uvals = uvals[:M * W + R * H] if gated else None
    backup_rows = maps[M:M + R]
    g_bk = be.split_combined(gvals, M, W, R, H)[1]
    u_bk = be.split_combined(uvals, M, W, R, H)[1] if gated else None
    for a, b in _backup_chunks(R, H, D, dt):
        # two GEMMs over the chunk's rows; one pass between them does the
        # element-wise work (u on the pattern, h, the rows' |h| sums into h_abs_rows)
        rows, g_c = backup_rows[a:b], g_bk[a:b]
        u_acc = be.gemm_acc(be.take_rows(x, rows), w_up.T) if gated else None
        hb = be.backup_rows_forward(g_c, u_acc, u_bk[a:b] if gated else None, rows, h_abs_rows, gated)
        del u_acc
        yb = be.gemm_acc(hb, w_down.T)
        # the GEMM also multiplies the zeros of inactive neurons: rows it left
        # non-finite are summed again over their pattern (finite rows: one read)
        be.backup_exact(yb, g_c, hb, w_downT)
        be.put_rows_from_acc(y, rows, yb)
        del hb, yb

    _mark("backup rows fwd", xp)
    ell_entries = counts_host.entries_upto(W)
    # 4) statistics (the L1 value is summed and read only when asked for)
    nnz_total = counts_host.total
    stats = _Stats({
        "l0": float(nnz_total) / M if M else 0.0,
        "l1": _deferred_l1(xp, h_abs_rows, l1, M) if M else 0.0,
        "l1_coef": l1,
        "n_backup_rows": R,
        "width": W,
        "token_counts": token_counts,
        "neuron_counts": neuron_counts,
        "deterministic": True,
    })
    _mark("stats", xp)
    ctx = TrainContext(gated=gated, nnz_total=nnz_total, ell_entries=ell_entries, xp=xp, _be=be, device=device_of(x),
                       dtype=dt, M=M, D=D, H=H, width=W, R=R, x=x, w_gate=w_gate, w_up=w_up,
                       w_down=w_down, w_downT=w_downT, idx=idx, ell_nnz=ell_nnz, row_map=row_map,
                       backup_rows=backup_rows, gvals=gvals, uvals=uvals, l1_coef=l1, stats=stats)
    return y, ctx, counts_host, spec is not None


def _backup_chunks(R, H, D, dtype):
    """``(start, stop)`` row ranges of the backup rows, each about
    ``BACKUP_CHUNK_BYTES`` of accumulator-dtype (R x max(H, D)) temporaries."""
    acc_bytes = 8 if np.dtype(dtype) == np.float64 else 4
    step = max(1, BACKUP_CHUNK_BYTES // max(1, max(H, D) * acc_bytes))
    return [(a, min(R, a + step)) for a in range(0, R, step)]


def _backup_wgrad_by_gemm(n_rows, n_entries):
    """Whether the backup rows' weight gradients go through GEMMs (see
    ``BACKUP_WGRAD_GEMM_MIN_ROWS``)."""
    return (BACKUP_WGRAD_GEMM and n_rows >= BACKUP_WGRAD_GEMM_MIN_ROWS
            and n_entries >= BACKUP_WGRAD_GEMM_MIN_MEAN * n_rows)


def _transpose_for_grads(ctx, g_bk, ell_only):
    """The deterministic transpose (counting sort) of the step's pattern: every entry,
    or with ``ell_only`` (the backup rows' weight gradients are GEMM sums) the ELL
    entries alone. The forward counted the entries, so it needs no sync."""
    be, xp = ctx._be, ctx.xp
    if not ell_only:
        return be.transpose_pattern(ctx.idx, ctx.row_map, g_bk, ctx.H, nnz=ctx.nnz_total)
    no_backup = xp.full(ctx.M, -1, dtype=np.int32)
    return be.transpose_pattern(ctx.idx, no_backup, g_bk[:0], ctx.H, nnz=ctx.ell_entries)


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
    # with many wide rows their weight gradients are GEMMs (step 2), and their
    # du / dg then live only a chunk at a time: da / db hold the ELL rows only
    wgrad_gemm = _backup_wgrad_by_gemm(R, ctx.nnz_total - ctx.ell_entries)
    R_kept = 0 if wgrad_gemm else R
    da = xp.empty(M * W + R_kept * H, dtype=dt)
    db = xp.empty_like(da) if gated else None
    da_ell, da_bk = be.split_combined(da, M, W, R_kept, H)
    db_ell, db_bk = be.split_combined(db, M, W, R_kept, H) if gated else (None, None)
    g_ell, g_bk = be.split_combined(ctx.gvals, M, W, R, H)
    u_ell, u_bk = be.split_combined(ctx.uvals, M, W, R, H) if gated else (None, None)
    by_neuron = DH_BY_NEURON and be.by_neuron_ok(D, ctx.x, dy, ctx.w_downT)
    side = None  # the transpose's side work: joined in any case before the context can go
    try:
        if by_neuron:
            # dh comes with the weight gradients (step 3), dx after it; the backup rows'
            # dx rows (step 2) are written first, and the ELL dx leaves them alone
            dx = xp.empty((M, D), dtype=dt)
            indptr, rows, pos = _transpose_for_grads(ctx, g_bk, ell_only=bool(wgrad_gemm and R))
            _mark("transpose (counting sort)", xp)
        else:
            # the transpose needs only the forward's pattern: it runs beside the ELL kernel
            # (with the backup rows' GEMM route it leaves their entries out: step 2 sums them).
            # BWD_ELL_FIRST: the ELL kernel is launched first (the side work still starts
            # where it would have), so that the device, which may have run out of queued work
            # while the host finished the forward, need not wait for the transpose's launches
            side = _side_work(be)

            def transpose():
                with side:
                    return _transpose_for_grads(ctx, g_bk, ell_only=bool(wgrad_gemm and R))

            def ell_kernel():
                return be.ffn_backward_ell(dy, ctx.w_downT, ctx.w_up, ctx.w_gate, ctx.idx, ctx.ell_nnz, g_ell, u_ell,
                                           l1s, gated, da_ell, db_ell)

            if BWD_ELL_FIRST:
                side.start_here()
                dx = ell_kernel()
                transposed = transpose()
            else:
                transposed = transpose()
                dx = ell_kernel()
            _mark("fused bwd kernel", xp)

        # 2) backup rows: dense products restricted to those rows, a chunk at a time;
        # with the GEMM route their weight gradients are summed in the accumulator
        # dtype over the chunks (the ELL entries are gathered onto those sums in 3)
        base = None
        for a, b in _backup_chunks(R, H, D, dt):
            br, g_c = ctx.backup_rows[a:b], g_bk[a:b]
            u_c = u_bk[a:b] if gated else None
            if wgrad_gemm:
                da_c = xp.empty((b - a, H), dtype=dt)
                db_c = xp.empty_like(da_c) if gated else None
            else:
                da_c, db_c = da_bk[a:b], db_bk[a:b] if gated else None
            dy_c = be.take_rows(dy, br)
            dh_acc = be.gemm_acc(dy_c, ctx.w_down)
            h_c = xp.empty((b - a, H), dtype=dt) if wgrad_gemm and gated else None
            be.backup_rows_backward(dh_acc, g_c, u_c, l1s, gated, da_c, db_c, h_out=h_c)
            del dh_acc
            dxb = be.gemm_acc(da_c, ctx.w_up)
            if gated:
                be.gemm_acc(db_c, ctx.w_gate, out=dxb)
            # as in the forward: an inactive neuron's NaN/Inf weights must add nothing
            be.backup_exact(dxb, g_c, da_c, ctx.w_up, db_c, ctx.w_gate if gated else None)
            be.put_rows_from_acc(dx, br, dxb)
            del dxb
            if wgrad_gemm:
                x_c = be.take_rows(ctx.x, br)
                factors = ((da_c.T, x_c), (db_c.T, x_c) if gated else None, ((h_c if gated else g_c).T, dy_c))
                if base is not None and ctx.check_finite:
                    for acc, f in zip(base, factors):
                        if f is not None:
                            be.gemm_acc(*f, out=acc)
                else:
                    part = tuple(None if f is None else be.gemm_acc(*f) for f in factors)
                    if not ctx.check_finite:
                        # checked x and dy are finite, so the zeros of inactive neurons add
                        # exactly nothing to the GEMMs; unchecked ones may hold NaN/Inf, and
                        # 0 * NaN is NaN: the chunk's spoilt sums are redone on its pattern
                        be.backup_wgrad_exact(part, g_c, u_c, da_c, db_c, ctx.x, dy, br, gated)
                    if base is None:
                        base = part
                    else:
                        with np.errstate(invalid="ignore", over="ignore"):  # Inf + -Inf: the caller's values
                            for acc, p in zip(base, part):
                                if p is not None:
                                    acc += p
                    del part
                del x_c, factors
            del da_c, db_c, h_c, dy_c

        _mark("backup rows bwd", xp)
        # 3) weight gradients from the deterministic transpose of the pattern
        if by_neuron:
            dw_up, dw_gate, dw_downT = be.ffn_backward_by_neuron(indptr, rows, pos, ctx.idx, ctx.x, dy, ctx.w_downT,
                                                                 da, db, ctx.gvals, ctx.uvals, l1s, H, gated,
                                                                 base=base)
            _mark("dh + weight grads (by neuron)", xp)
            be.ell_dx(ctx.w_up, ctx.w_gate if gated else None, ctx.idx, ctx.ell_nnz, da_ell, db_ell, dx,
                      skip=ctx.row_map if R else None)
            _mark("ELL dx", xp)
        else:
            side.join()
            indptr, rows, pos = transposed
            del transposed
            _mark("transpose (counting sort)", xp)
            dw_up, dw_gate, dw_downT = be.ffn_weight_grads(indptr, rows, pos, ctx.x, dy, da, db, ctx.gvals,
                                                           ctx.uvals, H, gated, base=base)
            _mark("weight grads", xp)
        del base
    finally:
        if side is not None:  # also on an error: the side work reads the pattern the context holds
            side.join()
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
                        check_finite=True, speculate=None):
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
    speculate : bool, optional
        Size the saved Hybrid from this layer's previous step instead of
        waiting for this step's counts (default: ``TWELLPY_TRAIN_SPECULATE``,
        ``auto`` = on for GPU arrays, off on the CPU). The exact path reads
        the active neurons per token back to the host before choosing W,
        which stalls the GPU queue; speculation takes W and room for backup
        rows from the previous call with the same activation weight, shapes
        and ``width``, queues the ELL kernel, and only then reads the counts.
        If those counts pick another W under ``width``, or more rows are wide
        than it made room for, the step runs again on the exact path (the
        layout follows the counts, the capacity grows), so nothing is ever
        dropped and the result is always the exact path's, bit for bit.
        ``width="auto"`` rounds W up to a coarse grid so that it rarely
        changes between steps, and a layer that re-runs takes the exact path
        for its next 1, 2, 4, ... 32 steps (each re-run doubles the count,
        each hit halves it). The first call of a layer, and batches whose
        gate output exceeds ``GATE_CHUNK_BYTES``, take the exact path.
        ``ctx.speculation`` says which path ran. The saved g and u keep the
        capacity's allocation (unused rows included) until the context is
        freed. On the CPU (no host/device split) it runs the same logic and
        gains nothing.

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
    return _forward(x, w_gate, w_up, w_down, l1, width, deterministic, check_finite, gated=True,
                    speculate=speculate)


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
def relu_forward_train(x, w_up, w_down, l1=0.0, width="auto", deterministic=False, check_finite=True,
                       speculate=None):
    """Forward pass of the ReLU FFN ``relu(x @ w_up.T) @ w_down.T`` keeping a sparse context.

    Parameters are as in :func:`gated_forward_train` without ``w_gate``; the
    context keeps ``h = relu(x @ w_up.T)`` on its pattern.

    Returns
    -------
    y : array, shape (M, D)
    ctx : TrainContext
    """
    return _forward(x, None, w_up, w_down, l1, width, deterministic, check_finite, gated=False,
                    speculate=speculate)


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
