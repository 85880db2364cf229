"""CPU backend of the fused FFN inference (NumPy BLAS + Numba).

Per row chunk: the dense gate GEMM goes through NumPy's BLAS; then one Numba
kernel, parallel over rows, finds each row's active neurons (ReLU active:
``g > 0`` or NaN), does the up-projection dot products and the
down-projection axpys for those neurons only (``w_down`` is transposed once to
(H, D) so both weights are read as contiguous rows). There is no capacity
limit: any number of active neurons per row is exact.

16-bit weights are widened to float32 once at preparation (NumPy has no
16-bit BLAS); the result is rounded to the input dtype.
"""
from __future__ import annotations

import numba
import numpy as np

from .._array import check_finite, quiet_underflow
from . import overflow_rows_to_backup

#: rows per chunk: one BLAS gate GEMM and one parallel Numba call per chunk
#: (few switches between BLAS and Numba threads, which compete for the cores);
#: bounds the (chunk, H) float32 gate block to 8192 * H * 4 bytes
CHUNK_ROWS = 8192
#: rows of each chunk whose active count estimates the chunk's density
SAMPLE_ROWS = 256
#: "auto" runs a chunk dense when its mean active neurons per token exceed this fraction of H
AUTO_DENSITY = 0.06


@numba.njit(cache=True, nogil=True, inline="always")
def _neuron_value(xi, gi, w_pairs, j, gated):
    """h of one active neuron j: ``g * (x . w_up[j])`` (gated) or ``g`` (ReLU)."""
    if not gated:
        return gi[j]
    wu = w_pairs[j, 0]
    s = xi[0] * wu[0]  # D >= 1 (validated by the front end)
    for d in range(1, xi.shape[0]):
        s += xi[d] * wu[d]
    return gi[j] * s


@numba.njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc", "contract"})
def ffn_sparse_rows(x, g, w_pairs, gated, y, h_out, write_h):
    """Sparse step of the FFN for a block of rows (mirrors ``twellpy_ffn_sparse``).

    x (M, D), g (M, H) gate pre-activation, ``w_pairs`` (H, 2, D) holding
    neuron j's ``w_up`` row and ``w_down`` column side by side when
    ``gated`` (one contiguous 2*D read per active neuron: ~20% faster than
    two separate matrices on C1), or (H, 1, D) with only the ``w_down``
    columns for the ReLU FFN. y (M, D) output (overwritten, also the
    accumulator), h_out (M, H) written at active positions when ``write_h``.
    Accumulation is in the data's precision (float32 or float64).

    Each row first lists its active neurons, then takes them two at a time:
    two independent dot products in one pass over ``x[i]`` and one pass over
    ``y[i]`` for both axpys. Two weight streams in flight at once hide more of
    the gathers' latency; on C1 (2 cores) the step ran 1.7-1.9x faster than one
    neuron at a time. ``reassoc`` only lets the loops vectorise (the order is
    fixed by the compiled code, so results are reproducible); there is no
    ``nnan``/``ninf``, so IEEE NaN/Inf semantics hold.
    """
    M, D = x.shape
    H = g.shape[1]
    down = w_pairs.shape[1] - 1
    for i in numba.prange(M):
        gi = g[i]
        active = np.empty(H, np.int32)
        n = 0
        for j in range(H):
            if not gi[j] <= 0:  # NaN is active: relu(NaN) = NaN
                active[n] = j
                n += 1
        xi = x[i]
        acc = y[i]
        acc[:] = 0
        k = 0
        while k + 1 < n:
            j1 = active[k]
            j2 = active[k + 1]
            if gated:
                wu1 = w_pairs[j1, 0]
                wu2 = w_pairs[j2, 0]
                s1 = xi[0] * wu1[0]
                s2 = xi[0] * wu2[0]
                for d in range(1, D):
                    s1 += xi[d] * wu1[d]
                    s2 += xi[d] * wu2[d]
                h1 = gi[j1] * s1
                h2 = gi[j2] * s2
            else:
                h1 = gi[j1]
                h2 = gi[j2]
            if write_h:
                h_out[i, j1] = h1
                h_out[i, j2] = h2
            wd1 = w_pairs[j1, down]
            wd2 = w_pairs[j2, down]
            for d in range(D):
                acc[d] += h1 * wd1[d] + h2 * wd2[d]
            k += 2
        if k < n:  # an odd count: the last neuron alone
            j = active[k]
            hv = _neuron_value(xi, gi, w_pairs, j, gated)
            if write_h:
                h_out[i, j] = hv
            wd = w_pairs[j, down]
            for d in range(D):
                acc[d] += hv * wd[d]


