"""The ``twellpy`` command line (also ``python -m twellpy``).

Sub-commands
------------
info
    Versions, GPU and compute capability, where the CUDA kernels are and how
    many are declared, compiled in this process and cached on disk.
demo
    Builds an activation-like sparse matrix, converts it to every format,
    compares their sizes, checks ``A @ W`` against scipy.sparse, checks the
    fused FFN against a float64 reference and times everything. Uses the GPU
    when one is usable, else the CPU.
bench
    Runs the benchmark scripts in ``benchmarks/`` with a progress bar and
    prints their tables (``--json`` for machine-readable output).
convert
    Converts a ``twellpy.save`` file, a ``scipy.sparse.save_npz`` file or a
    dense ``.npy`` file to another format.
stats
    Sparsity statistics of an activation array saved with ``numpy.save``, and
    optionally a figure.

Every sub-command is also a plain function (``cmd_info(args)`` ...) so it can
be tested without a subprocess; :func:`main` returns the exit status.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

#: Formats ``convert`` writes with ``twellpy.save`` / ``scipy.sparse.save_npz``.
TWELLPY_FORMATS = ("twell", "ell", "hybrid")
SCIPY_FORMATS = ("csr", "csc", "coo")

#: Relative-error bounds the demo checks against (float64 reference).
_DEMO_RTOL = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}

_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")


class CLIError(Exception):
    """A user error: printed as ``twellpy <command>: error: ...``, exit status 2."""


# --------------------------------------------------------------------- helpers
def _print_table(headers, rows, file=None):
    """Print ``rows`` (lists of str) under ``headers`` with aligned columns."""
    file = file or sys.stdout
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    print("  ".join(h.ljust(w) for h, w in zip(cells[0], widths)).rstrip(), file=file)
    print(line, file=file)
    for r in cells[1:]:
        # first column left-aligned (names), the rest right-aligned (numbers)
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))).rstrip(), file=file)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable; keeps type checkers quiet


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _dist_version(*names):
    """Installed version of the first distribution in ``names``, or None."""
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _parse_dtype(name: str):
    from ._array import bfloat16

    if name == "bfloat16":
        return bfloat16
    return np.dtype(name)


def _positive_int(text: str) -> int:
    """argparse ``type=`` for options that must be an integer >= 1 (``--tile``,
    ``--slots``): a bad value is a usage error (exit 2) found before any work."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _width_arg(text: str):
    """argparse ``type=`` for ``convert --width``: a non-negative int or a Hybrid
    strategy, checked by the same parser :class:`twellpy.Hybrid` uses."""
    from .hybrid import parse_width

    try:
        return parse_width(int(text) if text.strip().lstrip("+-").isdigit() else text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _load_npy(path: Path):
    """``numpy.load`` for activations and dense matrices.

    numpy.save writes an ml_dtypes bfloat16 array as the 2-byte void dtype
    ``|V2`` (numpy has no name for bfloat16), so np.load gives back ``V2``.
    We assume such an array is bfloat16 and reinterpret its bits; a
    structured dtype (one with fields) is left alone and rejected later.
    """
    arr = np.load(path, allow_pickle=False)
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2 and arr.dtype.fields is None:
        arr = arr.view(_parse_dtype("bfloat16"))
    return arr


def _check_output_folder(path: Path, option: str):
    """Fail before any work when the folder ``path`` would be written in is missing."""
    parent = path.parent
    if not parent.is_dir():
        raise CLIError(f"{option} {path}: folder {parent} does not exist")


def _to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _rel_err(got, ref) -> float:
    got = np.asarray(_to_host(got), dtype=np.float64)
    ref = np.asarray(_to_host(ref), dtype=np.float64)
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(got - ref))
    return num / den if den else num


