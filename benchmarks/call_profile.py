"""Host-side cost of one small FFN call (decode sizes), by cProfile.

At M <= a few hundred tokens the GPU work of the fused FFN takes tens of
microseconds and the Python side of the call decides the time. This prints
the host time per call of ``GatedFFN.__call__`` (calls issued back to back,
no synchronisation) and the functions that take it, so per-call overhead can
be cut where it is spent.

    PYTHONPATH=. python benchmarks/call_profile.py [--rows 16] [--calls 2000]
"""
# twellpy-bench: suite gpu-only
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--mode", default="sparse", choices=("auto", "sparse", "dense"))
    p.add_argument("--check-finite", action="store_true")
    a = p.parse_args()
    import cupy as cp
    import torch

    from benchmarks.workloads import WORKLOADS, make_ffn
    from twellpy._array import bfloat16, to_caller
    from twellpy.ffn import GatedFFN

    w = make_ffn(**dict(WORKLOADS["W1-16k"], M=a.rows), dtype=bfloat16, xp=cp, seed=0)
    x, wg, wu, wd = w["x"], w["w_gate"], w["w_up"], w["w_down"]
    ffn = GatedFFN(wg, wu, wd, check_finite=a.check_finite, mode=a.mode)
    tx, tg, tu, td = (to_caller(v, "torch") for v in (x, wg, wu, wd))

    def dense():
        return (torch.relu(tx @ tg.T) * (tx @ tu.T)) @ td.T

    for name, fn, sync in (("twellpy", lambda: ffn(x), cp.cuda.Device().synchronize),
                           ("torch dense", dense, torch.cuda.synchronize)):
        for _ in range(50):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        t_host = (time.perf_counter() - t0) / a.calls
        sync()
        t_all = (time.perf_counter() - t0) / a.calls
        print(f"{name:12s} M={a.rows}: host {t_host * 1e6:7.1f} us/call issued, {t_all * 1e6:7.1f} us/call "
              f"with the final sync")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        ffn(x)
    prof.disable()
    cp.cuda.Device().synchronize()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(22)
    st.sort_stats("cumulative").print_stats(22)


if __name__ == "__main__":
    main()