@numba.njit(cache=True, nogil=True)
def count_active_rows(g, n_rows):
    """Active entries of the first ``n_rows`` rows of ``g`` (serial: a cheap sample)."""
    total = 0
    for i in range(min(n_rows, g.shape[0])):
        for j in range(g.shape[1]):
            if not (g[i, j] <= 0):
                total += 1
    return total


@numba.njit(cache=True, nogil=True)
def _pack_rows(h, tile, slots, values, indices, counts, row_max):
    M, N = h.shape
    n_tiles = counts.shape[1]
    for i in range(M):
        best = 0
        for t in range(n_tiles):
            c0 = t * tile
            c1 = min(N, c0 + tile)
            found = 0
            for c in range(c0, c1):
                v = h[i, c]
                if v != 0:  # NaN != 0 is True: NaN is kept
                    if found < slots:
                        values[i, t, found] = v
                        indices[i, t, found] = c
                    found += 1
            stored = min(found, slots)
            for p in range(stored, slots):
                values[i, t, p] = 0
                indices[i, t, p] = -1
            counts[i, t] = stored
            if found > best:
                best = found
        row_max[i] = best


def pack_activation(h, tile, slots):
    """TwELL components ``values, indices, counts, backup, backup_rows`` of ``h``.

    Rows whose largest tile holds more than ``slots`` non-zeros are kept in
    ``backup`` entirely (counts 0, slots padding).
    """
    h = np.ascontiguousarray(h)
    M, N = h.shape
    n_tiles = (N + tile - 1) // tile
    work = h if h.dtype in (np.float32, np.float64) else h.astype(np.float32)  # exact widening
    vals = np.empty((M, n_tiles, slots), work.dtype)
    indices = np.empty((M, n_tiles, slots), np.int32)
    counts = np.empty((M, n_tiles), np.int32)
    row_max = np.zeros((M,), np.int32)
    if M and n_tiles:
        _pack_rows(work, tile, slots, vals, indices, counts, row_max)
    values = vals.astype(h.dtype)
    backup, backup_rows = overflow_rows_to_backup(np, h, values, indices, counts, row_max, slots)
    return values, indices, counts, backup, backup_rows


