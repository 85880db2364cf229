"""Hand-written float64 dense references and input makers for the training tests."""
import numpy as np


def f64(a):
    """float64 numpy copy of a numpy or cupy array (bfloat16 moved as raw bits)."""
    if hasattr(a, "get"):
        a = a.view(np.uint16).get().view(a.dtype) if a.dtype.itemsize == 2 else a.get()
    return np.asarray(a, dtype=np.float64)


def to_gpu(a):
    """cupy copy of a numpy array (bfloat16 moved as raw bits)."""
    import cupy as cp

    if a.dtype.itemsize == 2:
        return cp.asarray(a.view(np.uint16)).view(a.dtype)
    return cp.asarray(a)


def dense_gated(x, wg, wu, wd, dy, l1):
    """Forward and hand-derived backward of the gated FFN in float64 (numpy)."""
    x, wg, wu, wd, dy = (f64(a) for a in (x, wg, wu, wd, dy))
    M = x.shape[0]
    z = x @ wg.T
    pat = z > 0
    g = np.where(pat, z, 0.0)
    u = x @ wu.T
    h = g * u
    y = h @ wd.T
    dh = np.where(pat, dy @ wd + (l1 / M) * np.sign(h), 0.0) if M else np.zeros_like(h)
    du, dg = dh * g, dh * u
    return {
        "y": y,
        "dx": du @ wu + dg @ wg,
        "dw_gate": dg.T @ x,
        "dw_up": du.T @ x,
        "dw_down": dy.T @ h,
        "l1": l1 * np.abs(h).sum() / M if M else 0.0,
        "token_counts": pat.sum(1),
        "neuron_counts": pat.sum(0),
    }


def dense_relu(x, wu, wd, dy, l1):
    """Forward and hand-derived backward of the ReLU FFN in float64 (numpy)."""
    x, wu, wd, dy = (f64(a) for a in (x, wu, wd, dy))
    M = x.shape[0]
    z = x @ wu.T
    pat = z > 0
    h = np.where(pat, z, 0.0)
    y = h @ wd.T
    dh = np.where(pat, dy @ wd + (l1 / M) * np.sign(h), 0.0) if M else np.zeros_like(h)
    return {
        "y": y,
        "dx": dh @ wu,
        "dw_up": dh.T @ x,
        "dw_down": dy.T @ h,
        "l1": l1 * np.abs(h).sum() / M if M else 0.0,
        "token_counts": pat.sum(1),
        "neuron_counts": pat.sum(0),
    }


def make_problem(M, D, H, nnz, *, sigma=0.0, hot=None, empty=(), seed=0, gated=True):
    """Synthetic FFN inputs in float64 (numpy) with about ``nnz`` active neurons per token.

    ``sigma`` spreads the row scale (uneven sparsity); ``hot=(row, k)`` makes
    token ``row`` fire at least ``k`` neurons; rows in ``empty`` fire none.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, D))
    if sigma:
        x *= np.exp(sigma * rng.standard_normal((M, 1)))
    x[:, 0] = 1.0
    w_act = rng.standard_normal((H, D)) / np.sqrt(D - 1)
    z = x[:, 1:] @ w_act[:, 1:].T
    t = np.quantile(z, 1.0 - min(nnz / H, 1.0)) if M else 0.0
    w_act[:, 0] = -t
    if hot is not None:
        row, k = hot
        x[:, 1] = 0.0          # column 1 only carries the hot token's signal
        x[row, 1:] = 0.0
        x[row, 1] = 50.0
        w_act[:k, 1] = np.abs(w_act[:k, 1]) + 1.0   # these k fire for the hot token
    for r in empty:
        x[r, 1:] = 0.0                                # z = -t < 0 everywhere
    if H and np.any(w_act[:, 0] >= 0) and empty:
        w_act[:, 0] = -abs(t) - 0.1
    # keep every gate value away from the ReLU kink, so that a last-bit
    # difference between two correct GEMMs cannot flip a neuron
    eps = 1e-3
    for _ in range(20):
        near = (np.abs(x @ w_act.T) < eps).any(axis=0) if M else np.zeros(H, bool)
        if not near.any():
            break
        w_act[near, 0] -= eps * (2.0 + rng.random(int(near.sum())))
    w_other = rng.standard_normal((H, D)) / np.sqrt(D)
    w_down = rng.standard_normal((D, H)) / np.sqrt(H)
    dy = rng.standard_normal((M, D))
    if gated:
        return x, w_act, w_other, w_down, dy
    return x, w_act, w_down, dy


def step_outputs(x, wg, wu, wd, dy, width, gated, ctx_out=None, **kw):
    """Every output of one training step as host arrays (for bit comparisons).

    ``kw`` goes to the forward (e.g. ``speculate``); the context is appended
    to ``ctx_out`` when given."""
    from twellpy import _ffn_train as T

    if gated:
        y, ctx = T.gated_forward_train(x, wg, wu, wd, l1=0.05, width=width, **kw)
        grads = T.gated_backward(ctx, dy)
    else:
        y, ctx = T.relu_forward_train(x, wu, wd, l1=0.05, width=width, **kw)
        grads = T.relu_backward(ctx, dy)
    if ctx_out is not None:
        ctx_out.append(ctx)
    out = {"y": y, "idx": ctx.idx, "ell_nnz": ctx.ell_nnz, "gvals": ctx.gvals,
           "backup_rows": ctx.backup_rows, "token_counts": ctx.stats["token_counts"],
           "neuron_counts": ctx.stats["neuron_counts"]}
    if gated:
        out["uvals"] = ctx.uvals
    out.update({f"grad{i}": g for i, g in enumerate(grads)})
    host = {k: np.asarray(v.get() if hasattr(v, "get") else v) for k, v in out.items()}
    return host, ctx.stats["l1"], ctx.stats["width"]
