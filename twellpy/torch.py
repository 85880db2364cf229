"""PyTorch adapter: autograd functions and drop-in MLP modules.

This module is imported only when used (``import twellpy.torch``); importing
:mod:`twellpy` alone never imports torch.

Tensors travel to twellpy through DLPack (zero-copy on CPU and CUDA; bfloat16
through an int16 view), the training step runs in twellpy
(:func:`twellpy.ffn.gated_forward_train` / :func:`twellpy.ffn.gated_backward`,
:func:`twellpy.ffn.relu_forward_train` / :func:`twellpy.ffn.relu_backward`),
and results come back as torch tensors on the input's device.

**L1 penalty.** With ``l1 > 0`` the backward pass adds the gradient of
``l1 * sum(|h|) / M`` (``h`` the hidden activation, ``M`` the number of token
rows of the call) to the gradients, as if that penalty were part of the
loss. The penalty is *injected*: do not add it to your loss yourself (its
value is reported in the statistics for logging). It is not scaled by the
upstream gradient, so if you divide your loss by ``k`` (gradient
accumulation), divide ``l1`` by ``k`` too.

Examples
--------
>>> import torch, twellpy.torch as twt
>>> mlp = twt.SparseGatedMLP(64, 256, l1=2e-5)
>>> y = mlp(torch.randn(2, 8, 64))      # (batch, seq, hidden), like a Llama MLP
>>> y.sum().backward()
>>> mlp.last_stats is not None
True
"""
from __future__ import annotations

import contextlib
import numbers

try:
    import torch
    from torch import nn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("twellpy.torch needs PyTorch: install the torch build for your machine "
                      "(e.g. the CPU or CUDA wheel from pytorch.org) and import again") from exc

__all__ = [
    "GatedFFNFunction",
    "ReluFFNFunction",
    "sparse_gated_ffn",
    "sparse_relu_ffn",
    "SparseGatedMLP",
    "SparseReluMLP",
]


def _ffn():
    # Imported lazily so that twellpy.torch stays importable while the FFN
    # backends are compiled/loaded only on first use.
    from . import ffn

    return ffn


def _on_torch_stream(t):
    """Context that makes CuPy launch on torch's current CUDA stream.

    twellpy's CUDA kernels run on CuPy's current stream; torch may be using a
    non-default stream (``torch.cuda.stream(...)``). Launching on torch's
    stream keeps the order of operations without extra synchronisation.
    """
    if not t.is_cuda:
        return contextlib.nullcontext()
    import cupy

    stream = torch.cuda.current_stream(t.device)
    return cupy.cuda.ExternalStream(stream.cuda_stream, t.device.index)


def _check_l1(l1):
    if isinstance(l1, torch.Tensor):
        if l1.numel() != 1:
            raise ValueError(f"l1 must be a scalar, got a tensor of shape {tuple(l1.shape)}")
        l1 = float(l1.item())
    if not isinstance(l1, numbers.Real) or isinstance(l1, bool):
        raise TypeError(f"l1 must be a real number, got {type(l1).__name__}")
    l1 = float(l1)
    if not l1 >= 0.0 or l1 == float("inf"):
        raise ValueError(f"l1 must be finite and >= 0, got {l1}")
    return l1