class FFNPlan:
    """Prepared weights of one FFN on the CPU (``w_gate`` None for plain ReLU).

    Every weight is copied at construction (into the compute dtype and the
    kernels' layouts), so later in-place changes of the caller's arrays never
    reach the plan, whatever their dtype or memory order.
    """

    @quiet_underflow
    def __init__(self, w_gate, w_up, w_down):
        self.gated = w_gate is not None
        self.dtype = np.dtype(w_up.dtype)
        self.cdt = np.dtype(np.float64) if self.dtype == np.float64 else np.dtype(np.float32)
        self.H, self.D = w_up.shape
        # w_pairs[j] = (w_up[j], w_down[:, j]) (gated) or (w_down[:, j],) (ReLU): the
        # sparse kernel reads one contiguous block per active neuron; w_up and
        # w_downT are views into it (row stride 2*D: fine for BLAS)
        n_pair = 2 if self.gated else 1
        self.w_pairs = np.empty((self.H, n_pair, self.D), self.cdt)
        self.w_pairs[:, n_pair - 1] = np.asarray(w_down).T
        if self.gated:
            self.w_pairs[:, 0] = w_up
            self.w_up = self.w_pairs[:, 0]
            # always a copy (ascontiguousarray would share a float32/float64 C array)
            self.gate_w = np.array(w_gate, dtype=self.cdt, order="C", copy=True)
        else:
            self.w_up = np.array(w_up, dtype=self.cdt, order="C", copy=True)
            self.gate_w = self.w_up
        self.w_downT = self.w_pairs[:, n_pair - 1]
        #: mean active neurons per token above which "auto" runs a chunk dense
        self.auto_threshold = AUTO_DENSITY * self.H
        self.chunk_rows = CHUNK_ROWS
        #: the CPU kernel computes every row itself; kept for API symmetry with CUDA
        self.heavy_limit = None
        self._activity = {"mean_active": None, "heavy_rows": 0}

    def activity(self):
        """Active-neuron statistics of the last call (sampled rows of each chunk)."""
        return dict(self._activity)

    def _dense_chunk(self, xc, g, yc, hc):
        if self.gated:
            u = xc @ self.w_up.T
            # inactive -> exactly 0 even if u is NaN (as the sparse kernel);
            # NaN in g stays NaN (relu(NaN) = NaN)
            h = np.where(g <= 0, 0, g * u)
        else:
            h = np.where(g <= 0, 0, g)
        if hc is not None:
            hc[...] = h
        np.matmul(h, self.w_downT, out=yc)

    @quiet_underflow
    def forward(self, x, *, mode="auto", return_activations=False, check_x=False):
        """y (M, D) in the input dtype, dense h (M, H) or None, info dict.

        With ``check_x`` a NaN or Inf in ``x`` raises ValueError naming ``x``.
        """
        if check_x:
            check_finite(x, "x")
        M = x.shape[0]
        xc_all = np.ascontiguousarray(x, dtype=self.cdt)
        y = np.empty((M, self.D), self.cdt)
        h_full = np.zeros((M, self.H), self.cdt) if return_activations else None
        dummy_h = np.zeros((1, 1), self.cdt)
        seen = 0
        sampled = 0
        n_dense = 0
        n_chunks = -(-M // self.chunk_rows) if M else 0
        with np.errstate(invalid="ignore", over="ignore"):
            for r0 in range(0, M, self.chunk_rows):
                r1 = min(M, r0 + self.chunk_rows)
                xc = xc_all[r0:r1]
                g = xc @ self.gate_w.T
                hc = None if h_full is None else h_full[r0:r1]
                if mode == "dense":
                    self._dense_chunk(xc, g, y[r0:r1], hc)
                    n_dense += 1
                    continue
                # the density of a sample of rows decides the chunk's path
                n_sample = min(r1 - r0, SAMPLE_ROWS)
                active = count_active_rows(g, n_sample)
                seen += active
                sampled += n_sample
                if mode == "auto" and active > self.auto_threshold * n_sample:
                    self._dense_chunk(xc, g, y[r0:r1], hc)
                    n_dense += 1
                    continue
                ffn_sparse_rows(xc, g, self.w_pairs, self.gated, y[r0:r1],
                                hc if hc is not None else dummy_h, hc is not None)
        n_chunks = -(-M // self.chunk_rows) if M else 0
        if mode == "dense" or (n_chunks and n_dense == n_chunks):
            label = "dense"
        else:
            label = "sparse" if n_dense == 0 else "sparse+dense"
        info = {"mode": label,
                "mean_active": (seen / sampled) if sampled else None,
                "dense_chunks": n_dense, "chunks": n_chunks, "heavy_rows": 0}
        self._activity = {"mean_active": info["mean_active"], "heavy_rows": 0}
        if self.cdt != self.dtype:
            y = y.astype(self.dtype)
            if h_full is not None:
                h_full = h_full.astype(self.dtype)
        return y, h_full, info


def prepare(w_gate, w_up, w_down):
    """FFN plan for numpy weights (``w_gate`` None for the plain ReLU FFN)."""
    return FFNPlan(w_gate, w_up, w_down)
