"""04 -- A sparse FFN training step with every gradient checked.

``gated_forward_train`` computes ``y`` and keeps the sparse activation (a
Hybrid: ELL rows plus dense backup rows for busy tokens); ``gated_backward``
returns ``dx, dw_gate, dw_up, dw_down``, including the gradient of the L1
penalty ``l1 * sum|h| / M`` on the activation.

The check: the same step written densely in float64 with NumPy (formulas
below), which is itself verified by a central finite difference of the
loss; then every twellpy gradient is compared with it. Finally a few SGD
steps show the loss going down.

Loss used for the check: ``L = sum(y * dy) + l1 * sum|h| / M`` so that
``dL/dy = dy``.

Run: ``python examples/04_training_step.py [--small] [--device cpu|cuda]``
"""
import argparse

import numpy as np
from ml_dtypes import bfloat16

import twellpy as tw
from twellpy import gpu_available


def dense_step(x, wg, wu, wd, dy, l1):
    """Forward and backward of the gated FFN with the L1 penalty, float64."""
    M = x.shape[0]
    a = x @ wg.T
    g = np.maximum(a, 0)
    u = x @ wu.T
    h = g * u
    y = h @ wd.T
    loss = float(np.sum(y * dy) + l1 * np.abs(h).sum() / M)
    active = a > 0
    dh = (dy @ wd + (l1 / M) * np.sign(h)) * active
    du = dh * g
    dg = dh * u  # relu'(a) = 1 on the active pattern, 0 elsewhere (already masked)
    grads = (du @ wu + dg @ wg, dg.T @ x, du.T @ x, dy.T @ h)
    return y, loss, grads


def finite_difference_check(x, wg, wu, wd, dy, l1, grads, rng):
    """Central difference of the float64 loss along a random direction."""
    params = [x, wg, wu, wd]
    dirs = [rng.standard_normal(p.shape) for p in params]
    eps = 1e-7  # small enough that no ReLU/|h| kink is crossed, large enough for float64 round-off
    plus = dense_step(*[p + eps * d for p, d in zip(params, dirs)], dy, l1)[1]
    minus = dense_step(*[p - eps * d for p, d in zip(params, dirs)], dy, l1)[1]
    numeric = (plus - minus) / (2 * eps)
    analytic = sum(float(np.sum(gr * d)) for gr, d in zip(grads, dirs))
    return abs(numeric - analytic) / max(abs(analytic), 1e-300)


def rel_err(got, ref):
    got = np.asarray(got.get() if hasattr(got, "get") else got, dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (what the tests run)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = ap.parse_args(argv)
    use_gpu = args.device == "cuda" or (args.device == "auto" and gpu_available())
    if use_gpu and not gpu_available():
        raise SystemExit("--device cuda: no usable CUDA GPU")
    if use_gpu:
        import cupy as xp
    else:
        xp = np

    if args.small:
        M, D, H, dtypes = 64, 32, 256, [np.float64, np.float32]
    elif use_gpu:
        M, D, H, dtypes = 4096, 1024, 2816, [np.float32, bfloat16]
    else:
        M, D, H, dtypes = 1024, 256, 1024, [np.float64, np.float32]
    l1 = 2e-2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, D))
    x[:, 0] = 1.0
    wg = rng.standard_normal((H, D)) / np.sqrt(D)
    wg[:, 0] = -1.5  # sparse gate: ~7% of the neurons fire
    wu = rng.standard_normal((H, D)) / np.sqrt(D)
    wd = rng.standard_normal((D, H)) / np.sqrt(H)
    dy = rng.standard_normal((M, D))

    y_ref, loss_ref, grads_ref = dense_step(x, wg, wu, wd, dy, l1)
    fd = finite_difference_check(x, wg, wu, wd, dy, l1, grads_ref, rng)
    print(f"float64 reference verified by finite differences: relative difference {fd:.1e}")
    assert fd < 1e-6, fd

    names = ("y", "dx", "dw_gate", "dw_up", "dw_down")
    tol = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-4, bfloat16: 5e-2}
    print(f"{'dtype':9s} " + " ".join(f"{n:>9s}" for n in names) + "   active/token  backup rows")
    for dt in dtypes:
        dt = np.dtype(dt)
        xs, wgs, wus, wds, dys = (xp.asarray(a).astype(dt) for a in (x, wg, wu, wd, dy))
        y, ctx = tw.ffn.gated_forward_train(xs, wgs, wus, wds, l1=l1)
        grads = tw.ffn.gated_backward(ctx, dys)
        errs = [rel_err(y, y_ref)] + [rel_err(g, r) for g, r in zip(grads, grads_ref)]
        print(f"{dt.name:9s} " + " ".join(f"{e:9.1e}" for e in errs)
              + f"   {ctx.stats['l0']:12.1f}  {ctx.stats['n_backup_rows']:11d}")
        for n, e in zip(names, errs):
            assert e <= tol[dt], f"{dt.name} {n}: relative error {e:.2e} > {tol[dt]:g}"

    # A few plain SGD steps on a regression target: the loss must go down.
    target = xp.asarray(rng.standard_normal((M, D)) * 0.1).astype(np.float32)
    params = [xp.asarray(a).astype(np.float32) for a in (wg, wu, wd)]
    xs = xp.asarray(x).astype(np.float32)
    losses = []
    for _ in range(5):
        y, ctx = tw.ffn.gated_forward_train(xs, *params, l1=1e-4)
        diff = y - target
        losses.append(float((diff * diff).sum()) / M + ctx.stats["l1"])
        _, dwg, dwu, dwd = tw.ffn.gated_backward(ctx, 2 * diff / M)
        params = [p - 0.5 * g for p, g in zip(params, (dwg, dwu, dwd))]
    print("SGD loss: " + " -> ".join(f"{v:.4f}" for v in losses))
    assert losses[-1] < losses[0], losses
    print("04 OK")


if __name__ == "__main__":
    main()
