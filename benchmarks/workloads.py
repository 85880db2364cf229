"""Synthetic FFN workloads of docs/workloads.md (shared by every benchmark and test).

``x`` (M, D) has N(0, 1) entries, each row scaled by ``exp(sigma * N(0, 1))``
(uneven sparsity across tokens), then ``x[:, 0] = 1``. The gate weights are
N(0, 1/(D-1)) with column 0 set to ``-t``; ``t`` is found by bisection on a
sample of rows so that the mean number of positive entries of
``x @ w_gate.T`` per row hits the target. ``w_up`` is N(0, 1/D), ``w_down``
N(0, 1/H). For the plain ReLU FFN the threshold goes into ``w_up`` instead.

Everything is generated in float32 on the array module given (numpy or
cupy) and cast to the requested dtype at the end.

Example
-------
>>> from benchmarks.workloads import make_ffn, WORKLOADS
>>> w = make_ffn(**WORKLOADS["C1"], xp=numpy)          # doctest: +SKIP
>>> w["x"].shape, w["w_gate"].shape, w["threshold"]    # doctest: +SKIP
"""
from __future__ import annotations

import numpy as np

#: docs/workloads.md reference workloads (W4 is run at M = 1, 16 and 128)
WORKLOADS = {
    "W1-16k": dict(M=16384, D=2048, H=5632, nnz=30, sigma=0.0),
    "W1-64k": dict(M=65536, D=2048, H=5632, nnz=30, sigma=0.0),
    "W2": dict(M=65536, D=2048, H=5632, nnz=100, sigma=0.0),
    "W3": dict(M=65536, D=2048, H=5632, nnz=30, sigma=0.15),
    "W4-1": dict(M=1, D=2048, H=5632, nnz=30, sigma=0.0),
    "W4-16": dict(M=16, D=2048, H=5632, nnz=30, sigma=0.0),
    "W4-128": dict(M=128, D=2048, H=5632, nnz=30, sigma=0.0),
    "W5": dict(M=16384, D=4096, H=11008, nnz=30, sigma=0.0),
    # uneven data beyond W3 (issue 4: exact and timed "with tiles far over capacity"):
    # row scales exp(0.3 N) and exp(0.5 N), and 16 tokens firing about 2000 neurons each
    "U1-s0.3": dict(M=16384, D=2048, H=5632, nnz=30, sigma=0.3),
    "U1-s0.5": dict(M=16384, D=2048, H=5632, nnz=30, sigma=0.5),
    "U1-hot": dict(M=16384, D=2048, H=5632, nnz=30, sigma=0.0, hot=(16, 2000)),
    "C1": dict(M=8192, D=1024, H=2816, nnz=15, sigma=0.0),
}


def _normal(xp, rng, shape, scale=1.0):
    if xp is np:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)


def make_inputs(M, D, *, sigma=0.0, xp=np, seed=0):
    """x (M, D) float32: N(0,1) rows scaled by exp(sigma N(0,1)), x[:, 0] = 1."""
    rng = xp.random.default_rng(seed) if xp is np else xp.random.default_rng(seed)
    x = _normal(xp, rng, (M, D))
    if sigma:
        scale = xp.exp(np.float32(sigma) * _normal(xp, rng, (M, 1))).astype(np.float32)
        x *= scale
    if D:
        x[:, 0] = 1
    return x


