"""CPU benchmark on workload C1 (see docs/workloads.md): twellpy vs scipy.sparse and numpy.

Workload C1: the activation ``h = relu(x @ w_gate.T) * (x @ w_up.T)`` of a
synthetic gated FFN with M=8192 tokens, D=1024, H=2816, about 15 non-zeros per
token (threshold found by bisection on a sample of rows), float32; the dense
operand is ``W = w_down.T`` (H, D).

Rows of the table (median of ``--repeats`` timed runs after ``--warmup``
untimed runs, so Numba compilation is excluded):

* dense -> TwELL (``TwELL.from_dense``) vs ``scipy.sparse.csr_array(dense)``;
* dense -> ELL / Hybrid for reference;
* ``A @ W`` (TwELL, ELL, Hybrid) vs scipy CSR @ W and numpy dense @ W;
* ``G @ A`` (left product, G (D', M)) vs ``G @ csr``;
* ``A.T`` (TwELL transpose) vs ``csr.T.tocsr()``.

twellpy and its baseline are timed interleaved (one call of each per repeat),
so a busy machine slows both alike and the ratios stay meaningful.

Usage::

    python benchmarks/cpu.py [--threads 2] [--repeats 7] [--json results.json]

The table of ratios is printed last. Full numbers go to ``--json`` and, when
``$OUT`` is set, to ``$OUT/cpu_benchmark.json``.
"""
# twellpy-bench: suite
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import scipy
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numba  # noqa: E402

import twellpy as tw  # noqa: E402


