"""Fused sparse FFN inference: ReLU gate GEMM + sparse up/down projection.

A transformer FFN with ReLU activations is ~99.5% sparse after L1 training.
These functions compute it exactly while doing the up- and down-projection
work only for the active neurons:

* gated: ``y = (relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``
* plain: ``y = relu(x @ w_up.T) @ w_down.T``

Weights use the ``torch.nn.Linear`` layout: ``w_gate`` and ``w_up`` are
(H, D), ``w_down`` is (D, H). Inputs are numpy, cupy or any DLPack array;
numpy inputs run on the CPU backend (Numba), cupy inputs on the CUDA backend.
Results come back in the caller's array type.

Exactness. ``relu(NaN) = NaN`` and counts as active (IEEE semantics with
``check_finite=False``). The sparse kernels have no per-tile capacity: they
compact each token's active neurons themselves, so a token firing thousands of
neurons is exact (on CUDA such a token, past 512 active neurons, is spread over
many blocks by ``raw_kernels/ffn_long.cu``, which rounds its h to the data type
as the dense path does). On CUDA, setting ``heavy_limit`` (<= 2048)
hands tokens firing more neurons to an exact dense sub-FFN instead. Nothing is
ever dropped; ``slots`` and ``tile`` only shape the TwELL container returned
with ``return_activations=True`` (rows over capacity go to its dense backup).

NaN/Inf in ``x`` (``check_finite=True``) raise ValueError. A CUDA call of at
most ``defer_check_rows`` (512) rows does not wait for that count: the next
call of the same object, or ``ffn.check()``, raises for it, and the offending
call's output holds NaN/Inf in the rows concerned. An object's first call,
``check_finite="sync"`` and the one-shot functions always wait.

Decode sizes. On CUDA a call of at most ``decode_rows`` (4 by default, up to 128,
in groups of 16 rows) rows whose 16-row groups of ``x`` fit a block's shared
memory runs two kernels for the whole FFN: the gate GEMV with ReLU and the
up dot products of the active neurons, then the down projection of those
neurons only (``last_info["kernel"] == "decode"``). The general path issues
about eight launches per call, which at these sizes cost more host time than
the GPU work. Same semantics, exact for any number of active neurons.

CUDA graphs (``graphs=True``, the default for FFN objects; ``graphs=False`` or
``TWELLPY_FFN_GRAPHS=0`` turns them off). A
decode-size call is host-bound: the general path's eight launches, a memset and an
event cost more host time (about 0.08 ms on an H100) than its GPU work. With graphs
on, a call of at most 128 rows whose launch sequence is fixed (no
``return_activations``, no ``heavy_limit``, one row chunk, ``mode`` "sparse",
"dense", or "auto", which never probes at these sizes) runs as one CUDA graph: the
first call of a signature (rows, path, NaN/Inf check on or off, the caller's CuPy
stream and thread, the kernel tunings) runs the ordinary path, the second captures the same
launches, later ones copy ``x`` into the graph's input buffer, launch the graph,
and copy its output into a fresh array (never the graph's own buffer). Same kernels
and arguments, so the same bits as without graphs; the NaN/Inf check of ``x`` keeps
its schedule: the graph itself stores each call's count into pinned host memory,
stamped with the call's number, and later calls read it without any CUDA call (a
host more than 64 checked calls ahead of the GPU waits). Each object keeps at most 8
graphs (least recently used dropped); they are freed with the object, when it is
turned off, and when a larger call grows the workspaces (recaptured on later calls).
``last_info["graph"]`` says ``"replay"``, ``"capture"``, ``"warm-up"`` or why a
call ran without one (``"fallback: ..."``). A failed capture warns once and leaves
those calls on the ordinary path. Each graph holds its input and output buffers
(2 * M * D elements); GEMM graphs share a cuBLAS workspace per launch stream and
thread (32 MiB on Hopper, 4 MiB before).

An inactive neuron contributes exactly nothing: ``h_j = 0`` when the gate is
inactive, even if the up projection of that neuron is NaN/Inf. (A non-finite
*down* weight column still reaches every row on the dense path, through the
GEMM's ``0 * NaN``; the sparse path only reads active columns.)

Mode. ``"sparse"`` always uses the sparse step, ``"dense"`` the dense GEMMs.
``"auto"`` measures the active neurons per token after the gate GEMM and
runs dense when the mean exceeds ``auto_threshold``. CUDA: the first row
chunk (up to 16384 rows) decides the whole call; a call already running dense
counts every 16th row of it only (rotating start), to keep the density measured. Waiting for that count is a
host synchronisation, so by default (``auto_probe="first"``) only an FFN
object's first call waits; later calls decide from the count of an earlier
call, copied to the host asynchronously (``last_info["decided_by"]`` says
which; ``auto_probe="always"`` waits in every call). Calls of at most 512
rows skip the probe and run sparse;
threshold ``~0.0086 * H`` for 16-bit data (48 at H = 5632, from the measured
H200 gather rate and crossover). CPU: each chunk of 8192 rows
(``twellpy.backends.cpu_ffn.CHUNK_ROWS``) decides for itself from the active
count of its first 256 rows (``SAMPLE_ROWS``); threshold ``0.06 * H``
(``AUTO_DENSITY``). The decision is reported in
``last_info["mode"]``.
"""
from __future__ import annotations

