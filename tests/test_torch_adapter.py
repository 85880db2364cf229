"""twellpy.torch: autograd functions and Llama-style MLP modules against torch autograd."""
import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import twellpy.torch as twt  # noqa: E402


def _weights(d, h, dtype=torch.float64, seed=0, gate_bias=-0.3):
    g = torch.Generator().manual_seed(seed)
    wg = torch.randn(h, d, generator=g, dtype=torch.float64) / d ** 0.5
    wg[:, 0] = gate_bias  # with x[:, 0] = 1 this shifts the gate: sparser activations
    wu = torch.randn(h, d, generator=g, dtype=torch.float64) / d ** 0.5
    wd = torch.randn(d, h, generator=g, dtype=torch.float64) / h ** 0.5
    return [w.to(dtype) for w in (wg, wu, wd)]


def _x(shape, dtype=torch.float64, seed=1, sigma=0.3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x = x * torch.exp(sigma * torch.randn(*shape[:-1], 1, generator=g, dtype=torch.float64))
    x[..., 0] = 1.0
    return x.to(dtype)


def _ref_gated(x, wg, wu, wd, l1):
    h = torch.relu(x @ wg.T) * (x @ wu.T)
    m = h.reshape(-1, h.shape[-1]).shape[0]
    return h @ wd.T, l1 * h.abs().sum() / m, h


def _ref_relu(x, wu, wd, l1):
    h = torch.relu(x @ wu.T)
    m = h.reshape(-1, h.shape[-1]).shape[0]
    return h @ wd.T, l1 * h.abs().sum() / m, h


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


class _LlamaMLPLike(nn.Module):
    """Same attribute layout and forward as transformers' LlamaMLP (act_fn = ReLU)."""

    def __init__(self, hidden, inter, act=None, bias=False):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden, inter
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = act if act is not None else nn.ReLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("l1", [0.0, 0.05])
@pytest.mark.parametrize("shape", [(13, 24), (2, 5, 24), (1, 24)])
def test_gated_function_matches_autograd(shape, l1):
    d, h = 24, 64
    wg, wu, wd = _weights(d, h)
    x = _x(shape)
    leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    dy = torch.randn(*shape[:-1], d, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    stats = []
    y = twt.sparse_gated_ffn(*leaves, l1=l1, stats_out=stats)
    (y * dy).sum().backward()

    y_ref, pen, h_ref = _ref_gated(*ref_leaves, l1)
    ((y_ref * dy).sum() + pen).backward()

    assert y.shape == y_ref.shape and y.dtype == torch.float64
    assert _rel(y.detach(), y_ref.detach()) < 1e-12
    for name, a, b in zip(("x", "w_gate", "w_up", "w_down"), leaves, ref_leaves):
        assert a.grad is not None and a.grad.shape == b.grad.shape, name
        assert _rel(a.grad, b.grad) < 1e-10, name
    st = stats[0]
    n_tok = h_ref.reshape(-1, h).shape[0]
    assert st["l0"] == pytest.approx(float((h_ref != 0).sum()) / n_tok)
    assert st["l1"] == pytest.approx(float(pen.detach()), rel=1e-10)


@pytest.mark.parametrize("l1", [0.0, 0.1])
def test_relu_function_matches_autograd(l1):
    d, h = 16, 48
    _, wu, wd = _weights(d, h)
    wu[:, 0] -= 0.3
    x = _x((3, 7, d))
    leaves = [t.clone().requires_grad_(True) for t in (x, wu, wd)]
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, wu, wd)]
    y = twt.sparse_relu_ffn(*leaves, l1=l1)
    (y.square()).sum().backward()
    y_ref, pen, _ = _ref_relu(*ref_leaves, l1)
    (y_ref.square().sum() + pen).backward()
    assert _rel(y.detach(), y_ref.detach()) < 1e-12
    for name, a, b in zip(("x", "w_up", "w_down"), leaves, ref_leaves):
        assert _rel(a.grad, b.grad) < 1e-10, name


def test_gradcheck_float64():
    # torch's own finite-difference check of the whole Function (l1 = 0: the
    # L1 term is injected, not part of the output, so it has no finite difference).
    d, h = 4, 12
    wg, wu, wd = _weights(d, h, gate_bias=0.0)
    x = _x((3, d), sigma=0.0)
    inputs = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    assert torch.autograd.gradcheck(lambda *a: twt.sparse_gated_ffn(*a), inputs, eps=1e-6, atol=1e-6,
                                    fast_mode=True)


