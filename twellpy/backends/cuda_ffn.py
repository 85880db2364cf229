"""CUDA backend of the fused FFN inference (CuPy + cuBLAS + RawKernels).

One call (sparse mode):

1. ``g = x @ w_gate.T`` (``w_up`` for the plain ReLU FFN) through cuBLAS
   ``gemmEx`` (fp32 compute; fp64 for fp64 data).
2. ``twellpy_ffn_rowpack`` (``raw_kernels/ffn_pack.cu``): one warp per row
   writes the row's active neurons (relu_active: > 0 or NaN) and gate values
   to a per-row work list (column order, warp prefix counts, no atomics).
3. ``twellpy_ffn_sparse`` (``raw_kernels/ffn_sparse.cu``): per row, the
   up-projection dot products and down-projection axpys of the listed neurons
   only; h never reaches DRAM. A row with more than ``LIST_ROW_CAP`` active
   neurons is left to ``raw_kernels/ffn_long.cu`` (``FFNPlan.long_rows``): one
   more launch spreads it over many blocks (work items: the long rows listed,
   up projections per 32 columns of g with h written over them, then the down
   projection per slice of y), so a token firing thousands of neurons is not
   one block's serial work. With
   ``long_rows`` off the kernel scans g itself for such a row and processes its
   neurons in as many rounds as needed. Any sparsity pattern is exact either
   way. Optionally (``heavy_limit``) such rows are handed to an exact dense
   sub-FFN instead.
   Split mode (``FFNPlan.split_down``): for the rows its lists serve, the kernel
   does only the up projection and writes h over the lists' gate values;
   ``twellpy_spmm_resident`` (``raw_kernels/spmm_resident.cu``) then adds the
   down projection from the lists with a column slice of ``w_down`` in each
   block's shared memory, so ``w_down`` is read once per slice instead of once
   per active neuron. Same bits.
   Two-pass mode (``FFNPlan.two_pass``): the same up-only first pass, then
   ``twellpy_ffn_list_down`` gathers the ``w_downT`` rows of the lists' neurons,
   so each pass gathers rows of one weight matrix instead of two. Same bits.

Decode calls (at most ``FFNPlan.decode_rows`` rows, default 4, up to 128; 16 rows of x
within a block's shared memory, "auto" or "sparse", no ``heavy_limit``) skip all of the above: ``raw_kernels/ffn_decode.cu``
does the gate GEMV, ReLU and up dot products of the active neurons in one kernel
and their down projection in a second, and the first kernel also writes the
NaN/Inf count of x. Two launches instead of about eight: those calls are
host-bound.

CUDA graphs (``FFNPlan.graphs``, on by default; ``TWELLPY_FFN_GRAPHS=0`` turns it off for
new plans). A call of at most ``GRAPH_MAX_ROWS`` (128) rows whose launch sequence is fixed
(no ``return_activations``, no ``heavy_limit``, one row chunk, and a mode that needs no
probe: "sparse", "dense", or "auto" at these sizes, which never probes) runs as one graph
launch: its first call of a signature (rows, kind, NaN/Inf check, caller's stream and
thread, kernel tunings) runs the ordinary path, its second captures the same launches into a graph
(every buffer allocated before the capture, cuBLAS given an explicit workspace), and
later ones copy x into the graph's input buffer, launch, and copy its output buffer
into a fresh y. Same kernels and arguments as the ordinary path, so the same bits. The
NaN/Inf count is written into the plan's counter word inside the graph and copied to
the host outside it, on the ordinary schedule.

Calls of more than ``MAX_CHUNK`` rows run as a two-stream pipeline over row
chunks: stream A does steps 1-2 of chunk ``i+1`` while stream B does step 3
of chunk ``i`` (ring buffers of two chunks).

``mode="auto"`` runs the dense path (cuBLAS up GEMM, ``twellpy_ffn_gate_mul``,
cuBLAS down GEMM) instead of step 3 when the mean active neurons per token of
the first chunk (counted in step 2) exceeds :attr:`FFNPlan.auto_threshold`.
Reading that count mid-call is a host synchronisation that drains the GPU
queue, so with ``auto_probe="first"`` (the default) only a plan's first call
waits for it: every call copies its count to pinned host memory
asynchronously, and a later call decides from the latest copy that has
arrived (an event query, no wait). ``auto_probe="always"`` waits in every
call. Calls of at most ``AUTO_MIN_ROWS`` rows never probe and run sparse.
A call that an earlier count already sends dense skips step 2, except on
every ``DENSITY_SAMPLE``-th row of its first chunk, which keeps the density
measured for later calls. Both paths are exact; the decision only affects speed.
"""
from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from contextlib import nullcontext as _nullcontext

import numpy as np

from .._array import bfloat16, cupy_module, raise_nonfinite, switch_setting
from . import _registry
from . import overflow_rows_to_backup
from .cuda import NonfiniteLedger, PendingCount, RepeatedNonfiniteCheck, allow_dynamic_smem

_SPARSE_FILE = "ffn_sparse.cu"
_PACK_FILE = "ffn_pack.cu"
_DTYPES = (np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64))
_NV_CHOICES = (1, 2, 4, 8)
#: neurons in flight per batch for each NV: "wide" keeps 2*KB*NV = 32 sixteen-byte
#: loads per thread in flight, "narrow" half of that (fewer registers, more blocks/SM)
_KB_FOR_NV = {"wide": {1: 16, 2: 8, 4: 4, 8: 2}, "narrow": {1: 8, 2: 4, 4: 2, 8: 1},
              "narrower": {1: 4, 2: 2, 4: 1, 8: 1}, "single": {1: 2, 2: 1, 4: 1, 8: 1}}
#: default variant (benchmarks/ffn.py times both: TWELLPY_FFN_KB=wide|narrow)
DEFAULT_KB = "narrow"
_LIST_CAP = 2048
#: NaN/Inf counts of x in flight at once: decode calls that do not wait for their
#: count (see FFNPlan.defer_check_rows) may run this many calls ahead of the GPU
_CHECK_RING = 8
#: an "auto" call that an earlier call's density sends dense packs only every
#: DENSITY_SAMPLE-th row of its first chunk (from a start row that rotates call by
#: call, so no position in a sequence always decides), to keep tracking the density:
#: the full row lists would cost about 4% of the dense FFN for nothing (W1-16k, H200).
#: Chunks of fewer than DENSITY_SAMPLE * DENSITY_MIN_SAMPLE rows are counted whole:
#: a few heavy rows in a small sample could flip the decision.
DENSITY_SAMPLE = 16
DENSITY_MIN_SAMPLE = 256


class _CheckTag:
    """Which call a queued NaN/Inf count of x belongs to (see FFNPlan._queue_check)."""

    __slots__ = ("call", "rows", "deferred")

    def __init__(self, call, rows, deferred):
        self.call, self.rows, self.deferred = call, rows, deferred


def _deferred_message(bad):
    """The error for bad deferred calls, ``bad`` a list of ``(tag, count)``, oldest first."""
    tag, n_bad = bad[0]
    also = ""
    if len(bad) > 1:
        more = ", ".join(str(t.call) for t, _ in bad[1:6]) + (", ..." if len(bad) > 6 else "")
        also = f" (and the x of calls {more})"
    return (f"x of an earlier call of this FFN (call {tag.call}, {tag.rows} rows) contains {n_bad} NaN/Inf "
            f"values{also}; that call returned NaN/Inf in the rows concerned (decode-sized calls do not wait "
            f"for the check: a later call or check() reports it). Pass check_finite='sync' to raise in the "
            f"offending call itself, or check_finite=False to let NaN/Inf through as IEEE arithmetic does")


def _sparse_name(dtype, nv, kb, gated, write_h, split=False):
    b = _registry.cbool
    return f"twellpy_ffn_sparse<{_registry.ctype(dtype)}, {nv}, {kb}, {b(gated)}, {b(write_h)}, {b(split)}>"


def _list_down_name(dtype, nv, kb):
    return f"twellpy_ffn_list_down<{_registry.ctype(dtype)}, {nv}, {kb}>"


#: calls of fewer rows keep the fused sparse step when ``FFNPlan.two_pass`` is on: the
#: pass is about the weights' L2 working set, which small calls do not fill
TWO_PASS_MIN_ROWS = 1024


#: resident blocks per SM of the sparse kernel's register budget. Every compile
#: of ffn_sparse.cu gets its budget as -DFFN_MIN_BLOCKS (run-time lookups and
#: declarations alike); the #ifndef default in the .cu file only serves
#: standalone compiles (tests/test_registry.py checks that it equals this).
DEFAULT_MIN_BLOCKS = 2


def _default_min_blocks(nv):
    """FFN_MIN_BLOCKS run time uses for rows of ``nv`` 16-byte vectors a thread:
    DEFAULT_MIN_BLOCKS, except nv = 8 (D > 4096 in 16-bit types), whose
    registers would spill under its cap."""
    return DEFAULT_MIN_BLOCKS if nv <= 4 else 1


def _sparse_defines(l2_hint=False, min_blocks=DEFAULT_MIN_BLOCKS):
    """Defines of a sparse-kernel module; run time and ``_declare_sparse`` both
    use this, so a warm-up compile (``twellpy info --compile``) is the module
    run time loads (the registry compiles one kernel per module anyway)."""
    d = {"FFN_L2_EVICT_LAST": 1} if l2_hint else {}
    d["FFN_MIN_BLOCKS"] = int(min_blocks)  # always explicit: Python is the one source of the budget
    return d


def _ci_instantiations():
    """A covering set of sparse-kernel instantiations for tools/check_kernels.py,
    as ``(dtype, nv, kb, gated, write_h[, split])`` tuples.

    Every dtype, both FFN kinds, both h-writing modes, every NV and both batch
    variants appear at least once; compiling all 256 combinations in CI would
    take half an hour and adds no coverage (run time compiles what it uses).
    """
    bf16, f32 = bfloat16, np.dtype(np.float32)
    out = []
    for dt in _DTYPES:
        nv = 2 if dt.itemsize == 2 else 1
        out.append((dt, nv, _KB_FOR_NV[DEFAULT_KB][nv], True, False))
    for gated, wh in ((False, False), (True, True), (False, True)):
        out.append((bf16, 2, _KB_FOR_NV[DEFAULT_KB][2], gated, wh))
    out.append((f32, 1, _KB_FOR_NV[DEFAULT_KB][1], False, True))
    for nv in (1, 4, 8):
        out.append((bf16, nv, _KB_FOR_NV[DEFAULT_KB][nv], True, False))
    out.append((bf16, 2, _KB_FOR_NV["wide"][2], True, False))
    # split mode (list rows: up projection only; spmm_resident.cu adds the down projection)
    for dt in _DTYPES:
        nv = 2 if dt.itemsize == 2 else 1
        out.append((dt, nv, _KB_FOR_NV[DEFAULT_KB][nv], True, False, True))
    out.append((bf16, 2, _KB_FOR_NV[DEFAULT_KB][2], False, False, True))
    out.append((bf16, 2, _KB_FOR_NV[DEFAULT_KB][2], True, True, True))
    return out


def _declare_sparse(instantiations, min_blocks=None, l2_hint=False):
    """Declare ``(dtype, nv, kb, gated, write_h)`` instantiations of the sparse
    kernel, each compiled with the FFN_MIN_BLOCKS run time gives its NV
    (``_default_min_blocks``), or ``min_blocks`` when given."""
    groups = {}
    for inst in instantiations:
        mb = _default_min_blocks(inst[1]) if min_blocks is None else int(min_blocks)
        groups.setdefault(mb, []).append(_sparse_name(*inst))
    for mb, names in groups.items():
        _registry.declare(_SPARSE_FILE, names, _sparse_defines(l2_hint, mb))


_declare_sparse(_ci_instantiations())


def _declare_list_down():
    """The two-pass step's second kernel at each dtype's usual NV, for the CI compiles."""
    for dt in _DTYPES:
        nv = 2 if dt.itemsize == 2 else 1
        _registry.declare(_SPARSE_FILE, [_list_down_name(dt, nv, _KB_FOR_NV[DEFAULT_KB][nv])],
                          _sparse_defines(False, _default_min_blocks(nv)))