def find_threshold(x, w, nnz, *, sample_rows=2048, iters=60):
    """Threshold t such that mean_rows #{j : x[:,1:] @ w[:,1:].T - t > 0} ~= nnz.

    ``x`` (M, D) with x[:, 0] = 1 and ``w`` (H, D) float32 on one module; only
    the first ``sample_rows`` rows are used. Returns a Python float.
    """
    xs = x[:sample_rows, 1:]
    z = xs @ w[:, 1:].T
    lo, hi = float(z.min()) - 1.0, float(z.max()) + 1.0   # mean count: H at lo, 0 at hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        mean = float((z > mid).sum()) / z.shape[0]
        if mean > nnz:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def make_hot_rows(x, w_act, rows, fire):
    """Move each row of ``rows`` of ``x`` (float32, threshold in column 0 as
    make_ffn builds it) so that it fires about ``fire`` neurons of ``w_act``
    (every neuron when ``fire >= H``); in place, returns ``x``."""
    H = w_act.shape[0]
    w0 = w_act[:, 0]  # -t in every neuron
    for r in rows:
        rest = x[r] @ w_act.T - x[r, 0] * w0  # the pre-activation without the threshold column
        # neuron j fires where rest_j + v * w0_j > 0, i.e. v < rest_j / t
        ratio = (rest / -w0)
        ratio = ratio[(-ratio).argsort()]
        x[r, 0] = float(ratio[fire - 1]) - 1e-3 if fire < H else -1e3
    return x


def make_ffn(M, D, H, nnz, sigma=0.0, *, gated=True, dtype=np.float32, xp=np, seed=0,
             sample_rows=2048, hot=None):
    """One synthetic FFN workload.

    Parameters
    ----------
    M, D, H : int
        Tokens, model width, hidden width.
    nnz : float
        Target mean active neurons per token.
    sigma : float
        Row-scale spread (0 = even sparsity).
    gated : bool
        Gated FFN (threshold in ``w_gate``) or plain ReLU FFN (in ``w_up``).
    dtype : dtype
        Output dtype of every array (e.g. ``ml_dtypes.bfloat16``).
    xp : module
        numpy or cupy.
    hot : (int, int), optional
        ``(count, fire)``: ``count`` tokens, evenly spaced, fire about ``fire``
        neurons each (``make_hot_rows``).

    Returns
    -------
    dict with ``x``, ``w_gate`` (None when not gated), ``w_up``, ``w_down``
    and ``threshold``.
    """
    rng = xp.random.default_rng(seed + 1)
    x = make_inputs(M, D, sigma=sigma, xp=xp, seed=seed)
    w_act = _normal(xp, rng, (H, D), 1.0 / np.sqrt(max(D - 1, 1)))
    # threshold from a sample that matches x's distribution, even when M is tiny
    sample = x if M >= sample_rows else make_inputs(sample_rows, D, sigma=sigma, xp=xp, seed=seed + 7)
    t = find_threshold(sample, w_act, nnz, sample_rows=sample_rows)
    w_act[:, 0] = -t
    if hot is not None and M:
        count, fire = hot
        make_hot_rows(x, w_act, [int(r) for r in np.linspace(0, M - 1, count).astype(int)], int(fire))
    w_down = _normal(xp, rng, (D, H), 1.0 / np.sqrt(H))
    if gated:
        w_gate = w_act
        w_up = _normal(xp, rng, (H, D), 1.0 / np.sqrt(D))
    else:
        w_gate = None
        w_up = w_act
    dt = np.dtype(dtype)

    def cast(a):
        return None if a is None else a.astype(dt)

    return {"x": cast(x), "w_gate": cast(w_gate), "w_up": cast(w_up), "w_down": cast(w_down),
            "threshold": t}


def reference_ffn(x, w_gate, w_up, w_down, *, dtype=np.float32):
    """Dense FFN in ``dtype`` (float32 or float64) on the inputs' module.

    NaN-propagating ReLU (relu(NaN) = NaN), as twellpy; an inactive gate
    gives h = 0 exactly, whatever the up projection holds (NaN/Inf included).
    """
    xp = _module_of(x)
    c = lambda a: None if a is None else a.astype(dtype)  # noqa: E731
    x, w_gate, w_up, w_down = c(x), c(w_gate), c(w_up), c(w_down)
    if w_gate is not None:
        g = x @ w_gate.T
        h = xp.where(g <= 0, 0, g * (x @ w_up.T))
    else:
        g = x @ w_up.T
        h = xp.where(g <= 0, 0, g)
    return h @ w_down.T


def _module_of(a):
    try:
        import cupy

        if isinstance(a, cupy.ndarray):
            return cupy
    except Exception:
        pass
    return np
