"""What a few hot tokens (rows firing thousands of neurons) cost the fused FFN (issue 4).

W1's D and H (2048, 5632), 30 active neurons per ordinary token, bf16. For M in
1, 16 and 16384 it makes ``hot`` rows fire about ``fire`` neurons each (x[:, 0]
carries the threshold, see ``workloads.make_ffn``) and times, back to back, the
dense FFN (three cuBLAS GEMMs through CuPy), the default ``GatedFFN`` call and
the same call unchecked in sparse mode, with the relative error of the default
call against a float32 reference; then, on the general path (decode kernels
off), unchecked sparse calls with the long-row kernels (``ffn_long.cu``, the
default) and without them (``long_rows = False``: one block computes a row of
more than ``LIST_ROW_CAP`` active neurons, in rounds).

Usage (device): ``python benchmarks/hot_rows_probe.py``
"""
# twellpy-bench: suite gpu-only
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.decode_probe import per_call_ms  # noqa: E402
from benchmarks.workloads import make_ffn, reference_ffn  # noqa: E402
from twellpy._array import bfloat16  # noqa: E402
from twellpy._ffn_infer import GatedFFN  # noqa: E402


def make_hot(x, w_gate, rows, fire):
    """x with ``rows`` rows moved so that each fires about ``fire`` neurons."""
    import cupy as cp

    x = x.copy()
    w0 = w_gate[:, 0].astype(cp.float32)  # -threshold in every neuron
    for r in rows:
        g = x[r].astype(cp.float32) @ w_gate.T.astype(cp.float32)
        rest = g - x[r, 0].astype(cp.float32) * w0  # g without the threshold column
        # fires where rest + v * w0 > 0, i.e. rest > v * t (t = -w0 > 0): v = quantile of rest / t
        ratio = cp.sort(rest / -w0)[::-1]
        v = float(ratio[min(fire, ratio.size) - 1]) - 1e-3 if fire < ratio.size else -1e3
        x[r, 0] = v
    return x


def main():
    import cupy as cp

    sync = cp.cuda.get_current_stream().synchronize
    print(f"device {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'M':>6s} {'hot':>4s} {'fire':>5s} {'dense ms':>9s} {'default':>9s} {'x':>6s} {'sparse':>9s} {'x':>6s}"
          f" {'general':>9s} {'x':>6s} {'one-block':>9s} {'x':>6s} {'max row':>8s} {'err':>8s}")
    for M in (1, 16, 16384):
        w = make_ffn(M, 2048, 5632, 30, dtype=bfloat16, xp=cp, seed=3)
        x0, wg, wu, wd = w["x"], w["w_gate"], w["w_up"], w["w_down"]
        wgT, wuT, wdT = (cp.ascontiguousarray(a.T) for a in (wg, wu, wd))
        ffn = GatedFFN(wg, wu, wd)
        general = GatedFFN(wg, wu, wd)
        general.decode_rows = 0
        serial = GatedFFN(wg, wu, wd)
        serial.decode_rows = 0
        serial._plan.long_rows = False
        cases = [(0, 0)] + [(k, f) for k in (1, 16) for f in (2000, 5632) if k <= M]
        for hot, fire in cases:
            rows = np.linspace(0, M - 1, hot).astype(int) if hot else []
            x = make_hot(x0, wg, rows, fire) if hot else x0
            n_act = int(((x.astype(cp.float32) @ wg.T.astype(cp.float32)) > 0).sum(axis=1).max())

            def dense(x=x):
                return (cp.maximum(x @ wgT, 0) * (x @ wuT)) @ wdT

            ref = reference_ffn(x, wg, wu, wd)
            y = ffn(x).astype(cp.float32)
            err = float(cp.linalg.norm(y - ref) / cp.linalg.norm(ref))
            calls = 200 if M < 1000 else 30
            t_dense = per_call_ms(dense, calls, sync)[0]
            t_def = per_call_ms(lambda x=x: ffn(x), calls, sync)[0]
            t_sp = per_call_ms(lambda x=x: ffn(x, mode="sparse", check_finite=False), calls, sync)[0]
            t_gen = per_call_ms(lambda x=x: general(x, mode="sparse", check_finite=False), calls, sync)[0]
            t_ser = per_call_ms(lambda x=x: serial(x, mode="sparse", check_finite=False), calls, sync)[0]
            y_gen = general(x, mode="sparse").astype(cp.float32)
            err = max(err, float(cp.linalg.norm(y_gen - ref) / cp.linalg.norm(ref)))
            print(f"{M:6d} {hot:4d} {fire:5d} {t_dense:9.4f} {t_def:9.4f} {t_dense / t_def:6.2f} {t_sp:9.4f}"
                  f" {t_dense / t_sp:6.2f} {t_gen:9.4f} {t_dense / t_gen:6.2f} {t_ser:9.4f} {t_dense / t_ser:6.2f}"
                  f" {n_act:8d} {err:8.1e}", flush=True)


if __name__ == "__main__":
    main()
