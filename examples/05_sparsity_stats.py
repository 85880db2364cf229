"""05 -- Sparsity statistics and plots from the activations of a trained sparse layer.

A ReLU FFN ``y = relu(x Wu^T) Wd^T`` is trained with Adam to imitate a fixed
"teacher" FFN, with an L1 penalty on its activation that pushes it to fire
few neurons (the recipe of the paper). The training step is twellpy's sparse
one (``relu_forward_train`` / ``relu_backward``), whose context reports the
mean active neurons per token (``ctx.stats["l0"]``) as training goes. The
few steps here teach the student little about the teacher (its held-out
error is printed next to that of predicting 0); the point is how the L1
penalty changes its activations.

Then, on held-out tokens, ``twellpy.stats`` measures the activations of the
initial and the trained layer: non-zeros per token, dead neurons, tile
occupancy, the fitted overflow model and the suggested TwELL ``slots``; and
``twellpy.plot`` draws the figures into ``--out``.

Run: ``python examples/05_sparsity_stats.py [--small] [--device cpu|cuda] [--out DIR]``
"""
import argparse
from pathlib import Path

import numpy as np

import twellpy as tw
from twellpy import plot, stats
from twellpy import gpu_available


class Adam:
    """Plain Adam on a list of arrays (numpy or cupy)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.lr, self.b1, self.b2, self.eps = params, lr, betas[0], betas[1], eps
        self.m = [p * 0 for p in params]
        self.v = [p * 0 for p in params]
        self.t = 0

    def step(self, grads):
        self.t += 1
        for i, (p, g) in enumerate(zip(self.params, grads)):
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
            m_hat = self.m[i] / (1 - self.b1 ** self.t)
            v_hat = self.v[i] / (1 - self.b2 ** self.t)
            p -= self.lr * m_hat / (v_hat ** 0.5 + self.eps)  # in place: the caller keeps references


def activations(x, w_up, w_down):
    """The layer's activation relu(x Wu^T) as a TwELL, from the inference path."""
    _, h = tw.ffn.relu_forward(x, w_up, w_down, return_activations=True)
    return h


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (what the tests run)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--out", default="sparsity_stats", help="folder for the figures (created)")
    args = ap.parse_args(argv)
    use_gpu = args.device == "cuda" or (args.device == "auto" and gpu_available())
    if use_gpu and not gpu_available():
        raise SystemExit("--device cuda: no usable CUDA GPU")
    if use_gpu:
        import cupy as xp
    else:
        xp = np
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.small:
        D, H, batch, steps, tile = 32, 512, 128, 30, 128
    else:
        D, H, batch, steps, tile = 128, 2048, 1024, 400, 256
    # Strong: the teacher fires ~5% of its neurons, the student starts at ~50%.
    # At the full size 1.0 silences the student (no neuron fires after ~80
    # steps, and its error is that of predicting 0), so it gets 0.1 there.
    l1 = 1.0 if args.small else 0.1
    rng = np.random.default_rng(0)

    def f32(a):
        return xp.asarray(a, dtype=xp.float32)

    # Teacher: a fixed ReLU FFN with a sparse hidden layer (~5% active).
    t_up = rng.standard_normal((H, D)) / np.sqrt(D)
    t_up[:, 0] = -1.6
    t_down = rng.standard_normal((D, H)) / np.sqrt(0.05 * H)

    def batch_of(n):
        x = rng.standard_normal((n, D))
        x[:, 0] = 1.0  # constant feature: column 0 of the weights acts as a bias
        y = np.maximum(x @ t_up.T, 0) @ t_down.T
        return f32(x), f32(y)

    w_up = f32(rng.standard_normal((H, D)) / np.sqrt(D))
    w_down = f32(rng.standard_normal((D, H)) / np.sqrt(H))
    x_eval, y_eval = batch_of(4 * batch)
    h_before = activations(x_eval, w_up, w_down)

    opt = Adam([w_up, w_down], lr=1e-2)
    l0_trace, loss_trace = [], []
    for step in range(steps):
        x, target = batch_of(batch)
        y, ctx = tw.ffn.relu_forward_train(x, w_up, w_down, l1=l1)
        diff = y - target
        loss_trace.append(float((diff * diff).sum()) / batch)
        l0_trace.append(float(ctx.stats["l0"]))
        _, dw_up, dw_down = tw.ffn.relu_backward(ctx, 2 * diff / batch)
        opt.step([dw_up, dw_down])
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            print(f"step {step:4d}: mse {loss_trace[-1]:.4f}, active neurons per token {l0_trace[-1]:.1f} of {H}, "
                  f"backup rows {ctx.stats['n_backup_rows']}")
    assert l0_trace[-1] < l0_trace[0], "the L1 penalty should have reduced the active neurons"
    mse_eval = float(((tw.ffn.relu_forward(x_eval, w_up, w_down) - y_eval) ** 2).sum()) / x_eval.shape[0]
    mse_zero = float((y_eval * y_eval).sum()) / x_eval.shape[0]
    print(f"held-out mse {mse_eval:.4f} (predicting 0: {mse_zero:.4f})")

    h_after = activations(x_eval, w_up, w_down)
    # The statistics accept the TwELL containers directly (stored entries = non-zeros).
    for name, h in (("initial", h_before), ("trained", h_after)):
        nnz = stats.nnz_per_token(h)
        assert nnz.sum() == h.nnz
        freq = stats.firing_frequency(h)
        occ = stats.tile_occupancy(h, tile=tile)
        slots = stats.suggest_slots(h, tile=tile, target_overflow=1e-3)
        p_row = stats.overflow_probability(h, slots, tile=tile, per="row")
        print(f"{name:8s}: nnz/token mean {nnz.mean():6.1f}, max {nnz.max():4d}; "
              f"dead neurons {int((freq == 0).sum()):4d} of {H}; max tile count {occ.max():3d}; "
              f"suggested slots {slots} (tile {tile}) -> P(row to backup) {p_row:.2e}")
        # What TwELL really does with the suggested slots on these activations:
        A = tw.TwELL.from_dense(h.toarray(), tile=tile, slots=slots)
        assert A.nnz == h.nnz
        print(f"          TwELL(tile={tile}, slots={slots}): {A.n_backup} backup rows of {A.shape[0]}, "
              f"{A.nbytes / (A.shape[0] * H * 4):.3f} of the dense float32 bytes")

    s_after = stats.suggest_slots(h_after, tile=tile)
    figures = {
        "nnz_histogram.png": plot.nnz_histogram(h_after, title="trained layer: active neurons per token"),
        "tile_heatmap.png": plot.tile_heatmap(h_after, tile=tile, slots=s_after),
        "tile_occupancy.png": plot.tile_occupancy_histogram(h_after, tile=tile, slots=s_after),
        "before_after.png": plot.layer_summary({"initial": h_before, "trained": h_after},
                                               title="active neurons per token, before and after training"),
    }
    for fname, fig in figures.items():
        fig.savefig(out / fname, dpi=100)
    print(f"figures written to {out}/: {', '.join(figures)}")
    print("05 OK")


if __name__ == "__main__":
    main()
