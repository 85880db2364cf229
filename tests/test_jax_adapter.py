"""twellpy.jax: custom_vjp wrappers against JAX's own autodiff (eager and jit)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import twellpy.jax as twj  # noqa: E402
from twellpy._array import bfloat16  # noqa: E402


@pytest.fixture
def x64():
    """float64 inside the test only (jax's x64 switch is global state)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # older jax keeps it in jax.experimental
        from jax.experimental import enable_x64 as enable
    with enable(True):
        yield


def _problem(m_shape, d, h, dtype=np.float64, seed=0, sigma=0.3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(m_shape + (d,)) * np.exp(sigma * rng.standard_normal(m_shape + (1,)))
    x[..., 0] = 1.0
    wg = rng.standard_normal((h, d)) / np.sqrt(d)
    wg[:, 0] = -0.3  # sparser gate
    wu = rng.standard_normal((h, d)) / np.sqrt(d)
    wd = rng.standard_normal((d, h)) / np.sqrt(h)
    dy = rng.standard_normal(m_shape + (d,))
    return [jnp.asarray(a.astype(dtype)) for a in (x, wg, wu, wd, dy)]


def _ref_gated(l1):
    def f(x, wg, wu, wd):
        h = jax.nn.relu(x @ wg.T) * (x @ wu.T)
        m = int(np.prod(x.shape[:-1]))
        return h @ wd.T, l1 * jnp.abs(h).sum() / m
    return f


def _ref_relu(l1):
    def f(x, wu, wd):
        h = jax.nn.relu(x @ wu.T)
        m = int(np.prod(x.shape[:-1]))
        return h @ wd.T, l1 * jnp.abs(h).sum() / m
    return f


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _check_grads(ours, ref, args, dy, tol, jit):
    def loss_ours(*a):
        return jnp.vdot(ours(*a), dy)

    def loss_ref(*a):
        y, pen = ref(*a)
        return jnp.vdot(y, dy) + pen

    argnums = tuple(range(len(args)))
    g = jax.grad(loss_ours, argnums=argnums)
    if jit:
        g = jax.jit(g)
    got = g(*args)
    want = jax.grad(loss_ref, argnums=argnums)(*args)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert _rel(a, b) < tol, (i, _rel(a, b))
    y = (jax.jit(ours) if jit else ours)(*args)
    assert isinstance(y, jax.Array)
    assert _rel(y, ref(*args)[0]) < tol


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("l1", [0.0, 0.07])
@pytest.mark.parametrize("m_shape", [(11,), (2, 6), (1,)])
def test_gated_ffn_grads_match_jax(x64, m_shape, l1, jit):
    x, wg, wu, wd, dy = _problem(m_shape, 16, 64)
    _check_grads(lambda *a: twj.gated_ffn(*a, l1=l1), _ref_gated(l1), (x, wg, wu, wd), dy, 1e-10, jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("l1", [0.0, 0.05])
def test_relu_ffn_grads_match_jax(x64, l1, jit):
    x, wg, _, wd, dy = _problem((3, 5), 12, 40)
    _check_grads(lambda *a: twj.relu_ffn(*a, l1=l1), _ref_relu(l1), (x, wg, wd), dy, 1e-10, jit)


def test_float32_and_bfloat16():
    # the reference runs in float64 on the exact inputs (it was JAX's float32 GEMMs), and
    # the gradients get the outputs' tolerance (4x it let bfloat16 gradients off by 8% pass;
    # measured: y 1.7e-3, gradients 3.4e-3 in bfloat16, 1.6e-7 in float32)
    for dtype, tol in ((np.float32, 1e-5), (bfloat16, 1e-2)):
        x, wg, wu, wd, dy = _problem((9,), 32, 128, dtype=dtype)
        y = twj.gated_ffn(x, wg, wu, wd, l1=0.01)
        assert y.dtype == x.dtype
        grads = jax.grad(lambda *a: jnp.vdot(twj.gated_ffn(*a, l1=0.01), dy).astype(jnp.float32),
                         argnums=(0, 1, 2, 3))(x, wg, wu, wd)
        enable = getattr(jax, "enable_x64", None)
        if enable is None:  # older jax keeps it in jax.experimental
            from jax.experimental import enable_x64 as enable
        with enable(True):
            ref = [jnp.asarray(np.asarray(a.astype(jnp.float32)), jnp.float64) for a in (x, wg, wu, wd, dy)]
            y_ref = _ref_gated(0.01)(*ref[:4])[0]
            want = jax.grad(lambda *a: (lambda y, p: jnp.vdot(y, ref[4]) + p)(*_ref_gated(0.01)(*a)),
                            argnums=(0, 1, 2, 3))(*ref[:4])
            assert y_ref.dtype == jnp.float64 and all(b.dtype == jnp.float64 for b in want)
            assert _rel(y.astype(jnp.float32), y_ref) < tol
            for a, b in zip(grads, want):
                assert a.dtype == x.dtype
                assert _rel(a.astype(jnp.float32), b) < tol


def test_evicted_context_is_recomputed(x64, monkeypatch):
    # With no room in the cache the backward recomputes the forward step: same gradients.
    x, wg, wu, wd, dy = _problem((7,), 8, 32)
    loss = lambda *a: jnp.vdot(twj.gated_ffn(*a, l1=0.1), dy)  # noqa: E731
    full = jax.grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    monkeypatch.setattr(twj, "CTX_CACHE_SIZE", 0)
    again = jax.grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    for a, b in zip(full, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(twj._ctx_cache) == 0


def test_backward_frees_context_and_reports_stats(x64):
    x, wg, wu, wd, dy = _problem((10,), 8, 32)
    before = len(twj._ctx_cache)
    jax.grad(lambda *a: jnp.vdot(twj.gated_ffn(*a, l1=0.2), dy))(x, wg, wu, wd)
    assert len(twj._ctx_cache) == before
    st = twj.last_stats()
    h = np.maximum(np.asarray(x @ wg.T), 0) * np.asarray(x @ wu.T)
    assert st["l0"] == pytest.approx((h != 0).sum() / 10)
    assert st["l1"] == pytest.approx(0.2 * np.abs(h).sum() / 10, rel=1e-10)


def test_bad_input():
    x, wg, wu, wd, _ = _problem((4,), 8, 16, dtype=np.float32)
    with pytest.raises(ValueError, match="l1"):
        twj.gated_ffn(x, wg, wu, wd, l1=-1.0)
    with pytest.raises(TypeError, match="l1"):
        jax.jit(lambda l1: twj.gated_ffn(x, wg, wu, wd, l1=l1))(0.1)
    with pytest.raises(TypeError, match="w_up has dtype"):
        twj.gated_ffn(x, wg, wu.astype(jnp.float16), wd)
    with pytest.raises(ValueError, match="w_down has shape"):
        twj.gated_ffn(x, wg, wu, wd.T)
    with pytest.raises(ValueError, match="x must have shape"):
        twj.relu_ffn(x[:, :3], wu, wd)


@pytest.mark.gpu
def test_gpu_arrays_eager_and_jit():
    gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
    if not gpus:
        pytest.skip("this jax install has no GPU backend")
    x, wg, wu, wd, dy = [jax.device_put(a, gpus[0]) for a in _problem((50,), 64, 256, dtype=np.float32)]
    # On GPUs jax's default float32 matmul precision is TF32 (~1e-3 relative);
    # the reference must use true float32 products.
    with jax.default_matmul_precision("highest"):
        ref = _gpu_ref_grads(x, wg, wu, wd, dy)
    for fn in (lambda g: g, jax.jit):
        got = fn(jax.grad(lambda *a: jnp.vdot(twj.gated_ffn(*a, l1=1e-3), dy), argnums=(0, 1, 2, 3)))(
            x, wg, wu, wd)
        for a, b in zip(got, ref):
            assert _rel(a, b) < 1e-4


def _gpu_ref_grads(x, wg, wu, wd, dy):
    return jax.grad(lambda *a: (lambda y, p: jnp.vdot(y, dy) + p)(*_ref_gated(1e-3)(*a)),
                    argnums=(0, 1, 2, 3))(x, wg, wu, wd)


def test_vmap_runs_one_call_per_element(x64):
    x, wg, wu, wd, dy = _problem((3, 5), 8, 32)
    wgs = jnp.stack([wg, wg * 0.9, wg * 1.1])  # a different gate per batch element

    def ours(xb, wgb):
        return jnp.vdot(twj.gated_ffn(xb, wgb, wu, wd, l1=0.1), dy[0])

    def ref(xb, wgb):
        y, pen = _ref_gated(0.1)(xb, wgb, wu, wd)
        return jnp.vdot(y, dy[0]) + pen

    got = jax.vmap(jax.grad(ours, argnums=(0, 1)))(x, wgs)
    want = jax.vmap(jax.grad(ref, argnums=(0, 1)))(x, wgs)
    for a, b in zip(got, want):
        assert a.shape == b.shape and _rel(a, b) < 1e-10