def _check_tensor(t, name, ndim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def _flatten_tokens(x, d):
    """(..., D) -> (M, D) contiguous, plus the leading shape to restore."""
    _check_tensor(x, "x")
    if x.dim() < 1 or x.shape[-1] != d:
        raise ValueError(f"x must have shape (..., {d}) to match the weights, got {tuple(x.shape)}")
    lead = tuple(x.shape[:-1])
    return x.reshape(-1, d).contiguous(), lead


class GatedFFNFunction(torch.autograd.Function):
    """Autograd function for the gated ReLU FFN ``(relu(x Wg^T) * (x Wu^T)) Wd^T``.

    ``apply(x, w_gate, w_up, w_down, l1)`` with ``x`` of shape (M, D),
    ``w_gate``/``w_up`` (H, D), ``w_down`` (D, H) (``nn.Linear`` layout).
    Forward and backward run twellpy's sparse training step; the activation
    is kept sparse (Hybrid) between them. The L1 gradient is injected in
    backward (see the module docstring). ``x`` and the weights are saved with
    ``save_for_backward`` (twellpy's context reads them without a copy), so
    changing one of them in place between forward and backward makes the
    backward raise ``RuntimeError``, as for native torch operations. The statistics of the last forward
    pass are available from ``ctx.stats`` through :func:`sparse_gated_ffn`'s
    ``stats_out`` argument.
    """

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, l1, stats_out=None):
        with _on_torch_stream(x):
            y, tctx = _ffn().gated_forward_train(x, w_gate, w_up, w_down, l1=l1)
        ctx.twell_ctx = tctx
        # tctx reads x and the weights zero-copy: saving them lets autograd's version
        # check raise in backward if one was changed in place (as native torch does)
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        if stats_out is not None:
            stats_out.append(tctx.stats)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        # The twellpy context is freed with the graph (it stays for
        # retain_graph=True / repeated backward calls).
        ctx.saved_tensors  # noqa: B018 -- RuntimeError if x or a weight was modified in place
        tctx = ctx.twell_ctx
        with _on_torch_stream(dy):
            dx, dw_gate, dw_up, dw_down = _ffn().gated_backward(tctx, dy.contiguous())
        return dx, dw_gate, dw_up, dw_down, None, None


class ReluFFNFunction(torch.autograd.Function):
    """Autograd function for the non-gated ReLU FFN ``relu(x Wu^T) Wd^T``.

    ``apply(x, w_up, w_down, l1)``; see :class:`GatedFFNFunction`.
    """

    @staticmethod
    def forward(ctx, x, w_up, w_down, l1, stats_out=None):
        with _on_torch_stream(x):
            y, tctx = _ffn().relu_forward_train(x, w_up, w_down, l1=l1)
        ctx.twell_ctx = tctx
        ctx.save_for_backward(x, w_up, w_down)  # version check, see GatedFFNFunction
        if stats_out is not None:
            stats_out.append(tctx.stats)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        ctx.saved_tensors  # noqa: B018 -- RuntimeError if x or a weight was modified in place
        tctx = ctx.twell_ctx
        with _on_torch_stream(dy):
            dx, dw_up, dw_down = _ffn().relu_backward(tctx, dy.contiguous())
        return dx, dw_up, dw_down, None, None


def _autocast(x, weights):
    """Apply torch.autocast's rule for linear layers: compute in the autocast dtype.

    Under ``torch.autocast`` a Llama MLP's ``nn.Linear`` layers run in the
    autocast dtype (e.g. bfloat16) with float32 master weights; the casts here
    are differentiable, so gradients reach the float32 weights as usual.
    """
    dev = x.device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return x, weights
    dt = torch.get_autocast_dtype(dev)

    def cast(t):
        return t.to(dt) if t.is_floating_point() and t.dtype != dt else t

    return cast(x), [cast(w) for w in weights]


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def sparse_gated_ffn(x, w_gate, w_up, w_down, l1=0.0, *, stats_out=None):
    """Gated ReLU FFN on torch tensors, differentiable through twellpy.

    Parameters
    ----------
    x : torch.Tensor
        Shape (..., D). Leading dimensions are flattened into M token rows.
    w_gate, w_up : torch.Tensor
        Shape (H, D) (``nn.Linear.weight`` layout).
    w_down : torch.Tensor
        Shape (D, H).
    l1 : float
        L1 coefficient; backward adds the gradient of ``l1 * sum|h| / M``.
    stats_out : list, optional
        When given, the statistics of this call (twellpy's ``ctx.stats``)
        are appended to it. Only the training path produces statistics.

    Returns
    -------
    torch.Tensor
        Shape (..., D), same dtype and device as ``x``.

    Notes
    -----
    When no input requires a gradient (or under ``torch.no_grad()``), the
    faster inference kernel :func:`twellpy.ffn.gated_forward` is used.
    Under ``torch.autocast`` the computation runs in the autocast dtype, as
    ``nn.Linear`` would. Otherwise all four tensors must share one dtype and
    device (a mismatch raises ``TypeError``/``ValueError`` naming the tensor).
    """
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        _check_tensor(w, name, ndim=2)
    l1 = _check_l1(l1)
    _check_tensor(x, "x")
    x, (w_gate, w_up, w_down) = _autocast(x, [w_gate, w_up, w_down])
    x2, lead = _flatten_tokens(x, w_gate.shape[1])
    if _needs_grad(x, w_gate, w_up, w_down) or stats_out is not None:
        y = GatedFFNFunction.apply(x2, w_gate.contiguous(), w_up.contiguous(), w_down.contiguous(),
                                   l1, stats_out)
    else:
        with _on_torch_stream(x2):
            y = _ffn().gated_forward(x2, w_gate, w_up, w_down)
    return y.reshape(*lead, w_down.shape[0])


