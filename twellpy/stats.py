"""Sparsity statistics of ReLU activations.

Every function accepts *activations* ``acts`` as

* a dense array of shape (M, H) -- or (..., H), whose leading dimensions are
  flattened into M token rows -- as numpy, cupy, torch (CPU or CUDA), jax, or
  any ``__dlpack__`` array; a neuron is *active* where the value is non-zero
  (NaN counts as active and -0.0 as inactive, as everywhere in twellpy);
  boolean masks and integer arrays are accepted too;
* a twellpy container (:class:`~twellpy.ELL`, :class:`~twellpy.TwELL`,
  :class:`~twellpy.Hybrid`) of shape (M, H); its *stored entries* are counted
  (slot entries, plus the non-zeros of its dense backup rows), which equals
  the non-zeros for containers built with ``from_dense``/``from_scipy``.

Counting runs where the data lives (on the GPU for cupy/torch CUDA/jax GPU
input); the results are small and are returned as **numpy** arrays so that
they can be printed, stored or plotted directly.

Contents
--------
* :func:`nnz_per_token`, :func:`nnz_per_position`, :func:`nnz_per_layer`,
  :func:`fit_position_trend`, :func:`token_ranking` -- how many neurons fire.
* :func:`firing_counts`, :func:`firing_frequency`, :class:`FiringTracker` --
  which neurons fire, and dead-neuron detection over a window of steps.
* :func:`tile_occupancy`, :func:`tile_occupancy_histogram`,
  :func:`empirical_overflow_rate`, :class:`OverflowModel`,
  :func:`fit_overflow_model`, :func:`overflow_probability`,
  :func:`suggest_slots` -- how full TwELL tiles get and which ``slots`` to use.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from ._array import as_array, bfloat16, float_or_inf, is_cupy
from ._base import _is_real_scalar, nonzero_mask

__all__ = [
    "nnz_per_token",
    "nnz_per_position",
    "PositionStats",
    "fit_position_trend",
    "PositionTrend",
    "nnz_per_layer",
    "LayerStats",
    "token_ranking",
    "firing_counts",
    "firing_frequency",
    "FiringTracker",
    "tile_occupancy",
    "tile_occupancy_histogram",
    "empirical_overflow_rate",
    "OverflowModel",
    "fit_overflow_model",
    "overflow_probability",
    "suggest_slots",
]


# --------------------------------------------------------------------------
# input plumbing

def _is_container(a):
    return hasattr(a, "components") and hasattr(a, "format") and hasattr(a, "toarray")


def _to_numpy(a):
    return a.get() if is_cupy(a) else np.asarray(a)


def _active(a):
    """Boolean mask of active entries: non-zero, NaN included, -0.0 excluded.

    Float data is tested on its bit pattern (the containers' rule, and it
    needs no float16/bfloat16 arithmetic on the device); other dtypes
    (bool masks, integers) with ``!= 0``.
    """
    if a.dtype.kind == "f" or a.dtype == bfloat16:
        return nonzero_mask(a)
    return a != 0


def _xp(a):
    if is_cupy(a):
        import cupy

        return cupy
    return np


class _Acts:
    """Uniform view of activations: dense 2-D array or container parts.

    ``dense`` is (M, H) (numpy/cupy) for dense input. For containers,
    ``indices`` is (M, K) with -1 in padding (internals contract) and
    ``backup``/``backup_rows`` hold the dense backup rows (R may be 0).
    """

    def __init__(self, acts, name="acts"):
        self.dense = None
        if _is_container(acts):
            comp = acts.components()
            self.shape = tuple(int(s) for s in comp["shape"])
            if len(self.shape) != 2:
                raise ValueError(f"{name} must be 2-D, got shape {self.shape}")
            m = self.shape[0]
            idx = comp["indices"]
            # explicit sizes: reshape(m, -1) is ambiguous when m or K is 0
            self.indices = idx.reshape(m, math.prod(idx.shape[1:]) if idx.ndim > 1 else idx.size // max(m, 1))
            xp = _xp(self.indices)
            backup = comp.get("backup")
            rows = comp.get("backup_rows")
            if backup is None:
                backup = xp.zeros((0, self.shape[1]), dtype=np.float32)
                rows = xp.zeros((0,), dtype=np.int32)
            self.backup, self.backup_rows = backup, rows
            self.xp = xp
        else:
            arr, _ = as_array(acts, name)
            if arr.dtype.kind not in "fiub" and arr.dtype != bfloat16:
                # complex or object data would be counted by `!= 0` without meaning anything
                raise TypeError(f"{name} has dtype {arr.dtype}; expected real activations "
                                f"(float, bfloat16, integer or bool)")
            if arr.ndim < 1:
                raise ValueError(f"{name} must have at least 1 dimension (..., H), got a scalar")
            if arr.ndim == 1:
                arr = arr.reshape(1, -1)
            # explicit row count: reshape(-1, 0) fails for zero neurons (H = 0)
            self.dense = arr.reshape(math.prod(arr.shape[:-1]), arr.shape[-1])
            self.shape = tuple(self.dense.shape)
            self.xp = _xp(self.dense)

    @property
    def m(self):
        return self.shape[0]

    @property
    def n(self):
        return self.shape[1]

    def nnz_per_row(self):
        if self.dense is not None:
            return self._dense_rows(self.dense, lambda nz: nz.sum(axis=1), axis=0)
        counts = (self.indices >= 0).sum(axis=1).astype(np.int64)
        if self.backup.shape[0]:
            counts[self.backup_rows] += self._dense_rows(self.backup, lambda nz: nz.sum(axis=1), axis=0)
        return counts

    def per_neuron(self):
        xp = self.xp
        if self.dense is not None:
            return self._dense_rows(self.dense, lambda nz: nz.sum(axis=0, dtype=np.int64), axis=None)
        idx = self.indices[self.indices >= 0]
        counts = xp.bincount(idx.ravel().astype(np.int64), minlength=self.n).astype(np.int64)
        if self.backup.shape[0]:
            counts = counts + self._dense_rows(self.backup, lambda nz: nz.sum(axis=0, dtype=np.int64),
                                               axis=None)
        return counts

    def occupancy(self, tile):
        """(M, n_tiles) count of active neurons per (row, tile)."""
        xp = self.xp
        m, n = self.shape
        n_tiles = -(-n // tile) if n else 0

        def tiles_of(nz):
            pad = n_tiles * tile - n
            if pad:
                nz = xp.concatenate([nz, xp.zeros((nz.shape[0], pad), dtype=bool)], axis=1)
            return nz.reshape(nz.shape[0], n_tiles, tile).sum(axis=2)

        if self.dense is not None:
            return self._dense_rows(self.dense, tiles_of, axis=0)
        mask = self.indices >= 0
        rows = xp.broadcast_to(xp.arange(m, dtype=np.int64)[:, None], self.indices.shape)[mask]
        tiles = self.indices[mask].astype(np.int64) // tile
        occ = xp.bincount(rows * n_tiles + tiles, minlength=m * n_tiles).reshape(m, n_tiles)
        if self.backup.shape[0]:
            occ[self.backup_rows] += self._dense_rows(self.backup, tiles_of, axis=0)
        return occ

    #: Elements per chunk of rows: bounds the temporary masks (about 16 MB).
    CHUNK_ELEMENTS = 1 << 22

    def _dense_rows(self, a, reduce, axis):
        """``reduce(active mask)`` over row chunks of ``a``; concatenate (axis=0) or sum (None)."""
        xp = self.xp
        rows = max(1, self.CHUNK_ELEMENTS // max(1, a.shape[1]))
        if a.shape[0] <= rows:
            return reduce(_active(a))
        parts = [reduce(_active(a[i:i + rows])) for i in range(0, a.shape[0], rows)]
        if axis is None:
            return sum(parts[1:], parts[0])
        return xp.concatenate(parts, axis=0)


def _whole_counts(arr, name, what="per-token counts (1-D)"):
    """Counts given as a 1-D array, as int64: whole, finite and >= 0.

    Float counts are accepted when they hold whole numbers; 1.5, a negative
    count, NaN or Inf raise instead of being truncated or cast to garbage.
    """
    c = _to_numpy(arr)
    if c.dtype.kind == "b":
        return c.astype(np.int64)
    if c.dtype.kind not in "iuf" and c.dtype != bfloat16:
        raise ValueError(f"{name} as {what} must be numeric, got dtype {c.dtype}")
    if c.dtype.kind not in "iu":
        c = c.astype(np.float64)
        bad = ~np.isfinite(c) | (c != np.floor(c))
        if bad.any():
            raise ValueError(f"{name} as {what} must hold whole, finite numbers, "
                             f"got {c[bad][0]} at index {int(np.flatnonzero(bad)[0])}")
    if c.size and c.min() < 0:
        raise ValueError(f"{name} as {what} must be >= 0, got {c.min()}")
    return c.astype(np.int64)


def _check_int(value, name, *, minimum=1, or_none=False):
    """ValueError naming ``name`` unless ``value`` is an integer >= ``minimum`` (or None
    when ``or_none``); a bool is no integer here."""
    if or_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise ValueError(f"{name} must be {kind}{' or None' if or_none else ''}, got {value!r}")


def _check_tile(tile):
    _check_int(tile, "tile")
    return int(tile)


# --------------------------------------------------------------------------
# how many neurons fire

def nnz_per_token(acts):
    """Number of active neurons of each token.

    Parameters
    ----------
    acts : array_like or twellpy container
        (M, H) or (..., H) activations (see the module docstring).

    Returns
    -------
    numpy.ndarray
        int64, shape (M,) -- for (..., H) input, M is the product of the
        leading dimensions (row-major order).
    """
    return _to_numpy(_Acts(acts).nnz_per_row()).astype(np.int64)


@dataclasses.dataclass
class PositionStats:
    """Non-zeros per position in a sequence, over the sequences of a batch.

    Attributes
    ----------
    position : numpy.ndarray
        0, 1, ..., T-1.
    mean, std : numpy.ndarray
        Mean and standard deviation over sequences, float64, shape (T,).
    min, max : numpy.ndarray
        Extremes over sequences, int64, shape (T,).
    n_sequences : int
        Number of sequences B.
    """

    position: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    n_sequences: int


def nnz_per_position(acts, seq_len=None):
    """Non-zeros per token as a function of its position in the sequence.

    Parameters
    ----------
    acts : array_like or twellpy container
        (B, T, H) activations, or (M, H) with ``seq_len`` given (rows are
        ``B`` consecutive sequences of ``seq_len`` tokens), or a 1-D array of
        per-token counts (M,) with ``seq_len``.
    seq_len : int, optional
        Sequence length T; required unless ``acts`` is 3-D.

    Returns
    -------
    PositionStats
    """
    _check_int(seq_len, "seq_len", or_none=True)  # before it is compared with a shape
    if _is_container(acts):
        counts = nnz_per_token(acts)
    else:
        arr, _ = as_array(acts, "acts")
        if arr.ndim == 3:
            if seq_len is not None and seq_len != arr.shape[1]:
                raise ValueError(f"seq_len={seq_len} contradicts acts of shape {tuple(arr.shape)}")
            seq_len = arr.shape[1]
            counts = nnz_per_token(arr)
        elif arr.ndim == 2:
            counts = nnz_per_token(arr)
        elif arr.ndim == 1:
            counts = _whole_counts(arr, "acts")  # already per-token counts
        else:
            raise ValueError(f"acts must be (B, T, H), (M, H) or per-token counts (M,), "
                             f"got shape {tuple(arr.shape)}")
    if seq_len is None:
        raise ValueError("seq_len is required when acts is not (B, T, H)")
    if counts.size % seq_len:
        raise ValueError(f"acts has {counts.size} tokens, not a multiple of seq_len={seq_len}")
    if counts.size == 0:
        raise ValueError("acts holds no tokens")
    per_seq = counts.reshape(-1, seq_len)
    return PositionStats(position=np.arange(seq_len), mean=per_seq.mean(axis=0),
                         std=per_seq.std(axis=0), min=per_seq.min(axis=0),
                         max=per_seq.max(axis=0), n_sequences=per_seq.shape[0])


@dataclasses.dataclass
class PositionTrend:
    """A fitted decay of non-zeros against position.

    ``kind="power"``: ``y = c + a * (p + 1) ** (-b)``;
    ``kind="exp"``: ``y = c + a * exp(-p / tau)`` (``b`` holds ``tau``).
    """

    kind: str
    a: float
    b: float
    c: float

    def __call__(self, position):
        """Evaluate the trend at ``position`` (array_like)."""
        p = np.asarray(position, dtype=np.float64)
        if self.kind == "power":
            return self.c + self.a * (p + 1.0) ** (-self.b)
        return self.c + self.a * np.exp(-p / self.b)

    def label(self):
        """Human-readable formula with the fitted numbers."""
        if self.kind == "power":
            return f"{self.c:.3g} + {self.a:.3g}·(p+1)^-{self.b:.3g}"
        return f"{self.c:.3g} + {self.a:.3g}·exp(-p/{self.b:.3g})"


def fit_position_trend(position, mean, kind="power"):
    """Fit a decaying trend to mean non-zeros per position.

    Parameters
    ----------
    position, mean : array_like
        Positions and the mean non-zeros at each (e.g. from
        :func:`nnz_per_position`).
    kind : {"power", "exp"}
        ``"power"``: ``c + a (p+1)^-b`` (the slow decay seen in LLMs);
        ``"exp"``: ``c + a exp(-p/tau)``.

    Returns
    -------
    PositionTrend
        Least-squares fit (scipy.optimize.curve_fit). With fewer than 4
        points, or if the fit fails, the offset ``c`` is fixed at the minimum
        of ``mean`` minus a small margin and the rest fitted in log space.
    """
    if kind not in ("power", "exp"):
        raise ValueError(f"kind must be 'power' or 'exp', got {kind!r}")
    p = np.asarray(position, dtype=np.float64).ravel()
    y = np.asarray(mean, dtype=np.float64).ravel()
    if p.shape != y.shape or p.size < 2:
        raise ValueError(f"position and mean must have the same length >= 2, got {p.size} and {y.size}")
    if not np.all(np.isfinite(y)):
        raise ValueError("mean contains NaN or Inf")
    if not np.all(np.isfinite(p)):
        raise ValueError("position contains NaN or Inf")

    def model(pp, a, b, c):
        return PositionTrend(kind, a, b, c)(pp)

    # Log-space start: with c just below the tail, log(y - c) is linear in
    # log(p+1) (power) or in p (exp).
    spread = max(y.max() - y.min(), 1e-12)
    c0 = y.min() - 0.01 * spread
    z = np.log(np.maximum(y - c0, 1e-12))
    if kind == "power":
        slope, icpt = np.polyfit(np.log(p + 1.0), z, 1)
        a0, b0 = math.exp(icpt), max(-slope, 1e-3)
    else:
        slope, icpt = np.polyfit(p, z, 1)
        a0, b0 = math.exp(icpt), (-1.0 / slope if slope < 0 else max(p.max(), 1.0))
    guess = PositionTrend(kind, float(a0), float(b0), float(c0))
    if p.size < 4:
        return guess
    try:
        from scipy.optimize import curve_fit

        lower = (-np.inf, 1e-6, -np.inf)
        popt, _ = curve_fit(model, p, y, p0=(a0, b0, c0), bounds=(lower, np.inf), maxfev=5000)
        fit = PositionTrend(kind, *(float(v) for v in popt))
    except (RuntimeError, ValueError):
        return guess
    sse = lambda t: float(np.sum((t(p) - y) ** 2))  # noqa: E731
    return fit if sse(fit) <= sse(guess) else guess


@dataclasses.dataclass
class LayerStats:
    """Per-layer summary of non-zeros per token.

    Attributes
    ----------
    names : list of str
    mean, std : numpy.ndarray
        float64, one per layer.
    max, min : numpy.ndarray
        int64, one per layer.
    n_neurons : numpy.ndarray
        H of each layer (int64).
    density : numpy.ndarray
        ``mean / n_neurons``.
    """

    names: list
    mean: np.ndarray
    std: np.ndarray
    max: np.ndarray
    min: np.ndarray
    n_neurons: np.ndarray
    density: np.ndarray


def nnz_per_layer(layers):
    """Mean, spread and extremes of non-zeros per token, for each layer.

    Parameters
    ----------
    layers : mapping, sequence or array
        ``{name: acts}``, a sequence of ``acts`` (named ``"0"``, ``"1"``,
        ...), or one dense array of shape (layers, tokens, H) as
        ``twellpy stats`` reads from a file (layer ``i`` is ``layers[i]``).
        Each ``acts`` is dense (..., H) or a container.

    Returns
    -------
    LayerStats
    """
    if isinstance(layers, collections.abc.Mapping):
        items = [(str(k), v) for k, v in layers.items()]
    elif isinstance(layers, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(layers)]
    elif hasattr(layers, "__dlpack__") or hasattr(layers, "__array__") or hasattr(layers, "__cuda_array_interface__"):
        arr, _ = as_array(layers, "layers")
        if arr.ndim != 3:
            raise ValueError(f"layers as one array must be 3-D (layers, tokens, neurons), "
                             f"got shape {tuple(arr.shape)}; pass a list for other shapes")
        items = [(str(i), arr[i]) for i in range(arr.shape[0])]
    else:
        raise TypeError(f"layers must be a mapping, a list of activations or a 3-D array, "
                        f"got {type(layers).__name__}")
    if not items:
        raise ValueError("layers is empty")
    means, stds, maxs, mins, hs = [], [], [], [], []
    for name, acts in items:
        view = _Acts(acts, f"layers[{name!r}]")
        c = _to_numpy(view.nnz_per_row()).astype(np.int64)
        if c.size == 0:
            raise ValueError(f"layers[{name!r}] holds no tokens")
        means.append(c.mean())
        stds.append(c.std())
        maxs.append(c.max())
        mins.append(c.min())
        hs.append(view.n)
    hs = np.asarray(hs, dtype=np.int64)
    mean = np.asarray(means, dtype=np.float64)
    return LayerStats(names=[n for n, _ in items], mean=mean, std=np.asarray(stds),
                      max=np.asarray(maxs, dtype=np.int64), min=np.asarray(mins, dtype=np.int64),
                      n_neurons=hs, density=mean / np.maximum(hs, 1))


def token_ranking(tokens, nnz, k=10, min_count=1):
    """Tokens (bytes, words ...) that fire the most and the fewest neurons.

    Parameters
    ----------
    tokens : sequence
        One label per token (str, bytes or int), length M.
    nnz : array_like or twellpy container
        Per-token counts (M,), or activations (M, H) / (..., H). Float
        counts (averages, say) are used as given, not truncated.
    k : int
        How many to return at each end.
    min_count : int
        Ignore labels seen fewer times than this (rare labels have noisy means).

    Returns
    -------
    most, fewest : list of (label, mean_nnz, occurrences)
        ``most`` sorted by decreasing mean, ``fewest`` by increasing mean.
    """
    if _is_container(nnz):
        counts = nnz_per_token(nnz)
    else:
        arr, _ = as_array(nnz, "nnz")
        if arr.ndim != 1:
            counts = nnz_per_token(arr)
        else:
            counts = _to_numpy(arr)
            if counts.dtype.kind not in "fiub" and counts.dtype != bfloat16:
                # astype would drop an imaginary part, or parse strings as numbers
                raise TypeError(f"nnz has dtype {counts.dtype}; expected real per-token counts "
                                f"(float, bfloat16, integer or bool)")
            # int64 for integer counts; floats kept as floats (int64 would truncate them)
            counts = counts.astype(np.float64 if counts.dtype.kind == "f" or counts.dtype == bfloat16
                                   else np.int64)
    labels = list(tokens)
    if len(labels) != counts.size:
        raise ValueError(f"tokens has {len(labels)} labels but nnz describes {counts.size} tokens")
    _check_int(k, "k")
    _check_int(min_count, "min_count")
    if counts.dtype.kind == "f" and not np.all(np.isfinite(counts)):
        raise ValueError("nnz contains NaN or Inf counts (they cannot be ranked)")
    sums, seen = {}, {}
    for lab, c in zip(labels, counts.tolist()):
        sums[lab] = sums.get(lab, 0) + c
        seen[lab] = seen.get(lab, 0) + 1
    rows = [(lab, sums[lab] / seen[lab], seen[lab]) for lab in sums if seen[lab] >= min_count]
    if not rows:
        raise ValueError(f"no label occurs at least min_count={min_count} times")
    # Ties broken by frequency then label text, so the result is deterministic.
    most = sorted(rows, key=lambda r: (-r[1], -r[2], str(r[0])))[:k]
    fewest = sorted(rows, key=lambda r: (r[1], -r[2], str(r[0])))[:k]
    return most, fewest


# --------------------------------------------------------------------------
# which neurons fire

def firing_counts(acts):
    """How many tokens activate each neuron.

    Parameters
    ----------
    acts : array_like or twellpy container
        (M, H) activations (see the module docstring).

    Returns
    -------
    numpy.ndarray
        int64, shape (H,).
    """
    return _to_numpy(_Acts(acts).per_neuron()).astype(np.int64)


def firing_frequency(acts):
    """Fraction of tokens that activate each neuron.

    Parameters
    ----------
    acts : array_like or twellpy container
        (M, H) activations (see the module docstring).

    Returns
    -------
    numpy.ndarray
        float64, shape (H,), in [0, 1].

    Raises
    ------
    ValueError
        ``acts`` holds no tokens (M = 0).
    """
    view = _Acts(acts)
    if view.m == 0:
        raise ValueError("acts holds no tokens")
    return _to_numpy(view.per_neuron()).astype(np.float64) / view.m


class FiringTracker:
    """Streaming neuron firing counts and dead-neuron detection over a window.

    Feed it the activations (or the per-neuron counts that twellpy's training
    step reports in ``ctx.stats``) of each step; it keeps the counts of the
    last ``window`` steps and reports firing frequencies and dead neurons
    over that window.

    Parameters
    ----------
    n_neurons : int, optional
        H; inferred from the first update if omitted.
    window : int, optional
        Number of most recent updates (steps) that count; ``None`` keeps
        everything since the last :meth:`reset`.

    Examples
    --------
    >>> tr = FiringTracker(window=100)
    >>> for acts in batches:                       # doctest: +SKIP
    ...     tr.update(acts)
    >>> tr.dead_neurons()                          # doctest: +SKIP
    """

    def __init__(self, n_neurons=None, window=None):
        _check_int(window, "window", or_none=True)
        if n_neurons is not None:
            _check_int(n_neurons, "n_neurons")
        self.n_neurons = None if n_neurons is None else int(n_neurons)
        self.window = None if window is None else int(window)
        self.reset()

    def reset(self):
        """Forget every update."""
        self._steps = collections.deque()
        self._counts = None if self.n_neurons is None else np.zeros(self.n_neurons, np.int64)
        self._tokens = 0
        self.n_updates = 0

    def update(self, acts):
        """Add one step's activations (dense (..., H) or a container)."""
        view = _Acts(acts)
        self._add(_to_numpy(view.per_neuron()).astype(np.int64), view.m)
        return self

    def update_counts(self, counts, n_tokens):
        """Add one step given per-neuron firing counts (H,) over ``n_tokens`` tokens."""
        arr, _ = as_array(counts, "counts", ndim=1)
        c = _whole_counts(arr, "counts", "per-neuron firing counts")
        _check_int(n_tokens, "n_tokens", minimum=0)
        n_tokens = int(n_tokens)
        if c.size and c.max() > n_tokens:
            raise ValueError(f"n_tokens={n_tokens} is smaller than the largest count {int(c.max())}")
        self._add(c, n_tokens)
        return self

    def _add(self, counts, n_tokens):
        if counts.size == 0 and self.n_neurons is None:
            # as n_neurons=0 in the constructor: no frequency or dead fraction exists
            raise ValueError("update has 0 neurons (H = 0); a FiringTracker needs H >= 1")
        if self.n_neurons is None:
            self.n_neurons = counts.size
            self._counts = np.zeros(self.n_neurons, np.int64)
        if counts.size != self.n_neurons:
            raise ValueError(f"update has {counts.size} neurons, expected {self.n_neurons}")
        self._steps.append((counts, n_tokens))
        self._counts += counts
        self._tokens += n_tokens
        self.n_updates += 1
        if self.window is not None and len(self._steps) > self.window:
            old, old_tokens = self._steps.popleft()
            self._counts -= old
            self._tokens -= old_tokens

    @property
    def n_tokens(self):
        """Tokens inside the window."""
        return self._tokens

    @property
    def counts(self):
        """Per-neuron firing counts inside the window (int64, copy)."""
        self._require_data()
        return self._counts.copy()

    @property
    def frequency(self):
        """Per-neuron firing frequency inside the window (float64, (H,))."""
        self._require_data()
        if self._tokens == 0:
            return np.zeros(self.n_neurons)
        return self._counts / self._tokens

    def dead_neurons(self, threshold=0.0):
        """Indices of neurons whose frequency in the window is <= ``threshold``.

        With the default ``threshold=0`` a neuron is dead if it never fired in
        the window. ``threshold`` must be a real number, not NaN (every
        comparison with NaN is false, which would report no dead neuron).
        """
        # a real scalar as the containers take one: number, 0-d numpy/torch/JAX array
        if not _is_real_scalar(threshold, "threshold"):
            raise TypeError(f"threshold must be a real number (a firing frequency), got {threshold!r}")
        t = float_or_inf(threshold)
        if math.isnan(t):
            raise ValueError("threshold is NaN; pass a firing frequency such as 0 or 1e-4")
        return np.flatnonzero(self.frequency <= t)

    def dead_fraction(self, threshold=0.0):
        """Fraction of neurons that are dead (see :meth:`dead_neurons`)."""
        return self.dead_neurons(threshold).size / self.n_neurons

    def _require_data(self):
        if self.n_neurons is None:
            raise ValueError("FiringTracker has no data yet: call update() first or pass n_neurons")

    def __repr__(self):
        return (f"FiringTracker(n_neurons={self.n_neurons}, window={self.window}, "
                f"steps_in_window={len(self._steps)}, tokens_in_window={self._tokens})")


