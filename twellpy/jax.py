"""JAX adapter: ``jax.custom_vjp`` wrappers around twellpy's FFN training step.

This module is imported only when used (``import twellpy.jax``); importing
:mod:`twellpy` alone never imports jax.

Two execution paths, chosen automatically per call:

* **Eager** (concrete arrays, e.g. ``jax.grad(loss)(params)`` without
  ``jax.jit``): arrays go to twellpy through DLPack, zero-copy, on the
  device where they live (CPU via Numba, GPU via CuPy), and results come back
  as jax arrays on that device.
* **Traced** (under ``jax.jit``, ``jax.lax.scan`` ...): the step runs through
  :func:`jax.pure_callback` on host (numpy) copies of the arrays, i.e. on
  twellpy's **CPU** backend even if jax computes on a GPU. It is exact but
  pays host transfers; for GPU speed call the wrappers eagerly.
* **Vectorised** (``jax.vmap``): the callback runs once per batch element
  (``vmap_method="sequential"``), and the L1 term is normalised by each
  element's own token count. To batch tokens, prefer ``x`` of shape
  (..., D): the wrappers flatten leading dimensions into one call.

The forward pass keeps twellpy's sparse context in a small host-side cache,
keyed by an int32 handle that travels as a residual; the backward pass uses
it and frees it. If the entry is gone (the cache holds at most
:data:`CTX_CACHE_SIZE` contexts, or JAX replayed the backward), the forward
step is recomputed from the saved inputs, which gives the same bits.

**L1 penalty.** With ``l1 > 0`` the backward pass adds the gradient of
``l1 * sum(|h|) / M`` (``M`` = number of token rows) to the gradients, as if
the penalty were part of the loss; do not add it yourself. It is not scaled
by the output cotangent.

Examples
--------
>>> import jax, jax.numpy as jnp, twellpy.jax as twj
>>> def loss(x, wg, wu, wd):
...     return (twj.gated_ffn(x, wg, wu, wd, l1=2e-5) ** 2).sum()
>>> grads = jax.grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)   # doctest: +SKIP
"""
from __future__ import annotations

import functools
import inspect
import itertools
import numbers
import threading
from collections import OrderedDict

import numpy as np

from ._array import FLOAT_DTYPES

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("twellpy.jax needs JAX: pip install 'twellpy[jax]' (or jax and jaxlib)") from exc

__all__ = ["gated_ffn", "relu_ffn", "last_stats", "CTX_CACHE_SIZE"]

#: Most forward contexts kept for backward at once (oldest evicted first;
#: an evicted context is recomputed in backward, exactly).
CTX_CACHE_SIZE = 64

_lock = threading.Lock()
_handles = itertools.count(1)
_ctx_cache: "OrderedDict[int, object]" = OrderedDict()
_last_stats = [None]


def _ffn():
    from . import ffn

    return ffn


def last_stats():
    """Statistics (twellpy's ``ctx.stats``) of the most recent training forward pass.

    Returns ``None`` before any differentiated call. Under ``jax.jit`` it is
    the statistics of the most recent callback execution.
    """
    return _last_stats[0]


def _store(ctx):
    with _lock:
        handle = next(_handles) % (2**31 - 1)
        _ctx_cache[handle] = ctx
        while len(_ctx_cache) > CTX_CACHE_SIZE:
            _ctx_cache.popitem(last=False)
    _last_stats[0] = getattr(ctx, "stats", None)
    return handle


def _take(handle):
    with _lock:
        return _ctx_cache.pop(int(handle), None)


# Under jax.vmap the callbacks run once per batch element (jax >= 0.4.34
# understands vmap_method; older versions reject vmap of a pure_callback).
_VMAP = ({"vmap_method": "sequential"}
         if "vmap_method" in inspect.signature(jax.pure_callback).parameters else {})


def _is_traced(*arrays):
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


_KINDS = {
    # kind: (inference fn, train fn, backward fn, names of the weights)
    "gated": ("gated_forward", "gated_forward_train", "gated_backward", ("w_gate", "w_up", "w_down")),
    "relu": ("relu_forward", "relu_forward_train", "relu_backward", ("w_up", "w_down")),
}


def _run_forward_train(kind, arrays, l1):
    ffn = _ffn()
    train = getattr(ffn, _KINDS[kind][1])
    return train(*arrays, l1=l1)


def _host_forward_train(kind, l1, out_dtype, *arrays):
    y, ctx = _run_forward_train(kind, [np.asarray(a) for a in arrays], l1)
    return np.asarray(y).astype(out_dtype, copy=False), np.int32(_store(ctx))


def _backward_from(kind, handle, arrays, l1, dy):
    """Gradients from the cached context, recomputing the forward step if evicted."""
    ctx = _take(handle)
    if ctx is None:
        _, ctx = _run_forward_train(kind, arrays, l1)
    backward = getattr(_ffn(), _KINDS[kind][2])
    return backward(ctx, dy)


def _host_backward(kind, l1, dtypes, handle, dy, *arrays):
    grads = _backward_from(kind, handle, [np.asarray(a) for a in arrays], l1, np.asarray(dy))
    return tuple(np.asarray(g).astype(dt, copy=False) for g, dt in zip(grads, dtypes))


def _primal(kind, l1, *arrays):
    x, w_down = arrays[0], arrays[-1]
    out = jax.ShapeDtypeStruct((x.shape[0], w_down.shape[0]), x.dtype)
    infer = getattr(_ffn(), _KINDS[kind][0])
    if _is_traced(*arrays):
        def host(*arrs):
            return np.asarray(infer(*[np.asarray(a) for a in arrs])).astype(out.dtype, copy=False)
        return jax.pure_callback(host, out, *arrays, **_VMAP)
    return jnp.asarray(infer(*arrays), dtype=out.dtype)


