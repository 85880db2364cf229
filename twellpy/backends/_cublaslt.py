"""The gate GEMM with cuBLASLt's ReLU bit-mask epilogue, through ctypes.

Why: the fused FFN's row pack (``twellpy_ffn_rowpack``) and the training count and
pack read the whole gate output ``g = x @ w_gate.T`` once more after the GEMM wrote
it: 184 MB at W1-16k, about 0.08 ms of an inference call and 0.125 ms of a training
step on an H100. With ``CUBLASLT_EPILOGUE_RELU_AUX`` cuBLASLt applies the ReLU in
the GEMM's epilogue and also writes one bit per output entry (11.5 MB at W1-16k),
so a pack can read the bits and then only the flagged values
(``twellpy_ffn_rowpack_mask`` in ``raw_kernels/ffn_pack.cu``).

Not on any call path yet: ``benchmarks/relu_mask_probe.py`` first checks on a GPU
what the epilogue's bits mean (the bit order in a word, which entries are flagged:
``acc > 0`` before rounding, NaN) and times the epilogue against the plain GEMM.

CuPy 14 has no cuBLASLt wrapper, so the entry points come from the libcublasLt
the process already loaded (libcublas depends on it), else from the one
``cuda.pathfinder`` finds.
"""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from .._array import bfloat16, cupy_module

# enum values of cublasLt.h (stable across cuBLAS 11-13)
_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0  # cudaDataType_t CUDA_R_32F (scale type)
_CUDA_TYPE = {np.dtype(np.float16): 2, bfloat16: 14, np.dtype(np.float32): 0}
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE = 3, 4, 7
_DESC_AUX_POINTER, _DESC_AUX_LD = 11, 12
_EPILOGUE_DEFAULT, _EPILOGUE_RELU_AUX = 1, 2 | 128
_PREF_MAX_WORKSPACE_BYTES = 1
_HEURISTIC_RESULT_BYTES = 96  # algo (64), workspaceSize (8), state (4), wavesCount (4), reserved (16)

_ONE32 = np.array(1.0, np.float32)
_ZERO32 = np.array(0.0, np.float32)


def blas_check(name, status):
    """Raise for a cuBLAS or cuBLASLt call (``name``) that returned a non-zero ``status``."""
    if status:
        raise RuntimeError(f"{name} failed with cuBLAS status {status}")


class _LtEntryPoints:
    """ctypes entry points of one libcublasLt."""

    def __init__(self, lib, path):
        self.path = path
        ptr, c_int, u64, i64, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        sig = {
            "cublasLtCreate": [ctypes.POINTER(ptr)],
            "cublasLtDestroy": [ptr],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(ptr), c_int, c_int],
            "cublasLtMatmulDescDestroy": [ptr],
            "cublasLtMatmulDescSetAttribute": [ptr, c_int, ptr, size],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(ptr), c_int, u64, u64, i64],
            "cublasLtMatrixLayoutDestroy": [ptr],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(ptr)],
            "cublasLtMatmulPreferenceSetAttribute": [ptr, c_int, ptr, size],
            "cublasLtMatmulPreferenceDestroy": [ptr],
            # handle, desc, A, B, C, D layouts, preference, requested, results, returned
            "cublasLtMatmulAlgoGetHeuristic": [ptr, ptr, ptr, ptr, ptr, ptr, ptr, c_int, ptr,
                                               ctypes.POINTER(c_int)],
            # handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace, bytes, stream
            "cublasLtMatmul": [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, size, ptr],
        }
        for name, argtypes in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, c_int
            setattr(self, name[len("cublasLt"):], fn)

    def call(self, name, *args):
        blas_check("cublasLt" + name, getattr(self, name)(*args))

    def new(self, name, *args):
        """``cublasLt<name>(&out, *args)``; returns ``out``."""
        out = ctypes.c_void_p()
        self.call(name, ctypes.byref(out), *args)
        return out.value