_declare_list_down()
_declare_sparse([(bfloat16, 2, _KB_FOR_NV[DEFAULT_KB][2], True, False)], l2_hint=True)
_declare_sparse([(bfloat16, 2, _KB_FOR_NV[k][2], True, False) for k in ("narrower", "single")])
_declare_sparse([(bfloat16, 2, _KB_FOR_NV[DEFAULT_KB][2], True, False)], min_blocks=1)
_registry.declare(_PACK_FILE, [f"twellpy_ffn_{k}<{_registry.ctype(d)}>"
                               for d in _DTYPES for k in ("pack", "gate_mul", "relu", "rowpack")])

_LONG_FILE = "ffn_long.cu"
#: threads of a long-row block (ffn_long.cu's LONG_THREADS) and the rows of row_count
#: per scan item (its LONG_SCAN)
_LONG_THREADS = 256
_LONG_SCAN = 1024
#: blocks per SM of the long-row kernel's persistent grid (256 threads, about 45 KB of
#: shared memory each)
_LONG_BLOCKS_PER_SM = 2


def _long_name(dtype, gated, write_h):
    b = _registry.cbool
    return f"twellpy_ffn_long<{_registry.ctype(dtype)}, {b(gated)}, {b(write_h)}>"


_registry.declare(_LONG_FILE, [_long_name(d, gated, wh) for d in _DTYPES for gated in (True, False)
                               for wh in (True, False)])

_DECODE_FILE = "ffn_decode.cu"
#: rows a decode launch is instantiated for: a call of M <= 16 rows uses the smallest >= M;
#: a longer call runs groups of 16 rows (a grid dimension of both kernels)
_DECODE_MR = (1, 2, 4, 8, 16)
#: most rows ``decode_rows`` may allow: the gate GEMV runs on CUDA cores, whose time grows
#: with M while the general path's is host-bound; ``benchmarks/decode_probe.py`` times both
_DECODE_MAX_ROWS = 128
#: x is staged in each gate block's shared memory: up to this many bytes without an opt-in
#: (48 KB less the kernel's few static bytes, with room to spare); beyond it, up to the
#: device's opt-in limit less the same margin (``_decode_smem_limit``)
_DECODE_SMEM = 48 * 1024 - 256


@functools.lru_cache(maxsize=None)
def _decode_smem_limit(device_id):
    """Most dynamic shared memory a decode gate block may ask for on ``device_id``."""
    from .cuda import _device_limits

    return max(_DECODE_SMEM, _device_limits(device_id)[1] - 1024)
#: threads of both decode kernels, and neurons per gate block (DECODE_WARPS * DECODE_NPW)
_DECODE_THREADS, _DECODE_NEURONS_PER_BLOCK = 256, 16


def _contiguous_aligned(a):
    """``a`` (cupy) when it is C-contiguous with 16-byte aligned data (the kernels read
    rows in 16-byte vectors), else such a copy."""
    a = cupy_module().ascontiguousarray(a)
    return a if a.data.ptr % 16 == 0 else a.copy()


def _own_copy(a):
    """A C-contiguous copy of ``a`` (cupy) in a new allocation (never a view of ``a``)."""
    c = cupy_module().ascontiguousarray(a)
    return c.copy() if c.data.ptr == a.data.ptr else c


def _decode_names(dtype, gated, mr):
    """Name expressions of the (gate, down) decode kernels for ``dtype`` and M <= ``mr``."""
    c = _registry.ctype(dtype)
    return (f"twellpy_ffn_decode_gate<{c}, {_registry.cbool(gated)}, {mr}>",
            f"twellpy_ffn_decode_down<{c}, {mr}>")


# every instantiation run time can ask for (CI compiles them in one program per arch)
_registry.declare(_DECODE_FILE, sorted({n for dt in _DTYPES for gated in (True, False) for mr in _DECODE_MR
                                        for n in _decode_names(dt, gated, mr)}))

#: capacity of the per-row active lists built by twellpy_ffn_rowpack; rows
#: firing more neurons are scanned directly by the sparse kernel (still exact)
LIST_ROW_CAP = 512
# kernel arguments built once (numpy scalars cost a microsecond each per call)
_NULL = np.uint64(0)
_I32_ZERO, _I64_ZERO, _I32_ONE = np.int32(0), np.int64(0), np.int32(1)
_I32_LIST_ROW_CAP = np.int32(LIST_ROW_CAP)

# cuBLAS constants (cudaDataType_t / cublasComputeType_t / cublasOperation_t)
_CUDA_TYPE = {np.dtype(np.float16): 2, bfloat16: 14, np.dtype(np.float32): 0, np.dtype(np.float64): 1}
_COMPUTE_32F, _COMPUTE_64F = 68, 70
_OP_N, _OP_T = 0, 1
_GEMM_DEFAULT = -1
# host scalars read by cuBLAS at call time (pointer mode host)
_ONE32, _ZERO32 = np.array(1.0, np.float32), np.array(0.0, np.float32)
_ONE64, _ZERO64 = np.array(1.0, np.float64), np.array(0.0, np.float64)


_CUBLAS = None


def _cublas():
    global _CUBLAS
    if _CUBLAS is None:
        from cupy_backends.cuda.libs import cublas

        _CUBLAS = cublas
    return _CUBLAS


class _BlasEntryPoints:
    """ctypes entry points of one loaded libcublas (see :func:`_capture_blas_lib`)."""

    __slots__ = ("path", "create", "destroy", "set_stream", "set_workspace", "gemm_ex")

    def __init__(self, path, create, destroy, set_stream, set_workspace, gemm_ex):
        self.path, self.create, self.destroy = path, create, destroy
        self.set_stream, self.set_workspace, self.gemm_ex = set_stream, set_workspace, gemm_ex

    def new_handle(self):
        """A cuBLAS handle of this library on the current device."""
        import ctypes

        handle = ctypes.c_void_p()
        _blas_check("cublasCreate", self.create(ctypes.byref(handle)))
        return handle.value


@functools.lru_cache(maxsize=None)
def _capture_blas_lib():
    """:class:`_BlasEntryPoints` of the libcublas CuPy loaded, or a string saying why not.

    CuPy 14 exposes no ``cublasSetWorkspace``, and its GEMM wrapper calls
    ``cublasSetStream`` first whenever a stream has ever been made current, which resets
    the handle to cuBLAS's default workspace: so graph captures run their GEMMs through
    ctypes, on handles made by the same library (never one of CuPy's: with two copies of
    libcublas in the process, torch's and CuPy's, a handle must not cross them). The
    library is the one CuPy loaded (``cuda.pathfinder`` says which), else the first
    libcublas in the process's maps; only a loaded one is opened (``RTLD_NOLOAD``).
    """
    import ctypes

    try:
        _cublas()  # importing CuPy's wrapper loads libcublas
    except Exception as exc:  # noqa: BLE001 - reported as the reason graphs are off
        return f"cuBLAS could not be loaded ({exc})"
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:
        return "this platform cannot open the libcublas CuPy loaded (no RTLD_NOLOAD)"
    names = []
    try:  # CuPy 14 loads its libraries through cuda.pathfinder, which caches what it loaded
        from cuda.pathfinder import load_nvidia_dynamic_lib

        path = load_nvidia_dynamic_lib("cublas").abs_path
        if path:
            names.append(path)
    except Exception:  # noqa: BLE001 - an older CuPy, or no pathfinder: look at the loaded libraries
        pass
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith("libcublas.so") and path not in names:
                    names.append(path)
    except OSError:
        pass
    names += ["libcublas.so.13", "libcublas.so.12", "libcublas.so.11"]
    c_int, ptr = ctypes.c_int, ctypes.c_void_p
    for name in names:
        try:
            lib = ctypes.CDLL(name, mode=noload | os.RTLD_LAZY)
            fns = (lib.cublasCreate_v2, lib.cublasDestroy_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
                   lib.cublasGemmEx)
        except (OSError, AttributeError):
            continue
        fns[0].argtypes = [ctypes.POINTER(ptr)]
        fns[1].argtypes = [ptr]
        fns[2].argtypes = [ptr, ptr]
        fns[3].argtypes = [ptr, ptr, ctypes.c_size_t]
        # handle, op_a, op_b, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute, algo
        fns[4].argtypes = [ptr, c_int, c_int, c_int, c_int, c_int, ptr, ptr, c_int, c_int, ptr, c_int, c_int,
                           ptr, ptr, c_int, c_int, c_int, c_int]
        for f in fns:
            f.restype = c_int
        return _BlasEntryPoints(name, *fns)
    return "the libcublas CuPy loaded was not found among the loaded libraries"


