"""02 -- TwELL @ W against cuSPARSE (GPU) or scipy.sparse (CPU), and dense.

The product ``h @ w_down`` of a transformer FFN, where ``h`` is the sparse
activation (M tokens x H neurons, ~30 active per token) and ``w_down`` is
dense (H x D). On a GPU it compares TwELL with cupyx CSR (cuSPARSE) and the
dense product (cuBLAS); on the CPU with scipy CSR and numpy. Every result is
checked against a float64 reference before it is timed.

Run: ``python examples/02_twell_vs_cusparse.py [--small] [--device cpu|cuda]``
"""
import argparse
import statistics
import time

import numpy as np
from ml_dtypes import bfloat16
import scipy.sparse as sp

import twellpy as tw
from twellpy import gpu_available


def timer(xp, fn, repeat):
    """Median seconds of fn() over ``repeat`` runs after one warm-up call.
    GPU: CUDA events around each run; CPU: perf_counter."""
    fn()
    times = []
    for _ in range(repeat):
        if xp is np:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        else:
            start, stop = xp.cuda.Event(), xp.cuda.Event()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(xp.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)


def rel_err(got, ref):
    got = np.asarray(got.get() if hasattr(got, "get") else got, dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (what the tests run)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = ap.parse_args(argv)
    use_gpu = args.device == "cuda" or (args.device == "auto" and gpu_available())
    if use_gpu and not gpu_available():
        raise SystemExit("--device cuda: no usable CUDA GPU")
    if use_gpu:
        import cupy as xp
        import cupyx.scipy.sparse as xsp
    else:
        xp, xsp = np, None

    if args.small:
        M, H, D, K, repeat = 256, 512, 64, 10, 3
    elif use_gpu:
        M, H, D, K, repeat = 16384, 5632, 2048, 30, 30  # workload W1-16k of benchmarks/workloads.py
    else:
        M, H, D, K, repeat = 8192, 2816, 1024, 15, 5    # workload C1 (CPU)
    print(f"{'GPU' if use_gpu else 'CPU'}: h {M}x{H} with ~{K} non-zeros per row, W {H}x{D}")

    rng = np.random.default_rng(0)
    mask = rng.random((M, H), dtype=np.float32) < K / H
    h32 = np.where(mask, rng.random((M, H), dtype=np.float32) + 0.1, 0).astype(np.float32)
    w32 = (rng.standard_normal((H, D), dtype=np.float32) / np.sqrt(H)).astype(np.float32)
    ref = sp.csr_array(h32.astype(np.float64)) @ w32.astype(np.float64)

    rows = []  # (method, dtype, seconds, relative error)
    h_x, w_x = xp.asarray(h32), xp.asarray(w32)
    for dt in ([bfloat16, np.float32] if use_gpu else [np.float32]):
        h, w = h_x.astype(dt), w_x.astype(dt)
        A = tw.TwELL.from_dense(h)
        rows.append(("TwELL @ W", np.dtype(dt).name, timer(xp, lambda: A @ w, repeat), rel_err(A @ w, ref)))
        try:
            rows.append(("dense h @ W", np.dtype(dt).name, timer(xp, lambda: h @ w, repeat), rel_err(h @ w, ref)))
        except Exception as e:  # noqa: BLE001 -- some CuPy builds have no bfloat16 matmul; report and go on
            print(f"dense {np.dtype(dt).name} matmul unavailable: {e}")
    if use_gpu:
        C = xsp.csr_matrix(h_x)  # cuSPARSE takes float32, not bfloat16
        rows.append(("cupyx CSR @ W (cuSPARSE)", "float32", timer(xp, lambda: C @ w_x, repeat), rel_err(C @ w_x, ref)))
    else:
        C = sp.csr_array(h32)
        rows.append(("scipy CSR @ W", "float32", timer(xp, lambda: C @ w32, repeat), rel_err(C @ w32, ref)))

    tol = {"float32": 1e-4, "bfloat16": 3e-2}
    for name, dt, _, err in rows:
        assert err <= tol[dt], f"{name} {dt}: relative error {err:.2e} > {tol[dt]}"
    csr_t = next(t for n, _, t, _ in rows if "CSR" in n)
    twell_f32 = next(t for n, d, t, _ in rows if n.startswith("TwELL") and d == "float32")
    print(f"{'method':28s} {'dtype':9s} {'time':>11s} {'rel. error':>11s} {'CSR / this':>11s}")
    for name, dt, t, err in rows:
        print(f"{name:28s} {dt:9s} {t * 1e3:8.3f} ms {err:11.2e} {csr_t / t:10.3g}x")
    print(f"TwELL float32 is {csr_t / twell_f32:.3g}x the speed of CSR on this {'GPU' if use_gpu else 'CPU'} "
          f"(median of {repeat} runs; every result checked against float64)")
    print("02 OK")


if __name__ == "__main__":
    main()
