"""Edge cases of the FFN front ends, the training step and the ops primitives.

Each test compares with a float64 numpy reference; the cuda variants (gpu
marker) repeat the CPU checks on the device.
"""
import ctypes

import numpy as np
import pytest

import twellpy as tw
from twellpy import ops
from twellpy._array import bfloat16

from _train_ref import dense_gated, dense_relu, f64, to_gpu


def _on(backend, *arrays):
    """The arrays on the backend's device (numpy for 'cpu')."""
    if backend == "cuda":
        return tuple(to_gpu(np.ascontiguousarray(a)) for a in arrays)
    return arrays


# ---------------------------------------------------------------------------
# 1. an inactive neuron contributes exactly nothing, in backup rows too
# ---------------------------------------------------------------------------
def _dead_neuron_problem(dtype):
    """x > 0 everywhere; neuron 2 never fires (w_gate row -1), neuron 3 fires in row 0 only."""
    x = np.array([[1., 2., 1.], [1., 1., .5], [2., 1., 1.], [1., 3., 2.]])
    wg = np.array([[1., 1., 1.], [1., .5, .2], [-1., -1., -1.], [-1., 2., -2.5]])
    wu = np.array([[1., 0., .5], [0., 1., -1.], [2., 1., 0.], [.5, .5, .5]])
    wd = np.array([[1., 0., 3., 1.], [0., 1., -2., 1.], [1., 1., 1., 1.]])
    dy = np.array([[1., -1., .5], [2., 1., 1.], [-1., .5, 1.], [1., 1., 1.]])
    return tuple(a.astype(dtype) for a in (x, wg, wu, wd, dy))