def sparse_relu_ffn(x, w_up, w_down, l1=0.0, *, stats_out=None):
    """Non-gated ReLU FFN ``relu(x Wu^T) Wd^T``; see :func:`sparse_gated_ffn`."""
    for name, w in (("w_up", w_up), ("w_down", w_down)):
        _check_tensor(w, name, ndim=2)
    l1 = _check_l1(l1)
    _check_tensor(x, "x")
    x, (w_up, w_down) = _autocast(x, [w_up, w_down])
    x2, lead = _flatten_tokens(x, w_up.shape[1])
    if _needs_grad(x, w_up, w_down) or stats_out is not None:
        y = ReluFFNFunction.apply(x2, w_up.contiguous(), w_down.contiguous(), l1, stats_out)
    else:
        with _on_torch_stream(x2):
            y = _ffn().relu_forward(x2, w_up, w_down)
    return y.reshape(*lead, w_down.shape[0])


def _check_linear(layer, name, in_features, out_features):
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"{name} must be an nn.Linear, got {type(layer).__name__}")
    if layer.bias is not None:
        raise ValueError(f"{name} has a bias; twellpy's sparse FFN supports bias-free projections "
                         f"only (Llama MLPs use mlp_bias=False)")
    if (layer.in_features, layer.out_features) != (in_features, out_features):
        raise ValueError(f"{name} maps {layer.in_features} -> {layer.out_features} features, "
                         f"expected {in_features} -> {out_features}")


def _is_relu(act):
    if isinstance(act, nn.ReLU):
        return True
    return act is torch.relu or act is torch.nn.functional.relu


def _activation_of(mlp):
    act = getattr(mlp, "act_fn", None)
    if act is None:
        cfg = getattr(mlp, "config", None)
        name = getattr(cfg, "hidden_act", None)
        return name, name == "relu"
    return type(act).__name__, _is_relu(act)


class _SparseMLPBase(nn.Module):
    def __init__(self, l1):
        super().__init__()
        self.l1 = _check_l1(l1)
        self.last_stats = None
        self.act_fn = nn.ReLU()  # what the layer computes; HF code inspects mlp.act_fn

    def extra_repr(self):
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, l1={self.l1}"


