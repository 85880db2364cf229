"""Interop: every public array function takes numpy, torch and jax (and cupy, torch CUDA,
jax GPU on a GPU machine) and answers in the caller's type; bfloat16 crosses bit-exactly;
containers round-trip through components()."""
import subprocess
import sys

import numpy as np
import pytest

import twellpy as tw
from _train_ref import dense_gated, dense_relu
from conftest import rel_err
from twellpy._array import as_array, bfloat16, to_caller

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402


def _jax_gpu():
    try:
        return [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
    except RuntimeError:
        return []


# name -> (convert numpy to this kind, predicate "is this kind")
KINDS = {
    "numpy": (lambda a: a, lambda o: isinstance(o, np.ndarray)),
    "torch": (lambda a: _torch_from_numpy(a, "cpu"), lambda o: isinstance(o, torch.Tensor) and o.device.type == "cpu"),
    "jax": (lambda a: jnp.asarray(a), lambda o: isinstance(o, jax.Array) and o.devices().pop().platform == "cpu"),
    "cupy": (lambda a: _cupy_from_numpy(a), lambda o: type(o).__module__.startswith("cupy")),
    "torch_cuda": (lambda a: _torch_from_numpy(a, "cuda"), lambda o: isinstance(o, torch.Tensor) and o.is_cuda),
    "jax_gpu": (lambda a: jax.device_put(jnp.asarray(a), _jax_gpu()[0]),
                lambda o: isinstance(o, jax.Array) and o.devices().pop().platform in ("gpu", "cuda")),
}
CPU_KINDS = ["numpy", "torch", "jax"]
GPU_KINDS = [pytest.param(k, marks=pytest.mark.gpu) for k in ("cupy", "torch_cuda", "jax_gpu")]


def _cupy_from_numpy(a):
    import cupy

    if a.dtype == bfloat16:  # move the bits, whatever CuPy thinks of bfloat16
        return cupy.asarray(a.view(np.int16)).view(bfloat16)
    return cupy.asarray(a)


def _torch_from_numpy(a, device):
    if a.dtype == bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(a.copy()).to(device)


def _np(o):
    """Any result back to numpy (bf16 bits preserved)."""
    if isinstance(o, torch.Tensor):
        o = o.detach().cpu()
        if o.dtype == torch.bfloat16:
            return o.view(torch.int16).numpy().view(bfloat16)
        return o.numpy()
    if hasattr(o, "get"):
        return o.get()
    return np.asarray(o)


@pytest.fixture(params=CPU_KINDS + GPU_KINDS)
def kind(request):
    k = request.param
    if k == "torch_cuda" and not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    if k == "jax_gpu" and not _jax_gpu():
        pytest.skip("this jax install has no GPU backend")
    return k


def _conv(kind, *arrays):
    return [KINDS[kind][0](a) for a in arrays]


def _assert_kind(kind, *outs):
    for o in outs:
        assert KINDS[kind][1](o), f"expected a {kind} result, got {type(o).__module__}.{type(o).__name__}"


def _same(got, want, kind):
    g = _np(got)
    assert g.shape == want.shape and g.dtype == want.dtype
    if kind in ("numpy", "torch", "jax"):  # same CPU backend: identical bits
        np.testing.assert_array_equal(g, want)
    else:  # GPU kernels: accumulation order differs
        np.testing.assert_allclose(g.astype(np.float64), want.astype(np.float64), rtol=1e-4, atol=1e-5)


def _acts(m=37, n=300, density=0.05, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    a = np.where(rng.random((m, n)) < density, rng.standard_normal((m, n)), 0.0)  # +0.0, not -0.0
    a[5, :260] = 1.5  # a row over any small slots: exercises the backup rows
    return a.astype(dtype)


FORMATS = {
    "twell": lambda x: tw.TwELL.from_dense(x, tile=64, slots=8),
    "ell": lambda x: tw.ELL.from_dense(x),
    "hybrid": lambda x: tw.Hybrid.from_dense(x, width=12),
}


# ---------------------------------------------------------------- plumbing
@pytest.mark.parametrize("src", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("dst", ["numpy", "torch", "jax"])
def test_bfloat16_round_trips_bit_exactly(src, dst):
    rng = np.random.default_rng(0)
    bits = rng.integers(-2**15, 2**15, size=(17, 33), dtype=np.int64).astype(np.int16)
    bits[0, :4] = [0x7FC0, -0x0040, 0x7F80, -0x0080]  # NaN, -NaN payload, +Inf, -Inf
    bits[1, :2] = [0x0001, -0x8000]  # smallest subnormal, -0.0
    ref = bits.view(bfloat16)
    x = KINDS[src][0](ref)
    arr, k = as_array(x, "x")
    assert k == src and arr.dtype == bfloat16
    np.testing.assert_array_equal(arr.view(np.int16), bits)
    out = to_caller(arr, dst if dst != "numpy" else "numpy")
    _assert_kind(dst, out)
    np.testing.assert_array_equal(_np(out).view(np.int16), bits)


def test_zero_copy_where_the_data_allows():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = torch.from_numpy(a)
    arr, _ = as_array(t, "x")
    assert np.shares_memory(arr, a)  # torch CPU -> numpy: no copy
    tb = torch.zeros(3, 5, dtype=torch.bfloat16)
    arr_b, _ = as_array(tb, "x")
    assert arr_b.ctypes.data == tb.data_ptr()  # bf16 through the int16 view: no copy either
    back = to_caller(a, "torch")
    assert back.data_ptr() == a.ctypes.data  # numpy -> torch: no copy
    j = jnp.asarray(a)
    arr_j, _ = as_array(j, "x")
    assert arr_j.ctypes.data == j.unsafe_buffer_pointer()  # jax CPU -> numpy: no copy
    # A transposed torch view keeps its strides (no copy); kernels make it contiguous.
    arr_t, _ = as_array(t.T, "x")
    assert np.shares_memory(arr_t, a) and arr_t.shape == (6, 4)
    # requires_grad tensors are accepted (detached, still no copy)
    g = torch.ones(3, requires_grad=True)
    assert as_array(g, "g")[0].ctypes.data == g.data_ptr()


def test_unsupported_inputs_are_named():
    with pytest.raises(TypeError, match="w must be"):
        as_array(object(), "w")
    with pytest.raises(TypeError, match="x is a torch tensor on meta"):
        as_array(torch.empty(3, device="meta"), "x")
    with pytest.raises(ValueError, match="x must be 2-D"):
        as_array(torch.zeros(3), "x", ndim=2)


class _DLPackOnly:
    """A foreign array type that only speaks the DLPack protocol."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_any_dlpack_producer_is_accepted():
    x, wg, wu, wd, _ = _ffn_problem()
    arr, k = as_array(_DLPackOnly(x), "x")
    assert k == "dlpack" and np.shares_memory(arr, x)
    y = tw.ffn.gated_forward(*[_DLPackOnly(v) for v in (x, wg, wu, wd)])
    assert isinstance(y, np.ndarray)  # generic producers get numpy (itself a DLPack producer)
    np.testing.assert_array_equal(y, tw.ffn.gated_forward(x, wg, wu, wd))
    A = tw.TwELL.from_dense(_DLPackOnly(_acts()), tile=64, slots=8)
    np.testing.assert_array_equal(A.toarray(), _acts())


def test_import_twellpy_imports_no_framework():
    code = ("import sys, twellpy, twellpy.stats, twellpy.ffn, twellpy.ops; "
            "bad = [m for m in ('torch', 'jax', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- containers
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_containers_from_any_array_and_matmul_in_callers_type(kind, fmt):
    a = _acts()
    ref = FORMATS[fmt](a)
    (x,) = _conv(kind, a)
    A = FORMATS[fmt](x)
    assert A.format == fmt and A.shape == a.shape and A.nnz == ref.nnz
    np.testing.assert_array_equal(_np(A.toarray()), a)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 7)).astype(np.float32)
    w2 = rng.standard_normal((5, 37)).astype(np.float32)
    (wk, w2k) = _conv(kind, w, w2)
    y, y2 = A @ wk, w2k @ A
    _assert_kind(kind, y, y2)
    _same(y, ref @ w, kind)
    _same(y2, w2 @ ref, kind)
    # ref @ w is the same call for the numpy kind: hold the products against float64 too
    a64 = a.astype(np.float64)
    assert rel_err(_np(y), a64 @ w) <= 1e-5 and rel_err(_np(y2), w2 @ a64) <= 1e-5
    y3 = A.dot(wk)
    _assert_kind(kind, y3)
    _same(y3, ref @ w, kind)
    assert rel_err(_np(y3), a64 @ w) <= 1e-5
    vals = _conv(kind, np.asarray(_np(A.values)) * 2)[0]
    bk = None if A.backup is None else _conv(kind, np.asarray(_np(A.backup)) * 2)[0]
    np.testing.assert_array_equal(_np(A.with_values(vals, backup=bk).toarray()), 2 * a)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_components_round_trip(kind, fmt):
    a = _acts(dtype=bfloat16)
    A = FORMATS[fmt](_conv(kind, a)[0])
    comp = A.components()
    assert comp["format"] == fmt and tuple(comp["shape"]) == a.shape
    B = type(A).from_components(comp, check="full")
    np.testing.assert_array_equal(_np(B.toarray()).view(np.int16), a.view(np.int16))
    # Another library's arrays (the caller's kind) rebuild the same container.
    foreign = {k: (KINDS[kind][0](_np(v)) if hasattr(v, "shape") and not isinstance(v, tuple) else v)
               for k, v in comp.items()}
    C = tw.SparseArray.from_components(foreign, check="full")
    assert type(C) is type(A) and C.dtype == bfloat16
    np.testing.assert_array_equal(_np(C.toarray()).view(np.int16), a.view(np.int16))
    for k, v in comp.items():
        if hasattr(v, "shape") and not isinstance(v, tuple):
            np.testing.assert_array_equal(_np(C.components()[k]).view(np.uint8), _np(v).view(np.uint8))


# ---------------------------------------------------------------- ops
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_ops_in_callers_type(kind, fmt):
    a = _acts()
    rng = np.random.default_rng(2)
    b = rng.standard_normal((300, 6)).astype(np.float32)
    g = rng.standard_normal((37, 6)).astype(np.float32)
    xs = rng.standard_normal((37, 9)).astype(np.float32)
    ys = rng.standard_normal((300, 9)).astype(np.float32)
    ref = FORMATS[fmt](a)
    A = FORMATS[fmt](_conv(kind, a)[0])
    bk, gk, xk, yk = _conv(kind, b, g, xs, ys)

    # the numpy call of the same function is no reference for the numpy kind (it is
    # the same call): every result is also held against float64
    a64 = a.astype(np.float64)
    out = tw.ops.spmm(A, bk)
    _assert_kind(kind, out)
    _same(out, tw.ops.spmm(ref, b), kind)
    assert rel_err(_np(out), a64 @ b) <= 1e-5
    out_t = tw.ops.spmm_t(A, gk)
    _assert_kind(kind, out_t)
    _same(out_t, tw.ops.spmm_t(ref, g), kind)
    assert rel_err(_np(out_t), a64.T @ g) <= 1e-5
    vec = tw.ops.spmm(A, bk[:, 0])
    _assert_kind(kind, vec)
    assert tuple(vec.shape) == (37,)
    assert rel_err(_np(vec), a64 @ b[:, 0]) <= 1e-5

    S = tw.ops.sddmm(xk, yk, A)
    S_ref = tw.ops.sddmm(xs, ys, ref)
    assert S.format == fmt
    _same(S.toarray(), _np(S_ref.toarray()), kind)
    assert rel_err(_np(S.toarray()), np.where(a != 0, xs.astype(np.float64) @ ys.T, 0.0)) <= 1e-5
    T = tw.ops.transpose(A)
    np.testing.assert_array_equal(_np(T.toarray()), a.T)
    P = tw.ops.multiply(A, A)
    np.testing.assert_allclose(_np(P.toarray()), a * a, rtol=1e-6)


# ---------------------------------------------------------------- ffn
def _ffn_problem(dtype=np.float32, m=23, d=32, h=96, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d))
    x[:, 0] = 1
    wg = rng.standard_normal((h, d)) / np.sqrt(d)
    wg[:, 0] = -0.4
    wu = rng.standard_normal((h, d)) / np.sqrt(d)
    wd = rng.standard_normal((d, h)) / np.sqrt(h)
    dy = rng.standard_normal((m, d))
    return [v.astype(dtype) for v in (x, wg, wu, wd, dy)]


def test_ffn_inference_in_callers_type(kind):
    x, wg, wu, wd, _ = _ffn_problem()
    xk, wgk, wuk, wdk = _conv(kind, x, wg, wu, wd)
    x64, wg64, wu64, wd64 = (v.astype(np.float64) for v in (x, wg, wu, wd))
    y_gated = (np.maximum(x64 @ wg64.T, 0) * (x64 @ wu64.T)) @ wd64.T  # float64 references: the
    y_relu = np.maximum(x64 @ wu64.T, 0) @ wd64.T                      # numpy call is the same call
    for got, want, y64 in (
        (tw.ffn.gated_forward(xk, wgk, wuk, wdk), tw.ffn.gated_forward(x, wg, wu, wd), y_gated),
        (tw.ffn.relu_forward(xk, wuk, wdk), tw.ffn.relu_forward(x, wu, wd), y_relu),
        (tw.ffn.GatedFFN(wgk, wuk, wdk)(xk), tw.ffn.GatedFFN(wg, wu, wd)(x), y_gated),
        (tw.ffn.ReluFFN(wuk, wdk)(xk), tw.ffn.ReluFFN(wu, wd)(x), y_relu),
    ):
        _assert_kind(kind, got)
        _same(got, want, kind)
        assert rel_err(_np(got), y64) <= 1e-5
    y, h = tw.ffn.gated_forward(xk, wgk, wuk, wdk, return_activations=True)
    _assert_kind(kind, y)
    ref_h = np.maximum(x.astype(np.float64) @ wg.T.astype(np.float64), 0) * (x.astype(np.float64) @ wu.T)
    np.testing.assert_array_equal(_np(h.toarray()) != 0, ref_h != 0)
    assert rel_err(_np(h.toarray()), ref_h) <= 1e-5  # the values too, not only the pattern
    # (..., D) inputs keep their leading shape
    y3 = tw.ffn.gated_forward(_conv(kind, x[:22].reshape(2, 11, 32))[0], wgk, wuk, wdk)
    _assert_kind(kind, y3)
    assert tuple(y3.shape) == (2, 11, 32)


def test_ffn_training_in_callers_type(kind):
    x, wg, wu, wd, dy = _ffn_problem()
    xk, wgk, wuk, wdk, dyk = _conv(kind, x, wg, wu, wd, dy)
    # float64 references besides the numpy call (which is the same call for the numpy kind)
    ref_g, ref_r = dense_gated(x, wg, wu, wd, dy, 1e-3), dense_relu(x, wu, wd, dy, 1e-3)
    y, ctx = tw.ffn.gated_forward_train(xk, wgk, wuk, wdk, l1=1e-3)
    y_ref, ctx_ref = tw.ffn.gated_forward_train(x, wg, wu, wd, l1=1e-3)
    _assert_kind(kind, y)
    _same(y, y_ref, kind)
    assert rel_err(_np(y), ref_g["y"]) <= 1e-5
    grads = tw.ffn.gated_backward(ctx, dyk)
    _assert_kind(kind, *grads)
    for g, r, name in zip(grads, tw.ffn.gated_backward(ctx_ref, dy), ("dx", "dw_gate", "dw_up", "dw_down")):
        _same(g, r, kind)
        assert rel_err(_np(g), ref_g[name]) <= 1e-5, name
    y, ctx = tw.ffn.relu_forward_train(xk, wuk, wdk, l1=1e-3)
    y_ref, ctx_ref = tw.ffn.relu_forward_train(x, wu, wd, l1=1e-3)
    _assert_kind(kind, y)
    _same(y, y_ref, kind)
    assert rel_err(_np(y), ref_r["y"]) <= 1e-5
    grads = tw.ffn.relu_backward(ctx, dyk)
    _assert_kind(kind, *grads)
    for g, r, name in zip(grads, tw.ffn.relu_backward(ctx_ref, dy), ("dx", "dw_up", "dw_down")):
        _same(g, r, kind)
        assert rel_err(_np(g), ref_r[name]) <= 1e-5, name


@pytest.mark.parametrize("src", ["numpy", "torch", "jax"])
def test_bfloat16_ffn_and_container_keep_bits_across_frameworks(src):
    x, wg, wu, wd, _ = _ffn_problem(dtype=bfloat16)
    ref = tw.ffn.gated_forward(x, wg, wu, wd)
    got = tw.ffn.gated_forward(*_conv(src, x, wg, wu, wd))
    _assert_kind(src, got)
    np.testing.assert_array_equal(_np(got).view(np.int16), ref.view(np.int16))
    a = _acts(dtype=bfloat16)
    A = tw.TwELL.from_dense(_conv(src, a)[0], tile=64, slots=8)
    np.testing.assert_array_equal(A.toarray().view(np.int16), a.view(np.int16))


def test_stats_accept_every_kind(kind):
    a = _acts()
    want = np.count_nonzero(a, axis=1)
    got = tw.stats.nnz_per_token(_conv(kind, a)[0])
    assert isinstance(got, np.ndarray)  # statistics are small: always numpy
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(tw.stats.tile_occupancy(_conv(kind, a)[0], 64),
                                  tw.stats.tile_occupancy(a, 64))


def test_bad_framework_input_names_the_argument():
    x, wg, wu, wd, _ = _ffn_problem()
    xt, wgt, wut, wdt = _conv("torch", x, wg, wu, wd)
    with pytest.raises(ValueError, match=r"w_gate has shape \(96, 32\), expected \(96, 5\)"):
        tw.ffn.gated_forward(xt, wgt, wut[:, :5], wdt)
    with pytest.raises(TypeError, match="w_up has dtype"):
        tw.ffn.gated_forward_train(*_conv("jax", x, wg), jnp.asarray(wu, dtype=jnp.float16), jnp.asarray(wd))


@pytest.mark.gpu
def test_mixed_devices_are_rejected_by_name():
    # A CUDA weight next to a CPU x is reported, not silently moved.
    x, wg, wu, wd, _ = _ffn_problem()
    wg_cuda = _torch_from_numpy(wg, "cuda") if torch.cuda.is_available() else __import__("cupy").asarray(wg)
    with pytest.raises(ValueError, match="is on"):
        tw.ffn.gated_forward(torch.from_numpy(x), wg_cuda, torch.from_numpy(wu), torch.from_numpy(wd))


@pytest.mark.parametrize("mod,framework", [("twellpy.torch", "torch"), ("twellpy.jax", "jax")])
def test_adapter_without_its_framework_says_what_to_install(mod, framework):
    code = (f"import sys; sys.modules[{framework!r}] = None\n"
            f"try:\n    import {mod}\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert f"{mod} needs" in out