def make_c1(m=8192, d=1024, h=2816, target_nnz=15.0, sigma=0.0, seed=0, dtype=np.float32):
    """Activation (M, H) and down weight W (H, D) of workload C1."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d), dtype=np.float32)
    x *= np.exp(sigma * rng.standard_normal((m, 1))).astype(np.float32)
    x[:, 0] = 1.0
    w_gate = (rng.standard_normal((h, d), dtype=np.float32) / np.sqrt(d - 1)).astype(np.float32)
    w_up = (rng.standard_normal((h, d), dtype=np.float32) / np.sqrt(d)).astype(np.float32)
    w_down = (rng.standard_normal((d, h), dtype=np.float32) / np.sqrt(h)).astype(np.float32)
    w_gate[:, 0] = 0.0
    base = x @ w_gate.T  # gate pre-activation without the threshold column
    sample = base[rng.choice(m, min(m, 1024), replace=False)]
    lo, hi = 0.0, float(np.abs(sample).max())
    for _ in range(60):  # bisection: mean #(base > t) per row hits the target
        t = 0.5 * (lo + hi)
        if (sample > t).sum(axis=1).mean() > target_nnz:
            lo = t
        else:
            hi = t
    t = hi
    gate = np.maximum(base - t, 0.0)  # column 0 of w_gate is -t and x[:, 0] = 1
    act = (gate * (x @ w_up.T)).astype(dtype)
    return np.ascontiguousarray(act), np.ascontiguousarray(w_down.T.astype(dtype)), t


def timeit(fn, repeats, warmup):
    """Median wall time (ms) of ``repeats`` calls after ``warmup`` untimed calls."""
    return timeit_pair(fn, None, repeats, warmup)[0]


def timeit_pair(fn, base_fn, repeats, warmup):
    """Time ``fn`` and ``base_fn`` interleaved, so load changes hit both alike.

    Returns ``((ms, times), (base_ms, base_times))``; the second is ``(None, [])``
    without ``base_fn``.
    """
    fns = [f for f in (fn, base_fn) if f is not None]
    for _ in range(warmup):
        for f in fns:
            f()
    ts = [[] for _ in fns]
    for _ in range(repeats):
        for k, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
    res = [(statistics.median(t) * 1e3, t) for t in ts]
    return res[0], (res[1] if len(res) > 1 else (None, []))


def rel_err(got, ref):
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (C1 is defined on 2 cores)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--json", type=Path, default=None, help="write full results here")
    args = ap.parse_args(argv)

    numba.set_num_threads(max(1, min(args.threads, numba.config.NUMBA_NUM_THREADS)))
    act, w, t = make_c1(m=args.m)
    m, h = act.shape
    d = w.shape[1]
    nnz_row = np.count_nonzero(act, axis=1)
    print(f"C1: activation {m}x{h} float32, mean nnz/row {nnz_row.mean():.2f} (max {nnz_row.max()}), "
          f"W {h}x{d}; threshold {t:.4f}; numba threads {numba.get_num_threads()}", flush=True)

    csr = sp.csr_array(act)
    csr64 = csr.astype(np.float64)
    ref = csr64 @ w.astype(np.float64)
    g = np.random.default_rng(1).standard_normal((256, m)).astype(np.float32)
    ref_left = (csr64.T @ g.T.astype(np.float64)).T
    A = tw.TwELL.from_dense(act)
    E = tw.ELL.from_dense(act)
    H = tw.Hybrid.from_dense(act)
    R, W_ = args.repeats, args.warmup

    rows = []  # (name, twellpy_ms, baseline_name, baseline_ms, err)

    def add(name, fn, base_name=None, base_fn=None, err=None, base_ms=None):
        (ms, ts), (bms, _) = timeit_pair(fn, base_fn, R, W_)
        base_ms = bms if base_fn is not None else base_ms
        rows.append({"op": name, "twellpy_ms": ms, "baseline": base_name, "baseline_ms": base_ms,
                     "ratio": (base_ms / ms) if base_ms else None, "rel_err": err, "times_s": ts})
        r = rows[-1]
        print(f"  {name:<28s} {ms:9.2f} ms" + (f"   {base_name}: {base_ms:9.2f} ms  ({r['ratio']:.2f}x)"
                                                if base_ms else ""), flush=True)
        return base_ms

    scipy_build = add("dense->TwELL", lambda: tw.TwELL.from_dense(act), "scipy csr_array(dense)",
                      lambda: sp.csr_array(act))
    add("dense->ELL", lambda: tw.ELL.from_dense(act), "scipy csr_array(dense)", base_ms=scipy_build)
    add("dense->Hybrid(auto)", lambda: tw.Hybrid.from_dense(act), "scipy csr_array(dense)", base_ms=scipy_build)
    spmm_scipy = add("TwELL @ W", lambda: A @ w, "scipy CSR @ W", lambda: csr @ w, err=rel_err(A @ w, ref))
    dense_ms, _ = timeit(lambda: act @ w, max(3, R // 2), 1)  # numpy BLAS: slow, fewer repeats
    rows.append({"op": "TwELL @ W", "twellpy_ms": rows[-1]["twellpy_ms"], "baseline": "numpy dense @ W",
                 "baseline_ms": dense_ms, "ratio": dense_ms / rows[-1]["twellpy_ms"], "rel_err": rows[-1]["rel_err"],
                 "times_s": rows[-1]["times_s"]})
    print(f"  {'TwELL @ W':<28s} {rows[-1]['twellpy_ms']:9.2f} ms   numpy dense @ W: {dense_ms:9.2f} ms "
          f"({rows[-1]['ratio']:.2f}x)", flush=True)
    add("ELL @ W", lambda: E @ w, "scipy CSR @ W", base_ms=spmm_scipy, err=rel_err(E @ w, ref))
    add("Hybrid @ W", lambda: H @ w, "scipy CSR @ W", base_ms=spmm_scipy, err=rel_err(H @ w, ref))
    add("G @ TwELL (G 256xM)", lambda: g @ A, "G @ scipy CSR", lambda: g @ csr, err=rel_err(g @ A, ref_left))
    add("TwELL.T", lambda: A.T, "scipy csr.T.tocsr()", lambda: csr.T.tocsr())
    add("TwELL -> scipy CSR", lambda: A.to_scipy(), "scipy csr_array(dense)", base_ms=scipy_build)

    info = {"workload": "C1", "shape": [m, h], "w_shape": [h, d], "mean_nnz_per_row": float(nnz_row.mean()),
            "threads": numba.get_num_threads(), "repeats": R, "warmup": W_, "numpy": np.__version__,
            "scipy": scipy.__version__, "numba": numba.__version__,
            "twellpy": tw.__version__, "machine": platform.platform(), "cpu": platform.processor(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "results": rows}
    out_paths = [p for p in (args.json, Path(os.environ["OUT"]) / "cpu_benchmark.json" if os.environ.get("OUT") else None) if p]
    for p in out_paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(info, indent=2))

    print()
    print("| operation | twellpy (ms) | baseline | baseline (ms) | speedup | rel. error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "exact"
        print(f"| {r['op']} | {r['twellpy_ms']:.2f} | {r['baseline']} | {r['baseline_ms']:.2f} | "
              f"{r['ratio']:.2f}x | {err} |")
    build = rows[0]["ratio"]
    spmm = next(r["ratio"] for r in rows if r["op"] == "TwELL @ W" and r["baseline"] == "scipy CSR @ W")
    print(f"\ntargets: construction >= 3x scipy: {'MET' if build >= 3 else 'MISSED'} ({build:.2f}x); "
          f"SpMM >= 1x scipy CSR: {'MET' if spmm >= 1 else 'MISSED'} ({spmm:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
