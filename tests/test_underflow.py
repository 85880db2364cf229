"""A caller's ``np.seterr(under="raise")`` does not turn twellpy's internal float16/bfloat16
rounding into ``FloatingPointError`` (``_array.quiet_underflow`` on the public entry points).

Before, every one of these calls with float16 data raised "underflow encountered in cast" on the CPU."""
import numpy as np
import pytest

import twellpy as tw
from twellpy import ops
from twellpy._array import bfloat16

M, D, H = 16, 32, 64


def _problem(xp, dt):
    rng = np.random.default_rng(0)
    small = lambda *shape, s=1e-3: xp.asarray((rng.standard_normal(shape) * s).astype(dt))  # noqa: E731
    h = xp.asarray(np.maximum(rng.standard_normal((M, H)) * 1e-4, 0).astype(dt))
    return small(M, D), small(H, D), small(H, D), small(D, H), h, small(H, 8, s=1e-4)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=str)
def test_ffn_calls_ignore_the_callers_underflow_setting(backend, xp, dtype):
    x, wg, wu, wd, _, _ = _problem(xp, dtype)
    dy = xp.full((M, D), 1e-4, dtype)
    with np.errstate(all="raise"):
        y = tw.ffn.gated_forward(x, wg, wu, wd)
        y2 = tw.ffn.GatedFFN(wg, wu, wd)(x)
        tw.ffn.relu_forward(x, wu, wd)
        _, ctx = tw.ffn.gated_forward_train(x, wg, wu, wd, l1=1e-3)
        grads = tw.ffn.gated_backward(ctx, dy)
        _, ctx = tw.ffn.relu_forward_train(x, wu, wd, l1=1e-3)
        tw.ffn.relu_backward(ctx, dy)
    assert y.shape == y2.shape == (M, D) and len(grads) == 4


@pytest.mark.parametrize("cls", [tw.TwELL, tw.ELL, tw.Hybrid])
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=str)
def test_container_calls_ignore_the_callers_underflow_setting(backend, xp, cls, dtype):
    _, _, _, _, h, W = _problem(xp, dtype)
    with np.errstate(all="raise"):
        A = cls.from_dense(h)
        A @ W
        xp.full((3, M), 1e-4, dtype) @ A
        A * 1e-5
        A / 1e5
        A.multiply(xp.full((M, H), 1e-4, dtype))
        A.sum(), A.mean(axis=0)
        A.astype(np.float16)
        ops.spmm(A, W)
        ops.spmm_t(A, xp.full((M, 4), 1e-4, dtype))
        ops.sddmm(xp.full((M, 4), 1e-4, dtype), xp.full((H, 4), 1e-4, dtype), A)
        ops.transpose(A)
    with pytest.raises(FloatingPointError):  # the caller's own code keeps the caller's setting
        with np.errstate(under="raise"):
            np.float32(1e-30) * np.float32(1e-30)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=str)
def test_train_context_h_ignores_the_callers_underflow_setting(backend, xp, dtype):
    """TrainContext.h (gated) forms g * u in the accumulator and rounds it to the value dtype
    outside the decorated forward/backward calls: float16 raised "underflow encountered in cast"."""
    x, wg, wu, wd, _, _ = _problem(xp, dtype)
    _, ctx = tw.ffn.gated_forward_train(x, wg, wu, wd)
    with np.errstate(all="raise"):
        h = ctx.h
        ctx.g, ctx.u
    assert h.shape == (M, H)
