"""03 -- The fused sparse FFN: ``gated_forward`` against a dense float64 reference.

A gated ReLU FFN ``y = (relu(x Wg^T) * (x Wu^T)) Wd^T`` whose gate fires for
~K of H neurons per token (the synthetic workload of benchmarks/workloads.py: the gate
bias, carried by a constant input feature, is set so that the mean number of
active neurons per token hits K). twellpy computes the gate GEMM densely and
the up/down projections only for the active neurons.

It shows
* the one-call API ``twellpy.ffn.gated_forward`` and the reusable
  ``GatedFFN`` (weights prepared once) with its ``last_info``;
* ``return_activations=True``, which also returns the activation as a TwELL;
* exactness against float64 and the time against the dense FFN.

Run: ``python examples/03_fused_ffn.py [--small] [--device cpu|cuda]``
"""
import argparse
import statistics
import time

import numpy as np
from ml_dtypes import bfloat16

import twellpy as tw
from twellpy import gpu_available


def synthetic_ffn(M, D, H, K, seed=0):
    """x (M, D), w_gate, w_up (H, D), w_down (D, H) in float32, with ~K active
    gate neurons per token (threshold fitted on a sample of rows)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, D), dtype=np.float32)
    x[:, 0] = 1.0
    w_gate = (rng.standard_normal((H, D)) / np.sqrt(D - 1)).astype(np.float32)
    w_up = (rng.standard_normal((H, D)) / np.sqrt(D)).astype(np.float32)
    w_down = (rng.standard_normal((D, H)) / np.sqrt(H)).astype(np.float32)
    w_gate[:, 0] = 0.0
    sample = x[: min(M, 1024)] @ w_gate.T
    w_gate[:, 0] = -np.quantile(sample, 1.0 - K / H)  # P(gate > 0) = K / H on the sample
    return x, w_gate, w_up, w_down


def reference(x, w_gate, w_up, w_down):
    x, g, u, d = (np.asarray(a, dtype=np.float64) for a in (x, w_gate, w_up, w_down))
    return (np.maximum(x @ g.T, 0) * (x @ u.T)) @ d.T


def timer(xp, fn, repeat):
    fn()
    sync = xp.cuda.runtime.deviceSynchronize if xp is not np else (lambda: None)
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    else:
        xp = np

    if args.small:
        M, D, H, K, repeat, dtype = 128, 64, 512, 8, 2, np.float32
    elif use_gpu:
        M, D, H, K, repeat, dtype = 16384, 2048, 5632, 30, 20, bfloat16  # W1-16k
    else:
        M, D, H, K, repeat, dtype = 8192, 1024, 2816, 15, 3, np.float32  # C1
    tol = 3e-2 if dtype == bfloat16 else 1e-4
    print(f"{'GPU' if use_gpu else 'CPU'} {np.dtype(dtype).name}: x {M}x{D}, hidden {H}, ~{K} active per token")

    x, w_gate, w_up, w_down = synthetic_ffn(M, D, H, K)
    # float64 reference on a sample of rows keeps the check cheap at full size
    rows = np.arange(0, M, max(1, M // 512))
    ref = reference(x[rows], w_gate, w_up, w_down)
    xd, gd, ud, dd = (xp.asarray(a).astype(dtype) for a in (x, w_gate, w_up, w_down))

    y = tw.ffn.gated_forward(xd, gd, ud, dd)
    y_host = y.get() if hasattr(y, "get") else y
    err = float(np.linalg.norm(y_host[rows].astype(np.float64) - ref) / np.linalg.norm(ref))
    print(f"gated_forward: relative error {err:.2e} against float64 on {rows.size} rows (bound {tol:g})")
    assert err <= tol, err

    ffn = tw.ffn.GatedFFN(gd, ud, dd)  # prepares the weights once, for repeated calls
    y2, h = ffn(xd, return_activations=True)
    assert isinstance(h, tw.TwELL) and h.shape == (M, H)
    y2_host = y2.get() if hasattr(y2, "get") else y2
    assert np.array_equal(y2_host, y_host), "GatedFFN and gated_forward differ"
    print(f"activation h: {h!r}")
    print(f"  mean active neurons per token {h.nnz / M:.1f} (target {K}); last_info: {ffn.last_info}")

    t_sparse = timer(xp, lambda: ffn(xd), repeat)

    def dense():
        return (xp.maximum(xd @ gd.T, 0) * (xd @ ud.T)) @ dd.T

    try:
        t_dense = timer(xp, dense, repeat)
    except Exception as e:  # noqa: BLE001 -- e.g. no bfloat16 matmul in this CuPy build
        xd32, gd32, ud32, dd32 = (a.astype(np.float32) for a in (xd, gd, ud, dd))
        print(f"dense {np.dtype(dtype).name} FFN unavailable ({e}); timing the dense FFN in float32")
        t_dense = timer(xp, lambda: (xp.maximum(xd32 @ gd32.T, 0) * (xd32 @ ud32.T)) @ dd32.T, repeat)
    print(f"time: sparse {t_sparse * 1e3:.3f} ms, dense {t_dense * 1e3:.3f} ms "
          f"-> {t_dense / t_sparse:.2f}x (median of {repeat})")
    print("03 OK")


if __name__ == "__main__":
    main()