def _timeit(fn, xp, repeat: int) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeat`` runs (after the
    caller's warm-up), synchronising the GPU around each run."""
    sync = xp.cuda.runtime.deviceSynchronize if xp is not np else (lambda: None)
    times = []
    for _ in range(max(1, repeat)):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _select_device(choice: str):
    """Return (xp, device label) for ``--device auto|cpu|cuda``."""
    from ._array import cupy_module, gpu_available

    if choice == "cpu" or (choice == "auto" and not gpu_available()):
        return np, "cpu"
    if not gpu_available():
        raise CLIError("--device cuda was given but no usable CUDA GPU was found "
                       "(run `twellpy info` to see why); use --device cpu")
    cp = cupy_module()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return cp, f"cuda:{cp.cuda.Device().id} ({name})"


# ------------------------------------------------------------------------ info
def _gpu_report():
    """Dict describing CUDA availability and every visible device."""
    from ._array import cupy_module

    cp = cupy_module()
    if cp is None:
        return {"cupy": None, "devices": [], "reason": "CuPy is not installed (pip install 'twellpy[cuda]')"}
    out = {"cupy": cp.__version__, "devices": []}
    try:
        out["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
    except Exception as exc:  # pragma: no cover - depends on the machine
        out["cuda_runtime"] = f"unavailable ({exc})"
    try:
        out["cuda_driver"] = cp.cuda.runtime.driverGetVersion()
    except Exception as exc:  # pragma: no cover
        out["cuda_driver"] = f"unavailable ({exc})"
    try:
        from cupy_backends.cuda.libs import nvrtc

        out["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
    except Exception as exc:
        out["nvrtc"] = f"unavailable ({exc})"
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:
        out["reason"] = f"no usable CUDA device: {exc}"
        return out
    for i in range(count):
        p = cp.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        out["devices"].append({
            "id": i,
            "name": name,
            "compute_capability": f"{p['major']}.{p['minor']}",
            "memory_gib": round(p["totalGlobalMem"] / 2**30, 1),
            "multiprocessors": p["multiProcessorCount"],
        })
    if not count:
        out["reason"] = "CUDA reports 0 devices"
    return out


def _kernel_report():
    """Dict describing the CUDA kernel sources, declarations and caches."""
    from .backends import _registry as reg

    out = {}
    try:
        kdir = reg.kernel_dir()
    except FileNotFoundError as exc:
        return {"error": str(exc)}
    out["kernel_dir"] = str(kdir)
    out["sources"] = sorted(p.name for p in kdir.glob("*.cu"))
    out["headers"] = sorted(p.name for p in kdir.glob("*.cuh"))
    # The CUDA backend modules declare their instantiations when imported;
    # they need CuPy, which may be missing on a CPU-only install.
    import pkgutil

    import twellpy.backends as backends_pkg

    import_errors = {}
    for info in pkgutil.iter_modules(backends_pkg.__path__):
        if info.name.startswith("cuda"):
            try:
                importlib.import_module(f"twellpy.backends.{info.name}")
            except Exception as exc:
                import_errors[info.name] = f"{type(exc).__name__}: {exc}"
    decl = reg.declared()
    out["declared_instantiations"] = sum(len(names) for groups in decl.values() for names, _ in groups)
    out["declared_by_file"] = {f: sum(len(n) for n, _ in g) for f, g in sorted(decl.items())}
    if import_errors:
        out["backend_import_errors"] = import_errors
    # _CACHE holds kernels (key ends with the kernel name) and modules (key
    # ends with the tuple of names compiled together).
    out["compiled_in_this_process"] = sum(1 for k in list(reg._CACHE) if isinstance(k[-1], str))
    cache_dir = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    out["cupy_cache_dir"] = str(cache_dir)
    out["cupy_cached_binaries"] = (sum(1 for p in cache_dir.iterdir() if p.is_file())
                                   if cache_dir.is_dir() else 0)
    return out


def _compile_all_kernels():
    """Compile every declared kernel on the current GPU; returns (count, seconds)."""
    from .backends import _registry as reg

    t0 = time.perf_counter()
    n = 0
    for fname, groups in reg.declared().items():
        for names, defines in groups:
            for name in names:
                reg.get_kernel(fname, name, **defines)
                n += 1
    return n, time.perf_counter() - t0


def cmd_info(args) -> int:
    """Print versions, GPU details and the state of the CUDA kernels."""
    from . import __version__
    from ._array import gpu_available

    report = {
        "twellpy": __version__,
        "package_dir": str(Path(__file__).resolve().parent),
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": {n: _dist_version(*d) for n, d in (
            ("numpy", ("numpy",)), ("scipy", ("scipy",)), ("numba", ("numba",)),
            ("ml_dtypes", ("ml_dtypes",)),
            ("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
            ("nvidia-cuda-nvrtc", ("nvidia-cuda-nvrtc",)),
            ("nvidia-cuda-runtime", ("nvidia-cuda-runtime",)),
            ("matplotlib", ("matplotlib",)), ("tqdm", ("tqdm",)), ("dask", ("dask",)),
            ("torch", ("torch",)), ("jax", ("jax",)), ("jaxlib", ("jaxlib",)))},
        "gpu": _gpu_report(),
        "kernels": _kernel_report(),
    }
    if args.compile:
        if not gpu_available():
            raise CLIError("--compile needs a usable CUDA GPU; on a machine without one, "
                           "`python tools/check_kernels.py` compiles every kernel with NVRTC")
        n, secs = _compile_all_kernels()
        report["kernels"]["compiled_now"] = {"kernels": n, "seconds": round(secs, 2)}
        report["kernels"]["compiled_in_this_process"] = n
    if args.json:
        print(json.dumps(report, indent=2))
        return 0

    print(f"twellpy {report['twellpy']}  ({report['package_dir']})")
    print(f"python  {report['python']}")
    print(f"platform {report['platform']}")
    print("packages: " + ", ".join(f"{k} {v}" for k, v in report["packages"].items() if v)
          + "; not installed: " + (", ".join(k for k, v in report["packages"].items() if not v) or "none"))
    g = report["gpu"]
    if g["cupy"] is None:
        print(f"GPU: none usable -- {g['reason']}")
    else:
        print(f"CUDA: runtime {g.get('cuda_runtime')}, driver {g.get('cuda_driver')}, NVRTC {g.get('nvrtc')}")
        if g["devices"]:
            for d in g["devices"]:
                print(f"GPU {d['id']}: {d['name']}, compute capability {d['compute_capability']}, "
                      f"{d['memory_gib']} GiB, {d['multiprocessors']} SMs")
        else:
            print(f"GPU: none usable -- {g.get('reason', 'unknown reason')}; twellpy runs on the CPU")
    k = report["kernels"]
    if "error" in k:
        print(f"kernels: {k['error']}")
    else:
        print(f"kernels: {len(k['sources'])} sources in {k['kernel_dir']}: {', '.join(k['sources']) or '(none)'}")
        print(f"  declared instantiations: {k['declared_instantiations']}"
              + "".join(f"\n    {f}: {n}" for f, n in k["declared_by_file"].items()))
        for mod, err in k.get("backend_import_errors", {}).items():
            print(f"  backend {mod} not importable: {err}")
        print(f"  compiled in this process: {k['compiled_in_this_process']}")
        if "compiled_now" in k:
            print(f"  compiled now: {k['compiled_now']['kernels']} kernels in {k['compiled_now']['seconds']} s")
        print(f"  CuPy kernel cache: {k['cupy_cache_dir']} ({k['cupy_cached_binaries']} cached binaries, all libraries)")
    return 0


# ------------------------------------------------------------------------ demo
def _activation_like(rows, cols, nnz_per_row, seed, hot_fraction=0.01):
    """A ReLU-output-like float32 matrix (numpy): ~``nnz_per_row`` positive
    entries per row at random columns, plus a few "hot" rows with 20% density
    so that the lossless backup path of TwELL and Hybrid is exercised.

    Generated on the host with NumPy so the CPU and GPU demos see the same data.
    """
    rng = np.random.default_rng(seed)
    density = min(1.0, nnz_per_row / cols)
    mask = rng.random((rows, cols), dtype=np.float32) < density
    n_hot = max(1, int(rows * hot_fraction)) if rows >= 8 else 0
    if n_hot:
        hot = rng.permutation(rows)[:n_hot]
        mask[hot] = rng.random((n_hot, cols), dtype=np.float32) < 0.2
    vals = np.abs(rng.standard_normal((rows, cols), dtype=np.float32)) + np.float32(0.05)
    return np.where(mask, vals, np.float32(0))


def _csr_bytes(m) -> int:
    return int(m.data.nbytes + m.indices.nbytes + m.indptr.nbytes)


def cmd_demo(args) -> int:
    """Convert, compare sizes, check products against scipy, time everything."""
    import scipy.sparse as sp

    import twellpy as tw

    xp, where = _select_device(args.device)
    on_gpu = xp is not np
    dtype = _parse_dtype(args.dtype)
    M = args.rows if args.rows is not None else (16384 if on_gpu else 1024)
    N = args.cols if args.cols is not None else (5632 if on_gpu else 2816)
    D = args.features if args.features is not None else (2048 if on_gpu else 1024)
    K = args.nnz if args.nnz is not None else (30 if on_gpu else 15)
    for name, v in (("--rows", M), ("--cols", N), ("--features", D), ("--nnz", K), ("--repeat", args.repeat)):
        if v < 1:
            raise CLIError(f"{name} must be >= 1, got {v}")
    if K > N:
        raise CLIError(f"--nnz ({K}) cannot exceed --cols ({N})")
    rtol = _DEMO_RTOL[args.dtype]
    failures = []

    print(f"twellpy {tw.__version__} demo on {where}, dtype {args.dtype}")
    print(f"[1/5] activation-like matrix h: {M} x {N}, ~{K} non-zeros per row, "
          f"1% hot rows at 20% density (seed {args.seed})")
    h_host = _activation_like(M, N, K, args.seed).astype(dtype)
    h = xp.asarray(h_host)
    true_nnz = int(np.count_nonzero(h_host.astype(np.float32)))
    print(f"      {true_nnz} non-zeros ({100 * true_nnz / (M * N):.2f}% dense)")

    # ---- conversions
    print("[2/5] converting h to every format (a first call includes Numba/NVRTC compilation)")
    builders = {
        "TwELL": lambda: tw.TwELL.from_dense(h, tile=args.tile, slots=args.slots),
        "ELL": lambda: tw.ELL.from_dense(h),
        "Hybrid": lambda: tw.Hybrid.from_dense(h, width="auto"),
    }
    h32 = xp.asarray(h_host.astype(np.float32))  # scipy/cupyx CSR do not take bfloat16
    if on_gpu:
        import cupyx.scipy.sparse as csp

        builders["CSR (cupyx)"] = lambda: csp.csr_matrix(h32)
    else:
        builders["CSR (scipy)"] = lambda: sp.csr_array(h32)
    built, build_time, first_call = {}, {}, {}
    for name, fn in builders.items():
        t0 = time.perf_counter()
        built[name] = fn()
        if on_gpu:
            xp.cuda.runtime.deviceSynchronize()
        first_call[name] = time.perf_counter() - t0
        build_time[name] = _timeit(fn, xp, args.repeat)
    csr_name = next(n for n in built if n.startswith("CSR"))
    _print_table(["from dense to", f"time (median of {args.repeat})", "first call"],
                 [[n, _fmt_ms(build_time[n]), _fmt_ms(first_call[n])] for n in built])

    # ---- sizes and exactness of the conversion
    print("[3/5] storage compared (bytes of all component arrays)")
    dense_bytes = M * N * np.dtype(dtype).itemsize
    rows = [["dense", _fmt_bytes(dense_bytes), "1.00", str(M * N), "-"]]
    for name, A in built.items():
        nbytes = _csr_bytes(A) if name.startswith("CSR") else int(A.nbytes)
        nnz = int(A.nnz)
        exact = "yes" if name.startswith("CSR") else ("yes" if nnz == true_nnz else "NO")
        if exact == "NO":
            failures.append(f"{name}.nnz = {nnz} but h has {true_nnz} non-zeros")
        rows.append([name, _fmt_bytes(nbytes), f"{nbytes / dense_bytes:.3f}", str(nnz), exact])
    _print_table(["format", "bytes", "vs dense", "nnz", "nnz exact"], rows)
    T = built["TwELL"]
    print(f"      TwELL(tile={args.tile}, slots={args.slots}) keeps {T.n_backup} overflowing rows "
          f"exactly in dense backup rows")
    roundtrip = _rel_err(T.toarray(), h)
    if roundtrip != 0.0:
        failures.append(f"TwELL.toarray() differs from h (relative error {roundtrip:.2e})")
    print(f"      TwELL.toarray() == h: {'yes' if roundtrip == 0.0 else 'NO'}")

    # ---- product checked against scipy in float64
    print(f"[4/5] product A @ W with W of shape {N} x {D}, checked against scipy.sparse in float64")
    rng = np.random.default_rng(args.seed + 1)
    W_host = (rng.standard_normal((N, D), dtype=np.float32) / np.float32(np.sqrt(N))).astype(dtype)
    W = xp.asarray(W_host)
    # reference from the values actually stored (after the dtype cast), in float64
    ref = sp.csr_array(h_host.astype(np.float32)).astype(np.float64) @ W_host.astype(np.float64)
    W32 = xp.asarray(W_host.astype(np.float32))
    products = {name: (lambda A=A: A @ W) for name, A in built.items() if not name.startswith("CSR")}
    products[csr_name] = lambda: built[csr_name] @ W32
    try:
        h @ W
        products["dense"] = lambda: h @ W
    except Exception:  # noqa: BLE001 -- e.g. no 16-bit matmul in this array library build
        products["dense"] = lambda: h32 @ W32
        print(f"      (no {args.dtype} dense matmul here: the dense baseline runs in float32)")
    rows = []
    dense_t = None
    times = {}
    for name, fn in products.items():
        y = fn()
        err = _rel_err(y, ref)
        times[name] = _timeit(fn, xp, args.repeat)
        ok = err <= (1e-4 if name.startswith("CSR") else rtol)
        if not ok:
            failures.append(f"{name} @ W: relative error {err:.2e} > {rtol:.0e}")
        rows.append([name, f"{err:.2e}", "ok" if ok else "FAIL"])
    dense_t = times["dense"]
    rows = [r + [_fmt_ms(times[r[0]]), f"{dense_t / times[r[0]]:.2f}x"] for r in rows]
    _print_table(["A @ W", "rel. error", "check", "time", "speed-up vs dense"], rows)

    # ---- fused FFN
    if args.skip_ffn:
        print("[5/5] fused FFN skipped (--skip-ffn)")
    else:
        _demo_ffn(tw, xp, M, N, D, K, dtype, args, rtol, failures)

    if failures:
        print("demo FAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"demo OK: every format stored all {true_nnz} non-zeros and every product matched the reference")
    return 0


def _demo_ffn(tw, xp, M, H, D, K, dtype, args, rtol, failures):
    """Gated FFN relu(x Wg^T) * (x Wu^T) @ Wd^T: fused sparse vs dense."""
    print(f"[5/5] fused gated FFN: x {M} x {D}, hidden {H}, ~{K} active neurons per token")
    rng = np.random.default_rng(args.seed + 2)
    x = rng.standard_normal((M, D), dtype=np.float32)
    x[:, 0] = 1  # column 0 carries the gate bias below
    w_gate = rng.standard_normal((H, D), dtype=np.float32) / np.float32(np.sqrt(max(D - 1, 1)))
    w_up = rng.standard_normal((H, D), dtype=np.float32) / np.float32(np.sqrt(D))
    w_down = rng.standard_normal((D, H), dtype=np.float32) / np.float32(np.sqrt(H))
    # Choose the gate bias so that on average K of H neurons fire per token.
    w_gate[:, 0] = 0
    sample = x[: min(M, 512)] @ w_gate.T
    w_gate[:, 0] = -np.quantile(sample.ravel(), 1.0 - K / H)
    x, w_gate, w_up, w_down = (xp.asarray(a.astype(dtype)) for a in (x, w_gate, w_up, w_down))

    y = tw.ffn.gated_forward(x, w_gate, w_up, w_down)  # the one-call API
    # float64 reference on a row sample keeps the check cheap at GPU sizes.
    rows = np.arange(0, M, max(1, M // 512))
    xs, g, u, d = (_to_host(a).astype(np.float64) for a in (x[rows], w_gate, w_up, w_down))
    ref = (np.maximum(xs @ g.T, 0) * (xs @ u.T)) @ d.T
    err = _rel_err(_to_host(y)[rows], ref)
    active = float((xs @ g.T > 0).sum(axis=1).mean())
    ok = err <= rtol
    if not ok:
        failures.append(f"gated_forward: relative error {err:.2e} > {rtol:.0e}")

    # Repeated inference prepares the weights once: time GatedFFN, as a model would use it.
    ffn = tw.ffn.GatedFFN(w_gate, w_up, w_down)
    ffn(x)
    t_sparse = _timeit(lambda: ffn(x), xp, args.repeat)
    dense_label = f"dense ({'cupy' if xp is not np else 'numpy'} matmul, {args.dtype})"
    wd = (x, w_gate, w_up, w_down)
    try:
        (xp.maximum(wd[0] @ wd[1].T, 0) * (wd[0] @ wd[2].T)) @ wd[3].T
    except Exception:  # noqa: BLE001 -- e.g. no 16-bit matmul in this array library build
        wd = tuple(a.astype(xp.float32) for a in wd)
        dense_label = dense_label.replace(args.dtype, "float32")
    t_dense = _timeit(lambda: (xp.maximum(wd[0] @ wd[1].T, 0) * (wd[0] @ wd[2].T)) @ wd[3].T, xp, args.repeat)
    _print_table(["FFN", "rel. error", "check", "time", "speed-up vs dense"], [
        ["twellpy.ffn.GatedFFN", f"{err:.2e}", "ok" if ok else "FAIL", _fmt_ms(t_sparse),
         f"{t_dense / t_sparse:.2f}x"],
        [dense_label, "-", "-", _fmt_ms(t_dense), "1.00x"],
    ])
    print(f"      {active:.1f} active neurons per token on average (checked on {len(rows)} rows); "
          f"twellpy ran {ffn.last_info.get('mode', '?')} (mode='auto' picks dense when sparsity is too low)")


# ----------------------------------------------------------------------- bench
#: The line that makes a script in benchmarks/ a suite of ``twellpy bench``.
#: ``benchmarks/`` also holds tools run by the device scripts (log followers,
#: sanitizer probes, pytest plugins) that have a ``__main__`` guard but are no
#: benchmark; a suite says so itself, in one line after its docstring::
#:
#:     # twellpy-bench: suite                  runs anywhere as it is
#:     # twellpy-bench: suite gpu-only         skipped without a usable CUDA GPU
#:     # twellpy-bench: suite cpu-args=--cpu   without a GPU, run with these
#:                                             arguments (comma-separated)
BENCH_MARKER = "# twellpy-bench:"


class _Suite(NamedTuple):
    """A benchmark script and how to run it without a GPU."""

    path: Path
    gpu_only: bool = False
    cpu_args: tuple = ()


def _parse_bench_marker(path: Path, text: str):
    """The :class:`_Suite` declared by ``text`` (a script's source), or None."""
    for line in text.splitlines():
        if not line.startswith(BENCH_MARKER):
            continue
        words = line[len(BENCH_MARKER):].split()
        if not words or words[0] != "suite":
            raise CLIError(f"{path}: {line.strip()!r} must start with {BENCH_MARKER} suite")
        gpu_only, cpu_args = False, ()
        for w in words[1:]:
            if w == "gpu-only":
                gpu_only = True
            elif w.startswith("cpu-args=") and len(w) > len("cpu-args="):
                cpu_args = tuple(w[len("cpu-args="):].split(","))
            else:
                # a typo here would silently change how the suite runs
                raise CLIError(f"{path}: unknown word {w!r} in {line.strip()!r}; "
                               f"expected gpu-only or cpu-args=ARG[,ARG...]")
        if gpu_only and cpu_args:
            raise CLIError(f"{path}: {line.strip()!r}: gpu-only and cpu-args contradict each other")
        return _Suite(path, gpu_only, cpu_args)
    return None


def _default_bench_dir() -> Path:
    pkg = Path(__file__).resolve().parent
    for cand in (pkg.parent / "benchmarks", pkg / "_benchmarks"):
        if cand.is_dir():
            return cand
    raise CLIError(f"no benchmarks/ folder next to {pkg}; pass --dir")


def _find_suites(bench_dir: Path):
    """The suites in ``bench_dir``: ``*.py`` scripts carrying a
    :data:`BENCH_MARKER` line, as a dict name -> :class:`_Suite`.

    An explicit marker, not "has a ``__main__`` guard": helper tools have
    one too, and running them as benchmarks fails."""
    suites = {}
    for p in sorted(bench_dir.glob("*.py")):
        if p.name.startswith("_"):
            continue
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        suite = _parse_bench_marker(p, text)
        if suite is not None:
            suites[p.stem] = suite
    return suites


def _bench_pythonpath(bench_dir: Path, tmp: Path) -> str:
    """A folder from which ``import benchmarks.<helper>`` finds ``bench_dir``.

    The scripts import their shared helpers as ``benchmarks.workloads``; in a
    checkout that is the repository root, in an installed wheel (where the
    scripts live in ``twellpy/_benchmarks``) a link named ``benchmarks``."""
    if bench_dir.name == "benchmarks":
        return str(bench_dir.parent)
    link = tmp / "benchmarks"
    if not link.exists():
        link.symlink_to(bench_dir, target_is_directory=True)
    return str(tmp)


def _progress(total, desc):
    """A tqdm bar on stderr, or a plain line-per-step fallback without tqdm."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="suite", file=sys.stderr, leave=True)
    except ImportError:
        class _Plain:
            def __init__(self):
                self.n = 0

            def set_postfix_str(self, s):
                pass

            def set_description(self, s):
                print(f"[{self.n + 1}/{total}] {s}", file=sys.stderr, flush=True)

            def update(self, k=1):
                self.n += k

            def close(self):
                pass

        return _Plain()


def _read_out_files(out_dir: Path):
    """Files a suite wrote under $OUT: parsed JSON where possible, else text."""
    files = {}
    for p in sorted(out_dir.rglob("*")):
        if not p.is_file():
            continue
        rel = str(p.relative_to(out_dir))
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            files[rel] = {"binary_bytes": p.stat().st_size}
            continue
        if p.suffix == ".json":
            try:
                files[rel] = json.loads(text)
                continue
            except json.JSONDecodeError:
                pass
        files[rel] = text
    return files


def _run_suite(path: Path, extra, out_dir: Path, timeout, bar, pythonpath: str):
    """Run one benchmark script; stream its stdout into the progress bar."""
    env = dict(os.environ, OUT=str(out_dir), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)
    import threading

    lines = []
    timed_out = threading.Event()
    t0 = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([sys.executable, str(path), *extra], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env, cwd=pythonpath)

        def kill():
            timed_out.set()
            proc.kill()

        # A watchdog, because a silent script would block the read loop forever.
        watchdog = threading.Timer(timeout, kill) if timeout else None
        if watchdog:
            watchdog.start()
        try:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if line.strip():
                    bar.set_postfix_str(line.strip()[:60])
            rc = proc.wait()
        finally:
            if watchdog:
                watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        stderr = err.read()
    return {
        "name": path.stem,
        "path": str(path),
        "returncode": rc,
        "timed_out": timed_out.is_set(),
        "seconds": round(time.perf_counter() - t0, 3),
        "stdout": "\n".join(lines),
        "stderr_tail": "\n".join(stderr.splitlines()[-20:]),
        "out_files": _read_out_files(out_dir),
    }


def cmd_bench(args) -> int:
    """Run benchmark suites with a progress bar, then print their tables."""
    bench_dir = Path(args.dir) if args.dir else _default_bench_dir()
    if not bench_dir.is_dir():
        raise CLIError(f"--dir {bench_dir} is not a folder")
    suites = _find_suites(bench_dir)
    if args.list:
        import ast

        for name, p in suites.items():
            try:
                lines = (ast.get_docstring(ast.parse(p.path.read_text())) or "").strip().splitlines()
            except (SyntaxError, UnicodeDecodeError):
                lines = []
            note = " (GPU only)" if p.gpu_only else (
                f" (without a GPU: {' '.join(p.cpu_args)})" if p.cpu_args else "")
            width = max(map(len, suites))
            print(f"{name:{width}s}  {lines[0] if lines else ''}{note}")
        return 0
    if not suites:
        raise CLIError(f"no benchmark scripts (*.py with a '{BENCH_MARKER} suite' line) in {bench_dir}")
    chosen = args.suites or list(suites)
    unknown = [s for s in chosen if s not in suites]
    if unknown:
        tools = [s for s in unknown if (bench_dir / f"{s}.py").is_file()]
        hint = (f" ({', '.join(t + '.py' for t in tools)}: no '{BENCH_MARKER} suite' line, "
                f"not a benchmark suite)" if tools else "")
        raise CLIError(f"unknown suite(s) {', '.join(unknown)}; available: {', '.join(suites)}{hint}")
    extra = list(args.passthrough)

    from ._array import gpu_available

    on_gpu = gpu_available()
    results = []
    runnable = []
    for name in chosen:
        if not on_gpu and suites[name].gpu_only:
            results.append({"name": name, "path": str(suites[name].path), "returncode": None,
                            "skipped": "needs a CUDA GPU; none is usable here"})
        else:
            runnable.append(name)
    skipped = [r["name"] for r in results]
    if skipped:
        print(f"bench: skipping {', '.join(skipped)}: GPU only, and no CUDA GPU is usable here",
              file=sys.stderr)
    bar = _progress(len(runnable), "bench")
    with tempfile.TemporaryDirectory(prefix="twellpy-bench-") as tmp:
        pythonpath = _bench_pythonpath(bench_dir.resolve(), Path(tmp))
        for name in runnable:
            bar.set_description(f"bench {name}")
            out_dir = (Path(args.out) / name if args.out else Path(tmp) / "out" / name).resolve()
            out_dir.mkdir(parents=True, exist_ok=True)
            suite_args = ([] if on_gpu else list(suites[name].cpu_args)) + extra
            results.append(_run_suite(suites[name].path, suite_args, out_dir, args.timeout, bar, pythonpath))
            bar.update(1)
    bar.close()

    results.sort(key=lambda r: chosen.index(r["name"]))
    failed = [r for r in results if r.get("skipped") is None and r["returncode"] != 0]
    if args.json:
        from . import __version__

        print(json.dumps({"twellpy": __version__, "python": platform.python_version(),
                          "bench_dir": str(bench_dir), "suites": results,
                          "failed": [r["name"] for r in failed]}, indent=2, default=str))
    else:
        for r in results:
            if r.get("skipped"):
                print(f"\n=== {r['name']} (skipped: {r['skipped']}) ===")
                continue
            status = "ok" if r["returncode"] == 0 else (
                "timed out" if r["timed_out"] else f"FAILED (exit {r['returncode']})")
            print(f"\n=== {r['name']} ({r['seconds']:.1f} s, {status}) ===")
            print(r["stdout"])
            if r["returncode"] != 0 and r["stderr_tail"]:
                print("--- stderr (last lines) ---\n" + r["stderr_tail"])
        print()
        _print_table(["suite", "status", "seconds"],
                     [[r["name"], "skipped" if r.get("skipped") else
                       ("ok" if r["returncode"] == 0 else "failed"),
                       "-" if r.get("skipped") else f"{r['seconds']:.1f}"] for r in results])
    return 1 if failed else 0


# --------------------------------------------------------------------- convert
def _npz_kind(path: Path):
    """'twellpy' or 'scipy' for a .npz file, from its ``format`` entry."""
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = set(z.files)
            fmt = z["format"][()] if "format" in keys else None
    except (OSError, ValueError) as exc:
        raise CLIError(f"input {path} is not a readable .npz file: {exc}") from None
    if isinstance(fmt, bytes):
        fmt = fmt.decode("ascii", "replace")
    fmt = str(fmt) if fmt is not None else None
    if fmt in TWELLPY_FORMATS:
        return "twellpy", fmt
    if fmt in ("csr", "csc", "coo", "bsr", "dia") and {"shape", "data"} <= keys:
        return "scipy", fmt
    raise CLIError(f"input {path} is neither a twellpy.save file nor a scipy.sparse.save_npz "
                   f"file (format entry {fmt!r}, arrays {sorted(keys)})")


def _load_any(path: Path):
    """Load a twellpy container, a scipy sparse matrix or a dense .npy array."""
    import scipy.sparse as sp

    import twellpy as tw

    if not path.exists():
        raise CLIError(f"input {path} does not exist")
    if path.suffix == ".npy":
        arr = _load_npy(path)
        if arr.ndim != 2:
            raise CLIError(f"input {path} holds a {arr.ndim}-D array of shape {arr.shape}, expected 2-D")
        return arr, "dense .npy"
    kind, fmt = _npz_kind(path)
    if kind == "twellpy":
        return tw.load(path), f"twellpy {fmt}"
    return sp.load_npz(path), f"scipy {fmt}"


def _describe(obj) -> str:
    if isinstance(obj, np.ndarray):
        return f"dense {obj.shape[0]}x{obj.shape[1]} {obj.dtype}, {int(np.count_nonzero(obj))} non-zeros, {_fmt_bytes(obj.nbytes)}"
    if hasattr(obj, "components"):
        return f"{obj.format} {obj.shape[0]}x{obj.shape[1]} {obj.dtype}, nnz {obj.nnz}, {_fmt_bytes(int(obj.nbytes))}"
    nbytes = sum(getattr(obj, a).nbytes for a in ("data", "indices", "indptr", "row", "col", "coords")
                 if isinstance(getattr(obj, a, None), np.ndarray))
    return f"scipy {obj.format} {obj.shape[0]}x{obj.shape[1]} {obj.dtype}, nnz {obj.nnz}, {_fmt_bytes(nbytes)}"


#: Which ``convert`` options each output format uses; one that the chosen
#: format ignores draws a warning on stderr, so a mistake does not go unnoticed.
_CONVERT_OPTIONS = {"twell": ("tile", "slots", "overflow"), "ell": ("width",), "hybrid": ("width",),
                    "csr": (), "csc": (), "coo": ()}
_SIXTEEN_BIT = ("float16", "bfloat16")


def cmd_convert(args) -> int:
    """Convert between twellpy.save, scipy.sparse.save_npz and dense .npy files.

    Values keep their dtype unless ``--dtype`` is given: twellpy containers
    are converted with :meth:`~twellpy.ELL.asformat` and cast with
    ``astype``, never through scipy (which has no 16-bit floats).
    """
    import scipy.sparse as sp

    import twellpy as tw

    src, dst = Path(args.input), Path(args.output)
    fmt = args.format
    if dst.suffix != ".npz":
        raise CLIError(f"output {dst} must end in .npz (twellpy.save and scipy.sparse.save_npz write .npz)")
    if src.resolve() == dst.resolve():
        raise CLIError(f"output {dst} is the input file; choose another name")
    _check_output_folder(dst, "output")
    unused = [o for o in ("tile", "slots", "overflow", "width")
              if getattr(args, o) is not None and o not in _CONVERT_OPTIONS[fmt]]
    if unused:
        # a warning, not an error: scripts may pass one set of options for every format
        print(f"twellpy convert: warning: {', '.join('--' + o for o in unused)} "
              f"{'does' if len(unused) == 1 else 'do'} not apply to --format {fmt}; ignored",
              file=sys.stderr)
    if fmt == "ell" and isinstance(args.width, str):
        raise CLIError(f"--width {args.width} is a Hybrid strategy; ELL takes an integer width")
    if fmt in SCIPY_FORMATS and args.dtype in _SIXTEEN_BIT:
        # checked before reading: the same answer for every kind of input
        raise CLIError(f"--dtype {args.dtype} cannot be written with scipy.sparse (it has no "
                       f"16-bit floats); choose float32/float64 or a twellpy --format")
    dtype = _parse_dtype(args.dtype) if args.dtype else None
    obj, kind = _load_any(src)
    print(f"read    {src}: {_describe(obj)} ({kind})")
    if fmt in SCIPY_FORMATS:
        if isinstance(obj, np.ndarray):
            if obj.dtype.itemsize == 2:
                obj = obj.astype(np.float32)  # scipy has no 16-bit floats; exact
            out = sp.csr_array(obj)
        elif hasattr(obj, "components"):
            out = obj.to_scipy("csr")  # 16-bit values come back as float32 (exact)
        else:
            out = obj
        if dtype is not None:
            out = out.astype(dtype)
        out = out.asformat(fmt)
        sp.save_npz(dst, out)
    else:
        cls = {"twell": tw.TwELL, "ell": tw.ELL, "hybrid": tw.Hybrid}[fmt]
        if fmt == "twell":
            kw = {"tile": args.tile or 256, "slots": args.slots or 32,
                  "overflow": args.overflow or "backup"}
        elif fmt == "hybrid":
            kw = {"width": "auto" if args.width is None else args.width}
        else:
            kw = {"width": args.width}
        if isinstance(obj, np.ndarray):
            if dtype is not None:
                obj = obj.astype(dtype)
            out = cls.from_dense(obj, check_finite=args.check_finite, **kw)
        elif hasattr(obj, "components"):
            if dtype is not None:
                obj = obj.astype(dtype)
            out = obj.asformat(fmt, **kw)
        else:
            # scipy holds no 16-bit floats, so the cast happens inside from_scipy
            out = cls.from_scipy(obj, dtype=dtype, check_finite=args.check_finite, **kw)
        tw.save(dst, out)
    print(f"wrote   {dst}: {_describe(out)}")
    return 0


# ----------------------------------------------------------------------- stats
def cmd_stats(args) -> int:
    """Sparsity statistics of saved activations, optionally plotted."""
    src = Path(args.activations)
    if not src.exists():
        raise CLIError(f"activations file {src} does not exist")
    if src.suffix != ".npy":
        raise CLIError(f"activations file {src} must be a .npy file written by numpy.save")
    # options are checked before the file is read and the statistics computed
    if args.slots is not None and args.slots < 1:
        raise CLIError(f"--slots must be >= 1, got {args.slots}")
    if args.tile < 1:
        raise CLIError(f"--tile must be >= 1, got {args.tile}")
    if not 0.0 < args.target < 1.0:
        raise CLIError(f"--target must be between 0 and 1, got {args.target}")
    if args.plot:
        _plot_target(args.plot)
    acts = _load_npy(src)
    if acts.ndim not in (2, 3):
        raise CLIError(f"activations in {src} have shape {acts.shape}; expected (tokens, neurons) "
                       f"or (layers, tokens, neurons)")
    if not np.issubdtype(acts.dtype, np.floating) and acts.dtype != _parse_dtype("bfloat16"):
        raise CLIError(f"activations in {src} have dtype {acts.dtype}, expected a floating dtype")
    if 0 in acts.shape:
        raise CLIError(f"activations in {src} have shape {acts.shape}: no tokens or no neurons")
    report = _stats_report(acts, args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_stats(report)
    if args.plot:
        _stats_plot(acts, args)
        if not args.json:
            print(f"figure written to {args.plot}")
    return 0


def _stats_layers(acts):
    """List of (tokens, neurons) arrays, one per layer."""
    return [acts] if acts.ndim == 2 else [acts[i] for i in range(acts.shape[0])]


def _stats_report(acts, args):
    from . import stats

    layers = _stats_layers(acts)
    report = {"shape": list(acts.shape), "dtype": str(acts.dtype), "tile": args.tile,
              "target_overflow": args.target, "slots": args.slots, "layers": []}
    for li, a in enumerate(layers):
        nnz = stats.nnz_per_token(a)
        counts = stats.firing_counts(a)
        occ = stats.tile_occupancy(a, tile=args.tile)
        model = stats.fit_overflow_model(a, tile=args.tile)
        entry = {
            "layer": li,
            "tokens": int(a.shape[0]),
            "neurons": int(a.shape[1]),
            "nnz_per_token": {"mean": float(nnz.mean()), "median": float(np.median(nnz)),
                              "p99": float(np.percentile(nnz, 99)), "max": int(nnz.max())},
            "density": float(nnz.mean() / a.shape[1]),
            # a neuron that fired for none of the tokens in the file
            "dead_neurons": int((counts == 0).sum()),
            "max_tile_count": int(occ.max()) if occ.size else 0,
            "suggested_slots": model.suggest_slots(args.target, per="tile"),
        }
        if args.slots is not None:
            entry["overflow"] = {
                "observed_tile_rate": stats.empirical_overflow_rate(a, args.slots, tile=args.tile, per="tile"),
                "predicted_tile_probability": model.probability(args.slots, per="tile"),
                "observed_row_rate": stats.empirical_overflow_rate(a, args.slots, tile=args.tile, per="row"),
                "predicted_row_probability": model.probability(args.slots, per="row"),
            }
        report["layers"].append(entry)
    return report


def _print_stats(report):
    print(f"activations {tuple(report['shape'])} {report['dtype']}, tile {report['tile']}")
    headers = ["layer", "tokens", "neurons", "nnz/token mean", "median", "p99", "max",
               "density", "dead neurons", "max tile count",
               f"slots for P(tile overflow)<={report['target_overflow']:g}"]
    rows = []
    for e in report["layers"]:
        n = e["nnz_per_token"]
        rows.append([e["layer"], e["tokens"], e["neurons"], f"{n['mean']:.2f}", f"{n['median']:.0f}",
                     f"{n['p99']:.0f}", n["max"], f"{100 * e['density']:.3f}%", e["dead_neurons"],
                     e["max_tile_count"], e["suggested_slots"]])
    _print_table(headers, rows)
    if report["slots"] is not None:
        print(f"\noverflow at slots={report['slots']} (observed in this file / predicted by the fitted model):")
        _print_table(["layer", "tiles observed", "tiles predicted", "rows observed", "rows predicted"],
                     [[e["layer"], f"{e['overflow']['observed_tile_rate']:.3g}",
                       f"{e['overflow']['predicted_tile_probability']:.3g}",
                       f"{e['overflow']['observed_row_rate']:.3g}",
                       f"{e['overflow']['predicted_row_probability']:.3g}"] for e in report["layers"]])
        print("(a row overflows when any of its tiles does; TwELL keeps such rows in dense backup rows)")


def _plot_target(path) -> Path:
    """Check ``stats --plot``: extension, folder and matplotlib, before any work."""
    out = Path(path)
    if out.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise CLIError(f"--plot {out} must end in .png, .pdf or .svg")
    _check_output_folder(out, "--plot")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install 'twellpy[plot]'") from None
    return out


def _stats_plot(acts, args):
    from matplotlib.figure import Figure

    from . import plot

    out = _plot_target(args.plot)
    layers = _stats_layers(acts)
    # One page with four panels: the last layer's histograms and heat map,
    # plus the per-layer summary (or the tile histogram for a single layer).
    fig = Figure(figsize=(13, 9), layout="constrained")
    ax = fig.subplots(2, 2)
    last = layers[-1]
    plot.nnz_histogram(last, ax=ax[0, 0])
    plot.tile_occupancy_histogram(last, tile=args.tile, slots=args.slots, ax=ax[0, 1])
    plot.tile_heatmap(last, tile=args.tile, slots=args.slots, ax=ax[1, 0])
    if len(layers) > 1:
        plot.layer_summary(layers, ax=ax[1, 1])
    else:
        plot.nnz_histogram(last, log=True, ax=ax[1, 1], title="non-zeros per token (log scale)")
    if len(layers) > 1:
        fig.suptitle(f"layer {len(layers) - 1} (top and bottom left); all layers (bottom right)")
    fig.savefig(out, dpi=110)


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for ``twellpy`` and all its sub-commands."""
    from . import __version__

    p = argparse.ArgumentParser(
        prog="twellpy",
        description="TwELL, ELL and Hybrid sparse formats and fused sparse FFN kernels.",
    )
    p.add_argument("--version", action="version", version=f"twellpy {__version__}")
    p.add_argument("--traceback", action="store_true",
                   help="show the full traceback on errors (for bug reports)")
    # --traceback is accepted after the sub-command too. SUPPRESS: a sub-command
    # that was not given it leaves the value parsed before the sub-command alone.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback on errors (for bug reports)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("info", parents=[common], help="versions, GPU, compute capability, kernels compiled/cached")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--compile", action="store_true",
                   help="compile every declared kernel on the GPU now (fills CuPy's cache)")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("demo", parents=[common], help="convert a matrix, compare formats, check products, time them")
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default) uses the GPU when one is usable")
    s.add_argument("--rows", type=int, help="rows M (default 16384 on GPU, 1024 on CPU)")
    s.add_argument("--cols", type=int, help="columns N = hidden size (default 5632 on GPU, 2816 on CPU)")
    s.add_argument("--features", type=int, help="columns of W = model size (default 2048 on GPU, 1024 on CPU)")
    s.add_argument("--nnz", type=int, help="mean non-zeros per row (default 30 on GPU, 15 on CPU)")
    s.add_argument("--dtype", choices=_DTYPE_NAMES, default="float32")
    s.add_argument("--tile", type=_positive_int, default=256, help="TwELL tile (default 256)")
    s.add_argument("--slots", type=_positive_int, default=32, help="TwELL slots per tile (default 32)")
    s.add_argument("--repeat", type=int, default=5, help="timed repetitions (median reported)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--skip-ffn", action="store_true", help="skip the fused FFN step")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("bench", parents=[common], help="run the benchmark suites in benchmarks/ and print their tables")
    s.add_argument("suites", nargs="*", help="suite names (file stems); default: all")
    s.add_argument("--dir", help="folder of benchmark scripts (default: the repository's benchmarks/)")
    s.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    s.add_argument("--list", action="store_true", help="list the suites and exit")
    s.add_argument("--out", help="keep each suite's $OUT files under OUT/<suite> (default: a temporary folder)")
    s.add_argument("--timeout", type=float, default=None, help="seconds allowed per suite")
    s.epilog = "Arguments after a bare -- are passed to every suite, e.g. twellpy bench cpu -- --repeats 3"
    s.set_defaults(passthrough=[])
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("convert", parents=[common], help="convert a sparse matrix file to another format")
    s.add_argument("input", help="twellpy.save .npz, scipy.sparse.save_npz .npz, or dense .npy")
    s.add_argument("output", help="output .npz")
    s.add_argument("--format", required=True, choices=TWELLPY_FORMATS + SCIPY_FORMATS)
    # None defaults: an option the chosen --format does not use is reported.
    s.add_argument("--tile", type=_positive_int, help="TwELL tile (default 256)")
    s.add_argument("--slots", type=_positive_int, help="TwELL slots per tile (default 32)")
    s.add_argument("--overflow", choices=("backup", "raise"),
                   help="TwELL: keep overflowing rows in dense backup rows (default) or raise")
    s.add_argument("--width", type=_width_arg,
                   help="ELL width (int >= 0) or Hybrid width / strategy: auto (default), "
                        "min_storage, quantile:P, fixed:N")
    s.add_argument("--dtype", choices=_DTYPE_NAMES, help="convert the values to this dtype")
    s.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                   help="accept NaN/Inf values (IEEE semantics)")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("stats", parents=[common], help="sparsity statistics of activations saved with numpy.save")
    s.add_argument("activations", help=".npy of shape (tokens, neurons) or (layers, tokens, neurons)")
    s.add_argument("--tile", type=int, default=256, help="TwELL tile used for tile statistics (default 256)")
    s.add_argument("--slots", type=int,
                   help="also report observed and predicted overflow at this slots (and mark it in the plot)")
    s.add_argument("--target", type=float, default=1e-3,
                   help="tile-overflow probability the suggested slots must meet (default 1e-3)")
    s.add_argument("--plot", help="write a figure (.png, .pdf or .svg)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_stats)
    return p


def main(argv=None) -> int:
    """Entry point of the ``twellpy`` console script; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a bare "--" goes, untouched, to the benchmark scripts.
    passthrough = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if passthrough:
        if args.command != "bench":
            parser.error(f"arguments after -- are only accepted by bench, got {' '.join(passthrough)}")
        args.passthrough = passthrough
    if args.traceback:
        return int(args.func(args) or 0)
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"twellpy {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as exc:
        # Library input errors carry precise messages; show them without a traceback.
        # The library names its keyword; on the command line it is a flag.
        msg = str(exc).replace("pass check_finite=False", "pass --no-check-finite")
        print(f"twellpy {args.command}: error: {type(exc).__name__}: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # e.g. `twellpy info --json | head`: the reader left. Point stdout at
        # /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # after BrokenPipeError, one of its subclasses
        # A file that cannot be read or written (permissions, full disk ...):
        # one line, like the other errors; --traceback shows where.
        print(f"twellpy {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
