"""Review of the CPU interop path: torch tensors and other array kinds given to twellpy."""
import numpy as np
import pytest

import twellpy as tw
from twellpy import ffn

torch = pytest.importorskip("torch")


class _UserTensor(torch.Tensor):
    """A torch.Tensor subclass defined outside the torch package."""


def _dense(seed=0, m=8, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(m, n, generator=g) - 0.5)


def _ffn_ref(x, wg, wu, wd):
    x, wg, wu, wd = (np.asarray(t.detach().double()) for t in (x, wg, wu, wd))
    return (np.maximum(x @ wg.T, 0) * (x @ wu.T)) @ wd.T


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_subclass_from_dense_and_matmul_are_torch(dtype):
    dt = getattr(torch, dtype)
    h = _dense().to(dt)
    A = tw.TwELL.from_dense(h.as_subclass(_UserTensor))
    np.testing.assert_array_equal(A.toarray().astype(np.float64), h.double().numpy())
    w = torch.randn(16, 3, dtype=dt, requires_grad=True).as_subclass(_UserTensor)
    y = A @ w
    assert isinstance(y, torch.Tensor)
    ref = h.double().numpy() @ w.detach().double().numpy()
    np.testing.assert_allclose(y.double().numpy(), ref, rtol=2e-2, atol=2e-2)


def test_torch_subclass_gated_forward_returns_torch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g)
    wg, wu = torch.randn(2, 32, 8, generator=g) / 3
    wd = torch.randn(8, 32, generator=g) / 5
    y = ffn.gated_forward(x.as_subclass(_UserTensor), wg, wu, wd)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == (6, 8)
    np.testing.assert_allclose(y.double().numpy(), _ffn_ref(x, wg, wu, wd), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "complex32"])
def test_torch_dtype_without_numpy_equivalent_names_argument(dtype):
    t = torch.zeros(4, 4).to(getattr(torch, dtype))
    with pytest.raises(TypeError, match=r"\bx\b.*float32"):
        tw.TwELL.from_dense(t)
    with pytest.raises(TypeError, match=r"\bW\b.*float32"):
        tw.TwELL.from_dense(_dense()) @ torch.zeros(16, 2).to(getattr(torch, dtype))


def test_torch_sparse_layout_names_argument():
    with pytest.raises(TypeError, match=r"\bx\b.*to_dense"):
        tw.Hybrid.from_dense(_dense().to_sparse())


class _DLPackOnly:
    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


@pytest.mark.parametrize("make", [lambda h: h.bfloat16(), lambda h: h.clone().requires_grad_()],
                         ids=["bfloat16", "requires_grad"])
def test_dlpack_export_failure_names_argument(make):
    with pytest.raises(TypeError, match=r"\bx\b.*DLPack"):
        tw.TwELL.from_dense(_DLPackOnly(make(_dense())))


def test_big_endian_float_dtype_message_says_byte_order():
    h = _dense().numpy().astype(">f4")
    with pytest.raises(TypeError, match=r"\bx\b.*byte order"):
        tw.TwELL.from_dense(h)


@pytest.mark.parametrize("cls", [tw.TwELL, tw.ELL, tw.Hybrid])
def test_zero_dim_torch_and_jax_scalars_scale_like_zero_dim_numpy(cls):
    """A * torch.tensor(2.0) was refused as 'a dense array W of shape ()' while A * np.array(2.0)
    scaled; 0-d tensors of every real dtype now scale, and bool or complex ones are refused."""
    x = np.zeros((3, 40), np.float32)
    x[0, 1], x[2, 39] = 2.0, -1.0
    A = cls.from_dense(x)
    for s in (torch.tensor(2.0), torch.tensor(2), torch.tensor(2.0, dtype=torch.bfloat16), torch.tensor(2.0, dtype=torch.float64)):
        for got in (A * s, s * A, A.multiply(s)):
            assert isinstance(got, cls) and got.dtype == A.dtype
            np.testing.assert_array_equal(got.toarray(), x * 2)
        np.testing.assert_array_equal((A / s).toarray(), x / 2)
    for bad, what in ((torch.tensor(True), "boolean"), (torch.tensor(1 + 2j), "complex")):
        with pytest.raises(TypeError, match=f"factor must be a real number, got the {what} Tensor"):
            A * bad
    with pytest.raises(TypeError, match=r"dense array W \(torch\.Tensor of shape \(3, 40\)\)"):
        A * torch.ones(3, 40)
    jnp = pytest.importorskip("jax.numpy")
    np.testing.assert_array_equal((A * jnp.asarray(0.5)).toarray(), x * 0.5)


def test_requires_grad_warning_covers_torch_tensor_subclasses(monkeypatch):
    """The inference API's 'no grad_fn' warning looked at the module name, so a requires-grad
    tensor of a torch.Tensor subclass defined outside torch passed silently."""
    from twellpy import _ffn_infer

    monkeypatch.setattr(_ffn_infer, "_AUTOGRAD_WARNED", [False])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    wg, wu = torch.randn(16, 8, generator=g, dtype=torch.float64), torch.randn(16, 8, generator=g, dtype=torch.float64)
    wd = torch.randn(8, 16, generator=g, dtype=torch.float64)
    with pytest.warns(UserWarning, match="requires grad"):
        ffn.gated_forward(x.clone().requires_grad_().as_subclass(_UserTensor), wg, wu, wd)
