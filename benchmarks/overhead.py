"""Per-call overhead at small model sizes (GPU): where does the time go?

At the showcase's sizes (D 256, H 1024) the GPU work of one FFN call is tens
of microseconds, so host work (argument checks, conversions, synchronisations,
allocations) decides the speed. This script times, in one process:

* the dense FFN (cupy / cuBLAS) and the prepared ``GatedFFN`` on cupy arrays;
* the one-shot ``gated_forward`` (prepares the weights on every call);
* the same call with jax arrays (DLPack both ways), when jax has a GPU;
* the training step ``gated_forward_train`` + ``gated_backward`` with its
  phases (CUDA events) and wall time;

and prints a cProfile summary of the slowest host paths. Run on the device::

    PYTHONPATH=. python benchmarks/overhead.py [--m 16384] [--d 256] [--h 1024] [--nnz 8]
"""
# twellpy-bench: suite gpu-only
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np


def _wall(fn, sync, reps=30):
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def _profile(fn, sync, n=20, top=14):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main():
    import cupy as cp

    import twellpy.ffn as tf
    from twellpy import _ffn_train
    from twellpy._array import bfloat16

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--h", type=int, default=1024)
    p.add_argument("--nnz", type=float, default=8.0)
    a = p.parse_args()
    M, D, H = a.m, a.d, a.h
    rng = np.random.default_rng(0)
    # weights with a gate threshold giving about --nnz active neurons per token
    x = rng.standard_normal((M, D)).astype(np.float32)
    x[:, 0] = 1
    wg = (rng.standard_normal((H, D)) / np.sqrt(D - 1)).astype(np.float32)
    from scipy.stats import norm
    wg[:, 0] = -norm.isf(a.nnz / H)
    wu = (rng.standard_normal((H, D)) / np.sqrt(D)).astype(np.float32)
    wd = (rng.standard_normal((D, H)) / np.sqrt(H)).astype(np.float32)
    xc, wgc, wuc, wdc = (cp.asarray(v.astype(bfloat16)) for v in (x, wg, wu, wd))
    sync = cp.cuda.get_current_stream().synchronize
    rows = []

    # dense bf16 FFN through cuBLAS (fp32 compute), same gemm helper as the library
    from twellpy.backends import cuda_ffn
    plan = cuda_ffn.prepare(wgc, wuc, wdc)

    def dense():
        return plan.dense_rows(xc, cp.empty((M, D), dtype=xc.dtype))

    rows.append(("dense (cuBLAS, library helper)", _wall(dense, sync)))
    ffn = tf.GatedFFN(wgc, wuc, wdc, mode="sparse", check_finite=False)
    rows.append(("GatedFFN prepared, sparse", _wall(lambda: ffn(xc), sync)))
    ffn_auto = tf.GatedFFN(wgc, wuc, wdc, mode="auto", check_finite=False)
    rows.append(("GatedFFN prepared, auto", _wall(lambda: ffn_auto(xc), sync)))
    ffn_checked = tf.GatedFFN(wgc, wuc, wdc, mode="sparse")
    rows.append(("GatedFFN prepared, sparse, check_finite", _wall(lambda: ffn_checked(xc), sync)))
    one = lambda: tf.gated_forward(xc, wgc, wuc, wdc, mode="sparse", check_finite=False)  # noqa: E731
    rows.append(("gated_forward one-shot, sparse", _wall(one, sync)))
    prof_one = _profile(one, sync)

    try:
        import jax
        import jax.numpy as jnp
        if any(d.platform in ("gpu", "cuda") for d in jax.devices()):
            xj, wgj, wuj, wdj = (jnp.asarray(v.astype(bfloat16)) for v in (x, wg, wu, wd))
            djit = jax.jit(lambda z, g, u, d: (jnp.maximum(z @ g.T, 0) * (z @ u.T)) @ d.T)
            jsync = lambda: (sync(), None)  # noqa: E731
            rows.append(("jax dense (jit)", _wall(lambda: djit(xj, wgj, wuj, wdj).block_until_ready(), jsync)))
            fj = tf.GatedFFN(wgj, wuj, wdj, mode="sparse", check_finite=False)
            rows.append(("GatedFFN prepared, jax in/out",
                         _wall(lambda: fj(xj).block_until_ready(), jsync)))
            rows.append(("gated_forward one-shot, jax in/out",
                         _wall(lambda: tf.gated_forward(xj, wgj, wuj, wdj, mode="sparse",
                                                        check_finite=False).block_until_ready(), jsync)))
    except Exception as e:  # noqa: BLE001 - diagnostics only
        rows.append((f"jax skipped: {type(e).__name__}: {e}", float("nan")))

    # training step
    dy = cp.asarray((rng.standard_normal((M, D)) / 10).astype(bfloat16))

    def step():
        y, ctx = tf.gated_forward_train(xc, wgc, wuc, wdc, l1=1e-3, check_finite=False)
        return tf.gated_backward(ctx, dy)

    rows.append(("train fwd+bwd (wall)", _wall(step, sync, reps=20)))
    fwd = lambda: tf.gated_forward_train(xc, wgc, wuc, wdc, l1=1e-3, check_finite=False)  # noqa: E731
    rows.append(("train fwd only (wall)", _wall(fwd, sync, reps=20)))
    _ffn_train._PROFILE = []
    step()
    sync()
    marks = _ffn_train._PROFILE
    _ffn_train._PROFILE = None
    phases = [(n1, cp.cuda.get_elapsed_time(e0, e1)) for (_, e0, _t0), (n1, e1, _t1) in zip(marks, marks[1:])]
    prof_train = _profile(step, sync, n=10)
    try:
        import torch
    except ImportError:
        torch = None
        rows.append(("torch autograd dense fwd+bwd: torch not installed", float("nan")))
    if torch is not None:
        tx, tg, tu, tdn = (torch.from_dlpack(v.view(cp.int16)).view(torch.bfloat16)
                           for v in (xc, wgc, wuc, wdc))
        tx = tx.clone().requires_grad_(True)
        tg, tu, tdn = (t.clone().requires_grad_(True) for t in (tg, tu, tdn))
        tdy = torch.from_dlpack(dy.view(cp.int16)).view(torch.bfloat16)

        def tstep():
            y = (torch.relu(tx @ tg.T) * (tx @ tu.T)) @ tdn.T
            y.backward(tdy)

        rows.append(("torch autograd dense fwd+bwd", _wall(tstep, torch.cuda.synchronize, reps=20)))

    print(prof_one)
    print(prof_train)
    print("training phases (ms, CUDA events): " + ", ".join(f"{n} {t:.3f}" for n, t in phases))
    print(f"\nM={M} D={D} H={H} nnz/token~{a.nnz}")
    for name, t in rows:
        print(f"{name:45s} {t:9.3f} ms")


if __name__ == "__main__":
    main()