def _fwd(kind, l1, *arrays):
    x, w_down = arrays[0], arrays[-1]
    out = jax.ShapeDtypeStruct((x.shape[0], w_down.shape[0]), x.dtype)
    if _is_traced(*arrays):
        y, handle = jax.pure_callback(
            functools.partial(_host_forward_train, kind, l1, out.dtype),
            (out, jax.ShapeDtypeStruct((), np.int32)), *arrays, **_VMAP)
    else:
        y, ctx = _run_forward_train(kind, arrays, l1)
        y = jnp.asarray(y, dtype=out.dtype)
        handle = jnp.int32(_store(ctx))
    return y, (handle, arrays)


def _bwd(kind, l1, res, dy):
    handle, arrays = res
    dtypes = tuple(a.dtype for a in arrays)
    if _is_traced(handle, dy, *arrays):
        shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
        return jax.pure_callback(functools.partial(_host_backward, kind, l1, dtypes),
                                 shapes, handle, dy, *arrays, **_VMAP)
    grads = _backward_from(kind, handle, arrays, l1, dy)
    return tuple(jnp.asarray(g, dtype=dt) for g, dt in zip(grads, dtypes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ffn_vjp(kind, l1, *arrays):
    return _primal(kind, l1, *arrays)


_ffn_vjp.defvjp(_fwd, _bwd)


def _check_l1(l1):
    if isinstance(l1, jax.core.Tracer):
        raise TypeError("l1 must be a Python float (a static value), got a traced jax value; "
                        "mark it static (e.g. jax.jit(..., static_argnames='l1'))")
    if isinstance(l1, (np.ndarray, jax.Array)) and np.ndim(l1) == 0 and l1.dtype.kind not in "bc":
        l1 = float(l1)  # a bool or complex array stays and is refused below
    if not isinstance(l1, numbers.Real) or isinstance(l1, bool):
        raise TypeError(f"l1 must be a real number, got {type(l1).__name__}")
    l1 = float(l1)
    if not (l1 >= 0.0) or l1 == float("inf"):
        raise ValueError(f"l1 must be finite and >= 0, got {l1}")
    return l1


def _prepare(kind, x, weights):
    names = _KINDS[kind][3]
    x = jnp.asarray(x)
    if x.dtype not in FLOAT_DTYPES:
        # checked first: otherwise an int x is reported as a wrong dtype of the first weight
        raise TypeError(f"x has dtype {x.dtype}, expected one of "
                        f"{', '.join(str(d) for d in FLOAT_DTYPES)}")
    ws = []
    for name, w in zip(names, weights):
        w = jnp.asarray(w)
        if w.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(w.shape)}")
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype}, expected {x.dtype} (the dtype of x)")
        ws.append(w)
    h, d = ws[0].shape
    if h < 1 or d < 1:
        # as the inference functions; x.reshape(-1, 0) would raise ZeroDivisionError, and
        # H = 0 failed in the primal but not under jax.grad (the training step accepts it)
        raise ValueError(f"{names[0]} has shape {(h, d)}, expected (H, D) with H, D >= 1")
    for name, w in zip(names[1:-1], ws[1:-1]):
        if w.shape != (h, d):
            raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {(h, d)}")
    if ws[-1].shape != (d, h):
        raise ValueError(f"{names[-1]} has shape {tuple(ws[-1].shape)}, expected {(d, h)}")
    if x.ndim < 1 or x.shape[-1] != d:
        raise ValueError(f"x must have shape (..., {d}) to match the weights, got {tuple(x.shape)}")
    return x, ws, d


def gated_ffn(x, w_gate, w_up, w_down, l1=0.0):
    """Gated ReLU FFN ``(relu(x Wg^T) * (x Wu^T)) Wd^T`` with a twellpy custom VJP.

    Parameters
    ----------
    x : jax.Array
        Shape (..., D); leading dimensions are flattened into M token rows.
    w_gate, w_up : jax.Array
        Shape (H, D) (``nn.Linear`` / Hugging Face layout), dtype of ``x``.
    w_down : jax.Array
        Shape (D, H).
    l1 : float
        L1 coefficient (static): backward adds the gradient of
        ``l1 * sum|h| / M``.

    Returns
    -------
    jax.Array
        Shape (..., D), dtype of ``x``.

    Notes
    -----
    Differentiable with ``jax.grad``/``jax.vjp`` in every argument but
    ``l1``. Eager calls run on the arrays' device through DLPack; under
    ``jax.jit`` the computation goes through :func:`jax.pure_callback` on the
    host CPU backend (see the module docstring).
    """
    l1 = _check_l1(l1)
    x, ws, d = _prepare("gated", x, (w_gate, w_up, w_down))
    lead = x.shape[:-1]
    y = _ffn_vjp("gated", l1, x.reshape(-1, d), *ws)
    return y.reshape(*lead, d)


def relu_ffn(x, w_up, w_down, l1=0.0):
    """Non-gated ReLU FFN ``relu(x Wu^T) Wd^T`` with a twellpy custom VJP.

    Same conventions as :func:`gated_ffn`, without ``w_gate``.
    """
    l1 = _check_l1(l1)
    x, ws, d = _prepare("relu", x, (w_up, w_down))
    lead = x.shape[:-1]
    y = _ffn_vjp("relu", l1, x.reshape(-1, d), *ws)
    return y.reshape(*lead, d)