# --------------------------------------------------------------------------
# tiles and slots

def tile_occupancy(acts, tile=256):
    """Active neurons in every (token, tile) cell, as TwELL would store them.

    Parameters
    ----------
    acts : array_like or twellpy container
        (M, H) activations.
    tile : int
        Tile width T (the last tile is ``H - (n_tiles-1) T`` wide).

    Returns
    -------
    numpy.ndarray
        int64, shape (M, ceil(H / T)).
    """
    tile = _check_tile(tile)
    return _to_numpy(_Acts(acts).occupancy(tile)).astype(np.int64)


def tile_occupancy_histogram(acts, tile=256):
    """Histogram of tile occupancy: how many (token, tile) cells hold k entries.

    Parameters
    ----------
    acts : array_like or twellpy container
        (M, H) activations.
    tile : int
        Tile width T (default 256).

    Returns
    -------
    numpy.ndarray
        int64, shape (tile + 1,); element k counts cells with occupancy k.
    """
    tile = _check_tile(tile)
    occ = tile_occupancy(acts, tile)
    return np.bincount(occ.ravel(), minlength=tile + 1).astype(np.int64)


def _check_slots(slots):
    _check_int(slots, "slots", minimum=0)
    return int(slots)


def empirical_overflow_rate(acts, slots, tile=256, per="tile"):
    """Observed fraction of tiles (or rows) holding more than ``slots`` entries.

    Parameters
    ----------
    acts : array_like or twellpy container
        (M, H) activations.
    slots : int
        Capacity S per (token, tile) cell; a cell overflows when it holds
        more than ``slots`` active neurons.
    tile : int
        Tile width T (default 256).
    per : {"tile", "row"}
        ``"tile"``: fraction of (token, tile) cells that overflow;
        ``"row"``: fraction of tokens with at least one overflowing tile
        (the rows TwELL moves to its dense backup).

    Returns
    -------
    float
        The observed fraction, in [0, 1].

    Raises
    ------
    ValueError
        ``slots`` is not a non-negative integer, ``per`` is not ``"tile"``
        or ``"row"``, or ``acts`` holds no tiles.
    """
    slots = _check_slots(slots)
    occ = tile_occupancy(acts, tile)
    if occ.size == 0:
        raise ValueError("acts holds no tiles")
    if per == "tile":
        return float(np.mean(occ > slots))
    if per == "row":
        return float(np.mean((occ > slots).any(axis=1)))
    raise ValueError(f"per must be 'tile' or 'row', got {per!r}")