import numpy as np

from . import _array, backends
from ._array import FLOAT_DTYPES, as_array, check_finite as _check_finite, device_of, float_or_inf, to_caller

__all__ = ["gated_forward", "relu_forward", "GatedFFN", "ReluFFN"]

_MODES = ("auto", "sparse", "dense")


def _check_mode(mode):
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    return mode


def _check_finite_mode(value, name="check_finite"):
    """True, False or "sync" (see GatedFFN)."""
    if isinstance(value, str):
        if value != "sync":
            raise ValueError(f"{name} must be True, False or 'sync', got {value!r}")
        return value
    if not isinstance(value, (bool, np.bool_, int, np.integer)):  # 0 and 1 read as before
        raise TypeError(f"{name} must be True, False or 'sync', got {value!r}")
    return bool(value)


def _check_graphs(value):
    """True or False (see GatedFFN's ``graphs``)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"graphs must be True, False or None, got {value!r}")
    return bool(value)


def _torch_dtype_name(dtype):
    """``torch.<name>`` of a numpy dtype, for error hints addressed to torch users."""
    return "torch." + {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
                       "float64": "float64"}.get(np.dtype(dtype).name, np.dtype(dtype).name)


_AUTOGRAD_WARNED = [False]


def _warn_autograd(named):
    """Warn once per process when a torch tensor that records gradients reaches the
    inference API: its result has no ``grad_fn``, so a later ``backward()`` would
    silently leave these inputs without gradients."""
    if _AUTOGRAD_WARNED[0]:
        return
    for name, t in named:
        # _torch_kind: isinstance, so a torch.Tensor subclass defined outside torch counts too
        if getattr(t, "requires_grad", False) and _array._torch_kind(t):
            import torch

            if torch.is_grad_enabled():
                import warnings

                _AUTOGRAD_WARNED[0] = True
                warnings.warn(f"{name} is a torch tensor that requires grad, but twellpy.ffn's inference "
                              f"functions are not differentiable: the result has no grad_fn. Use "
                              f"twellpy.torch.sparse_gated_ffn / sparse_relu_ffn (or SparseGatedMLP) for "
                              f"training, or call under torch.no_grad(). (Warned once per process.)",
                              UserWarning, stacklevel=4)
                return


def _check_layout(tile, slots):
    for name, v in (("tile", tile), ("slots", slots)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(tile), int(slots)


def _weight(w, name, ndim=2):
    arr, _ = as_array(w, name, ndim=ndim)
    if arr.dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(f"{name} has dtype {arr.dtype}, expected one of {names}")
    return arr


class _FFN:
    """Shared machinery of :class:`GatedFFN` and :class:`ReluFFN`."""

    _gated = True

    def __init__(self, w_gate, w_up, w_down, *, tile=256, slots=32, mode="auto", check_finite=True, graphs=None):
        self.tile, self.slots = _check_layout(tile, slots)
        self.mode = _check_mode(mode)
        self.check_finite = _check_finite_mode(check_finite)
        if graphs is not None:
            _check_graphs(graphs)
        named = ([("w_gate", w_gate)] if self._gated else []) + [("w_up", w_up), ("w_down", w_down)]
        arrs = {name: _weight(w, name) for name, w in named}
        # all weights on one device, one dtype
        devices = {name: device_of(a) for name, a in arrs.items()}
        first = next(iter(arrs))
        for name, a in arrs.items():
            if devices[name] != devices[first]:
                raise ValueError(f"{name} is on {devices[name]} but {first} is on {devices[first]}; "
                                 f"move all weights to one device")
            if a.dtype != arrs[first].dtype:
                raise TypeError(f"{name} has dtype {a.dtype} but {first} has dtype {arrs[first].dtype}; "
                                f"all weights must share one dtype")
        wu, wd = arrs["w_up"], arrs["w_down"]
        H, D = wu.shape
        if H < 1 or D < 1:
            raise ValueError(f"w_up has shape {tuple(wu.shape)}, expected (H, D) with H, D >= 1")
        if self._gated and tuple(arrs["w_gate"].shape) != (H, D):
            raise ValueError(f"w_gate has shape {tuple(arrs['w_gate'].shape)}, expected {(H, D)} "
                             f"(the shape of w_up)")
        if tuple(wd.shape) != (D, H):
            raise ValueError(f"w_down has shape {tuple(wd.shape)}, expected {(D, H)} "
                             f"(nn.Linear layout: (D, H) for w_up of shape {(H, D)})")
        if self.check_finite:
            for name, a in arrs.items():
                _check_finite(a, name)
        self.H, self.D = int(H), int(D)
        self.dtype = np.dtype(wu.dtype)
        self.device = devices[first]
        self._backend = backends.get(wu, "ffn")
        if graphs and self.device == "cpu":  # before the weights are copied
            raise ValueError("graphs=True needs the CUDA backend (CUDA graphs), but the weights are on cpu")
        self._plan = self._backend.prepare(arrs.get("w_gate"), wu, wd)
        if graphs is not None and hasattr(self._plan, "graphs"):
            self._plan.graphs = bool(graphs)
        #: details of the last call: ``mode`` used (``"sparse"``, ``"dense"``, or on
        #: the CPU ``"sparse+dense"`` when auto switched some chunks), ``mean_active`` when measured
        #: on the host (CUDA "auto": the density that decided, and ``decided_by``: ``"probe"``
        #: for this call's own count, ``"earlier call"`` or ``"earlier decision"``),
        #: ``heavy_rows`` handed to the dense sub-FFN
        self.last_info = {}

    # tunables forwarded to the backend plan
    @property
    def auto_threshold(self):
        """Mean active neurons per token above which ``mode="auto"`` runs dense."""
        return self._plan.auto_threshold

    @auto_threshold.setter
    def auto_threshold(self, value):
        if isinstance(value, (str, bytes, bool, np.bool_)):
            raise TypeError(f"auto_threshold must be a real number, got {value!r}")
        v = float_or_inf(value)  # an int beyond float range means +-Inf ("never dense")
        if v != v:  # NaN would make every comparison False: "auto" would never go dense
            raise ValueError("auto_threshold must not be NaN")
        self._plan.auto_threshold = v

    @property
    def auto_probe(self):
        """CUDA: ``"first"`` (default) or ``"always"``: which ``mode="auto"`` calls
        wait for their own measured density (a host synchronisation mid-call).

        With ``"first"`` only the first call waits; later calls decide from the
        density of an earlier call (copied to the host without waiting), so an
        abrupt change of density is followed a call or two later (more when the
        host queues calls far ahead of the GPU). Both paths are
        exact; only the speed differs. None on the CPU, which samples each
        chunk of every call.
        """
        return getattr(self._plan, "auto_probe", None)

    @auto_probe.setter
    def auto_probe(self, value):
        if not hasattr(self._plan, "auto_probe"):
            raise AttributeError("auto_probe applies to the CUDA backend only (the CPU samples every chunk)")
        if value not in ("first", "always"):
            raise ValueError(f"auto_probe must be 'first' or 'always', got {value!r}")
        self._plan.auto_probe = value

    @property
    def heavy_limit(self):
        """CUDA: None (the sparse kernel computes every token) or an int <= 2048:
        tokens firing more neurons go to an exact dense sub-FFN. None on the
        CPU, where setting it raises ``AttributeError`` (as ``auto_probe``)."""
        return getattr(self._plan, "heavy_limit", None)

    @heavy_limit.setter
    def heavy_limit(self, value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                  or not 0 <= int(value) <= 2048):
            raise ValueError(f"heavy_limit must be None or an int in [0, 2048], got {value!r}")
        if not getattr(self._plan, "supports_heavy_limit", False):
            # as the other CUDA-only tunables: the CPU kernel computes every row itself
            raise AttributeError("heavy_limit applies to the CUDA backend only (the CPU kernel computes every row)")
        self._plan.heavy_limit = None if value is None else int(value)

    def check(self):
        """Raise the ValueError of an earlier call whose ``x`` held NaN or Inf and that
        has not been reported yet.

        With ``check_finite=True`` a CUDA call of at most ``defer_check_rows`` rows
        (512: decode sizes), except the object's first, does not wait for the
        NaN/Inf count of its ``x``; a later call of this object (one whose start
        finds the count landed) or this method raises for it. Call it after
        the last call of a loop. Waits for the counts in flight, not for the
        FFN's own kernels. A no-op on the CPU, where every call checks itself.
        """
        check = getattr(self._plan, "check", None)
        if check is not None:
            check()

    @property
    def defer_check_rows(self):
        """CUDA: calls of at most this many rows (default 512) do not wait for the
        NaN/Inf count of ``x`` under ``check_finite=True`` (see :meth:`check`);
        0 makes every call wait. None on the CPU."""
        return getattr(self._plan, "defer_check_rows", None)

    @defer_check_rows.setter
    def defer_check_rows(self, value):
        if not hasattr(self._plan, "defer_check_rows"):
            raise AttributeError("defer_check_rows applies to the CUDA backend only (CPU calls check themselves)")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 0:
            raise ValueError(f"defer_check_rows must be a non-negative int, got {value!r}")
        self._plan.defer_check_rows = int(value)

    @property
    def decode_rows(self):
        """CUDA: calls of at most this many rows (default 4; at most 128) run the two
        decode kernels when ``min(M, 16) * D * itemsize`` fits a block's shared memory
        (the device's opt-in limit less 1 KB: 226 KB on Hopper): the whole FFN (gate
        GEMV, ReLU, up and down projections of the active neurons, and the NaN/Inf
        count of ``x``) in two launches instead of about eight, for ``"auto"`` and
        ``"sparse"`` calls with ``heavy_limit=None``; calls of more than 16 rows run
        in groups of 16 rows. ``last_info["kernel"]`` says ``"decode"`` then. 0
        turns them off. None on the CPU."""
        return getattr(self._plan, "decode_rows", None)

    @decode_rows.setter
    def decode_rows(self, value):
        if not hasattr(self._plan, "decode_rows"):
            raise AttributeError("decode_rows applies to the CUDA backend only")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) <= 128:
            raise ValueError(f"decode_rows must be an int in [0, 128], got {value!r}")
        self._plan.decode_rows = int(value)

    @property
    def graphs(self):
        """CUDA: run decode-size calls as CUDA graphs (see the ``graphs`` parameter of
        :class:`GatedFFN`); turning it off frees the graphs. None on the CPU."""
        return getattr(self._plan, "graphs", None)

    @graphs.setter
    def graphs(self, value):
        if not hasattr(self._plan, "graphs"):
            raise AttributeError("graphs applies to the CUDA backend only (CUDA graphs)")
        self._plan.graphs = _check_graphs(value)

    def activity(self):
        """Active-neuron statistics of the last call: ``{"mean_active", "heavy_rows"}``.

        On CUDA this synchronises with the device.
        """
        return self._plan.activity()

    def __repr__(self):
        kind = "GatedFFN" if self._gated else "ReluFFN"
        graphs = ", graphs=True" if self.graphs else ""
        return (f"{kind}(D={self.D}, H={self.H}, dtype={self.dtype}, device={self.device!r}, "
                f"mode={self.mode!r}, tile={self.tile}, slots={self.slots}{graphs})")

    def __call__(self, x, *, return_activations=False, mode=None, check_finite=None):
        """Apply the FFN to ``x``.

        Parameters
        ----------
        x : array_like
            (..., D) activations on the weights' device, with the weights' dtype.
        return_activations : bool
            Also return the activation ``h`` (M, H), M = number of tokens, as
            a :class:`twellpy.TwELL` (rows over ``slots`` in its dense backup).
        mode : {"auto", "sparse", "dense"}, optional
            Overrides the mode given at construction.
        check_finite : bool or "sync", optional
            Overrides the construction setting for ``x``.

        Returns
        -------
        y : array
            (..., D), the caller's array type.
        h : TwELL
            Only with ``return_activations=True``.
        """
        mode = self.mode if mode is None else _check_mode(mode)
        chk = self.check_finite if check_finite is None else _check_finite_mode(check_finite)
        _warn_autograd([("x", x)])
        arr, kind = as_array(x, "x")
        if arr.ndim < 1:
            raise ValueError(f"x must have at least 1 dimension (..., {self.D}), got a scalar")
        if arr.shape[-1] != self.D:
            raise ValueError(f"x has shape {tuple(arr.shape)}, expected (..., {self.D}) "
                             f"(last dimension = D of the weights)")
        if arr.dtype not in FLOAT_DTYPES:
            names = ", ".join(str(d) for d in FLOAT_DTYPES)
            raise TypeError(f"x has dtype {arr.dtype}, expected one of {names}")
        if arr.dtype != self.dtype:
            how = f"x.to({_torch_dtype_name(self.dtype)})" if kind == "torch" else f"x.astype({self.dtype.name!r})"
            raise TypeError(f"x has dtype {arr.dtype} but the weights have dtype {self.dtype}; "
                            f"cast x with {how}")
        dev = device_of(arr)
        if dev != self.device:
            raise ValueError(f"x is on {dev} but the weights are on {self.device}; "
                             f"move x to {self.device}")
        flat = arr.ndim == 2  # the common case skips two reshapes (decode calls are host-bound)
        lead = None if flat else tuple(arr.shape[:-1])
        x2 = arr if flat else arr.reshape(-1, self.D)
        # each plan checks x for NaN/Inf itself: the CUDA plan counts them on the
        # device and reads the count at a synchronisation it makes anyway
        # True lets a CUDA decode call defer the wait for that count ("auto"); "sync" never does
        y, h_dense, info = self._plan.forward(x2, mode=mode, return_activations=return_activations,
                                              check_x="auto" if chk is True else bool(chk))
        self.last_info = info
        y = to_caller(y if flat else y.reshape(lead + (self.D,)), kind)
        if not return_activations:
            return y
        return y, self._activation(h_dense)

    def _activation(self, h_dense):
        from .twell import TwELL

        values, indices, counts, backup, backup_rows = self._backend.pack_activation(h_dense, self.tile, self.slots)
        # h may legitimately hold NaN/Inf (check_finite=False, fp16 overflow)
        # built here from the packer's arrays: no content scan (a host sync on the GPU)
        return TwELL(values, indices, counts, shape=tuple(h_dense.shape), tile=self.tile,
                     backup=backup, backup_rows=backup_rows, check=False, check_finite=False)


class GatedFFN(_FFN):
    """Reusable gated ReLU FFN: ``(relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``.

    Prepares the weight layouts (``w_down`` transposed once so that each
    neuron's down column is contiguous), kernels, streams and workspaces at
    construction or first call; later calls of a seen size allocate only the
    output.

    The object keeps its own copies of all weights, made at construction:
    changing the caller's arrays afterwards (in place or not) does not affect
    it, on any backend, dtype or memory order. Build a new object to use
    updated weights. The copies take about the weights' size again on their
    device (the CUDA plan keeps ``w_down`` only transposed, one copy).

    Parameters
    ----------
    w_gate, w_up : array_like
        (H, D) gate and up weights (nn.Linear layout).
    w_down : array_like
        (D, H) down weights.
    tile, slots : int
        Layout of the TwELL activation returned with ``return_activations``.
    mode : {"auto", "sparse", "dense"}
        Default mode of the calls (see the module docstring).
    check_finite : bool or "sync"
        Reject NaN/Inf in the weights (here) and in ``x`` (each call) with a
        ValueError. On CUDA, True lets decode-sized calls (at most
        ``defer_check_rows`` = 512 rows) after the first return without waiting
        for the count of ``x``: a NaN/Inf there is raised by a later call or by :meth:`check`,
        and the offending call's ``y`` holds NaN/Inf in the rows concerned.
        ``"sync"`` makes every call wait and raise itself. False lets NaN/Inf
        in ``x`` through, as IEEE arithmetic does.
    graphs : bool or None
        CUDA only: run each decode-size call (at most 128 rows) whose launches are
        fixed as one CUDA graph launch instead of about eight launches (see "CUDA
        graphs" in the module docstring). None (default) takes ``TWELLPY_FFN_GRAPHS``
        (``0`` off, ``1`` or unset on: 1.04-1.35x torch's dense FFN at 16-128 rows
        against 0.79-0.85x without, H100, 2026-12-06); True with weights on the CPU
        raises ValueError.
        Also a settable property.

    Notes
    -----
    On CUDA a call returns before its kernels finish (results are ordered on
    the caller's stream, as for any CuPy operation); with ``check_finite`` a
    call of more than ``defer_check_rows`` rows waits only for the NaN/Inf
    count of ``x``, a smaller one for nothing (waiting there would leave the
    GPU idle after every decode step, slower than dense). Calls from one thread may use
    different streams: each call's stream waits for the previous call's work,
    whose workspaces it reuses. One object must not be called from two
    threads at once; give each thread its own (``twellpy.dask`` does).

    Examples
    --------
    >>> ffn = GatedFFN(w_gate, w_up, w_down)      # doctest: +SKIP
    >>> y = ffn(x)                                   # doctest: +SKIP
    >>> y, h = ffn(x, return_activations=True)       # doctest: +SKIP
    """

    _gated = True


class ReluFFN(_FFN):
    """Reusable plain ReLU FFN: ``relu(x @ w_up.T) @ w_down.T``.

    Same parameters and behaviour as :class:`GatedFFN`, without ``w_gate``;
    it also keeps its own copies of the weights, made at construction.
    """

    _gated = False

    def __init__(self, w_up, w_down, *, tile=256, slots=32, mode="auto", check_finite=True, graphs=None):
        super().__init__(None, w_up, w_down, tile=tile, slots=slots, mode=mode, check_finite=check_finite,
                         graphs=graphs)


def gated_forward(x, w_gate, w_up, w_down, *, return_activations=False, slots=32, tile=256,
                  mode="auto", check_finite=True):
    """Gated ReLU FFN ``(relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``.

    Parameters
    ----------
    x : array_like
        (..., D) numpy, cupy or DLPack array; float16, bfloat16, float32 or float64.
    w_gate, w_up : array_like
        (H, D), same dtype and device as ``x``.
    w_down : array_like
        (D, H).
    return_activations : bool
        Also return ``h = relu(x @ w_gate.T) * (x @ w_up.T)`` as a TwELL (M, H).
    slots, tile : int
        TwELL layout of the returned activation.
    mode : {"auto", "sparse", "dense"}
        See the module docstring.
    check_finite : bool or "sync"
        Raise ``ValueError`` on NaN/Inf in any input (always within this call:
        the object is used once, so nothing is left for a later call to report).

    Returns
    -------
    y : array
        (..., D) in the caller's array type; with ``return_activations`` a
        tuple ``(y, h)``.

    Notes
    -----
    Prepares the weights on every call; use :class:`GatedFFN` for repeated calls.
    Not differentiable: a torch tensor that requires grad gets a result
    without ``grad_fn`` (warned once per process); train through
    :mod:`twellpy.torch`.
    """
    _warn_autograd([("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)])
    ffn = GatedFFN(w_gate, w_up, w_down, tile=tile, slots=slots, mode=mode, check_finite=check_finite,
                    graphs=False)  # used once: a graph would never be replayed
    return ffn(x, return_activations=return_activations, check_finite="sync" if ffn.check_finite else False)


def relu_forward(x, w_up, w_down, *, return_activations=False, slots=32, tile=256,
                 mode="auto", check_finite=True):
    """Plain ReLU FFN ``relu(x @ w_up.T) @ w_down.T``.

    Same parameters and returns as :func:`gated_forward`, without ``w_gate``;
    the returned activation is ``relu(x @ w_up.T)``.
    """
    _warn_autograd([("w_up", w_up), ("w_down", w_down)])
    ffn = ReluFFN(w_up, w_down, tile=tile, slots=slots, mode=mode, check_finite=check_finite,
                    graphs=False)  # used once: a graph would never be replayed
    return ffn(x, return_activations=return_activations, check_finite="sync" if ffn.check_finite else False)
