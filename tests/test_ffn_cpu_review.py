"""Review of the CPU FFN path as a NumPy user sees it: defects found and fixed.

Every test compares with a float64 NumPy reference (IEEE semantics where the
inputs hold NaN/Inf: an inactive neuron contributes exactly nothing).
"""
import numpy as np
import pytest

import twellpy as tw


def _problem(M, D, H, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, D)).astype(dtype)
    wg = (rng.standard_normal((H, D)) / np.sqrt(D)).astype(dtype)
    wu = (rng.standard_normal((H, D)) / np.sqrt(D)).astype(dtype)
    wd = (rng.standard_normal((D, H)) / np.sqrt(H)).astype(dtype)
    return x, wg, wu, wd


def _f64(a):
    return np.asarray(a, dtype=np.float64)


def _ref_gated(x, wg, wu):
    """g, u (on g's pattern) and h in float64, IEEE NaN semantics (NaN gate is active)."""
    x, wg, wu = _f64(x), _f64(wg), _f64(wu)
    with np.errstate(invalid="ignore", over="ignore"):
        z = x @ wg.T
        on = ~(z <= 0)
        g = np.where(on, z, 0.0)
        u = np.where(on, x @ wu.T, 0.0)
        h = np.where(on, g * u, 0.0)
    return g, u, h


def _same_nonfinite_then_close(got, want, rtol):
    got = _f64(got)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=rtol * max(1.0, np.abs(want[fin]).max(initial=0)))