@functools.lru_cache(maxsize=None)
def _blas_workspace_bytes(device_id):
    """Bytes of the workspace a graph's GEMMs get: what cuBLAS's default pool gives a call
    (32 MiB from Hopper on, 4 MiB before; the largest size in ``CUBLAS_WORKSPACE_CONFIG``
    when set), so that cuBLAS's heuristics pick the ordinary path's algorithm."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    sizes = [int(v) for v in config.split(":")[1::2] if v.isdigit()]
    if sizes:
        return max(sizes) * 1024
    major = int(cupy_module().cuda.runtime.getDeviceProperties(device_id)["major"])
    return (32 if major >= 9 else 4) << 20


class _CaptureBlas:
    """cuBLAS GEMMs recorded into a CUDA graph: the thread's capture handle, pointed at an
    explicit workspace before every call (``gemm_nt`` and ``gemm_nn`` take it in place of
    a handle). Without one, cuBLAS would allocate its workspace inside the capture."""

    __slots__ = ("lib", "handle", "workspace")

    def __init__(self, lib, handle, workspace):
        self.lib, self.handle, self.workspace = lib, handle, workspace

    def gemm_ex(self, stream, args):
        """``cublasGemmEx(handle, *args)`` on ``stream`` with the explicit workspace."""
        lib, h = self.lib, self.handle
        _blas_check("cublasSetStream", lib.set_stream(h, stream.ptr))
        # after the stream: setting a stream resets the handle to the default workspace
        _blas_check("cublasSetWorkspace", lib.set_workspace(h, self.workspace.data.ptr, self.workspace.nbytes))
        _blas_check("cublasGemmEx", lib.gemm_ex(h, *args))


def _blas_check(name, status):
    if status:
        raise RuntimeError(f"{name} failed with cuBLAS status {status}")


_ONE32_PTR, _ZERO32_PTR = _ONE32.ctypes.data, _ZERO32.ctypes.data
_ONE64_PTR, _ZERO64_PTR = _ONE64.ctypes.data, _ZERO64.ctypes.data


def gemm_nt(a, b, out, handle, stream, on_current=False):
    """``out[:] = a @ b.T`` with cuBLAS on ``stream`` (fp32 compute; fp64 for fp64).

    ``a`` (m, k) and ``b`` (n, k) have unit column stride; ``out`` (m, n) is
    C-contiguous. Row strides of ``a`` may exceed k (row slices).
    ``on_current=True`` says ``stream`` is already the current stream (saves
    entering its context: decode-sized calls are bound by host time).
    """
    return _gemm(a, b, b.shape[0], _OP_T, out, handle, stream, on_current)


def gemm_nn(a, b, out, handle, stream, on_current=False):
    """``out[:] = a @ b`` with cuBLAS on ``stream``; ``b`` (k, n) with unit column stride,
    otherwise as :func:`gemm_nt` (the dense path multiplies by the plan's ``w_downT``)."""
    return _gemm(a, b, b.shape[1], _OP_N, out, handle, stream, on_current)


def _gemm(a, b, n, op_b, out, handle, stream, on_current):
    """Row-major ``out = a @ op(b)``: column-major ``out^T = op(b)^T a^T``, so cuBLAS takes
    ``b``'s memory as its first operand (transposed for ``a @ b.T``, as is for ``a @ b``)."""
    m, k = a.shape
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.fill(0)
        return out
    dt = a.dtype
    isz = dt.itemsize
    if isz == 8:
        one, zero, compute = _ONE64_PTR, _ZERO64_PTR, _COMPUTE_64F
    else:
        one, zero, compute = _ONE32_PTR, _ZERO32_PTR, _COMPUTE_32F
    ctype = _CUDA_TYPE[dt]
    # Row-major C = A @ B.T is column-major C^T = B @ A^T: op(B) = T, op(A) = N; for
    # C = A @ B the row-major (k, n) B read column-major is already B^T: op(B) = N.
    gemm_args = (handle, op_b, _OP_N, n, m, k, one, b.data.ptr, ctype, b.strides[0] // isz,
                 a.data.ptr, ctype, a.strides[0] // isz, zero, out.data.ptr, ctype, out.strides[0] // isz,
                 compute, _GEMM_DEFAULT)
    # CuPy's cuBLAS wrappers bind the handle to the *current* stream on every
    # call, so the stream is selected by making it current.
    if type(handle) is not int:  # a graph capture's _CaptureBlas: it binds stream and workspace itself
        handle.gemm_ex(stream, gemm_args[1:])
    elif on_current:
        _cublas().gemmEx(*gemm_args)
    else:
        with stream:
            _cublas().gemmEx(*gemm_args)
    return out


_THREAD_RESOURCES = threading.local()


def _thread_resources(device_id):
    """Two non-blocking streams and two cuBLAS handles per (thread, device).

    Shared by every plan of the thread: creating and destroying cuBLAS handles
    costs ~0.25 ms a pair, which dominated one-shot calls such as
    :func:`twellpy.ffn.gated_forward` at small sizes. Per thread, because a
    cuBLAS handle must not be used by two threads at once; destroyed when the
    thread ends. Plans of one thread share them: the pipeline's work is
    ordered on the two streams, and the first handle also runs GEMMs on the
    caller's stream (as CuPy shares its own per-thread handle across
    streams), so one thread should not interleave calls on several of its
    own streams expecting them to overlap.
    """
    res = _thread_cuda(device_id)
    return res.streams, res.handles


def _thread_cuda(device_id):
    """The calling thread's :class:`_ThreadCuda` of ``device_id`` (made on first use)."""
    cache = getattr(_THREAD_RESOURCES, "by_device", None)
    if cache is None:
        cache = _THREAD_RESOURCES.by_device = {}
    res = cache.get(device_id)
    if res is None:
        res = cache[device_id] = _ThreadCuda(device_id)
    return res


#: cuBLAS workspaces of graph GEMMs a thread keeps, one per stream graphs are launched on
_GRAPH_WORKSPACES = 4


class _ThreadCuda:
    """One thread's streams and cuBLAS handles on one device (see :func:`_thread_resources`),
    and what its CUDA graph captures use (made on the first capture, see :meth:`capture_blas`)."""

    def __init__(self, device_id):
        cp = cupy_module()
        cublas = _cublas()
        self.device_id = device_id
        with cp.cuda.Device(device_id):
            self.streams = (cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True))
            self.handles = (cublas.create(), cublas.create())
        self._capture_stream = None  # made on the first capture, as the two below
        self._capture_handle = None  # (_BlasEntryPoints, handle it made) of the captured GEMMs
        self._blas_ws = OrderedDict()  # launch stream pointer -> cuBLAS workspace of its graphs

    def capture_stream(self):
        """The stream this thread captures graphs on (a capture cannot run on the legacy stream)."""
        if self._capture_stream is None:
            cp = cupy_module()
            with cp.cuda.Device(self.device_id):
                self._capture_stream = cp.cuda.Stream(non_blocking=True)
        return self._capture_stream

    def capture_blas(self, lib, launch_stream_ptr):
        """A :class:`_CaptureBlas` for graphs launched on ``launch_stream_ptr``, with
        ``lib`` (:func:`_capture_blas_lib`).

        The workspace is shared by every graph of this thread launched on that stream,
        of any plan: launches on one stream run one after the other. The graphs keep a
        reference to it, so one dropped from this short list lives on while they do.
        """
        if self._capture_handle is None:
            cp = cupy_module()
            with cp.cuda.Device(self.device_id):
                self._capture_handle = (lib, lib.new_handle())
        lib, handle = self._capture_handle  # the library that made the handle (one, in practice)
        ws = self._blas_ws.get(launch_stream_ptr)
        nbytes = _blas_workspace_bytes(self.device_id)
        if ws is None or ws.nbytes < nbytes:
            cp = cupy_module()
            with cp.cuda.Device(self.device_id):
                ws = self._blas_ws[launch_stream_ptr] = cp.empty((nbytes,), np.uint8)
        self._blas_ws.move_to_end(launch_stream_ptr)
        while len(self._blas_ws) > _GRAPH_WORKSPACES:
            self._blas_ws.popitem(last=False)
        return _CaptureBlas(lib, handle, ws)

    def __del__(self):
        # runs when the thread's local storage goes; cublasDestroy waits for
        # the device, so work still queued with these handles finishes first
        try:
            cp = cupy_module()
            cublas = _cublas()
            with cp.cuda.Device(self.device_id):
                for h in self.handles:
                    cublas.destroy(h)
                if self._capture_handle is not None:
                    lib, h = self._capture_handle
                    lib.destroy(h)
        except Exception:  # noqa: BLE001 - interpreter shutdown or a lost device: nothing to free
            pass


