"""Finite-difference check of the sparse FFN gradients on small float64 problems (CPU).

The loss is ``L = sum(y * R) + l1 * sum|h| / M`` for a fixed random R, so that
``dL/dy = R``; every analytic gradient entry is compared with a central
difference. Problems are built with gate values kept away from the ReLU kink
and with ``h`` away from 0, where both L and its gradient are smooth.
"""
import numpy as np
import pytest

from twellpy import _ffn_train as T

from _train_ref import make_problem

EPS = 1e-6


def _loss_gated(x, wg, wu, wd, R, l1):
    y, ctx = T.gated_forward_train(x, wg, wu, wd, l1=l1, width="quantile:0.5")
    return float((y * R).sum()) + ctx.stats["l1"]


def _loss_relu(x, wu, wd, R, l1):
    y, ctx = T.relu_forward_train(x, wu, wd, l1=l1, width="quantile:0.5")
    return float((y * R).sum()) + ctx.stats["l1"]


def _fd_check(loss, params, grads, rng, n_probe=12):
    for i, (p, g) in enumerate(zip(params, grads)):
        flat = p.reshape(-1)
        for j in rng.choice(flat.size, size=min(n_probe, flat.size), replace=False):
            old = flat[j]
            flat[j] = old + EPS
            lp = loss(*params)
            flat[j] = old - EPS
            lm = loss(*params)
            flat[j] = old
            fd = (lp - lm) / (2 * EPS)
            an = g.reshape(-1)[j]
            assert abs(fd - an) <= 1e-6 * max(1.0, abs(fd)), (i, j, fd, an)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("l1", [0.0, 0.3])
def test_gated_gradients_by_finite_differences(seed, l1):
    x, wg, wu, wd, R = make_problem(M=12, D=7, H=40, nnz=6, sigma=0.5, seed=seed)
    rng = np.random.default_rng(100 + seed)
    y, ctx = T.gated_forward_train(x, wg, wu, wd, l1=l1, width="quantile:0.5")
    assert ctx.stats["n_backup_rows"] > 0  # both the ELL and the backup paths are checked
    grads = T.gated_backward(ctx, R)
    params = [x, wg, wu, wd]
    _fd_check(lambda *p: _loss_gated(*p, R, l1), params, grads, rng)


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("l1", [0.0, 0.3])
def test_relu_gradients_by_finite_differences(seed, l1):
    x, wu, wd, R = make_problem(M=10, D=6, H=30, nnz=5, sigma=0.5, seed=seed, gated=False)
    rng = np.random.default_rng(200 + seed)
    y, ctx = T.relu_forward_train(x, wu, wd, l1=l1, width="quantile:0.5")
    grads = T.relu_backward(ctx, R)
    _fd_check(lambda *p: _loss_relu(*p, R, l1), [x, wu, wd], grads, rng)