def _rows_close(got, ref, dtype):
    got = f64(got)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), (got, ref)
    fin = np.isfinite(ref)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(got[fin], ref[fin], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("width", [8, 1, 2, "auto"])
@pytest.mark.parametrize("bad", ["up_nan", "up_inf", "gate_inf", "down_nan"])
def test_inactive_neuron_nonfinite_weights_do_not_reach_backup_rows(backend, dtype, width, bad):
    x, wg, wu, wd, dy = _dead_neuron_problem(dtype)
    # the reference sees finite weights: neuron 2 never fires, so they must not matter
    ref = dense_gated(x, wg, wu, wd, dy, 0.0)
    assert ref["neuron_counts"][2] == 0
    if bad == "up_nan":
        wu[2] = np.nan
    elif bad == "up_inf":
        wu[2] = [np.inf, -np.inf, np.inf]
    elif bad == "gate_inf":
        wg[2] = -np.inf  # z = -inf: still inactive
    else:
        wd[:, 2] = np.nan
    args = _on(backend, x, wg, wu, wd)
    y, ctx = tw.ffn.gated_forward_train(*args, width=width, check_finite=False)
    if width == 1:
        assert ctx.R >= 3  # most rows are backup rows
    dx, dwg, dwu, dwd = tw.ffn.gated_backward(ctx, _on(backend, dy)[0])
    _rows_close(y, ref["y"], dtype)
    _rows_close(dx, ref["dx"], dtype)
    # the weight gradients of the dead neuron are exactly 0, the others match
    for got, name in ((dwg, "dw_gate"), (dwu, "dw_up")):
        _rows_close(got, ref[name], dtype)
    _rows_close(dwd, ref["dw_down"], dtype)


@pytest.mark.parametrize("width", [8, 1])
def test_nonfinite_weight_reaches_only_the_rows_where_the_neuron_fires(backend, width):
    x, wg, wu, wd, dy = _dead_neuron_problem(np.float64)
    ref = dense_gated(x, wg, wu, wd, dy, 0.0)
    fires = np.flatnonzero(f64(x) @ f64(wg)[3] > 0)
    assert fires.tolist() == [0]
    wu[3] = np.nan  # neuron 3 fires in row 0 only
    y, ctx = tw.ffn.gated_forward_train(*_on(backend, x, wg, wu, wd), width=width, check_finite=False)
    dx = tw.ffn.gated_backward(ctx, _on(backend, dy)[0])[0]
    for got, want in ((y, ref["y"]), (dx, ref["dx"])):
        got = f64(got)
        assert np.isnan(got[0]).all()
        np.testing.assert_allclose(got[1:], want[1:], rtol=1e-12)


@pytest.mark.parametrize("width", [8, 1])
@pytest.mark.parametrize("bad", ["up_inf", "down_nan"])
def test_relu_inactive_neuron_nonfinite_weights(backend, width, bad):
    x, _, wu, wd, dy = _dead_neuron_problem(np.float64)
    wu[2] = [-1., -1., -1.]  # never fires on x > 0
    ref = dense_relu(x, wu, wd, dy, 0.0)
    assert ref["neuron_counts"][2] == 0
    if bad == "up_inf":
        wu[2] = -np.inf
    else:
        wd[:, 2] = np.nan
    y, ctx = tw.ffn.relu_forward_train(*_on(backend, x, wu, wd), width=width, check_finite=False)
    dx, dwu, dwd = tw.ffn.relu_backward(ctx, _on(backend, dy)[0])
    for got, name in ((y, "y"), (dx, "dx"), (dwu, "dw_up"), (dwd, "dw_down")):
        _rows_close(got, ref[name], np.float64)


def test_reviewer_repro_gradient_does_not_depend_on_width():
    x = np.array([[1., 2.], [1., 1.], [2., 1.]])
    dy = np.ones((3, 2))
    wg = np.array([[1., 1.], [1., .5], [-1., -1.]])
    wu = np.array([[1., 0.], [0., 1.], [np.nan, np.nan]])
    wd = np.eye(2, 3)
    # neuron 2 never fires (x > 0, w_gate row < 0): the float64 reference may use any
    # finite w_up row for it, and every gradient must match that reference
    assert (x @ wg[2] < 0).all()
    ref = dense_gated(x, wg, np.where(np.isnan(wu), 0.0, wu), wd, dy, 0.0)
    out = []
    for w in (8, 1):
        y, ctx = tw.ffn.gated_forward_train(x, wg, wu, wd, width=w, check_finite=False)
        if w == 1:
            assert ctx.R >= 1  # the backup-row path is taken
        grads = tw.ffn.gated_backward(ctx, dy)
        np.testing.assert_allclose(y, ref["y"], rtol=1e-12, atol=1e-12)
        for got, name in zip(grads, ("dx", "dw_gate", "dw_up", "dw_down")):
            assert np.isfinite(got).all(), (w, name)
            np.testing.assert_allclose(got, ref[name], rtol=1e-12, atol=1e-12, err_msg=f"width={w} {name}")
        out.append(grads[0])
    np.testing.assert_array_equal(out[0], out[1])


def test_spmm_backup_rows_skip_nonfinite_rows_of_b(backend):
    """ops.spmm: a NaN row of B meets only the rows that store that column."""
    a = np.array([[1., 2., 0., 3.], [0., 0., 1., 0.], [4., 0., 0., 5.]])
    b = np.array([[1., 2.], [3., 4.], [np.nan, np.nan], [5., 6.]])
    A = tw.Hybrid.from_dense(_on(backend, a)[0], width=1)
    assert A.n_backup == 2
    got = f64(ops.spmm(A, _on(backend, b)[0]))
    want = np.nan_to_num(a) @ np.where(np.isnan(b), 0, b)
    want[1] = np.nan
    _rows_close(got, want, np.float64)


_EXACT_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"
extern "C" {
#define EXACT(SUFFIX, T, DUAL)                                                                          \
void exact_##SUFFIX(typename twellpy::accum<T>::type* out, const T* g, const T* a, const T* a2, const T* b, \
                    const T* b2, int R, int H, int D, int grid) {                                      \
    emu::launch(twellpy_train_backup_exact<T, DUAL>, dim3(grid), dim3(256), 0, out, g, a, a2, b, b2, R, H, D); \
}
EXACT(f32_0, float, 0)
EXACT(f32_1, float, 1)
EXACT(bf16_1, __nv_bfloat16, 1)
EXACT(f64_1, double, 1)
}
"""


@pytest.fixture(scope="module")
def exact_lib(tmp_path_factory):
    emu = pytest.importorskip("test_kernel_emulation")
    return emu._build(tmp_path_factory, "train_ffn.cu", _EXACT_HARNESS, {})


@pytest.mark.parametrize("dtype,suffix,dual", [(np.float32, "f32", False), (np.float32, "f32", True),
                                               (bfloat16, "bf16", True), (np.float64, "f64", True)])
@pytest.mark.parametrize("grid", [1, 3])
def test_backup_exact_kernel_emulated(exact_lib, dtype, suffix, dual, grid):
    """twellpy_train_backup_exact on the CPU emulator against its numpy twin and a float64 reference."""
    from twellpy.backends import cpu_train

    dtype = np.dtype(dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    rng = np.random.default_rng(7 + grid)
    R, H, D = 5, 40, 300  # D > 256: every thread owns two columns
    g = np.maximum(rng.standard_normal((R, H)), 0)
    g[:, 3] = 0          # neuron 3 is inactive everywhere, neuron 5 only in row 1
    g[:, 5] = 0
    g[1, 5] = 1.0
    a = np.where(g != 0, rng.standard_normal((R, H)), 0)
    a2 = np.where(g != 0, rng.standard_normal((R, H)), 0)
    b = rng.standard_normal((H, D))
    b2 = rng.standard_normal((H, D))
    b[3] = np.nan        # never reaches a row
    b2[3, ::2] = np.inf
    b[5, 7] = np.nan     # reaches row 1 only, column 7
    g, a, a2, b, b2 = (np.ascontiguousarray(v.astype(dtype)) for v in (g, a, a2, b, b2))
    with np.errstate(invalid="ignore"):
        out = f64(a) @ f64(b) + (f64(a2) @ f64(b2) if dual else 0)
    ref = np.zeros((R, D))
    for r in range(R):
        on = f64(g[r]) != 0
        ref[r] = f64(a[r, on]) @ f64(b[on]) + (f64(a2[r, on]) @ f64(b2[on]) if dual else 0)
    assert np.isnan(out).any(axis=1).all()  # the GEMM's 0 * NaN poisons every row
    out[2] = ref[2]
    out[2, 0] = ref[2, 0] = 123.0  # a finite row is taken as it is (one read), even if wrong
    out = out.astype(acc)
    got = out.copy()
    fn = getattr(exact_lib, f"exact_{suffix}_{int(dual)}")
    p = lambda v: ctypes.c_void_p(v.ctypes.data)  # noqa: E731
    fn(p(got), p(g), p(a), p(a2 if dual else a), p(b), p(b2 if dual else b), R, H, D, grid)
    twin = cpu_train.backup_exact(out.copy(), g, a, b, a2 if dual else None, b2 if dual else None)
    for res in (got, twin):
        assert np.array_equal(np.isnan(res), np.isnan(ref))
        fin = np.isfinite(ref)
        np.testing.assert_allclose(res[fin], ref[fin], rtol=1e-12 if acc == np.float64 else 2e-5, atol=1e-5)
    assert np.isnan(got[1, 7]) and np.isfinite(np.delete(got[1], 7)).all()


# ---------------------------------------------------------------------------
# 2. torch: in-place changes between forward and backward raise, as in torch
# ---------------------------------------------------------------------------
def _torch_problem(torch, gated=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.float64, generator=g)
    ws = [torch.randn(16, 8, dtype=torch.float64, generator=g) / 3 for _ in range(2 if gated else 1)]
    wd = torch.randn(8, 16, dtype=torch.float64, generator=g) / 3
    return x, [w.requires_grad_() for w in ws] + [wd.requires_grad_()]


def _torch_ffn(twt, torch, x, ws, native):
    if native:
        if len(ws) == 3:
            return (torch.relu(x @ ws[0].T) * (x @ ws[1].T)) @ ws[2].T
        return torch.relu(x @ ws[0].T) @ ws[1].T
    fn = twt.sparse_gated_ffn if len(ws) == 3 else twt.sparse_relu_ffn
    return fn(x, *ws)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("which", ["x", "weight"])
def test_torch_inplace_change_after_forward_raises(gated, native, which):
    torch = pytest.importorskip("torch")
    import twellpy.torch as twt

    x0, ws = _torch_problem(torch, gated)
    x = x0.clone().requires_grad_()
    x_in = x * 1.0  # a non-leaf, so it may be changed in place
    y = _torch_ffn(twt, torch, x_in, ws, native)
    with torch.no_grad():
        (x_in if which == "x" else ws[-1]).mul_(2)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


@pytest.mark.parametrize("gated", [True, False])
def test_torch_gradients_without_inplace_change_match_float64(gated):
    torch = pytest.importorskip("torch")
    import twellpy.torch as twt

    x0, ws = _torch_problem(torch, gated)
    x = x0.clone().requires_grad_()
    _torch_ffn(twt, torch, x, ws, False).sum().backward()
    got = [x.grad] + [w.grad for w in ws]
    dy = np.ones((6, 8))
    arrs = [w.detach().numpy() for w in ws]
    if gated:
        ref = dense_gated(x0.numpy(), *arrs, dy, 0.0)
        names = ["dx", "dw_gate", "dw_up", "dw_down"]
    else:
        ref = dense_relu(x0.numpy(), *arrs, dy, 0.0)
        names = ["dx", "dw_up", "dw_down"]
    for g, n in zip(got, names):
        np.testing.assert_allclose(g.numpy(), ref[n], rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------
# 3. GatedFFN / ReluFFN keep their own copies of every weight
# ---------------------------------------------------------------------------
def _ffn_ref(x, wg, wu, wd):
    x, wu, wd = f64(x), f64(wu), f64(wd)
    if wg is None:
        return np.maximum(x @ wu.T, 0) @ wd.T
    return (np.maximum(x @ f64(wg).T, 0) * (x @ wu.T)) @ wd.T


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_ffn_object_ignores_later_changes_of_the_weights(backend, dtype, order, gated, mode):
    rng = np.random.default_rng(3)
    D, H = 8, 32
    x = rng.standard_normal((5, D)).astype(dtype)
    ws = [np.asarray(rng.standard_normal(s) / 2, dtype=dtype, order=order)
          for s in ([(H, D)] if gated else []) + [(H, D), (D, H)]]
    want = _ffn_ref(x, *(ws if gated else [None] + ws))
    if backend == "cuda":
        import cupy as cp

        dev = [cp.asarray(w, order=order) for w in ws]
        xd = cp.asarray(x)
    else:
        dev, xd = ws, x
    ffn = tw.ffn.GatedFFN(*dev) if gated else tw.ffn.ReluFFN(*dev)
    for w, f in zip(dev, (-1, 2, 3)):
        w *= f  # in place, after construction
    got = f64(ffn(xd, mode=mode))
    tol = 2e-2 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------
# 4. ctx.stats reads as values under every mapping protocol
# ---------------------------------------------------------------------------
def test_stats_mapping_protocols_see_values(backend):
    x, wg, wu, wd, _ = _dead_neuron_problem(np.float64)
    l1 = 0.5
    ref = dense_gated(x, wg, wu, wd, np.zeros_like(x), l1)["l1"]
    _, ctx = tw.ffn.gated_forward_train(*_on(backend, x, wg, wu, wd), l1=l1)
    st = ctx.stats
    views = {"dict": dict(st), "star": {**st}, "copy": st.copy(), "items": dict(st.items()),
             "values": dict(zip(st.keys(), st.values()))}
    for name, d in views.items():
        assert isinstance(d["l1"], float), name
        assert d["l1"] == pytest.approx(ref, rel=1e-12), name
    assert st.get("l1") == pytest.approx(ref, rel=1e-12)
    assert "l1" in st and len(st) == len(views["dict"])
    assert "<function" not in repr(st)
    with pytest.raises(TypeError):
        st["l1"] = 0.0  # read-only


def test_torch_stats_out_and_last_stats_are_values():
    torch = pytest.importorskip("torch")
    import twellpy.torch as twt

    mlp = twt.SparseGatedMLP(8, 16, l1=0.1).double()
    mlp(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
    assert isinstance(dict(mlp.last_stats)["l1"], float)
    out = []
    x0, ws = _torch_problem(torch)
    twt.sparse_gated_ffn(x0, *ws, l1=0.1, stats_out=out)
    assert isinstance({**out[0]}["l1"], float)


# ---------------------------------------------------------------------------
# 6. the documented CPU chunking matches the code
# ---------------------------------------------------------------------------
def test_cpu_auto_chunking_documented_as_coded():
    from twellpy import _ffn_infer
    from twellpy.backends import cpu_ffn

    doc = " ".join(_ffn_infer.__doc__.split())
    assert f"each chunk of {cpu_ffn.CHUNK_ROWS} rows" in doc
    assert f"first {cpu_ffn.SAMPLE_ROWS} rows" in doc
    assert f"``{cpu_ffn.AUTO_DENSITY} * H``" in doc


# ---------------------------------------------------------------------------
# 7. argument validation and messages
# ---------------------------------------------------------------------------
def test_train_check_finite_is_validated(backend):
    x, wg, wu, wd, dy = _dead_neuron_problem(np.float64)
    args = _on(backend, x, wg, wu, wd)
    with pytest.raises(ValueError, match="check_finite must be True, False or 'sync'"):
        tw.ffn.gated_forward_train(*args, check_finite="no")
    with pytest.raises(TypeError, match="check_finite"):
        tw.ffn.gated_forward_train(*args, check_finite=None)
    with pytest.raises(ValueError, match="check_finite"):
        tw.ffn.relu_forward_train(*args[:1], *args[2:], check_finite="off")
    bad = _on(backend, np.where(np.arange(3) == 1, np.nan, x))[0]
    for flag in (True, "sync", 1):
        with pytest.raises(ValueError, match="NaN"):
            tw.ffn.gated_forward_train(bad, *args[1:], check_finite=flag)
    y, _ = tw.ffn.gated_forward_train(*args, check_finite=0)
    np.testing.assert_allclose(f64(y), dense_gated(x, wg, wu, wd, dy, 0.0)["y"], rtol=1e-12)


@pytest.mark.parametrize("l1", ["0.1", True, np.True_, b"1"])
def test_train_l1_must_be_a_real_number(backend, l1):
    x, wg, wu, wd, _ = _dead_neuron_problem(np.float64)
    with pytest.raises(TypeError, match="l1 must be a real number"):
        tw.ffn.gated_forward_train(*_on(backend, x, wg, wu, wd), l1=l1)


def test_train_l1_accepts_numpy_scalars(backend):
    x, wg, wu, wd, dy = _dead_neuron_problem(np.float64)
    _, ctx = tw.ffn.gated_forward_train(*_on(backend, x, wg, wu, wd), l1=np.float32(0.25))
    assert ctx.stats["l1"] == pytest.approx(dense_gated(x, wg, wu, wd, dy, 0.25)["l1"], rel=1e-7)


def test_cpu_heavy_limit_setter_raises_like_other_cuda_tunables():
    x, wg, wu, wd, _ = _dead_neuron_problem(np.float64)
    ffn = tw.ffn.GatedFFN(wg, wu, wd)
    assert ffn.heavy_limit is None
    for name, value in (("heavy_limit", 5), ("heavy_limit", None), ("auto_probe", "always")):
        with pytest.raises(AttributeError, match="CUDA backend only"):
            setattr(ffn, name, value)


@pytest.mark.gpu
def test_cuda_heavy_limit_setter_still_works():
    x, wg, wu, wd, _ = _dead_neuron_problem(np.float64)
    ffn = tw.ffn.GatedFFN(*_on("cuda", wg, wu, wd))
    ffn.heavy_limit = 2
    assert ffn.heavy_limit == 2
    np.testing.assert_allclose(f64(ffn(_on("cuda", x)[0])), _ffn_ref(x, wg, wu, wd), rtol=1e-12)


def test_auto_threshold_rejects_nan(backend):
    _, wg, wu, wd, _ = _dead_neuron_problem(np.float64)
    ffn = tw.ffn.GatedFFN(*_on(backend, wg, wu, wd))
    before = ffn.auto_threshold
    with pytest.raises(ValueError, match="^auto_threshold must not be NaN"):
        ffn.auto_threshold = float("nan")
    for bad in ("3", b"3", True, np.True_):
        with pytest.raises(TypeError, match=r"^auto_threshold must be a real number, got "):
            ffn.auto_threshold = bad
    assert ffn.auto_threshold == before
    ffn.auto_threshold = 2
    assert ffn.auto_threshold == 2.0


@pytest.mark.parametrize("fmt,kw", [("hybrid", ({"width": 1}, {"width": 2})),
                                    ("twell", ({"tile": 2, "slots": 1}, {"tile": 2, "slots": 2}))])
def test_multiply_names_layout_difference(backend, fmt, kw):
    a = np.array([[1., 2, 3, 4], [0, 5, 0, 0], [6, 0, 0, 7]])
    cls = tw.Hybrid if fmt == "hybrid" else tw.TwELL
    A = cls.from_dense(_on(backend, a)[0], **kw[0])
    B = cls.from_dense(_on(backend, a)[0], **kw[1])
    with pytest.raises(ValueError, match=r"different layouts .*asformat") as e:
        ops.multiply(A, B)
    assert "backup rows" in str(e.value)
    C = ops.multiply(A, B.asformat(fmt, **kw[0]))
    np.testing.assert_array_equal(f64(C.toarray()), a * a)


def test_torch_dtype_mismatch_hint_is_torch_like():
    torch = pytest.importorskip("torch")
    x0, ws = _torch_problem(torch)
    ws32 = [w.detach().float() for w in ws]
    with pytest.raises(TypeError, match=r"x\.to\(torch\.float32\)"):
        tw.ffn.gated_forward(x0, *ws32)
    with pytest.raises(TypeError, match=r"x\.astype\('float32'\)"):
        tw.ffn.gated_forward(x0.numpy(), *[w.numpy() for w in ws32])


def test_inference_with_requires_grad_tensor_warns_once(monkeypatch):
    torch = pytest.importorskip("torch")
    from twellpy import _ffn_infer

    monkeypatch.setattr(_ffn_infer, "_AUTOGRAD_WARNED", [False])
    x0, ws = _torch_problem(torch)
    w = [t.detach() for t in ws]
    with torch.no_grad():  # no gradients recorded: nothing to warn about
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tw.ffn.gated_forward(x0.clone().requires_grad_(), *w)
    with pytest.warns(UserWarning, match="twellpy.torch") as rec:
        y = tw.ffn.gated_forward(x0.clone().requires_grad_(), *w)
        tw.ffn.gated_forward(x0, *ws)  # weights that require grad: already warned
    assert len(rec) == 1 and y.grad_fn is None
    np.testing.assert_allclose(y.numpy(), _ffn_ref(x0.numpy(), *[t.numpy() for t in w]), rtol=1e-12)


# ---------------------------------------------------------------------------
# 5. sddmm on backup rows: the documented behaviour (dense rows store no zeros)
# ---------------------------------------------------------------------------
def test_sddmm_backup_rows_combine_with_pattern_before_transpose(backend):
    g = np.array([[1., 2, 3, 4], [0, 5, 0, 0], [6, 0, 0, 7]])
    G = tw.Hybrid.from_dense(_on(backend, g)[0], width=1)
    dy = np.array([[0.], [1], [1]])
    W = np.ones((4, 1))
    dh = ops.sddmm(*_on(backend, dy, W), G)
    want = np.where(g != 0, dy @ W.T, 0)
    np.testing.assert_array_equal(f64(dh.toarray()), want)
    prod = ops.multiply(dh, G)  # same slots and backup rows: allowed
    np.testing.assert_array_equal(f64(ops.transpose(prod).toarray()), (want * g).T)
    E = tw.ELL.from_dense(_on(backend, g)[0])
    assert ops.sddmm(*_on(backend, dy, W), E).nnz == G.nnz  # slots keep exact zeros


@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=str)
def test_overflow_backup_rows_hold_no_negative_zero(xp, dtype):
    """The FFN packers' overflow rows (backends.overflow_rows_to_backup) become dense backup
    rows; a -0.0 there is a zero, which the slots never store, so the backup row must hold
    +0.0, as every container's backup does (dense_backup_rows). It kept the sign bit."""
    from twellpy import backends

    h = np.zeros((3, 8), np.float32)
    h[1] = [1.0, -0.0, 2.0, -0.0, 3.0, 0.0, -4.0, -0.0]   # row 1 overflows 2 slots
    h[2, 0] = -0.0
    h = xp.asarray(h.astype(dtype))
    values = xp.ones((3, 1, 2), dtype)
    indices = xp.zeros((3, 1, 2), np.int32)
    counts = xp.asarray(np.array([[0], [2], [0]], np.int32))
    row_max = xp.asarray(np.array([0, 4, 0], np.int32))
    backup, rows = backends.overflow_rows_to_backup(xp, h, values, indices, counts, row_max, 2)
    host = backup.get() if hasattr(backup, "get") else backup
    assert rows.tolist() == [1] and host.dtype == np.dtype(dtype)
    h32 = host.astype(np.float32)
    assert not np.signbit(h32[h32 == 0]).any(), "a backup row kept -0.0"
    np.testing.assert_array_equal(host.astype(np.float32), [[1.0, 0.0, 2.0, 0.0, 3.0, 0.0, -4.0, 0.0]])
    assert int(counts[1, 0]) == 0 and int(indices[1, 0, 0]) == -1 and float(values[1, 0, 0]) == 0.0