@functools.lru_cache(maxsize=None)
def _sm_count(device_id):
    cp = cupy_module()
    return int(cp.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def _n_sm():
    return _sm_count(cupy_module().cuda.Device().id)


def _elementwise_grid(n):
    return (max(1, min(int(n + 255) // 256, _n_sm() * 32)),), (256,)


def gate_mul(g, u, out, stream):
    """``out = relu(g) * u`` (NaN-propagating ReLU), element-wise."""
    n = g.size
    if n == 0:
        return out
    k = _registry.get_kernel(_PACK_FILE, f"twellpy_ffn_gate_mul<{_registry.ctype(g.dtype)}>")
    grid, block = _elementwise_grid(n)
    with stream:
        k(grid, block, (g, u, out, np.int64(n)))
    return out


def relu(g, out, stream):
    """``out = relu(g)`` (NaN kept), element-wise."""
    n = g.size
    if n == 0:
        return out
    k = _registry.get_kernel(_PACK_FILE, f"twellpy_ffn_relu<{_registry.ctype(g.dtype)}>")
    grid, block = _elementwise_grid(n)
    with stream:
        k(grid, block, (g, out, np.int64(n)))
    return out


def pack_activation(h, tile, slots):
    """TwELL components of the dense activation ``h`` (M, N).

    Returns ``values, indices, counts, backup, backup_rows``: rows whose
    largest tile holds more than ``slots`` non-zeros are stored entirely in
    ``backup`` (their counts are 0 and their slots padding).
    """
    cp = cupy_module()
    h = cp.ascontiguousarray(h)
    M, N = h.shape
    n_tiles = (N + tile - 1) // tile
    if M * n_tiles * slots > np.iinfo(np.int64).max // 8:
        raise ValueError("activation too large to pack")
    values = cp.empty((M, n_tiles, slots), h.dtype)
    indices = cp.empty((M, n_tiles, slots), np.int32)
    counts = cp.empty((M, n_tiles), np.int32)
    row_max = cp.zeros((M,), np.int32)
    if M and n_tiles:
        warps = 8
        grid = ((M * n_tiles + warps - 1) // warps,)
        k = _registry.get_kernel(_PACK_FILE, f"twellpy_ffn_pack<{_registry.ctype(h.dtype)}>")
        # a tile wider than the row is the row (one tile; fits the int32 argument)
        k(grid, (warps * 32,), (h, np.int64(N), np.int32(M), np.int32(N), np.int32(min(tile, N)),
                                np.int32(slots), np.int32(n_tiles), values, indices, counts, row_max))
    backup, backup_rows = overflow_rows_to_backup(cp, h, values, indices, counts, row_max, slots)
    return values, indices, counts, backup, backup_rows


# ---- CUDA graphs of decode-size calls -----------------------------------------
#: most rows of a call that runs as a CUDA graph (the decode sizes, issue 4's W4)
GRAPH_MAX_ROWS = _DECODE_MAX_ROWS
#: graphs (and the notes on signatures without one) a plan keeps, least recently used dropped
GRAPH_LIMIT = 8


def graph_route(M, mode, *, return_activations=False, heavy_limit=None, chunk=None, sparse_ok=True,
                auto_min_rows=512, max_rows=GRAPH_MAX_ROWS):
    """Whether a call can run as a CUDA graph, from the call and its plan's settings alone.

    A graph replays one launch sequence, so only a call whose launches are decided
    before it starts qualifies; everything else runs the ordinary path.

    Parameters
    ----------
    M : int
        Rows of the call.
    mode : {"auto", "sparse", "dense"}
        The call's mode.
    return_activations : bool
        The call returns h (fresh arrays of its own: not a graph).
    heavy_limit : int or None
        The plan's hand-off of heavy rows (a host synchronisation per call).
    chunk : int or None
        Rows per pipeline chunk asked for (``chunk_rows``); fewer than ``M`` is a pipeline.
    sparse_ok : bool
        The plan has a sparse path (else every call is dense).
    auto_min_rows : int
        ``FFNPlan.AUTO_MIN_ROWS``: "auto" calls of more rows measure their density.
    max_rows : int
        Most rows a graph serves.

    Returns
    -------
    kind : {"sparse", "dense"} or None
        The path the graph holds ("sparse" covers the decode kernels, which the plan
        tells apart), or None.
    reason : str or None
        Why not, when ``kind`` is None.
    """
    if return_activations:
        return None, "return_activations"
    if not 0 < M <= max_rows:
        return None, f"{M} rows (graphs serve 1 to {max_rows})"
    if mode == "dense" or not sparse_ok:
        return "dense", None  # one chunk of GEMMs whatever the other settings
    if heavy_limit is not None:
        return None, "heavy_limit (a host synchronisation per call)"
    if chunk is not None and int(chunk) < M:
        return None, f"chunks of {int(chunk)} rows (the two-stream pipeline)"
    if mode == "auto" and M > auto_min_rows:
        return None, "mode='auto' measures the density of this call"
    return "sparse", None  # "auto" at these sizes never probes: it runs sparse


class GraphCache:
    """Bounded least-recently-used map from a call's signature to its graph (or a note).

    Parameters
    ----------
    limit : int
        Most entries kept; :meth:`put` returns the ones it drops, so that the owner can
        wait for their last launch before their buffers are freed.
    """

    def __init__(self, limit=GRAPH_LIMIT):
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or int(limit) < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        self.limit = int(limit)
        self._items = OrderedDict()

    def get(self, key):
        """The entry of ``key`` (now the most recently used), or None."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key, value):
        """Store ``value`` under ``key``; returns the entries dropped to stay within the limit."""
        self._items[key] = value
        self._items.move_to_end(key)
        dropped = []
        while len(self._items) > self.limit:
            dropped.append(self._items.popitem(last=False)[1])
        return dropped

    def replace(self, predicate, value):
        """Put ``value`` in place of every entry ``predicate`` holds for (order kept);
        returns the entries replaced."""
        out = []
        for key, old in self._items.items():
            if predicate(old):
                out.append(old)
                self._items[key] = value
        return out

    def clear(self):
        """Drop every entry; returns them."""
        values = list(self._items.values())
        self._items.clear()
        return values

    def keys(self):
        """Keys from least to most recently used."""
        return list(self._items)

    def __len__(self):
        return len(self._items)

    def __contains__(self, key):
        return key in self._items


class _GraphNote:
    """A signature's entry without a graph: seen once (warm-up) or not capturable."""

    __slots__ = ("note",)

    def __init__(self, note):
        self.note = note


#: a signature seen once: its next call captures
_WARM = _GraphNote("warm-up")


class _GraphEntry:
    """A captured call: the graph, its input and output buffers, what it holds on to."""

    __slots__ = ("graph", "x", "y", "x_ptr", "y_ptr", "nbytes", "kind", "counters", "blas_workspace",
                 "__weakref__")

    def __init__(self, graph, x, y, kind, counters, blas_workspace):
        self.graph, self.x, self.y, self.kind = graph, x, y, kind
        self.x_ptr, self.y_ptr, self.nbytes = x.data.ptr, y.data.ptr, x.nbytes
        self.counters, self.blas_workspace = counters, blas_workspace


def _is_graph(entry):
    return type(entry) is _GraphEntry


def graphs_default():
    """Whether new plans run decode-size calls as CUDA graphs: ``TWELLPY_FFN_GRAPHS`` (0 or 1; 1 when unset).

    On by default: without graphs a call of 16-128 rows is bound by host time and ran
    0.79-0.85x torch's dense FFN; replayed as a graph 1.04-1.35x, same bits (H100, 2026-12-06)."""
    return switch_setting("TWELLPY_FFN_GRAPHS", os.environ.get("TWELLPY_FFN_GRAPHS", "1"))


def _refuse_allocation(nbytes):
    """CuPy allocator in force during a capture: a buffer allocated there would go back
    to the pool after the capture while the graph still uses it."""
    raise RuntimeError(f"twellpy: {nbytes} bytes were allocated during a CUDA graph capture "
                       f"(every buffer of a graph must exist before it)")


class FFNPlan:
    """Prepared weights, kernel choice, streams and workspaces of one FFN.

    Parameters
    ----------
    w_gate : cupy.ndarray or None
        (H, D) gate weights; None for the plain ReLU FFN.
    w_up, w_down : cupy.ndarray
        (H, D) and (D, H), same dtype and device.
    """

    #: the device-side list of active neurons of one row holds this many entries
    LIST_CAP = _LIST_CAP
    #: GatedFFN.heavy_limit may be set (the CPU plan has no such hand-off)
    supports_heavy_limit = True

    def __init__(self, w_gate, w_up, w_down):
        self.gated = w_gate is not None
        self.dtype = np.dtype(w_up.dtype)
        self.H, self.D = w_up.shape
        self.device_id = w_up.device.id
        # the plan owns copies of all weights (fresh allocations: C-contiguous and
        # 16-byte aligned for the kernels' vector loads), so later in-place changes of
        # the caller's arrays reach none of them (the CPU plan copies too)
        self.w_gate = _own_copy(w_gate) if self.gated else None
        self.w_up = _own_copy(w_up)
        self.gate_w = self.w_gate if self.gated else self.w_up
        self.config = self._choose_config()
        #: "wide" or "narrow" batches of neurons in flight (see _KB_FOR_NV)
        self.kb_variant = os.environ.get("TWELLPY_FFN_KB", DEFAULT_KB)
        if self.kb_variant not in _KB_FOR_NV:
            raise ValueError(f"TWELLPY_FFN_KB must be one of {sorted(_KB_FOR_NV)}, got {self.kb_variant!r}")
        #: gather weights with an L2 evict_last policy (TWELLPY_FFN_L2HINT=1)
        self.l2_hint = os.environ.get("TWELLPY_FFN_L2HINT", "0") == "1"
        #: resident blocks per SM the sparse kernel's registers are sized for
        #: (FFN_MIN_BLOCKS; TWELLPY_FFN_MIN_BLOCKS, benchmarks/ffn.py times 1 to 4)
        env_blocks = os.environ.get("TWELLPY_FFN_MIN_BLOCKS")
        self.min_blocks = int(env_blocks) if env_blocks else self.default_min_blocks()
        if not 1 <= self.min_blocks <= 8:
            raise ValueError(f"TWELLPY_FFN_MIN_BLOCKS must be in [1, 8], got {self.min_blocks}")
        self.sparse_ok = self.config is not None
        # One copy of the down projection per plan (D x H elements; 23 MB in bf16 at W1):
        # the sparse kernels gather rows of w_downT (row j is column j of w_down), and the
        # dense path multiplies by it too (gemm_nn), so w_down itself is kept only when no
        # sparse path exists.
        if self.sparse_ok:
            self.w_down, self.w_downT = None, _own_copy(w_down.T)
        else:
            self.w_down, self.w_downT = _own_copy(w_down), None
        #: None: the sparse kernel computes every row itself, however many
        #: neurons it fires (no host synchronisation). An int <= LIST_CAP hands
        #: rows with more active neurons to an exact dense sub-FFN instead (one
        #: host synchronisation per call to learn how many there are).
        self.heavy_limit = None
        #: rows per pipeline chunk (None: default_chunk(M))
        self.chunk_rows = None
        #: split the sparse step (TWELLPY_FFN_SPLIT=auto|1|0): the fused kernel does
        #: only the up projection of the rows its row lists serve and writes their h
        #: compacted; twellpy_spmm_resident adds the down projection with a column
        #: slice of w_downT in each block's shared memory (w_downT read once per
        #: slice instead of once per active neuron). "auto": calls of at least
        #: cuda.RESIDENT_MIN_ROWS rows whose slice fits. Same bits either way.
        #: Off (0): measured slower (W1-16k on an H200, 2026-12-05: 1.93 ms against
        #: 1.19 ms fused; re-reading the row lists per slice costs more than it saves).
        env_split = os.environ.get("TWELLPY_FFN_SPLIT", "0")
        if env_split not in ("auto", "0", "1"):
            raise ValueError(f"TWELLPY_FFN_SPLIT must be auto, 0 or 1, got {env_split!r}")
        self.split_down = {"auto": "auto", "0": False, "1": True}[env_split]
        #: two-pass sparse step (TWELLPY_FFN_TWO_PASS=1|0) for calls of at least
        #: TWO_PASS_MIN_ROWS rows: the fused kernel does only the up projection of
        #: the rows its lists serve (as split mode), then twellpy_ffn_list_down adds
        #: their down projection by gathers. Each pass's weight working set is then
        #: one matrix (23 MB at W1 in bf16), not two. Same bits. Off: on an H100
        #: (2026-12-07) it was no faster (W1-16k 1.304 against 1.257 ms fused,
        #: W1-64k 5.03 against 5.06, W2 10.8 against 10.6-11.0).
        self.two_pass = switch_setting("TWELLPY_FFN_TWO_PASS", os.environ.get("TWELLPY_FFN_TWO_PASS", "0"))
        #: mean active neurons per token above which "auto" runs the dense path
        self.auto_threshold = self._default_threshold()
        self._ws_rows = 0
        self._ws = {}
        self._kernels = {}  # see _kernel
        self._dims = (np.int32(self.D), np.int32(self.H))
        self._last_rows = 0
        self._last_sparse_rows = 0
        #: "first": only the plan's first "auto" call waits for its own measured
        #: density; later calls decide from an earlier call's count, copied to
        #: pinned host memory without a synchronisation. "always": every call waits.
        self.auto_probe = "first"
        # "auto" (see _remember_density): the mean that decided the last call, and the
        # PendingCount of an earlier call's active count with its row count
        self._density_mean = None
        self._density_copy = None
        self._density_rows = 1
        self._density_slot = None  # (pinned host word, event) reused by every density copy
        self._check = None  # RepeatedNonfiniteCheck of x into counters[3] (see _queue_check)
        self._check_counters = None  # the counter block self._check writes into
        self._ledger = None  # NonfiniteLedger: the counts checked graph replays publish (see _graph_call)
        #: calls of at most this many rows do not wait for the NaN/Inf count of x when
        #: the caller allows it (``check_x="auto"``): a decode call's GPU work is shorter
        #: than the host's own work per call, so waiting for the count leaves the GPU idle
        #: after every call (H200, 2026-12-05: checked M = 1 calls back to back 0.58x
        #: dense). Such a call's count is collected by a later call or by check().
        #: A plan's first call always waits, so a one-off call raises itself.
        self.defer_check_rows = 512
        self._calls = 0  # numbers the calls in deferred NaN/Inf reports
        self._unreported = []  # (tag, count) of bad deferred calls collected but not yet raised
        #: calls of at most this many rows (at most _DECODE_MAX_ROWS) whose 16-row groups
        #: of x fit a block's shared memory run the decode kernels (``ffn_decode.cu``):
        #: the whole FFN in two launches instead of about eight, for "auto" and "sparse"
        #: calls without ``heavy_limit``. 0 turns them off. Default 4: since the general
        #: path replays as a CUDA graph, it beats the decode kernels at 8 rows (H100,
        #: decode_probe.py, W1 sizes, checked, back to back: 0.0555 against 0.0736 ms on
        #: 2026-12-07, 0.0434 against 0.0725 on 2026-12-08) and at a token firing every
        #: neuron (0.10 against 0.38-0.49 ms at 4-8 rows); at 1-4 rows the two are within
        #: noise and the decode kernels' synced call is shorter (M = 1: 0.059 against
        #: 0.078 ms). Groups of 16 (decode_rows = 128) were 0.14-0.40x dense at 32-128 rows.
        self.decode_rows = 4
        #: rows firing more than LIST_ROW_CAP neurons are spread over many blocks by
        #: ffn_long.cu (one launch after the sparse kernel; without ``heavy_limit``).
        #: False: the sparse kernel computes them in one block each, serially (a token
        #: firing all 5632 neurons of W1 took that block about 1.7 ms on an H100).
        self.long_rows = True
        #: launches of the long-row kernel (TWELLPY_FFN_LONG_LAUNCHES=1|3): 1, blocks
        #: take work tickets and wait inside one launch for the stage before theirs
        #: (scan, up work, down work); 3, the three stages as three launches, no waiting
        #: between blocks (same bits). For tools that suspend or serialise blocks
        #: (compute-sanitizer's racecheck and initcheck stalled on the one-launch form on
        #: an H100, 2026-12-06).
        env_launches = os.environ.get("TWELLPY_FFN_LONG_LAUNCHES", "1")
        if env_launches not in ("1", "3"):
            raise ValueError(f"TWELLPY_FFN_LONG_LAUNCHES must be 1 or 3, got {env_launches!r}")
        self.long_launches = int(env_launches)
        self._decode_ws = None
        #: event recorded at the end of every call: the next call's stream waits for it,
        #: since a call returns before its kernels finish and the workspaces are shared
        self._done = None
        #: the stream object _done was last recorded on (held: its handle cannot be reused
        #: while held); a call on that same stream is ordered after it without a wait
        self._done_on = None
        self._graphs_on = graphs_default()  # see the graphs property
        #: graphs of this plan by call signature (see _graph_key), and notes on signatures without one
        self._graphs = GraphCache(GRAPH_LIMIT)
        self._graph_warned = False  # a failed capture is reported once per plan

    def __del__(self):
        # The workspaces go back to the free list of the stream they were allocated on,
        # which may be idle while a later call on another stream still writes them. The
        # same wait covers the graphs' buffers (_done is recorded after each replay too):
        # they go with the plan's attributes, after this returns.
        bad = list(getattr(self, "_unreported", ()))
        try:
            if self._done is not None:
                self._done.synchronize()
            bad += [(tag, n) for tag, n in self._landed_counts(wait="all") if n and tag.deferred]
        except Exception:  # noqa: BLE001 - interpreter shutdown or a lost device
            pass
        if bad:  # outside the try: under -W error the warning is the report, not something to swallow
            import warnings

            warnings.warn(_deferred_message(bad) + " (reported when the FFN was freed: call check() after "
                          "the last call to raise it)", RuntimeWarning, stacklevel=1)

    # ---- configuration ------------------------------------------------------
    def _choose_config(self):
        vec = 16 // self.dtype.itemsize
        if self.D % vec or self.H % vec or self.D == 0 or self.H == 0:
            return None
        dv = self.D // vec
        for warps in (4, 8):
            nv = -(-dv // (warps * 32))
            for cand in _NV_CHOICES:
                if cand >= nv:
                    return warps, cand
        return None  # D too large for the register-resident row: dense path

    def default_min_blocks(self):
        """FFN_MIN_BLOCKS for this plan: 2, except for rows of 8 vectors a thread
        (D > 4096 in 16-bit types), whose registers would spill under its cap."""
        return DEFAULT_MIN_BLOCKS if self.config is None else _default_min_blocks(self.config[1])

    def _default_threshold(self):
        # Cost model calibrated on the H200 (benchmarks/ffn.py): the sparse step
        # gathers 2*D*itemsize bytes per active neuron at ~6 TB/s (measured
        # slope); the dense up+down GEMMs cost 4*D*H flops per token. Crossover
        # nnz ~= 2*H*gather_rate / (gemm_rate * itemsize): ~48 for H = 5632 bf16.
        rate = {2: 700e12, 4: 50e12, 8: 50e12}[self.dtype.itemsize]
        return max(8.0, 2.0 * self.H * 6.0e12 / (rate * self.dtype.itemsize))

    # ---- resources ----------------------------------------------------------
    def _resources(self):
        # looked up per call (a thread-local dict read), so a plan used from
        # another thread takes that thread's handles
        return _thread_resources(self.device_id)

    def _before_replacing_buffers(self):
        """Wait for the previous call's kernels: calls return before they finish,
        and a freed buffer goes back to the free list of the stream that allocated
        it, which may be idle while a later call on another stream still uses it
        (growth is rare, so this wait is too). The plan's graphs hold the addresses of the
        buffers about to go: they are dropped, their signatures left warm (the next call
        of each captures again, with the new buffers)."""
        if self._done is not None:
            self._done.synchronize()
        graphs = getattr(self, "_graphs", None)  # plans made by object.__new__ in tests have none
        if graphs:
            graphs.replace(_is_graph, _WARM)

    def _workspace(self, chunk):
        """Grow-only ring buffers; a call with an already-seen size allocates nothing."""
        cp = cupy_module()
        if chunk > self._ws_rows:
            self._before_replacing_buffers()
            acc = np.float64 if self.dtype == np.float64 else np.float32
            capr = LIST_ROW_CAP
            self._ws = {"g": [cp.empty((chunk, self.H), self.dtype) for _ in range(2)],
                        "u": None}
            if self.sparse_ok:
                self._ws["list_idx"] = [cp.empty((chunk, capr), np.int32) for _ in range(2)]
                # active bits of the long rows (ffn_long.cu); 1/16 of g's bytes in bf16
                self._ws["long_mask"] = [cp.empty((chunk, -(-self.H // 32)), np.uint32) for _ in range(2)]
                # the long-row kernel's state (tickets, counts): zero between launches (it
                # zeroes it itself), and its list of the long rows found
                self._ws["long_state"] = cp.zeros((8,), np.uint32)
                self._ws["long_list"] = [cp.empty((chunk,), np.int32) for _ in range(2)]
                self._ws["list_val"] = [cp.empty((chunk, capr), acc) for _ in range(2)]
                self._ws["row_count"] = [cp.empty((chunk,), np.int32) for _ in range(2)]
            self._ws_rows = chunk
        if "counters" not in self._ws:
            # [0] active neurons seen by the sparse kernel, [1] heavy rows,
            # [2] active neurons of the first chunk (row-pack; "auto" decision),
            # [3] NaN/Inf elements of x (check_x; read with [2] at one synchronisation)
            self._ws["counters"] = cp.zeros((4,), np.uint64)
        return self._ws

    def _heavy_flags(self, M):
        cp = cupy_module()
        hv = self._ws.get("heavy")
        if hv is None or hv.size < M:
            self._before_replacing_buffers()
            hv = cp.zeros((max(M, 1),), np.int32)
            self._ws["heavy"] = hv
        # a slice costs microseconds; the kernels index rows < M only
        return hv if hv.size == M else hv[:M]

    def _u_buffer(self, chunk):
        cp = cupy_module()
        u = self._ws.get("u")
        if u is None or u.shape[0] < chunk:
            self._before_replacing_buffers()
            u = cp.empty((chunk, self.H), self.dtype)
            self._ws["u"] = u
        return u

    #: "auto" never probes calls of at most this many rows (decode sizes run
    #: sparse without a host synchronisation)
    AUTO_MIN_ROWS = 512

    #: largest default chunk: bounds the workspaces (g ring, per-row lists)
    MAX_CHUNK = 16384

    @classmethod
    def default_chunk(cls, M):
        """Rows per pipeline chunk: all rows up to MAX_CHUNK, else MAX_CHUNK.

        Measured on the H200 (W1-16k): one chunk ran 7% faster than four
        overlapped chunks of 4096 rows (the concurrent GEMM and gathers compete
        for L2), so the two-stream pipeline is only used past MAX_CHUNK rows.
        """
        return int(max(1, min(M, cls.MAX_CHUNK)))

    # ---- kernels ------------------------------------------------------------
    def _kernel(self, kind):
        """(kernel, grid cap) of the row-pack or sparse kernel for the current
        device and tuning, memoised per plan: the registry lookup builds names
        and define sets, which decode-sized calls cannot afford each time."""
        dev = cupy_module().cuda.Device().id
        write_h = kind.startswith("sparse_h")
        split = kind.endswith("_split")
        key = (dev, kind, self.config, self.kb_variant, self.l2_hint, self.min_blocks)
        hit = self._kernels.get(key)
        if hit is not None:
            return hit
        if kind == "rowpack":
            k = _registry.get_kernel(_PACK_FILE, f"twellpy_ffn_rowpack<{_registry.ctype(self.dtype)}>")
        elif kind == "list_down":
            _, nv = self.config
            k = _registry.get_kernel(_SPARSE_FILE, _list_down_name(self.dtype, nv, _KB_FOR_NV[self.kb_variant][nv]),
                                     **_sparse_defines(self.l2_hint, self.min_blocks))
        elif kind.startswith("long"):
            k = _registry.get_kernel(_LONG_FILE, _long_name(self.dtype, self.gated, kind == "long_h"))
        else:
            _, nv = self.config
            kb = _KB_FOR_NV[self.kb_variant][nv]
            k = _registry.get_kernel(_SPARSE_FILE, _sparse_name(self.dtype, nv, kb, self.gated, write_h, split),
                                     **_sparse_defines(self.l2_hint, self.min_blocks))
        hit = self._kernels[key] = (k, _sm_count(dev) * 16)
        return hit

    def _launch_rowpack(self, g, buf, stream, total=None, on_current=False):
        m = g.shape[0]
        if m == 0:
            return
        k, _ = self._kernel("rowpack")
        ws = self._ws
        args = (g, np.int64(g.strides[0] // self.dtype.itemsize), np.int32(m), np.int32(self.H),
                _I32_LIST_ROW_CAP, ws["list_idx"][buf], ws["list_val"][buf], ws["row_count"][buf],
                _NULL if total is None else total)
        if on_current:
            k(((m + 7) // 8,), (256,), args)
        else:
            with stream:
                k(((m + 7) // 8,), (256,), args)

    def _split_plan(self, m, y, buf):
        """Resident-kernel plan of the split sparse step for ``m`` rows, or None
        (the fused kernel does the whole row): see ``split_down``."""
        if self.split_down is False or buf is None or not self.sparse_ok:
            return None
        from . import cuda

        # the lists are read in place: no compaction budget (0 slots to copy)
        return cuda._resident_plan(m, self.H, self.D, 0, self.dtype, self.w_downT, y, mode=self.split_down)

    def _two_pass_on(self, m, buf):
        """Whether a sparse step of ``m`` rows runs in two passes (see ``two_pass``)."""
        return self.two_pass and buf is not None and self.sparse_ok and m >= TWO_PASS_MIN_ROWS

    def _launch_sparse(self, x, g, y, h_out, heavy, counters, stream, buf=None, on_current=False):
        warps, nv = self.config
        m = x.shape[0]
        if m == 0:
            return
        split = self._split_plan(m, y, buf)
        two_pass = split is None and self._two_pass_on(m, buf)   # the resident split takes precedence
        kind = "sparse" if h_out is None else "sparse_h"
        k, grid_cap = self._kernel(kind + ("_split" if split is not None or two_pass else ""))
        isz = self.dtype.itemsize
        if h_out is None:
            h_ptr, ldh = _NULL, _I64_ZERO
        else:
            h_ptr, ldh = h_out, np.int64(h_out.strides[0] // isz)
        if buf is None:
            lists = (_NULL, _NULL, _NULL, _I32_ZERO)
        else:
            ws = self._ws
            lists = (ws["list_idx"][buf], ws["list_val"][buf], ws["row_count"][buf], _I32_LIST_ROW_CAP)
        heavy_arg = self._heavy_arg()
        long_rows = buf is not None and self.long_rows and self.heavy_limit is None
        if long_rows and self.long_launches not in (1, 3):  # before anything is queued
            raise ValueError(f"long_launches must be 1 or 3, got {self.long_launches!r}")
        args = (x, np.int64(x.strides[0] // isz), g, np.int64(g.strides[0] // isz),
                self.w_up, self.w_downT, y, np.int64(y.strides[0] // isz),
                h_ptr, ldh) + lists + (heavy, counters,
                np.int32(m)) + self._dims + (np.int32(heavy_arg), _I32_ONE if long_rows else _I32_ZERO)
        grid = (min(m, grid_cap),)
        with (_nullcontext() if on_current else stream):
            k(grid, (warps * 32,), args)
            if long_rows:
                self._launch_long(x, g, y, h_out, buf)
            if two_pass:
                # the first pass wrote h over the gate values of the list rows; rows
                # over min(capr, heavy_limit) it computed whole (or left to others)
                kd, _ = self._kernel("list_down")
                ws = self._ws
                kd(grid, (warps * 32,), (ws["list_idx"][buf], ws["list_val"][buf], ws["row_count"][buf],
                                         _I32_LIST_ROW_CAP, np.int32(min(LIST_ROW_CAP, heavy_arg)), self.w_downT,
                                         y, np.int64(y.strides[0] // isz), np.int32(m), self._dims[0]))
            if split is not None:
                # the fused kernel wrote h over the gate values of the list rows; rows
                # over min(capr, heavy_limit) it computed whole (or left to the host)
                from . import cuda

                ws = self._ws
                cuda._resident_spmm(ws["list_idx"][buf], ws["list_val"][buf], self.w_downT, y, split,
                                    row_count=ws["row_count"][buf], stride=LIST_ROW_CAP,
                                    row_cap=min(LIST_ROW_CAP, heavy_arg))

    def _launch_long(self, x, g, y, h_out, buf):
        """The rows of more than LIST_ROW_CAP active neurons (``ffn_long.cu``), on the
        current stream after the sparse kernel, which left them alone: h over their
        active gate values in ``g``, then their y rows, in one launch (or three, see
        ``long_launches``)."""
        m = x.shape[0]
        k, _ = self._kernel("long" if h_out is None else "long_h")
        isz = self.dtype.itemsize
        ws = self._ws
        mask = ws["long_mask"][buf]
        if h_out is None:
            h_ptr, ldh = _NULL, _I64_ZERO
        else:
            h_ptr, ldh = h_out, np.int64(h_out.strides[0] // isz)
        head = (x, np.int64(x.strides[0] // isz), g, np.int64(g.strides[0] // isz), self.w_up, self.w_downT, y,
                np.int64(y.strides[0] // isz), ws["row_count"][buf], _I32_LIST_ROW_CAP, mask, np.int64(mask.shape[1]),
                h_ptr, ldh, ws["long_state"], ws["long_list"][buf])
        tail = (np.int32(m),) + self._dims
        grid = (_sm_count(self.device_id) * _LONG_BLOCKS_PER_SM,)
        if self.long_launches == 1:  # _launch_sparse checked the value before queueing anything
            k(grid, (_LONG_THREADS,), head + (_I32_ZERO,) + tail)
        else:
            k((-(-m // _LONG_SCAN),), (_LONG_THREADS,), head + (_I32_ONE,) + tail)
            k(grid, (_LONG_THREADS,), head + (np.int32(2),) + tail)
            k(grid, (_LONG_THREADS,), head + (np.int32(3),) + tail)

    def _heavy_arg(self):
        if self.heavy_limit is None:
            return 0x7FFFFFFF
        lim = int(self.heavy_limit)
        if not 0 <= lim <= _LIST_CAP:
            raise ValueError(f"heavy_limit must be None or in [0, {_LIST_CAP}], got {self.heavy_limit!r}")
        return lim

    def _dense_stage2(self, x, g, y, h_out, handle, stream, u):
        """Dense remainder given the gate pre-activation ``g`` of rows ``x``."""
        if self.gated:
            gemm_nt(x, self.w_up, u, handle, stream)
            h = h_out if h_out is not None else u
            gate_mul(g, u, h, stream)
        else:
            h = h_out if h_out is not None else g
            relu(g, h, stream)
        if self.w_downT is not None:
            gemm_nn(h, self.w_downT, y, handle, stream)
        else:
            gemm_nt(h, self.w_down, y, handle, stream)

    def dense_rows(self, x, y, h_out=None, *, max_chunk=16384, handle=None):
        """Dense FFN of all rows of ``x`` on the current stream (chunked workspace);
        ``handle``: the cuBLAS handle (default the thread's first), or a graph capture's
        :class:`_CaptureBlas`."""
        cp = cupy_module()
        if handle is None:
            (_, _), (handle, _) = self._resources()
        stream = cp.cuda.get_current_stream()
        M = x.shape[0]
        step = max(1, min(M, max_chunk))
        g = self._workspace(step)["g"][0]
        u = self._u_buffer(step) if self.gated else None
        for r0 in range(0, M, step):
            r1 = min(M, r0 + step)
            gc = g[: r1 - r0]
            gemm_nt(x[r0:r1], self.gate_w, gc, handle, stream)
            self._dense_stage2(x[r0:r1], gc, y[r0:r1], None if h_out is None else h_out[r0:r1],
                               handle, stream, None if u is None else u[: r1 - r0])
        return y

    def activity(self):
        """Active-neuron statistics of the last sparse call (synchronises).

        Returns ``{"mean_active": float or None, "heavy_rows": int}``; chunks
        run on the dense path (``mode="auto"``) are not counted.
        """
        ws = self._ws
        if "counters" not in ws or self._last_rows == 0:
            return {"mean_active": None, "heavy_rows": 0}
        cp = cupy_module()
        with cp.cuda.Device(self.device_id):
            stream = cp.cuda.get_current_stream()
            if self._done is not None:
                stream.wait_event(self._done)  # the last call may have run on another stream
            seen, n_heavy = (int(v) for v in ws["counters"].get(stream=stream)[:2])
        return {"mean_active": seen / self._last_sparse_rows if self._last_sparse_rows else None,
                "heavy_rows": n_heavy}

    # ---- counts read back without draining the queue ------------------------------
    def _host_slot(self):
        """A pinned host word and an event on the plan's device, allocated once per
        use so that calls allocate nothing for their read-backs (one copy in flight
        at a time: see :class:`twellpy.backends.cuda.PendingCount`)."""
        import cupyx

        cp = cupy_module()
        with cp.cuda.Device(self.device_id):  # the event must belong to the plan's device
            return cupyx.empty_pinned((1,), np.uint64), cp.cuda.Event(block=False, disable_timing=True)

    def _earlier_density(self):
        """``(mean_active, source)`` for this call's "auto" decision without a
        host synchronisation, or ``(None, "probe")`` when the call must measure.

        The latest count copied by :meth:`_remember_density` is used once it has
        arrived (a query, no wait); while it is still in flight the mean that
        decided the previous call decides again.
        """
        if self.auto_probe == "always":
            return None, "probe"
        copy = self._density_copy
        if copy is not None and copy.arrived():
            self._density_mean = copy.read() / self._density_rows
            self._density_copy = copy = None
        if self._density_mean is None:
            return None, "probe"
        return self._density_mean, ("earlier call" if copy is None else "earlier decision")

    def _dense_known(self, early):
        """True when ``early`` (from :meth:`_earlier_density`) already sends this call dense."""
        return early[0] is not None and early[0] > self.auto_threshold

    def _density_rows_of(self, g):
        """The rows of ``g`` whose active count keeps the density measured on the dense
        path: every DENSITY_SAMPLE-th from a start that rotates with the calls, or all
        of them when that would be fewer than DENSITY_MIN_SAMPLE rows."""
        if g.shape[0] < DENSITY_SAMPLE * DENSITY_MIN_SAMPLE:
            return g
        return g[self._calls % DENSITY_SAMPLE::DENSITY_SAMPLE]

    def _remember_density(self, counters, rows, stream, probed_mean=None):
        """Queue a copy of the first chunk's active count (``counters[2]``) to
        pinned host memory (no synchronisation), or take ``probed_mean``, a
        count this call already read."""
        if probed_mean is not None:
            self._density_mean, self._density_copy = probed_mean, None
            return
        if self._density_copy is not None:
            if not self._density_copy.arrived():
                # still in flight: re-recording its event now would push its completion
                # past every later query (a host that runs calls ahead would never see
                # a count arrive); a later call takes the next one
                return
            # landed (no wait): it is the freshest count there is
            self._density_mean = self._density_copy.read() / self._density_rows
        if self._density_slot is None:
            self._density_slot = self._host_slot()
        host, event = self._density_slot
        self._density_copy = PendingCount(counters[2:], stream, host=host, event=event)
        self._density_rows = int(rows)

    def _queue_check(self, x, counters, stream, deferred, rows=None):
        """Count the NaN/Inf elements of x into ``counters[3]`` (zeroed by the caller)
        and queue a copy of the count to pinned host memory right after it; returns
        the call's :class:`_CheckTag`. ``x`` None: a fused kernel already wrote the
        count of the call's ``rows`` rows (the decode gate kernel); only the copy is queued.

        A call that is not ``deferred`` waits on that copy before it returns
        (:meth:`_read_check`), so a NaN or Inf still raises before anything is
        returned, but the wait covers only the work queued before the count
        (earlier calls on the stream, and the count itself), not this call's own
        GEMM and sparse kernels. A deferred call does not wait at all: a later
        call, or :meth:`check`, collects its count (:meth:`_settle_checks`).
        """
        self._ensure_check(counters)
        if self._check.full:  # the host ran _CHECK_RING deferred calls ahead of the GPU
            self._settle_checks(self._check.collect(wait="oldest"))
        tag = _CheckTag(self._calls, x.shape[0] if x is not None else int(rows), deferred)
        self._check.queue(x, stream, tag)
        return tag

    def _ensure_check(self, counters):
        """Make :attr:`_check` (once) and bind it to ``counters[3]``."""
        if self._check is None:
            import cupyx

            cp = cupy_module()
            with cp.cuda.Device(self.device_id):  # the events must belong to the plan's device
                host = cupyx.empty_pinned((_CHECK_RING,), np.uint64)
                events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(_CHECK_RING)]
            self._check = RepeatedNonfiniteCheck(self.dtype, counters[3:], host, events)
            self._check_counters = counters
        elif self._check_counters is not counters:  # the workspaces grew
            self._check.rebind(counters[3:])
            self._check_counters = counters
        return self._check

    def _ensure_ledger(self):
        """Make :attr:`_ledger` (once, on the plan's device)."""
        if self._ledger is None:
            cp = cupy_module()
            with cp.cuda.Device(self.device_id):
                self._ledger = NonfiniteLedger()
        return self._ledger

    def _settle_checks(self, landed, streams=()):
        """Raise for the deferred calls among ``landed`` (``(tag, count)`` pairs from
        :meth:`RepeatedNonfiniteCheck.collect`), and any collected earlier, whose x held
        NaN or Inf: one error naming every such call, each reported once."""
        bad = [(tag, n) for tag, n in landed if n and tag.deferred]
        if self._unreported:
            bad = sorted(self._unreported + bad, key=lambda pair: pair[0].call)
        if bad:
            self._unreported = []
            for s_ in streams:  # let queued work on x finish before the caller reuses it
                s_.synchronize()
            self._density_copy = None  # NaN rows fire every neuron: not a density to steer by
            raise ValueError(_deferred_message(bad))

    def check(self):
        """Raise for deferred calls whose x held NaN or Inf (waits for the counts in flight)."""
        self._settle_checks(self._landed_counts(wait="all"))

    def _call_done(self, stream):
        """Record the end of this call's work on ``stream`` (see ``_done``)."""
        if self._done is None:
            cp = cupy_module()
            with cp.cuda.Device(self.device_id):
                self._done = cp.cuda.Event(block=False, disable_timing=True)
        self._done.record(stream)
        self._done_on = stream

    def _after_previous_call(self, stream):
        """Order ``stream`` after the previous call's end: a wait on ``_done``, skipped when
        that call ended on this very stream object (stream order already does it; decode
        calls are bound by host time, and each CUDA call costs some)."""
        if self._done is not None and self._done_on is not stream:
            stream.wait_event(self._done)

    def _counts_in_flight(self):
        """True when NaN/Inf counts of earlier calls are still to be collected."""
        return bool((self._check is not None and self._check.in_flight)
                    or (self._ledger is not None and self._ledger.in_flight))

    def _landed_counts(self, wait=None):
        """``(tag, count)`` of the calls whose NaN/Inf counts have landed, by call: the
        ordinary calls' copies (:attr:`_check`) and the graph replays' publications
        (:attr:`_ledger`). ``wait``: None waits for nothing; "all" for every count;
        "copies" for the ordinary calls' copies only (the graph replays queued before
        them have ended by then, so their counts are read as they are)."""
        out = []
        if self._check is not None and self._check.in_flight:
            out += self._check.collect(wait=None if wait is None else "all")
        if self._ledger is not None and self._ledger.in_flight:
            out += self._ledger.collect(done=self._done if wait == "all" else None)
        if len(out) > 1:
            out.sort(key=lambda pair: pair[0].call)
        return out

    def _read_check(self, tag, streams, graph=False):
        """The NaN/Inf count of the call ``tag`` (waits for its copy, and earlier ones, only;
        ``graph``: a graph replay's publication, which waits for the replay); raises for an
        earlier deferred call whose x held NaN or Inf when this one's is clean."""
        landed = self._landed_counts(wait="all" if graph else "copies")
        n_bad = next((n for t, n in landed if t is tag), 0)
        if not n_bad:
            self._settle_checks(landed, streams)
        else:  # this call raises for its own x; earlier bad calls are reported by the next call
            self._unreported += [(t, n) for t, n in landed if n and t.deferred and t is not tag]
        return n_bad

    # ---- decode calls -------------------------------------------------------
    def _decode_fits(self, M, mode):
        """True when a call of ``M`` rows in ``mode`` runs the two decode kernels."""
        return (mode != "dense" and self.sparse_ok and self.heavy_limit is None
                and 0 < M <= min(int(self.decode_rows), _DECODE_MAX_ROWS)
                and min(M, _DECODE_MR[-1]) * self.D * self.dtype.itemsize <= _decode_smem_limit(self.device_id)
                and -(-self.H // _DECODE_NEURONS_PER_BLOCK) <= 65535)  # the neuron blocks are grid.y

    def _decode_kernels(self, M):
        """(gate kernel, down kernel) for calls of ``M`` rows, memoised per plan."""
        mr = next(r for r in _DECODE_MR if r >= min(M, _DECODE_MR[-1]))
        key = (cupy_module().cuda.Device().id, "decode", mr)
        hit = self._kernels.get(key)
        if hit is None:
            gate, down = _decode_names(self.dtype, self.gated, mr)
            hit = self._kernels[key] = (_registry.get_kernel(_DECODE_FILE, gate),
                                        _registry.get_kernel(_DECODE_FILE, down))
        return hit

    def _decode_workspace(self, groups):
        """h scratch (16 * groups, H), per group one uint16 per neuron with bit m set where
        it is active in the group's row m (zero padding to a multiple of 8), per-block
        active counts; grow-only, so a call of an already-seen size allocates nothing."""
        ws = self._decode_ws
        if ws is None or ws["groups"] < groups:
            if ws is not None:
                self._before_replacing_buffers()
            cp = cupy_module()
            acc = np.float64 if self.dtype == np.float64 else np.float32
            n_blk = -(-self.H // _DECODE_NEURONS_PER_BLOCK)
            ws = self._decode_ws = {
                "groups": groups,
                "h": cp.empty((_DECODE_MR[-1] * groups, self.H), acc),
                "flags": cp.zeros((groups, -(-self.H // 8) * 8), np.uint16),
                "blk": cp.empty((groups * n_blk,), np.int32),
                "n_blk": n_blk,
                "dv_blocks": -(-(self.D // (16 // self.dtype.itemsize)) // 32),
                "grids": {},
            }
        return ws

    def _launch_decode_gate(self, x, h_full, check_x):
        """Queue the decode gate kernel of the rows ``x`` (C-contiguous, 16-byte aligned) on
        the current stream; returns what :meth:`_launch_decode_down` takes."""
        M = x.shape[0]
        k_gate, k_down = self._decode_kernels(M)
        groups = -(-M // _DECODE_MR[-1])
        ws = self._decode_workspace(groups)
        grids = ws["grids"].get(groups)
        if grids is None:  # (gate grid, down grid, gate blocks) per group count, made once
            grids = ws["grids"][groups] = ((groups, ws["n_blk"]), (ws["dv_blocks"], groups),
                                           np.int32(groups * ws["n_blk"]))
        counters = self._workspace(1)["counters"]
        isz = self.dtype.itemsize
        if h_full is None:
            h_ptr, ldh = _NULL, _I64_ZERO
        else:
            h_ptr, ldh = h_full, np.int64(h_full.strides[0] // isz)
        m32 = np.int32(M)
        smem = min(M, _DECODE_MR[-1]) * self.D * isz
        if smem > _DECODE_SMEM:
            allow_dynamic_smem(k_gate, smem)
        k_gate(grids[0], (_DECODE_THREADS,),
               (x, np.int64(x.strides[0] // isz), self.gate_w, self.w_up, ws["h"], h_ptr, ldh, ws["flags"],
                ws["blk"], counters, np.int32(1 if check_x else 0), m32) + self._dims,
               shared_mem=smem)
        return k_down, ws, grids, counters, m32

    def _launch_decode_down(self, y, launch):
        """Queue the decode down kernel into ``y`` after :meth:`_launch_decode_gate` (``launch``)."""
        k_down, ws, grids, counters, m32 = launch
        k_down(grids[1], (_DECODE_THREADS,),
               (ws["h"], ws["flags"], self.w_downT, y, np.int64(y.strides[0] // self.dtype.itemsize), ws["blk"],
                grids[2], counters, m32) + self._dims)

    def _forward_decode(self, x, y, h_full, info, stream, check_x, deferred):
        """The FFN of a few rows in two kernels (see ``decode_rows``); x is C-contiguous
        and 16-byte aligned. The gate kernel also writes the NaN/Inf count of x (no
        count kernel, no memset) and the activity counts that :meth:`activity` reads."""
        M = x.shape[0]
        launch = self._launch_decode_gate(x, h_full, check_x)
        # the gate kernel wrote the count into counters[3]: queue only its copy, before the
        # down kernel, so that a call that waits for it does not wait for the whole FFN
        tag = self._queue_check(None, launch[3], stream, deferred, rows=M) if check_x else None
        self._launch_decode_down(y, launch)
        info["mode"], info["kernel"] = "sparse", "decode"
        self._call_done(stream)
        self._last_rows = M
        self._last_sparse_rows = M
        if check_x and not deferred:
            info["finite_check"] = "waited"
            if self._read_check(tag, (stream,)):
                stream.synchronize()  # let the queued kernels finish with x before the caller reuses it
                raise_nonfinite(x, "x")
        return y, h_full, info

    # ---- the call -----------------------------------------------------------
    def forward(self, x, *, mode="auto", return_activations=False, chunk_rows=None, check_x=False):
        """Run the FFN on ``x`` (M, D) cupy; see :meth:`_forward`. A call that fails
        midway waits for the work it queued before the error propagates, since
        the next call may run on another stream and reuse the workspaces."""
        cp = cupy_module()
        try:
            if cp.cuda.runtime.getDevice() != self.device_id:
                # streams, events, workspaces and cuBLAS handles all belong to the plan's device
                with cp.cuda.Device(self.device_id):
                    return self._forward(x, mode=mode, return_activations=return_activations,
                                         chunk_rows=chunk_rows, check_x=check_x)
            return self._forward(x, mode=mode, return_activations=return_activations, chunk_rows=chunk_rows,
                                 check_x=check_x)
        except BaseException:
            try:
                cupy_module().cuda.Device(self.device_id).synchronize()
            except Exception:  # noqa: BLE001 - a lost device: the original error matters more
                pass
            raise

    def _forward(self, x, *, mode="auto", return_activations=False, chunk_rows=None, check_x=False):
        """Run the FFN on ``x`` (M, D) cupy; returns ``(y, h_dense_or_None, info)``.

        ``check_x``: False, True or ``"auto"``. With True a NaN or Inf in ``x``
        raises ValueError (naming ``x``) before anything is returned; the count is
        queued ahead of the gate GEMM and read at the call's first host
        synchronisation, or at its end by waiting for the count's own copy only
        (:meth:`_queue_check`): the call returns while its GEMM and sparse kernels
        still run. ``"auto"`` is True for calls of more than ``defer_check_rows``
        rows; smaller calls do not wait, and a later call (before it queues any
        work) or :meth:`check` raises for them.
        """
        cp = cupy_module()
        M = x.shape[0]
        self._calls += 1
        if self._unreported or self._counts_in_flight():
            # counts of earlier deferred calls that have landed (an event query or a word read each, no wait)
            self._settle_checks(self._landed_counts())
        # the first call waits: a one-off GatedFFN(...)(x) then raises itself
        deferred = check_x == "auto" and M <= self.defer_check_rows and self._calls > 1
        graph_note = None
        if self._graphs_on:
            out = self._graph_call(x, M, mode, return_activations, chunk_rows, check_x, deferred)
            if type(out) is tuple:
                return out
            graph_note = out  # why this call runs the ordinary path
        y = cp.empty((M, self.D), self.dtype)
        decode = self._decode_fits(M, mode)
        # the decode gate kernel writes every entry of h; the other paths only the active ones
        h_full = (cp.empty if decode else cp.zeros)((M, self.H), self.dtype) if return_activations else None
        info = {"mode": "dense", "mean_active": None, "heavy_rows": 0,
                "finite_check": "deferred" if deferred else ("waited" if check_x else "off")}
        if graph_note is not None:
            info["graph"] = graph_note
        if M == 0:
            return y, h_full, info
        x = _contiguous_aligned(x)
        cur = cp.cuda.get_current_stream()
        # calls return before their kernels finish: one made on another stream must not
        # overwrite workspaces the previous call's kernels still read
        self._after_previous_call(cur)
        if decode:
            return self._forward_decode(x, y, h_full, info, cur, check_x, deferred)
        if not self.sparse_ok or mode == "dense":
            if check_x:
                # count first, read after the GEMMs are queued (as on the sparse path)
                counters = self._workspace(max(1, min(M, self.MAX_CHUNK)))["counters"]
                cp.cuda.runtime.memsetAsync(counters.data.ptr + 3 * counters.itemsize, 0,
                                            counters.itemsize, cur.ptr)
                tag = self._queue_check(x, counters, cur, deferred)
            self.dense_rows(x, y, h_full)
            self._call_done(cur)
            if check_x and not deferred and self._read_check(tag, (cur,)):
                cur.synchronize()  # let the queued GEMMs finish with x before the caller reuses it
                raise_nonfinite(x, "x")
            return y, h_full, info

        (sA, sB), (hA, hB) = self._resources()
        chunk_rows = chunk_rows or self.chunk_rows
        chunk = int(chunk_rows) if chunk_rows else self.default_chunk(M)
        chunk = max(1, min(chunk, M))
        ws = self._workspace(chunk)
        counters = ws["counters"]
        heavy = self._heavy_flags(M)
        chunks = [(r0, min(M, r0 + chunk)) for r0 in range(0, M, chunk)]
        n = len(chunks)
        use_sparse = True
        x_checked = not check_x or deferred  # True once the NaN/Inf count of x has been read (or need not be)
        tag = None

        def raise_if_nonfinite(n_bad):
            if tag is not None:
                tag.deferred = False  # read here: a later collect must not report it again
                info["finite_check"] = "waited"
            if n_bad:
                for s_ in (cur, sA, sB):  # let queued work on x finish before the caller reuses it
                    s_.synchronize()
                # NaN rows count every neuron as active: this call's density must not
                # steer the next "auto" call (the one before it decides again)
                self._density_copy = None
                raise_nonfinite(x, "x")

        if n == 1:
            # one chunk: everything on the caller's stream, no extra streams
            cp.cuda.runtime.memsetAsync(counters.data.ptr, 0, counters.nbytes, cur.ptr)
            if check_x:
                tag = self._queue_check(x, counters, cur, deferred)
            if self.heavy_limit is not None:
                heavy.fill(0)
            g = ws["g"][0][:M]
            gemm_nt(x, self.gate_w, g, hA, cur, on_current=True)
            measure = mode == "auto" and M > self.AUTO_MIN_ROWS
            early = self._earlier_density() if measure else (None, None)
            # a call that an earlier count already sends dense needs no row lists: it packs
            # every DENSITY_SAMPLE-th row only, to keep measuring the density for later calls
            dense_known = self._dense_known(early)
            packed = self._density_rows_of(g) if dense_known else g
            self._launch_rowpack(packed, 0, cur, total=counters[2:] if measure else None, on_current=True)
            if measure:
                mean, source = early
                if mean is None:
                    # measured density decides (host waits for the gate GEMM + row lists)
                    cur.record().synchronize()
                    seen, n_bad = (int(v) for v in counters[2:].get())
                    raise_if_nonfinite(n_bad)
                    x_checked = True
                    mean = seen / M
                    self._remember_density(counters, M, cur, probed_mean=mean)
                else:
                    self._remember_density(counters, packed.shape[0], cur)
                info["mean_active"], info["decided_by"] = mean, source
                # one reading of the threshold: a call without full row lists must run dense
                use_sparse = not dense_known and mean <= self.auto_threshold
            if use_sparse:
                self._launch_sparse(x, g, y, h_full, heavy, counters, cur, buf=0, on_current=True)
            else:
                u = self._u_buffer(M) if self.gated else None
                self._dense_stage2(x, g, y, h_full, hA, cur, None if u is None else u[:M])
        else:
            start = cur.record()
            sA.wait_event(start)
            sB.wait_event(start)
            cp.cuda.runtime.memsetAsync(counters.data.ptr, 0, counters.nbytes, sB.ptr)
            if check_x:
                tag = self._queue_check(x, counters, sB, deferred)
            if self.heavy_limit is not None:
                with sB:
                    heavy.fill(0)
            zeroed = sB.record()
            early = self._earlier_density() if mode == "auto" else (None, None)
            dense_known = self._dense_known(early)
            measured = [None]  # the rows of chunk 0 that the dense path counts (launch_gate)
            gate_done = [None] * n
            stage2_done = [None] * n

            def launch_gate(ci):
                # stage 1 (stream A): gate GEMM + per-row active lists into ring slot ci % 2
                r0, r1 = chunks[ci]
                b = ci % 2
                g = ws["g"][b][: r1 - r0]
                if ci >= 2:
                    sA.wait_event(stage2_done[ci - 2])  # ring buffer reuse
                if ci == 0:
                    sA.wait_event(zeroed)  # counters[2] is reset on stream B
                gemm_nt(x[r0:r1], self.gate_w, g, hA, sA)
                if not dense_known:
                    self._launch_rowpack(g, b, sA, total=counters[2:] if ci == 0 else None)
                elif ci == 0:  # dense: no row lists, only the (sampled) density of chunk 0
                    measured[0] = self._density_rows_of(g)
                    self._launch_rowpack(measured[0], b, sA, total=counters[2:])
                gate_done[ci] = sA.record()

            def launch_stage2(ci, sparse):
                # stage 2 (stream B): fused sparse up/down, or the dense remainder
                r0, r1 = chunks[ci]
                b = ci % 2
                g = ws["g"][b][: r1 - r0]
                sB.wait_event(gate_done[ci])
                hc = None if h_full is None else h_full[r0:r1]
                if sparse:
                    self._launch_sparse(x[r0:r1], g, y[r0:r1], hc, heavy[r0:r1], counters, sB, buf=b)
                else:
                    u = self._u_buffer(chunk)[: r1 - r0] if self.gated else None
                    self._dense_stage2(x[r0:r1], g, y[r0:r1], hc, hB, sB, u)
                stage2_done[ci] = sB.record()

            launch_gate(0)
            launch_gate(1)
            rows0 = chunks[0][1] - chunks[0][0]
            if mode == "auto":
                # the first chunk's measured density decides every chunk
                mean, source = early
                if mean is None:
                    # the GPU keeps running chunk 1's gate GEMM while the host reads it
                    gate_done[0].synchronize()  # after `zeroed`, so the count of x is done too
                    seen, n_bad = (int(v) for v in counters[2:].get(stream=sA))
                    raise_if_nonfinite(n_bad)
                    x_checked = True
                    mean = seen / rows0
                    self._remember_density(counters, rows0, sA, probed_mean=mean)
                else:
                    # on stream B after chunk 0's row pack: the call's end waits for
                    # stream B, so the next call's reset of the counters comes later
                    sB.wait_event(gate_done[0])
                    self._remember_density(counters, measured[0].shape[0] if dense_known else rows0, sB)
                info["mean_active"], info["decided_by"] = mean, source
                # one reading of the threshold: a call without full row lists must run dense
                use_sparse = not dense_known and mean <= self.auto_threshold
            launch_stage2(0, use_sparse)
            for ci in range(1, n):
                if ci + 1 < n:
                    launch_gate(ci + 1)
                launch_stage2(ci, use_sparse)
            cur.wait_event(stage2_done[-1])
        info["mode"] = "sparse" if use_sparse else "dense"
        self._call_done(cur)
        self._last_rows = M
        self._last_sparse_rows = M if use_sparse else 0

        if self.heavy_limit is None:
            # no host synchronisation with this call's own kernels: statistics stay
            # on the device (activity()); the NaN/Inf count was copied right after
            # it was made, so reading it waits for nothing queued after the count
            if not x_checked:
                raise_if_nonfinite(self._read_check(tag, (cur, sA, sB)))
            return y, h_full, info
        # exact path for heavy rows (costs one host synchronisation)
        stats = counters.get(stream=cur)
        if check_x:  # this host synchronisation reads the count anyway, deferred or not
            raise_if_nonfinite(int(stats[3]))
        n_heavy = int(stats[1])
        if info["mean_active"] is None and use_sparse:
            info["mean_active"] = float(stats[0]) / M
        info["heavy_rows"] = n_heavy
        if n_heavy:
            rows = cp.nonzero(heavy)[0]
            xr = x[rows]
            yr = cp.empty((rows.size, self.D), self.dtype)
            hr = cp.zeros((rows.size, self.H), self.dtype) if h_full is not None else None
            self.dense_rows(xr, yr, hr)
            y[rows] = yr
            if h_full is not None:
                h_full[rows] = hr
            self._call_done(cur)  # the dense sub-FFN used the workspaces too
        return y, h_full, info


    # ---- CUDA graphs of decode-size calls -------------------------------------
    @property
    def graphs(self):
        """Run calls of at most ``GRAPH_MAX_ROWS`` rows whose launches are fixed as CUDA
        graphs (see the module docstring and :func:`graph_route`). On by default;
        ``TWELLPY_FFN_GRAPHS=0`` turns it off for new plans. Turning it off drops the graphs."""
        return self._graphs_on

    @graphs.setter
    def graphs(self, on):
        if not isinstance(on, (bool, np.bool_)):
            raise TypeError(f"graphs must be True or False, got {on!r}")
        if not on and len(self._graphs):
            if self._done is not None:
                self._done.synchronize()  # their last replay must end before their buffers go
            self._graphs.clear()
        self._graphs_on = bool(on)

    def _graph_key(self, M, mode, return_activations, chunk_rows, check_x, stream_ptr):
        """``(signature, kind)`` of a call that can run as a graph, ``kind`` one of "decode",
        "sparse" and "dense"; ``(None, reason)`` when it cannot. The signature holds every
        setting the call's launches depend on, so a tuning changed later (decode_rows,
        kb_variant, long_launches, ...) gets a graph of its own, and the caller's stream and
        thread: a graph is only replayed on the stream it was made for, by the thread that
        made it (its GEMMs use that thread's cuBLAS workspace for that stream, and the
        per-thread default stream has one pointer for a different stream in each thread)."""
        # the chunk the ordinary path takes: the call's, the plan's, else default_chunk (MAX_CHUNK)
        chunk = (chunk_rows or self.chunk_rows) or self.default_chunk(M)
        kind, reason = graph_route(M, mode, return_activations=return_activations, heavy_limit=self.heavy_limit,
                                   chunk=chunk, sparse_ok=self.sparse_ok, auto_min_rows=self.AUTO_MIN_ROWS)
        if kind is None:
            return None, reason
        if kind == "sparse" and self._decode_fits(M, mode):
            kind = "decode"
        return (M, self.dtype, kind, bool(check_x), stream_ptr, threading.get_ident(), self.config, self.kb_variant,
                self.l2_hint, self.min_blocks, self.long_rows, self.long_launches, self.split_down,
                self.two_pass), kind

    def _graph_call(self, x, M, mode, return_activations, chunk_rows, check_x, deferred):
        """This call as a CUDA graph when it can be one: ``(y, None, info)``; otherwise a note
        (``last_info["graph"]``) and the ordinary path runs it. A signature's first call
        runs the ordinary path (it loads the kernels and sizes the workspaces), its
        second captures, later ones replay."""
        cur = cupy_module().cuda.get_current_stream()
        if x.dtype != self.dtype or x.ndim != 2 or x.shape[1] != self.D:
            return "fallback: x is not (M, D) of the weights' dtype"
        key, kind = self._graph_key(M, mode, return_activations, chunk_rows, check_x, cur.ptr)
        if key is None:
            return "fallback: " + kind
        entry = self._graphs.get(key)
        # a capture makes the ledger (_capture); the host may run NonfiniteLedger.RING
        # checked replays ahead of the GPU, no more
        if check_x and self._ledger is not None and self._ledger.full and type(entry) is not _GraphNote:
            self._settle_checks(self._ledger.collect(done=self._done))
        if type(entry) is _GraphEntry:
            self._graph_input(entry.x, x, cur)
            entry.graph.launch(cur)
            how = "replay"
        elif entry is _WARM:
            entry = self._graph_capture(key, kind, x, M, bool(check_x), cur)
            if type(entry) is _GraphNote:
                return entry.note
            how = "capture"
        elif entry is None:
            self._graph_store(key, _WARM)
            return _WARM.note
        else:
            return entry.note
        cp = cupy_module()
        rt = cp.cuda.runtime
        # the graph publishes its NaN/Inf count itself (a call that waits, waits for the whole
        # graph: it ran as one launch)
        tag = None
        if check_x:
            tag = _CheckTag(self._calls, M, deferred)
            self._ledger.queue(tag)
        # the caller gets a fresh array: the next replay overwrites the graph's output buffer
        y = cp.empty((M, self.D), self.dtype)
        rt.memcpyAsync(y.data.ptr, entry.y_ptr, entry.nbytes, rt.memcpyDeviceToDevice, cur.ptr)
        self._call_done(cur)  # after the copy: the next call's graph may overwrite entry.y
        info = {"mode": "dense" if entry.kind == "dense" else "sparse", "mean_active": None, "heavy_rows": 0,
                "finite_check": "deferred" if deferred else ("waited" if check_x else "off"), "graph": how}
        if entry.kind == "decode":
            info["kernel"] = "decode"
        if entry.kind != "dense":  # as the ordinary path, whose dense branch leaves these alone
            self._last_rows = M
            self._last_sparse_rows = M
        if check_x and not deferred and self._read_check(tag, (cur,), graph=True):
            cur.synchronize()  # let the queued work finish with x before the caller reuses it
            if entry.kind == "sparse":  # as the ordinary path's sparse branch (raise_if_nonfinite)
                self._density_copy = None
            raise_nonfinite(x, "x")
        return y, None, info

    def _graph_store(self, key, entry):
        dropped = self._graphs.put(key, entry)
        if self._done is not None and any(map(_is_graph, dropped)):
            self._done.synchronize()  # their last replay must end before their buffers go back to the pool

    def _graph_input(self, x_static, x, cur):
        """Copy ``x`` into a graph's input buffer on ``cur``, after the previous call (whose
        kernels may still read the workspaces, on another stream)."""
        self._after_previous_call(cur)
        if x.flags.c_contiguous:
            rt = cupy_module().cuda.runtime
            rt.memcpyAsync(x_static.data.ptr, x.data.ptr, x_static.nbytes, rt.memcpyDeviceToDevice, cur.ptr)
        else:
            x_static[...] = x  # a strided copy on the current stream (cur)

    def _graph_unsupported(self, kind, M):
        """Why calls of ``kind`` and ``M`` rows cannot be captured on this setup, or None."""
        if kind != "decode":
            lib = _capture_blas_lib()
            if isinstance(lib, str):
                return lib
        if kind == "sparse" and (self.split_down is True or self.split_down == "auto" and M >= _split_min_rows()):
            return "the split sparse step (TWELLPY_FFN_SPLIT; not captured)"
        return None

    def _graph_capture(self, key, kind, x, M, check, cur):
        """Capture the call of signature ``key`` and launch it on ``cur``; returns the stored
        :class:`_GraphEntry`, or the stored :class:`_GraphNote` saying why there is none
        (the ordinary path then runs this call and the later ones of the signature)."""
        try:
            capturing = cur.is_capturing()
        except Exception:  # noqa: BLE001 - a query refused while some capture runs: do not add one
            capturing = True
        if capturing:  # not stored: a later call of the signature may capture
            return _GraphNote("fallback: the caller's stream is capturing a graph itself")
        why = self._graph_unsupported(kind, M)
        entry = None
        if why is None:
            try:
                entry = self._capture(kind, x, M, check, cur)
            except Exception as exc:  # noqa: BLE001 - the ordinary path is exact: fall back, say so once
                why = f"capture failed ({type(exc).__name__}: {exc})"
                if not self._graph_warned:
                    import warnings

                    self._graph_warned = True
                    warnings.warn(f"twellpy: the CUDA graph of a {M}-row FFN call could not be captured; such "
                                  f"calls run without one: {why}", RuntimeWarning, stacklevel=6)
        if entry is None:
            entry = _GraphNote("fallback: " + why)
        self._graph_store(key, entry)
        return entry

    def _capture(self, kind, x, M, check, cur):
        cp = cupy_module()
        res = _thread_cuda(self.device_id)
        # every buffer the launches touch exists before the capture (the warm-up call sized
        # the workspaces; these calls allocate nothing then)
        if kind == "decode":
            self._decode_workspace(-(-M // _DECODE_MR[-1]))
            counters = self._workspace(1)["counters"]
        else:
            counters = self._workspace(M)["counters"]
            if kind == "sparse":
                self._heavy_flags(M)
            elif self.gated:
                self._u_buffer(M)
        if check:
            self._ensure_check(counters)
            self._ensure_ledger()
        x_s = cp.empty((M, self.D), self.dtype)
        y_s = cp.empty((M, self.D), self.dtype)
        blas = None if kind == "decode" else res.capture_blas(_capture_blas_lib(), cur.ptr)
        cap = res.capture_stream()
        # this call's input, and one run of the launches on the caller's stream outside the
        # capture: the capture handle's first GEMMs load what they need here
        self._graph_input(x_s, x, cur)
        self._graph_body(kind, x_s, y_s, check, blas, cur, publish=False)
        # thread-local mode: an unsafe call of this thread (cudaMalloc) fails the capture, other
        # threads are not affected; a CuPy allocation fails it too (_refuse_allocation). No
        # cyclic garbage collection inside it: a finalizer run there on this thread (a CuPy
        # array freed without the pool, as under compute-sanitizer: cudaFree) would fail it too.
        import gc

        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            with cp.cuda.using_allocator(_refuse_allocation), cap:
                cap.begin_capture(cp.cuda.runtime.streamCaptureModeThreadLocal)
                try:
                    self._graph_body(kind, x_s, y_s, check, blas, cap)
                except BaseException:
                    try:
                        cap.end_capture()
                    except Exception:  # noqa: BLE001 - an invalidated capture ends with an error: the first one matters
                        pass
                    raise
                graph = cap.end_capture()
        finally:
            if gc_was_on:
                gc.enable()
        entry = _GraphEntry(graph, x_s, y_s, kind, counters, None if blas is None else blas.workspace)
        entry.graph.launch(cur)
        return entry

    def _graph_body(self, kind, x, y, check, blas, stream, publish=True):
        """The device work of one call of ``kind`` on ``x`` into ``y`` (``stream`` current),
        without what a graph cannot hold: no events, no host reads, no allocation; the
        NaN/Inf count goes into ``counters[3]`` and, with ``publish``, to the host through
        :attr:`_ledger`. Launch for launch the ordinary path of that kind
        (``_forward_decode``; the one-chunk branch of ``_forward`` without a probe; its
        dense branch), so the same bits: tests/test_gpu_ffn_infer.py compares them."""
        publish = publish and check
        if kind == "decode":
            launch = self._launch_decode_gate(x, None, check)
            if publish:
                self._ledger.launch(launch[3][3:], stream)
            self._launch_decode_down(y, launch)
            return
        M = x.shape[0]
        counters = self._ws["counters"]
        rt = cupy_module().cuda.runtime
        if kind == "dense":
            if check:
                rt.memsetAsync(counters.data.ptr + 3 * counters.itemsize, 0, counters.itemsize, stream.ptr)
                self._check.launch(x, stream, counters[3:])
                if publish:
                    self._ledger.launch(counters[3:], stream)
            self.dense_rows(x, y, None, handle=blas)
            return
        rt.memsetAsync(counters.data.ptr, 0, counters.nbytes, stream.ptr)
        if check:
            self._check.launch(x, stream, counters[3:])
            if publish:
                self._ledger.launch(counters[3:], stream)
        g = self._ws["g"][0][:M]
        gemm_nt(x, self.gate_w, g, blas, stream, on_current=True)
        self._launch_rowpack(g, 0, stream, on_current=True)
        self._launch_sparse(x, g, y, None, self._heavy_flags(M), counters, stream, buf=0, on_current=True)


def _split_min_rows():
    from .cuda import RESIDENT_MIN_ROWS

    return RESIDENT_MIN_ROWS


def prepare(w_gate, w_up, w_down):
    """FFN plan for cupy weights (``w_gate`` None for the plain ReLU FFN)."""
    return FFNPlan(w_gate, w_up, w_down)