def loaded_libraries(prefix):
    """Paths of the shared libraries this process has loaded whose file name starts with
    ``prefix`` (e.g. ``"libcublas.so"``), from ``/proc/self/maps``; empty where unreadable."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith(prefix) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


@functools.lru_cache(maxsize=None)
def lt_library():
    """:class:`_LtEntryPoints` of a libcublasLt, or a string saying why there is none."""
    names = loaded_libraries("libcublasLt.so")  # the copy the process already loaded, if any
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        path = load_nvidia_dynamic_lib("cublasLt").abs_path
        if path and path not in names:
            names.append(path)
    except Exception:  # noqa: BLE001 - an older CuPy, or no pathfinder
        pass
    names += ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11"]
    for name in names:
        try:
            return _LtEntryPoints(ctypes.CDLL(name), name)
        except (OSError, AttributeError):
            continue
    return "no libcublasLt could be loaded"


class ReluMaskGemm:
    """``g = relu(x @ w.T)`` and its ReLU bit mask in one cuBLASLt GEMM.

    Parameters
    ----------
    w : cupy.ndarray
        (H, D) weight, C-contiguous, float16, bfloat16 or float32 (fp32 accumulation).
    workspace_bytes : int
        cuBLASLt workspace (32 MiB: what cuBLAS gives a GEMM on Hopper).
    relu_mask : bool
        False: the plain product through cuBLASLt (no ReLU, no mask; ``mask`` is then
        None in :meth:`__call__`), to tell the epilogue's cost from cuBLASLt's choice
        of algorithm in ``benchmarks/relu_mask_probe.py``.

    Notes
    -----
    Row-major ``g`` (M, H) is column-major ``g^T`` (H, M) = ``w x^T``: cuBLASLt's
    first operand is ``w``'s memory transposed, its second ``x``'s as is. The mask
    is column-major over ``g^T``: bit ``c`` of token ``r`` is bit ``r * mask_ld + c``,
    ``mask_ld`` = H rounded up to 128 bits; :attr:`mask_words` 32-bit words a row.
    """

    def __init__(self, w, workspace_bytes=32 << 20, relu_mask=True):
        lt = lt_library()
        if isinstance(lt, str):
            raise RuntimeError(lt)
        cp = cupy_module()
        dt = np.dtype(w.dtype)
        if dt not in _CUDA_TYPE:
            raise TypeError(f"w has dtype {dt}, expected float16, bfloat16 or float32")
        if w.ndim != 2 or not w.flags.c_contiguous:
            raise ValueError(f"w must be a C-contiguous (H, D) array, got shape {w.shape}")
        self.lt, self.w, self.dtype, self.relu_mask = lt, w, dt, bool(relu_mask)
        self.H, self.D = (int(n) for n in w.shape)
        self.mask_ld = -(-self.H // 128) * 128
        self.mask_words = self.mask_ld // 32
        self.workspace = cp.empty((workspace_bytes,), np.uint8)
        self.handle = lt.new("Create")
        self.desc = lt.new("MatmulDescCreate", _COMPUTE_32F, _R_32F)
        self._set_desc(_DESC_TRANSA, ctypes.c_int32(_OP_T))
        self._set_desc(_DESC_TRANSB, ctypes.c_int32(_OP_N))
        if self.relu_mask:
            self._set_desc(_DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_RELU_AUX))
            self._set_desc(_DESC_AUX_LD, ctypes.c_int64(self.mask_ld))
        ctype = _CUDA_TYPE[dt]
        self.a_layout = lt.new("MatrixLayoutCreate", ctype, self.D, self.H, self.D)  # w^T read column-major
        self.pref = lt.new("MatmulPreferenceCreate")
        lt.call("MatmulPreferenceSetAttribute", self.pref, _PREF_MAX_WORKSPACE_BYTES,
                ctypes.byref(ctypes.c_uint64(workspace_bytes)), 8)
        self._plans = {}  # M -> (x layout, g layout, algo bytes, workspace size)

    def _set_desc(self, attr, value):
        self.lt.call("MatmulDescSetAttribute", self.desc, attr, ctypes.byref(value), ctypes.sizeof(value))

    def _plan(self, M, mask_ptr):
        hit = self._plans.get(M)
        if hit is None:
            lt, ctype = self.lt, _CUDA_TYPE[self.dtype]
            x_layout = lt.new("MatrixLayoutCreate", ctype, self.D, M, self.D)
            g_layout = lt.new("MatrixLayoutCreate", ctype, self.H, M, self.H)
            if self.relu_mask:  # the heuristic reads the mask pointer's alignment
                self._set_desc(_DESC_AUX_POINTER, ctypes.c_void_p(mask_ptr))
            result = (ctypes.c_uint8 * _HEURISTIC_RESULT_BYTES)()
            found = ctypes.c_int(0)
            lt.call("MatmulAlgoGetHeuristic", self.handle, self.desc, self.a_layout, x_layout, g_layout, g_layout,
                    self.pref, 1, ctypes.byref(result), ctypes.byref(found))
            if found.value < 1:
                raise RuntimeError(f"cuBLASLt has no algorithm for the ReLU-mask GEMM of {M} x {self.H} x {self.D}")
            raw = bytes(result)
            ws_size = int(np.frombuffer(raw[64:72], np.uint64)[0])
            hit = self._plans[M] = (x_layout, g_layout, (ctypes.c_uint8 * 64).from_buffer_copy(raw[:64]), ws_size)
        return hit

    def new_mask(self, M):
        """A (M, :attr:`mask_words`) uint32 cupy array for :meth:`__call__`."""
        return cupy_module().empty((M, self.mask_words), np.uint32)

    def __call__(self, x, g, mask, stream=None):
        """``g[:] = relu(x @ w.T)`` and ``mask`` its ReLU bits (``x @ w.T`` alone without
        ``relu_mask``), on ``stream`` (default: current).

        ``x`` (M, D) and ``g`` (M, H) C-contiguous of ``w``'s dtype; ``mask`` from :meth:`new_mask`.
        """
        cp = cupy_module()
        M = int(x.shape[0])
        mask_shape = (M, self.mask_words) if self.relu_mask else None
        if x.shape != (M, self.D) or g.shape != (M, self.H) or (None if mask is None else mask.shape) != mask_shape:
            raise ValueError(f"shapes: x {x.shape}, g {g.shape}, mask {None if mask is None else mask.shape} for "
                             f"w (H, D) = ({self.H}, {self.D}); expected mask {mask_shape}")
        if M == 0:
            return g
        x_layout, g_layout, algo, ws_size = self._plan(M, None if mask is None else mask.data.ptr)
        if self.relu_mask:
            self._set_desc(_DESC_AUX_POINTER, ctypes.c_void_p(mask.data.ptr))
        s = cp.cuda.get_current_stream() if stream is None else stream
        self.lt.call("Matmul", self.handle, self.desc, _ONE32.ctypes.data, self.w.data.ptr, self.a_layout,
                     x.data.ptr, x_layout, _ZERO32.ctypes.data, g.data.ptr, g_layout, g.data.ptr, g_layout,
                     ctypes.byref(algo), self.workspace.data.ptr, min(ws_size, self.workspace.nbytes), s.ptr)
        return g

    def __del__(self):
        lt = getattr(self, "lt", None)
        if lt is None:
            return
        try:
            for x_layout, g_layout, _, _ in self._plans.values():
                lt.MatrixLayoutDestroy(x_layout)
                lt.MatrixLayoutDestroy(g_layout)
            lt.MatrixLayoutDestroy(self.a_layout)
            lt.MatmulPreferenceDestroy(self.pref)
            lt.MatmulDescDestroy(self.desc)
            lt.Destroy(self.handle)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