# ---------------------------------------------------------------------------
# 1. ctx.g / ctx.u / ctx.h of a training step whose activations hold NaN/Inf
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("width", [1, "auto"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)])
def test_ctx_activations_with_nan_under_check_finite_false(dtype, width):
    """check_finite=False keeps IEEE semantics; reading the saved activations must too
    (they raised 'values contains .. NaN' before, although the step itself ran)."""
    x, wg, wu, wd = _problem(6, 5, 11, dtype)
    x[2, 3] = np.nan  # row 2: every gate NaN, so every neuron active with NaN h
    g, u, h = _ref_gated(x, wg, wu)
    y, ctx = tw.ffn.gated_forward_train(x, wg, wu, wd, width=width, check_finite=False)
    for got, want in ((ctx.g, g), (ctx.u, u), (ctx.h, h)):
        _same_nonfinite_then_close(got.toarray(), want, 1e-5)
    _, ctx = tw.ffn.relu_forward_train(x, wu, wd, width=width, check_finite=False)
    with np.errstate(invalid="ignore"):
        z = _f64(x) @ _f64(wu).T
    want = np.where(~(z <= 0), z, 0.0)
    for got in (ctx.g, ctx.h):
        _same_nonfinite_then_close(got.toarray(), want, 1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_ctx_h_after_float16_overflow():
    """Finite fp16 inputs whose h overflows to Inf (legitimate, check_finite=True):
    ctx.h must return it, as gated_forward(return_activations=True) does."""
    x = np.full((2, 4), 100, np.float16)
    wg = np.full((3, 4), 100, np.float16)
    wu = wg.copy()
    wd = np.full((4, 3), 1e-3, np.float16)
    y, ctx = tw.ffn.gated_forward_train(x, wg, wu, wd)
    h = ctx.h.toarray()
    assert h.shape == (2, 3) and np.isposinf(_f64(h)).all()
    np.testing.assert_array_equal(_f64(ctx.g.toarray()), np.full((2, 3), 40000.0))


# ---------------------------------------------------------------------------
# 2. width strategies are validated whatever the batch size
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("width", ["bogus", "quantile:2", "quantile:abc", "min_storage:3", "auto:0.5"])
@pytest.mark.parametrize("M", [0, 4])
def test_bad_width_strategy_raises_for_every_batch(width, M):
    x, wg, wu, wd = _problem(M, 5, 7, np.float32)
    with pytest.raises(ValueError, match="width"):
        tw.ffn.gated_forward_train(x, wg, wu, wd, width=width)
    with pytest.raises(ValueError, match="width"):
        tw.ffn.choose_width(np.zeros(M, np.int32), width, n_cols=7)


@pytest.mark.parametrize("width", ["quantile:0.5", "min_storage", "auto", "fixed:3", 2])
def test_good_width_strategy_on_empty_batch(width):
    x, wg, wu, wd = _problem(0, 5, 7, np.float32)
    y, ctx = tw.ffn.gated_forward_train(x, wg, wu, wd, width=width)
    assert y.shape == (0, 5) and ctx.width >= 1
    grads = tw.ffn.gated_backward(ctx, np.zeros((0, 5), np.float32))
    assert [g.shape for g in grads] == [(0, 5), (7, 5), (7, 5), (5, 7)]
    assert all(not np.any(g) for g in grads)


# ---------------------------------------------------------------------------
# 3. NaN/Inf weights of inactive neurons: no floating-point warning from the
#    backup-row GEMMs (whose 0 * Inf products are discarded), whatever the width
# ---------------------------------------------------------------------------
def _dead_inf_problem(dtype):
    """Neurons 0-2 fire in every row, the others never; a never-firing neuron
    has an Inf w_down column and another an Inf / NaN w_up / w_gate entry."""
    x, wg, wu, wd = _problem(8, 5, 30, dtype, seed=3)
    x = np.abs(x)
    wg = -np.abs(wg)
    wg[:3] = np.abs(wg[:3])
    clean = tuple(a.copy() for a in (wg, wu, wd))
    wd[1, 10] = np.inf
    wu[12, 0] = np.inf
    wu[13, 1] = np.nan
    wg[14, 2] = -np.inf  # gate -Inf: inactive
    return x, (wg, wu, wd), clean


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("width", [1, "auto"])
def test_inactive_nonfinite_weights_raise_no_fp_error(width, gated):
    x, (wg, wu, wd), (cg, cu, cd) = _dead_inf_problem(np.float32)
    if not gated:  # ReLU FFN: the up projection is the gate
        wu = wg.copy()
        wu[12, 0] = -np.inf
        cu = cg
    dy = np.random.default_rng(1).standard_normal((8, 5)).astype(np.float32)
    x64, dy64 = _f64(x), _f64(dy)
    with np.errstate(all="raise", under="ignore"):
        if gated:
            y, ctx = tw.ffn.gated_forward_train(x, wg, wu, wd, width=width, l1=0.1, check_finite=False)
            grads = tw.ffn.gated_backward(ctx, dy)
        else:
            y, ctx = tw.ffn.relu_forward_train(x, wu, wd, width=width, l1=0.1, check_finite=False)
            grads = tw.ffn.relu_backward(ctx, dy)
    # reference from the clean weights (the bad ones belong to neurons that never fire)
    if gated:
        z = x64 @ _f64(cg).T
        on = z > 0
        g, u = np.where(on, z, 0), x64 @ _f64(cu).T
        h = g * u
        dh = (dy64 @ _f64(cd) + 0.1 / 8 * np.sign(h)) * on
        du, dg = dh * g, dh * u
        want = [du @ _f64(cu) + dg @ _f64(cg), dg.T @ x64, du.T @ x64, dy64.T @ h]
    else:
        z = x64 @ _f64(cu).T
        on = z > 0
        h = np.where(on, z, 0)
        dh = (dy64 @ _f64(cd) + 0.1 / 8 * np.sign(h)) * on
        want = [dh @ _f64(cu), dh.T @ x64, dy64.T @ h]
    assert ctx.R == (8 if width == 1 else 0)
    np.testing.assert_allclose(_f64(y), h @ _f64(cd).T, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, want):
        assert np.isfinite(_f64(got)).all()
        np.testing.assert_allclose(_f64(got), ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# 4. Python ints beyond float range: named errors (l1), the limit they mean
#    (auto_threshold), not a bare OverflowError
# ---------------------------------------------------------------------------
def test_huge_int_l1_is_a_named_value_error():
    x, wg, wu, wd = _problem(3, 4, 6, np.float32)
    for l1 in (10**400, -10**400):
        with pytest.raises(ValueError, match="l1 must be a finite number"):
            tw.ffn.gated_forward_train(x, wg, wu, wd, l1=l1)
        with pytest.raises(ValueError, match="l1 must be a finite number"):
            tw.ffn.relu_forward_train(x, wu, wd, l1=l1)


def test_huge_int_auto_threshold_means_never_dense():
    x, wg, wu, wd = _problem(40, 4, 6, np.float64)
    _, _, h = _ref_gated(x, wg, wu)
    ffn = tw.ffn.GatedFFN(wg, wu, wd)
    ffn.auto_threshold = 10**400
    assert ffn.auto_threshold == float("inf")
    np.testing.assert_allclose(ffn(x), h @ _f64(wd).T, rtol=1e-12, atol=1e-12)
    assert ffn.last_info["mode"] == "sparse"
    ffn.auto_threshold = -10**400
    assert ffn.auto_threshold == float("-inf")
    np.testing.assert_allclose(ffn(x), h @ _f64(wd).T, rtol=1e-12, atol=1e-12)
    assert ffn.last_info["mode"] == "dense"