class SparseGatedMLP(_SparseMLPBase):
    """Drop-in replacement for a Hugging Face ``LlamaMLP`` with ReLU activation.

    Computes ``down_proj(relu(gate_proj(x)) * up_proj(x))`` with twellpy's
    sparse kernels: the training step keeps the activation sparse (Hybrid)
    and injects the L1 gradient; in inference (no gradient needed) the fused
    sparse inference kernel runs.

    Parameters
    ----------
    hidden_size : int
        D, the model width.
    intermediate_size : int
        H, the FFN width.
    l1 : float
        L1 coefficient on the activation ``h`` (gradient of
        ``l1 * sum|h| / M`` is injected in backward; do not add it to the
        loss yourself).
    device, dtype : optional
        Passed to the ``nn.Linear`` layers.

    Attributes
    ----------
    gate_proj, up_proj : nn.Linear
        ``hidden_size -> intermediate_size``, no bias.
    down_proj : nn.Linear
        ``intermediate_size -> hidden_size``, no bias.
    last_stats : object or None
        Statistics of the last training forward pass (twellpy's
        ``ctx.stats``: mean active neurons per token ``l0``, the L1 value,
        backup rows, per-token and per-neuron counts); ``None`` before the
        first training step. Inference calls do not update it unless
        ``collect_stats`` is True.
    collect_stats : bool
        Run the training forward (which computes statistics) even when no
        gradient is needed. Default False.
    """

    def __init__(self, hidden_size, intermediate_size, l1=0.0, *, device=None, dtype=None):
        super().__init__(l1)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, device=device, dtype=dtype)
        self.collect_stats = False

    @classmethod
    def from_llama_mlp(cls, mlp, l1=0.0, *, check_activation=True):
        """Build from a Hugging Face ``LlamaMLP`` (or any module with the same layout).

        The new module **shares** the weight parameters of ``mlp`` (no copy),
        so optimisers and state dicts keep working: the parameter names
        ``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight`` are
        the same.

        Parameters
        ----------
        mlp : nn.Module
            Has ``gate_proj``, ``up_proj``, ``down_proj`` (bias-free
            ``nn.Linear``) and a ReLU activation (``act_fn`` or
            ``config.hidden_act == "relu"``).
        l1 : float
            L1 coefficient.
        check_activation : bool
            Raise ``ValueError`` when ``mlp`` does not use ReLU (the sparse
            layer always computes ReLU). Default True.
        """
        for attr in ("gate_proj", "up_proj", "down_proj"):
            if not hasattr(mlp, attr):
                raise TypeError(f"mlp has no attribute {attr!r}; expected a Llama-style MLP "
                                f"with gate_proj, up_proj and down_proj")
        d, h = mlp.gate_proj.in_features, mlp.gate_proj.out_features
        _check_linear(mlp.gate_proj, "mlp.gate_proj", d, h)
        _check_linear(mlp.up_proj, "mlp.up_proj", d, h)
        _check_linear(mlp.down_proj, "mlp.down_proj", h, d)
        if check_activation:
            name, ok = _activation_of(mlp)
            if not ok:
                raise ValueError(f"mlp uses activation {name!r}, expected ReLU; twellpy's sparse "
                                 f"FFN computes relu (pass check_activation=False to convert anyway)")
        w = mlp.gate_proj.weight
        new = cls(d, h, l1=l1, device="meta", dtype=w.dtype)
        new.gate_proj = mlp.gate_proj
        new.up_proj = mlp.up_proj
        new.down_proj = mlp.down_proj
        return new

    def forward(self, x):
        """Apply the MLP to ``x`` of shape (..., hidden_size)."""
        stats = [] if (self.training or self.collect_stats) else None
        needs = _needs_grad(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        y = sparse_gated_ffn(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                             self.l1, stats_out=stats if (needs or self.collect_stats) else None)
        if stats:
            self.last_stats = stats[-1]
        return y


class SparseReluMLP(_SparseMLPBase):
    """Non-gated ReLU MLP ``down_proj(relu(up_proj(x)))`` on twellpy's kernels.

    Same conventions as :class:`SparseGatedMLP` without ``gate_proj``.

    Parameters
    ----------
    hidden_size, intermediate_size : int
        D and H.
    l1 : float
        L1 coefficient on the activation.
    device, dtype : optional
        Passed to the ``nn.Linear`` layers.
    """

    def __init__(self, hidden_size, intermediate_size, l1=0.0, *, device=None, dtype=None):
        super().__init__(l1)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, device=device, dtype=dtype)
        self.collect_stats = False

    @classmethod
    def from_mlp(cls, mlp, l1=0.0, *, check_activation=True):
        """Build from a module with ``up_proj`` and ``down_proj`` (shares the weights).

        See :meth:`SparseGatedMLP.from_llama_mlp`.
        """
        for attr in ("up_proj", "down_proj"):
            if not hasattr(mlp, attr):
                raise TypeError(f"mlp has no attribute {attr!r}; expected up_proj and down_proj")
        d, h = mlp.up_proj.in_features, mlp.up_proj.out_features
        _check_linear(mlp.up_proj, "mlp.up_proj", d, h)
        _check_linear(mlp.down_proj, "mlp.down_proj", h, d)
        if check_activation:
            name, ok = _activation_of(mlp)
            if not ok:
                raise ValueError(f"mlp uses activation {name!r}, expected ReLU "
                                 f"(pass check_activation=False to convert anyway)")
        new = cls(d, h, l1=l1, device="meta", dtype=mlp.up_proj.weight.dtype)
        new.up_proj = mlp.up_proj
        new.down_proj = mlp.down_proj
        return new

    def forward(self, x):
        """Apply the MLP to ``x`` of shape (..., hidden_size)."""
        stats = [] if (self.training or self.collect_stats) else None
        needs = _needs_grad(x, self.up_proj.weight, self.down_proj.weight)
        y = sparse_relu_ffn(x, self.up_proj.weight, self.down_proj.weight, self.l1,
                            stats_out=stats if (needs or self.collect_stats) else None)
        if stats:
            self.last_stats = stats[-1]
        return y