class OverflowModel:
    """Fitted model of tile occupancy, to predict overflow for any ``slots``.

    **Model** (``kind="mixture"``, the default). Let ``c_ij`` be the number of
    active neurons of token ``i`` in tile ``j`` (width ``T_j``). The model is
    rank-one in expectation: ``E[c_ij] = r_i * lam_j``, where ``lam_j`` is the
    mean occupancy of tile ``j`` (popular tiles are fuller) and ``r_i`` the
    token's intensity (a few tokens fire many neurons), estimated from its
    non-zeros ``n_i`` relative to the mean ``mu``, de-noised so that the
    spread of the fitted intensities matches the spread of the true ones:
    ``r_i = 1 + sqrt(k) (n_i / mu - 1)`` with ``k = 1 - mu / Var(n)`` (the
    part of the variance of ``n`` not explained by counting noise; ``k = 0``
    when tokens are alike). Given both, the ``T_j`` neurons of the
    tile fire independently, so ``c_ij ~ Binomial(T_j, min(1, r_i lam_j /
    T_j))``. The predicted probability that a tile overflows is the average
    over the fitted tiles and over the *empirical distribution* of token
    intensities::

        P(c > S) = mean_i mean_j  BinomSF(S; T_j, min(1, r_i lam_j / T_j))

    and the probability that a row overflows (goes to TwELL's backup) is
    ``mean_i [1 - prod_j BinomCDF(S; T_j, p_ij)]``. The token mixture makes
    the tail overdispersed (heavier than any single binomial), which is what
    uneven data shows; the binomial makes the prediction extend beyond the
    largest occupancy seen in the sample.

    Validation (``tests/test_stats.py``): fitted on 4000 synthetic tokens and
    checked on 4000 others, the predicted overflow rate is within a factor
    0.6-1.6 of the observed one wherever the observed rate is at least 3e-3,
    for uniform and uneven (lognormal sigma 0.3) tokens; it errs on the
    conservative side in the far tail of uneven data.

    ``kind="binomial"`` drops the token mixture (all ``r_i = 1``): it fits
    uniform data but underestimates overflow on uneven data.

    Build it with :func:`fit_overflow_model`.

    Attributes
    ----------
    tile : int
    kind : str
    tile_rate : numpy.ndarray
        ``lam_j`` (n_tiles,).
    tile_width : numpy.ndarray
        ``T_j`` (n_tiles,).
    intensity : numpy.ndarray
        Distinct token intensities ``r`` with their ``weights`` (fractions of
        tokens), the compressed empirical mixture.
    weights : numpy.ndarray
    n_tokens : int
    """

    def __init__(self, tile, kind, tile_rate, tile_width, intensity, weights, n_tokens):
        self.tile = tile
        self.kind = kind
        self.tile_rate = tile_rate
        self.tile_width = tile_width
        self.intensity = intensity
        self.weights = weights
        self.n_tokens = n_tokens

    def _p(self):
        # (K distinct intensities, n_tiles) firing probability of one neuron.
        p = self.intensity[:, None] * self.tile_rate[None, :] / self.tile_width[None, :]
        return np.clip(p, 0.0, 1.0)

    def probability(self, slots, per="tile"):
        """Predicted probability that a tile (``per="tile"``) or a row
        (``per="row"``) holds more than ``slots`` active neurons."""
        from scipy.stats import binom

        slots = _check_slots(slots)
        p = self._p()
        widths = self.tile_width[None, :]
        if per == "tile":
            sf = binom.sf(slots, widths, p)
            return float(np.sum(self.weights[:, None] * sf) / p.shape[1])
        if per == "row":
            # log of the probability that every tile fits, summed over tiles.
            log_fit = binom.logcdf(slots, widths, p).sum(axis=1)
            return float(np.sum(self.weights * -np.expm1(log_fit)))
        raise ValueError(f"per must be 'tile' or 'row', got {per!r}")

    def suggest_slots(self, target_overflow=1e-3, per="tile", multiple_of=1):
        """Smallest ``slots`` whose predicted overflow probability is <= target.

        The result is rounded up to a multiple of ``multiple_of`` and never
        exceeds ``tile`` (a full tile cannot overflow): when the rounding
        would pass ``tile``, the result is ``tile``, whether or not it is a
        multiple of ``multiple_of``.

        Parameters
        ----------
        target_overflow : float
            Acceptable overflow probability (see :meth:`probability`).
        per : {"tile", "row"}
            Probability of a (token, tile) cell or of a token row.
        multiple_of : int
            Positive; round the result up to a multiple of this.

        Returns
        -------
        int
            In ``[1, tile]``.
        """
        try:
            target = float(target_overflow)
        except (TypeError, ValueError):
            target = math.nan
        if isinstance(target_overflow, (bool, str)) or not (0.0 <= target < 1.0):
            raise ValueError(f"target_overflow must be a number in [0, 1), got {target_overflow!r}")
        _check_int(multiple_of, "multiple_of")
        lo, hi = 0, self.tile  # probability(hi) == 0 <= target: hi always feasible
        while lo < hi:  # the probability is non-increasing in slots: bisect
            mid = (lo + hi) // 2
            if self.probability(mid, per) <= target_overflow:
                hi = mid
            else:
                lo = mid + 1
        s = max(lo, 1)
        return int(min(-(-s // multiple_of) * multiple_of, self.tile))

    def __repr__(self):
        return (f"OverflowModel(kind={self.kind!r}, tile={self.tile}, n_tiles={self.tile_rate.size}, "
                f"n_tokens={self.n_tokens}, mean_tile_rate={self.tile_rate.mean():.3g})")


def fit_overflow_model(acts, tile=256, kind="mixture"):
    """Fit an :class:`OverflowModel` to activations.

    Parameters
    ----------
    acts : array_like or twellpy container
        (M, H) activations, e.g. a sample of a few thousand tokens.
    tile : int
        Tile width T.
    kind : {"mixture", "binomial"}
        See :class:`OverflowModel`.
    """
    tile = _check_tile(tile)
    if kind not in ("mixture", "binomial"):
        raise ValueError(f"kind must be 'mixture' or 'binomial', got {kind!r}")
    view = _Acts(acts)
    m, h = view.shape
    if m == 0 or h == 0:
        raise ValueError(f"acts must hold at least one token and one neuron, got shape {(m, h)}")
    occ = _to_numpy(view.occupancy(tile)).astype(np.int64)
    n_tiles = occ.shape[1]
    widths = np.full(n_tiles, tile, dtype=np.float64)
    widths[-1] = h - (n_tiles - 1) * tile
    lam = occ.mean(axis=0).astype(np.float64)
    row = occ.sum(axis=1)
    mean_row = row.mean()
    if kind == "binomial" or mean_row == 0:
        intensity, weights = np.ones(1), np.ones(1)
    else:
        # A token's total n_i is itself noisy (about Poisson around r_i * mu),
        # so n_i / mu is more spread than the true intensity r_i:
        # Var(n) = mu + mu^2 Var(r). Shrinking towards 1 by sqrt(k), with
        # k = 1 - mu / Var(n), gives intensities whose spread matches Var(r)
        # (plain n_i / mu makes the predicted tail too heavy when tokens are
        # alike). Distinct totals compress the mixture (a few hundred values).
        var_row = row.var()
        k = max(0.0, 1.0 - mean_row / var_row) if var_row > 0 else 0.0
        values, freq = np.unique(row, return_counts=True)
        intensity = np.maximum(1.0 + math.sqrt(k) * (values / mean_row - 1.0), 0.0)
        weights = freq.astype(np.float64) / m
    return OverflowModel(tile, kind, lam, widths, intensity, weights, m)


def overflow_probability(acts, slots, tile=256, per="tile", kind="mixture"):
    """Predicted probability that a tile (or a row) overflows ``slots``.

    Shorthand for ``fit_overflow_model(acts, tile, kind).probability(slots, per)``;
    see :class:`OverflowModel` for the model.

    Parameters
    ----------
    acts : array_like or twellpy container
        (M, H) activations (see the module docstring).
    slots : int
        Capacity S per (token, tile) cell.
    tile : int
        Tile width T (default 256).
    per : {"tile", "row"}
        Probability that a (token, tile) cell overflows, or that a token row
        has at least one overflowing tile.
    kind : {"mixture", "binomial"}
        See :class:`OverflowModel`.

    Returns
    -------
    float
        In [0, 1].
    """
    return fit_overflow_model(acts, tile, kind).probability(slots, per)


def suggest_slots(acts, tile=256, target_overflow=1e-3, per="tile", kind="mixture", multiple_of=1):
    """Smallest TwELL ``slots`` whose predicted overflow probability is <= target.

    Parameters
    ----------
    acts : array_like or twellpy container
        A representative sample of activations (M, H).
    tile : int
        Tile width T.
    target_overflow : float
        Acceptable probability that a (token, tile) cell overflows
        (``per="tile"``) or that a token row overflows and goes to the dense
        backup (``per="row"``).
    per : {"tile", "row"}
    kind : {"mixture", "binomial"}
        See :class:`OverflowModel`.
    multiple_of : int
        Round the result up to a multiple of this (e.g. 8 for vector loads);
        the result is then capped at ``tile``, which need not be a multiple.

    Returns
    -------
    int
        In ``[1, tile]``.

    Examples
    --------
    >>> s = suggest_slots(acts, tile=256, target_overflow=1e-3)   # doctest: +SKIP
    >>> A = twellpy.TwELL.from_dense(acts, tile=256, slots=s)     # doctest: +SKIP
    """
    return fit_overflow_model(acts, tile, kind).suggest_slots(target_overflow, per, multiple_of)
