"""Can the gate GEMM and the sparse step of the fused FFN overlap? (issue 4, one GPU call)

The fused FFN runs the gate GEMM (tensor cores) and then the sparse step
(L2 gathers); at W1-16k they take about 0.53 and 0.64 ms, one after the
other. Their bottlenecks differ, so running chunk i's sparse step while
chunk i+1's GEMM runs could hide one under the other. The library's
two-stream pipeline does that over row chunks, but on the H200 it was
slower than one chunk: cuBLAS takes every SM, so the sparse kernel of the
other stream has nowhere to run.

This probe caps the SMs of the pipeline's GEMM handle with
``cublasSetSmCountTarget`` (the other SMs are left to the sparse kernel) and
times the whole FFN for each cap and chunk count, with its error against a
float32 reference, next to dense torch and the gate GEMM alone in the same
run. It changes nothing in the library: the cap goes on the calling
thread's pipeline handles only while the probe runs.

Usage (on the device): ``PYTHONPATH=. python benchmarks/overlap_probe.py [--workload W1-16k] [--reps 20]``
"""
# twellpy-bench: suite gpu-only
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ffn import rel_err, time_cupy, time_torch  # noqa: E402
from benchmarks.workloads import WORKLOADS, make_ffn, reference_ffn  # noqa: E402
from twellpy._array import bfloat16, to_caller  # noqa: E402
from twellpy._ffn_infer import GatedFFN  # noqa: E402


def _cublas_library():
    """The libcublas this process loaded (CuPy loads it on its first GEMM)."""
    names = ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    with open("/proc/self/maps") as maps:  # the exact file CuPy loaded, if any
        names = sorted({ln.split()[-1] for ln in maps if "/libcublas.so" in ln}) + names
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(lib, "cublasSetSmCountTarget"):
            lib.cublasSetSmCountTarget.argtypes = (ctypes.c_void_p, ctypes.c_int)
            lib.cublasSetSmCountTarget.restype = ctypes.c_int
            return lib
    raise RuntimeError(f"no libcublas with cublasSetSmCountTarget among {names}")


def set_sm_target(lib, handles, n_sms):
    """Cap (n_sms > 0) or uncap (0) the SMs cuBLAS uses on each handle."""
    for h in handles:
        status = lib.cublasSetSmCountTarget(ctypes.c_void_p(int(h)), int(n_sms))
        if status != 0:
            raise RuntimeError(f"cublasSetSmCountTarget({n_sms}) returned status {status}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="W1-16k")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--caps", default="0,124,116,108,100,92,84",
                   help="SM counts for the pipeline's GEMM handle (0: no cap)")
    p.add_argument("--chunks", default="1,2,4,8", help="row chunks of the pipeline")
    args = p.parse_args(argv)

    import cupy as cp
    import torch

    from twellpy.backends import cuda_ffn

    spec = dict(WORKLOADS[args.workload])
    w = make_ffn(**spec, dtype=bfloat16, xp=cp, seed=1)
    x, wg, wu, wd = w["x"], w["w_gate"], w["w_up"], w["w_down"]
    ref = reference_ffn(x, wg, wu, wd, dtype=np.float32)
    tx, tg, tu, td = (to_caller(a, "torch") for a in (x, wg, wu, wd))
    dense_ms = time_torch(lambda: (torch.relu(tx @ tg.T) * (tx @ tu.T)) @ td.T, args.reps)
    gate_ms = time_torch(lambda: tx @ tg.T, args.reps)

    ffn = GatedFFN(wg, wu, wd, check_finite=False)
    ffn(x, mode="sparse")  # compiles, and makes this thread's streams and handles
    lib = _cublas_library()
    dev = cp.cuda.Device().id
    _, handles = cuda_ffn._thread_resources(dev)
    n_sm = cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]
    M = spec["M"]
    plan = ffn._plan
    g = cp.empty((M, plan.H), plan.dtype)
    rows = []
    print(f"{args.workload}: M={M} D={plan.D} H={plan.H}, {n_sm} SMs; dense (torch) {dense_ms:.3f} ms, "
          f"gate GEMM alone {gate_ms:.3f} ms", flush=True)
    try:
        for cap in (int(c) for c in args.caps.split(",")):
            if cap > n_sm:
                continue
            set_sm_target(lib, handles, cap)
            gemm_ms = time_cupy(lambda: cuda_ffn.gemm_nt(x, plan.gate_w, g, handles[0],
                                                         cp.cuda.get_current_stream()), args.reps)
            for n_chunks in (int(c) for c in args.chunks.split(",")):
                plan.chunk_rows = -(-M // n_chunks)
                y = ffn(x, mode="sparse")
                err = rel_err(y, ref)
                ms = time_cupy(lambda: ffn(x, mode="sparse"), args.reps)
                rows.append({"sm_cap": cap, "chunks": n_chunks, "ms": ms, "err": err, "gemm_ms_capped": gemm_ms,
                             "speedup": dense_ms / ms})
                print(f"  cap {cap or 'none':>4} SMs, {n_chunks} chunk(s): {ms:7.3f} ms  x{dense_ms / ms:.2f}  "
                      f"err {err:.2e}  (capped gate GEMM alone {gemm_ms:.3f} ms)", flush=True)
    finally:
        set_sm_target(lib, handles, 0)
        plan.chunk_rows = None
    good = [r for r in rows if r["err"] <= 1e-2]
    best = min(good, key=lambda r: r["ms"]) if good else None
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "overlap_probe.json"), "w") as f:
            json.dump({"workload": args.workload, "dense_ms": dense_ms, "gate_ms": gate_ms, "sms": n_sm,
                       "rows": rows}, f, indent=1)
    print()
    print(f"{'SM cap':>7} {'chunks':>6} {'ms':>8} {'x dense':>8} {'err':>9}")
    for r in rows:
        print(f"{r['sm_cap'] or '-':>7} {r['chunks']:>6} {r['ms']:8.3f} {r['speedup']:8.2f} {r['err']:9.2e}")
    if best:
        base = next((r for r in rows if r["sm_cap"] == 0 and r["chunks"] == 1), None)
        print(f"best: cap {best['sm_cap'] or 'none'}, {best['chunks']} chunk(s): {best['ms']:.3f} ms = "
              f"{best['speedup']:.2f}x dense" + (f" (uncapped single chunk {base['ms']:.3f} ms)" if base else ""))


if __name__ == "__main__":
    main()
