"""The one kernel registry.

Kernels live as CUDA sources in ``raw_kernels/``. A backend module declares the
template instantiations it uses with :func:`declare`; at run time
:func:`get_kernel` compiles a source file once per device (through
``cupy.RawModule`` with ``name_expressions``, so CuPy's own disk cache is the
cache) and returns the requested ``cupy.RawKernel``. ``tools/check_kernels.py``
compiles every declared instantiation with NVRTC for sm_90a and sm_80 on a
machine without a GPU, using :func:`nvrtc_options`, the same options as here.
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from .._array import bfloat16, cupy_module

#: Options passed to NVRTC for every kernel (CuPy appends -arch and -ftz=true;
#: kernels therefore test "non-zero" on bit patterns, never with float compares).
BASE_OPTIONS = ("-std=c++17",)

_CTYPES = {
    np.dtype(np.float16): "__half",
    bfloat16: "__nv_bfloat16",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
    np.dtype(np.int32): "int",
    np.dtype(np.int64): "long long",
}

# source_file -> list of (name_expressions tuple, defines dict)
_DECLARED: dict[str, list] = {}
_CACHE: dict = {}
_LOCK = threading.RLock()


def kernel_dir() -> Path:
    """Folder holding the ``.cu`` sources.

    ``raw_kernels/`` sits next to the package in a source checkout and inside
    the package (``twellpy/raw_kernels``) in an installed wheel.
    """
    env = os.environ.get("TWELLPY_KERNEL_DIR")
    if env:
        return Path(env)
    pkg = Path(__file__).resolve().parent.parent
    for cand in (pkg / "raw_kernels", pkg.parent / "raw_kernels"):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(f"raw_kernels/ not found next to {pkg}; reinstall twellpy")


def ctype(dtype) -> str:
    """C++ type name used in template name expressions for ``dtype``."""
    try:
        return _CTYPES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no CUDA type for dtype {np.dtype(dtype)}") from None


def cbool(value) -> str:
    """C++ literal for a bool template argument in a name expression."""
    return "true" if value else "false"


def declare(source_file: str, name_expressions, defines=None):
    """Register kernel instantiations that live in ``raw_kernels/source_file``.

    Parameters
    ----------
    source_file : str
        File name inside ``raw_kernels/``.
    name_expressions : iterable of str
        e.g. ``["twellpy_spmm<float>", "twellpy_spmm<__half>"]``.
    defines : dict, optional
        ``#define`` tunables these instantiations are compiled with.
    """
    with _LOCK:
        _DECLARED.setdefault(source_file, []).append((tuple(name_expressions), dict(defines or {})))


def declared():
    """All declarations: ``{source_file: [(name_expressions, defines), ...]}``."""
    with _LOCK:
        return {k: list(v) for k, v in _DECLARED.items()}


def _define_options(defines):
    return tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))


def nvrtc_options(defines=None, arch=None):
    """Options for NVRTC: BASE_OPTIONS, include dir, defines and (optionally) arch."""
    opts = BASE_OPTIONS + (f"-I{kernel_dir()}",) + _define_options(defines or {})
    if arch is not None:
        opts += (f"-arch=sm_{arch}",)
    return opts


def read_source(source_file: str) -> str:
    """Text of ``raw_kernels/source_file`` as it is on disk."""
    return (kernel_dir() / source_file).read_text()


@functools.lru_cache(maxsize=None)
def _headers_digest(folder: str) -> str:
    """Digest of every ``.cuh`` header in ``folder`` (names and contents)."""
    h = hashlib.sha256()
    for path in sorted(Path(folder).glob("*.cuh")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def module_source(source_file: str) -> str:
    """The source handed to NVRTC: the file plus a last comment line holding the
    digest of the headers it may include. CuPy's disk cache keys on the source
    text and the options only, not on included files, so without this line a
    changed ``common.cuh`` (a new twellpy over an old ``~/.cupy/kernel_cache``)
    would load kernels compiled from the old header."""
    folder = kernel_dir()
    return read_source(source_file) + f"\n// twellpy headers {_headers_digest(str(folder))}\n"


def _names_for(source_file, defines, name):
    """Name expressions compiled in the module that serves ``name``: just ``name``.

    One kernel per module keeps the first-call latency proportional to what
    is used (a file such as spmm.cu declares ~100 instantiations, about a
    minute of NVRTC time together, about a second each); CuPy's disk cache
    keys on the name expressions, so each kernel is still compiled once per
    machine. ``declare`` remains the list ``tools/check_kernels.py`` compiles.
    """
    return (name,)


def get_kernel(source_file: str, name: str, **defines):
    """Compiled ``cupy.RawKernel`` for ``name`` in ``raw_kernels/source_file``.

    Memoized per device, per file, per name and per set of defines;
    thread-safe. Each kernel is compiled in its own module on first use (see
    ``_names_for``), and CuPy's disk cache keeps it across processes.
    """
    cp = cupy_module()
    if cp is None:
        raise RuntimeError("CuPy is required for GPU kernels: pip install 'twellpy[cuda]'")
    dev = cp.cuda.Device().id
    key = (dev, source_file, tuple(sorted(defines.items())), name)
    k = _CACHE.get(key)
    if k is not None:
        return k
    with _LOCK:
        k = _CACHE.get(key)
        if k is not None:
            return k
        module = _module(cp, dev, source_file, defines, name)
        k = module.get_function(name)
        _CACHE[key] = k
        return k


def _module(cp, dev, source_file, defines, name):
    names = _names_for(source_file, defines, name)
    mkey = (dev, source_file, tuple(sorted(defines.items())), names)
    mod = _CACHE.get(mkey)
    if mod is None:
        opts = nvrtc_options(defines)
        cc = cp.cuda.Device(dev).compute_capability
        if cc == "90":
            # sm_90a unlocks wgmma/setmaxnreg; CuPy's own -arch=sm_90 is then
            # superseded (NVRTC keeps the arch-specific feature set).
            opts += ("-arch=sm_90a",)
        mod = cp.RawModule(code=module_source(source_file), options=opts, name_expressions=names)
        mod.compile()
        _CACHE[mkey] = mod
    return mod


def launch_1d(n, block=256):
    """Grid for ``n`` threads in blocks of ``block``."""
    return (max(1, (int(n) + block - 1) // block),), (block,)