def test_float32_and_bfloat16_forward_backward():
    d, h = 32, 128
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        wg, wu, wd = _weights(d, h, dtype=dtype)
        x = _x((9, d), dtype=dtype)
        leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
        y = twt.sparse_gated_ffn(*leaves, l1=0.01)
        assert y.dtype == dtype
        y.float().sum().backward()
        ref = [t.double().requires_grad_(True) for t in (x, wg, wu, wd)]
        y_ref, pen, _ = _ref_gated(*ref, 0.01)
        (y_ref.sum() + pen).backward()
        assert _rel(y.detach(), y_ref.detach()) < tol
        for a, b in zip(leaves, ref):
            assert a.grad.dtype == dtype
            assert _rel(a.grad, b.grad) < 4 * tol


def test_module_from_llama_mlp_is_drop_in():
    torch.manual_seed(0)
    d, h = 16, 64
    mlp = _LlamaMLPLike(d, h).double()
    with torch.no_grad():
        mlp.gate_proj.weight[:, 0] -= 0.5
    sparse = twt.SparseGatedMLP.from_llama_mlp(copy.deepcopy(mlp), l1=0.0)
    # Same parameter names: state dicts are interchangeable.
    assert set(sparse.state_dict()) == set(mlp.state_dict())
    assert isinstance(sparse.gate_proj, nn.Linear) and sparse.gate_proj.bias is None
    assert (sparse.hidden_size, sparse.intermediate_size) == (d, h)

    x = _x((2, 6, d))
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = mlp(xa), sparse(xb)
    assert _rel(yb.detach(), ya.detach()) < 1e-12
    ya.pow(2).sum().backward()
    yb.pow(2).sum().backward()
    assert _rel(xb.grad, xa.grad) < 1e-10
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert _rel(getattr(sparse, name).weight.grad, getattr(mlp, name).weight.grad) < 1e-10, name
    assert sparse.last_stats is not None and sparse.last_stats["l0"] > 0

    # Eval mode without grad takes the inference kernel and leaves stats alone.
    sparse.eval()
    sparse.last_stats = None
    with torch.no_grad():
        y_inf = sparse(x)
    assert _rel(y_inf, ya.detach()) < 1e-12
    assert sparse.last_stats is None


def test_from_llama_mlp_shares_parameters_and_trains():
    torch.manual_seed(1)
    mlp = _LlamaMLPLike(8, 32)
    sparse = twt.SparseGatedMLP.from_llama_mlp(mlp, l1=1e-3)
    assert sparse.gate_proj.weight is mlp.gate_proj.weight
    opt = torch.optim.SGD(sparse.parameters(), lr=0.1)
    x = _x((64, 8), dtype=torch.float32)
    target = torch.zeros(64, 8)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = (sparse(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    # the shared weights moved in the original module too
    assert mlp.gate_proj.weight is sparse.gate_proj.weight


def test_from_llama_mlp_rejects_bad_modules():
    with pytest.raises(ValueError, match="activation"):
        twt.SparseGatedMLP.from_llama_mlp(_LlamaMLPLike(8, 16, act=nn.SiLU()))
    assert twt.SparseGatedMLP.from_llama_mlp(_LlamaMLPLike(8, 16, act=nn.SiLU()),
                                             check_activation=False).intermediate_size == 16
    with pytest.raises(ValueError, match="bias"):
        twt.SparseGatedMLP.from_llama_mlp(_LlamaMLPLike(8, 16, bias=True))
    bad = _LlamaMLPLike(8, 16)
    bad.down_proj = nn.Linear(16, 4, bias=False)
    with pytest.raises(ValueError, match="down_proj"):
        twt.SparseGatedMLP.from_llama_mlp(bad)
    with pytest.raises(TypeError, match="gate_proj"):
        twt.SparseGatedMLP.from_llama_mlp(nn.Linear(3, 4))
    with pytest.raises(ValueError, match="l1"):
        twt.SparseGatedMLP(8, 16, l1=-1.0)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 8\)"):
        twt.SparseGatedMLP(8, 16)(torch.zeros(3, 5))


def test_relu_module_matches_reference():
    torch.manual_seed(2)
    d, h = 12, 40
    m = twt.SparseReluMLP(d, h, l1=0.02, dtype=torch.float64)
    with torch.no_grad():
        m.up_proj.weight[:, 0] -= 0.4
    x = _x((4, 5, d)).requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    wu = m.up_proj.weight.detach().clone().requires_grad_(True)
    wd = m.down_proj.weight.detach().clone().requires_grad_(True)
    y = m(x)
    y.sum().backward()
    y_ref, pen, _ = _ref_relu(xr, wu, wd, 0.02)
    (y_ref.sum() + pen).backward()
    assert _rel(y.detach(), y_ref.detach()) < 1e-12
    assert _rel(x.grad, xr.grad) < 1e-10
    assert _rel(m.up_proj.weight.grad, wu.grad) < 1e-10
    assert _rel(m.down_proj.weight.grad, wd.grad) < 1e-10
    assert m.last_stats["l1_coef"] == pytest.approx(0.02)
    other = nn.Module()
    other.up_proj, other.down_proj, other.act_fn = m.up_proj, m.down_proj, nn.ReLU()
    assert twt.SparseReluMLP.from_mlp(other).up_proj is m.up_proj


def test_hugging_face_llama_with_sparse_mlps():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, hidden_act="relu",
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double()
    sparse_model = copy.deepcopy(model)
    for layer in sparse_model.model.layers:
        layer.mlp = twt.SparseGatedMLP.from_llama_mlp(layer.mlp, l1=0.0)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    out = model(ids, labels=ids)
    out_s = sparse_model(ids, labels=ids)
    assert _rel(out_s.logits.detach(), out.logits.detach()) < 1e-10
    out.loss.backward()
    out_s.loss.backward()
    g = dict(model.named_parameters())
    for name, p in sparse_model.named_parameters():
        assert _rel(p.grad, g[name].grad) < 1e-8, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cuda_tensors_match_autograd(dtype, tol):
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    d, h = 64, 256
    wg, wu, wd = _weights(d, h)
    x = _x((3, 40, d))
    dev = [t.to("cuda", dtype).requires_grad_(True) for t in (x, wg, wu, wd)]
    ref = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]  # float64 CPU reference
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    with torch.cuda.stream(side):  # a non-default torch stream must be honoured
        y = twt.sparse_gated_ffn(*dev, l1=1e-3)
        (y.float() ** 2).sum().backward()
    torch.cuda.synchronize()
    y_ref, pen, _ = _ref_gated(*ref, 1e-3)
    ((y_ref ** 2).sum() + pen).backward()
    assert y.is_cuda and y.dtype == dtype
    assert _rel(y.detach().cpu(), y_ref.detach()) < tol
    for name, a, b in zip(("x", "w_gate", "w_up", "w_down"), dev, ref):
        assert a.grad.is_cuda and a.grad.dtype == dtype, name
        assert _rel(a.grad.cpu(), b.grad) < 4 * tol, name


def test_autocast_runs_in_autocast_dtype_with_float32_master_weights():
    torch.manual_seed(3)
    mlp = _LlamaMLPLike(16, 64)
    with torch.no_grad():
        mlp.gate_proj.weight[:, 0] -= 0.5
    sparse = twt.SparseGatedMLP.from_llama_mlp(copy.deepcopy(mlp))
    x = _x((2, 7, 16), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sparse(x)
        y_ref = mlp(x)
    assert y.dtype == torch.bfloat16 == y_ref.dtype
    assert _rel(y.float(), y_ref.float()) < 2e-2
    y.float().sum().backward()
    y_ref.float().sum().backward()
    for name in ("gate_proj", "up_proj", "down_proj"):
        g = getattr(sparse, name).weight.grad
        assert g.dtype == torch.float32, name
        assert _rel(g, getattr(mlp, name).weight.grad) < 5e-2, name


def test_mismatched_dtypes_name_the_tensor():
    wg, wu, wd = _weights(8, 16, dtype=torch.float32)
    with pytest.raises(TypeError, match="w_gate has dtype"):
        twt.sparse_gated_ffn(_x((3, 8), dtype=torch.float32), wg.double(), wu, wd)
